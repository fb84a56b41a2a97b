"""deploy.tritonserver.free_port: ports for servers started next, chosen below the kernel's ephemeral range, so
that no outgoing connection (gloo's between engine ranks, a client's) takes one before the server binds it (a
CI run saw tritonserver's gRPC port taken so: "Socket '0.0.0.0:40195' already in use")."""

import socket

from tritonllm.deploy import tritonserver
from tritonllm.deploy.tritonserver import Ports, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    low = tritonserver._ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low > tritonserver.LOWEST_PORT:
            assert tritonserver.LOWEST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))


def test_a_port_in_use_is_not_given(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(tritonserver, "_ephemeral_low", lambda: tritonserver.LOWEST_PORT + 2)
        monkeypatch.setattr(tritonserver._pick, "randrange", lambda low, high: busy)
        assert free_port() != busy  # every pick busy: the kernel's choice instead


def test_the_three_server_ports_differ(monkeypatch):
    picks = iter([20_000, 20_000, 20_001, 20_001, 20_000, 20_002])
    monkeypatch.setattr(tritonserver, "_ephemeral_low", lambda: 30_000)
    monkeypatch.setattr(tritonserver._pick, "randrange", lambda low, high: next(picks))
    monkeypatch.setattr(tritonserver, "_bindable", lambda port: True)
    assert Ports.free() == Ports(20_000, 20_001, 20_002)


def test_without_a_known_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(tritonserver, "_ephemeral_low", lambda: 0)
    port = free_port()
    assert 0 < port < 65536

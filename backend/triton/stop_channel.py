"""A way for the `postprocessing` step to stop the `tensorrt_llm` request whose tokens it is given.

Triton 2.51 hands an ensemble request's cancellation only to the steps it schedules after the cancel: in a
stream those are the postprocessing steps, never the `tensorrt_llm` step that is generating. So each streamed
`tensorrt_llm` response carries a `cancel_key` (wired to postprocessing's CANCEL_KEY by the ensemble), and a
postprocessing step whose request is cancelled sends that key back here. The key names this model instance's
socket (an abstract Unix datagram socket: no file, gone with the process) and a random token of the request, so
nothing else can guess it. A datagram costs the sender nothing and needs no Triton call (a BLS call to a
decoupled model from inside an ensemble step is what Triton 2.51 handles worst)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Callable

log = logging.getLogger("tritonllm.stop_channel")
SEPARATOR = "#"
MAX_DATAGRAM = 256


class StopChannel:
    """Receives the tokens sent to `key(token)` and passes each to `on_stop` (on the channel's own thread)."""

    def __init__(self, on_stop: Callable[[str], None]):
        self.address = f"\0tritonllm-stop-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.address)
        self.on_stop = on_stop
        self.thread = threading.Thread(target=self._receive, name="tritonllm-stop-channel", daemon=True)
        self.thread.start()

    @staticmethod
    def new_token() -> str:
        return uuid.uuid4().hex

    def key(self, token: str) -> str:
        return f"{self.address[1:]}{SEPARATOR}{token}"

    def _receive(self) -> None:
        while True:
            try:
                data = self.socket.recv(MAX_DATAGRAM)
            except OSError:
                return  # closed
            if not data:
                return  # close() wakes the thread with an empty datagram
            try:
                self.on_stop(data.decode("ascii"))
            except Exception:  # noqa: BLE001 - a bad datagram must not end the channel
                log.exception("could not stop the request of a cancel key")

    def close(self) -> None:
        send_stop(self.key(""))
        self.thread.join(timeout=1.0)
        self.socket.close()


def send_stop(key: str) -> bool:
    """Ask the model instance named by `key` to stop the key's request; False if the key is malformed or nobody
    listens any more (the request, or the model, is gone: nothing is left to stop)."""
    address, separator, token = key.partition(SEPARATOR)
    if not separator or not address.startswith("tritonllm-stop-"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        try:
            sender.sendto(token.encode("ascii"), "\0" + address)
        except (OSError, UnicodeEncodeError):
            return False
    return True

"""A model process whose tritonserver is gone ends (parent_watch), instead of living on under init: also when one
of its threads holds the GIL forever, as a stub thread blocked in a Python backend call does."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tritonllm.triton import parent_watch

CHILD = """
import time
from tritonllm.triton.parent_watch import exit_with_parent
exit_with_parent(0.1)
exit_with_parent(0.1)  # a second model in the same process: still one watcher
print("watching", flush=True)
time.sleep(60)
"""
# A thread stuck in a C call that keeps the GIL (ctypes.PyDLL does not release it), as a stub's metrics thread stuck
# in Metric.set once tritonserver is gone: no Python thread of this process runs again.
STUCK_CHILD = CHILD.replace("time.sleep(60)", "import ctypes; ctypes.PyDLL(None).sleep(60)")
# The middle process plays tritonserver: it starts the "stub", waits for its watcher, says its pid, and dies.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
"""


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return " Z " not in state + " " and "zombie" not in state  # an exited child nobody reaped yet is gone


@pytest.mark.parametrize("child", [CHILD, STUCK_CHILD], ids=["idle", "gil-held"])
def test_a_stub_ends_within_seconds_of_its_parent(child):
    parent = subprocess.run(
        [sys.executable, "-c", PARENT, child], capture_output=True, text=True, timeout=30, check=True
    )
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), f"process {pid} outlived its parent by 10 s"
    assert f"is gone: ending its model process {pid}" in parent.stderr


def test_the_watcher_ends_with_its_stub():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "watching"
    (watcher,) = children_of(child.pid)
    child.kill()
    child.wait()
    deadline = time.monotonic() + 5
    while alive(watcher) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(watcher)


def test_a_reused_pid_is_left_alone():
    """Once the stub is gone its pid may name another process: the watcher knows the stub by its start time too."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        script = parent_watch._WATCH_SCRIPT
        args = [str(other.pid), "1", "0", "0.1"]  # a parent it lacks, but not the stub's start time
        subprocess.run(["/bin/sh", "-c", script, "parent_watch", *args], timeout=10, check=True)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_the_watcher_leaves_a_process_whose_parent_lives_alone():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()

"""A model process whose tritonserver is gone exits by itself (parent_watch), instead of living on under init."""

import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import time
from tritonllm.triton.parent_watch import exit_with_parent
exit_with_parent(0.1)
exit_with_parent(0.1)  # a second model in the same process: still one watcher
print("watching", flush=True)
time.sleep(60)
"""
# The middle process plays tritonserver: it starts the "stub", waits for its watcher, says its pid, and dies.
PARENT = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
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


def test_a_stub_exits_within_seconds_of_its_parent():
    parent = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=30, check=True)
    child = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), f"process {child} outlived its parent by 10 s"


def test_the_watcher_leaves_a_process_whose_parent_lives_alone():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()

"""Stub processes end with their tritonserver.

Each Triton model runs in a stub process that tritonserver starts. When tritonserver dies (killed, crashed, or
past its exit timeout) a stub left running keeps its memory (a GPU's too) and its engine thread forever,
re-parented to init.

The watcher is a separate small process, not a thread: a stub thread that calls into the Python backend while
tritonserver dies (a metric's `set`, a log line, a response) waits forever for an answer, holding the GIL, so no
Python thread of that stub runs again (seen: a stub's metrics thread blocked in `Metric.set` after tritonserver
failed to bind a port). The watcher needs nothing of the stub: it reads the stub's parent from /proc and kills
the stub once that parent is gone. It ends by itself when the stub does."""

from __future__ import annotations

import os
import subprocess
import threading

CHECK_PERIOD_S = 1.0
_started = threading.Event()

# $1 the stub's pid, $2 its parent (tritonserver), $3 the stub's start time (field 22 of /proc/PID/stat, which tells
# a reused pid from the stub), $4 seconds between checks. The fields are read after the command name's ")", since a
# name may hold spaces: state is then $1, the parent $2, the start time ${20}.
_WATCH_SCRIPT = r"""
stub=$1 parent=$2 started=$3 period=$4
while read -r stat 2>/dev/null </proc/$stub/stat; do
    set -- ${stat##*") "}
    [ "${20}" = "$started" ] || exit 0
    if [ "$2" != "$parent" ]; then
        echo "tritonllm: tritonserver (pid $parent) is gone: ending its model process $stub" >&2
        kill -9 $stub
        exit 0
    fi
    sleep $period
done
"""


def exit_with_parent(check_period_s: float = CHECK_PERIOD_S) -> None:
    """Have this process killed within `check_period_s` of its parent process going away. Idempotent: the models of
    one stub process share one watcher."""
    if _started.is_set():
        return
    _started.set()
    stub = os.getpid()
    watch = [str(stub), str(os.getppid()), start_time(stub), f"{check_period_s:g}"]
    subprocess.Popen(
        ["/bin/sh", "-c", _WATCH_SCRIPT, "parent_watch", *watch],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def start_time(pid: int) -> str:
    """A process's start time in clock ticks since boot (/proc/PID/stat's 22nd field)."""
    return proc_stat_fields(pid)[19]


def proc_stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): the state, the parent's pid, ...
    Raises OSError once the process is gone."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()

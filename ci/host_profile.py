"""Where the host's time goes in the engine's prefill steps: cProfile around ModelRunner.execute for prefill
batches (the engine thread's own Python), written as pstats tables when the process exits.

Used as a bench prelude on the GPU machine (ci/gpu_session.sh's host-profile target):
    BENCH_PRELUDE="import sys; sys.path.insert(0, 'ci'); import host_profile; host_profile.install('OUT.txt')"
The bench's own figures in such a run are slowed by the profiler; only the tables are meant to be read."""

from __future__ import annotations

import atexit
import cProfile
import io
import pstats
import time

SKIP_STEPS = 1  # the warm-up request's prefill (compiles, autotuning) is left out
TOP = 45


def install(path: str) -> None:
    import torch

    from tritonllm.engine.embedded.model_runner import ModelRunner

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    profiler = cProfile.Profile()
    seen = {"prefills": 0, "seconds": 0.0, "profiled": 0}
    execute = ModelRunner.execute

    def profiled_execute(self, batch, *args, **kwargs):
        if batch.phase != "prefill":
            return execute(self, batch, *args, **kwargs)
        seen["prefills"] += 1
        if seen["prefills"] <= SKIP_STEPS:
            return execute(self, batch, *args, **kwargs)
        sync()
        started = time.perf_counter()
        profiler.enable()
        try:
            return execute(self, batch, *args, **kwargs)
        finally:
            profiler.disable()
            sync()
            seen["seconds"] += time.perf_counter() - started
            seen["profiled"] += 1

    ModelRunner.execute = profiled_execute
    atexit.register(lambda: _write(profiler, seen, path))


def _write(profiler: cProfile.Profile, seen: dict, path: str) -> None:
    text = io.StringIO()
    text.write(f"profiled prefill steps: {seen['profiled']}, {seen['seconds'] * 1e3:.1f} ms with the GPU's work\n")
    for key in ("tottime", "cumulative"):
        text.write(f"\n==== by {key}\n")
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(TOP)
    with open(path, "a", encoding="utf-8") as out:
        out.write(text.getvalue())

"""Where the host's time goes in the engine's steps, by cProfile on the engine thread, written as pstats tables
when the process exits:
- "prefill": ModelRunner.execute of prefill batches, between two device synchronisations (the first prefill,
  the warm-up's, left out);
- "decode": whole EngineCore.step calls once the warm-up's have passed, no synchronisation added (what the host
  does between the GPU's steps, the wait for the tokens included).

Used as a bench prelude on the GPU machine (ci/gpu_session.sh's host-profile target):
    BENCH_PRELUDE="import sys; sys.path.insert(0, 'ci'); import host_profile; host_profile.install('OUT.txt')"
The bench's own figures in such a run are slowed by the profiler; only the tables are meant to be read."""

from __future__ import annotations

import atexit
import cProfile
import io
import pstats
import time

SKIP_PREFILLS = 1  # the warm-up request's prefill (compiles, autotuning) is left out
SKIP_STEPS = 150  # engine steps left out in "decode" mode (bench engine's warm-up request of 128 tokens and more)
TOP = 45


def install(path: str, mode: str = "prefill") -> None:
    profiler = cProfile.Profile()
    seen = {"count": 0, "seconds": 0.0, "profiled": 0}
    if mode == "prefill":
        _profile_prefills(profiler, seen)
    elif mode == "decode":
        _profile_steps(profiler, seen)
    else:
        raise ValueError(f"mode must be prefill or decode, got {mode!r}")
    atexit.register(lambda: _write(profiler, seen, path, mode))


def _profile_prefills(profiler: cProfile.Profile, seen: dict) -> None:
    import torch

    from tritonllm.engine.embedded.model_runner import ModelRunner

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    execute = ModelRunner.execute

    def profiled_execute(self, batch, *args, **kwargs):
        if batch.phase != "prefill":
            return execute(self, batch, *args, **kwargs)
        return _counted(profiler, seen, SKIP_PREFILLS, lambda: execute(self, batch, *args, **kwargs), sync)

    ModelRunner.execute = profiled_execute


def _profile_steps(profiler: cProfile.Profile, seen: dict) -> None:
    from tritonllm.engine.embedded.engine_core import EngineCore

    step = EngineCore.step
    EngineCore.step = lambda self: _counted(profiler, seen, SKIP_STEPS, lambda: step(self), lambda: None)


def _counted(profiler: cProfile.Profile, seen: dict, skip: int, call, sync):
    """call() under the profiler (between two sync() calls) once `skip` calls have passed, timed into `seen`."""
    seen["count"] += 1
    if seen["count"] <= skip:
        return call()
    sync()
    started = time.perf_counter()
    profiler.enable()
    try:
        return call()
    finally:
        profiler.disable()
        sync()
        seen["seconds"] += time.perf_counter() - started
        seen["profiled"] += 1


def _write(profiler: cProfile.Profile, seen: dict, path: str, mode: str) -> None:
    text = io.StringIO()
    text.write(f"profiled {mode} steps: {seen['profiled']}, {seen['seconds'] * 1e3:.1f} ms\n")
    if seen["profiled"]:
        for key in ("tottime", "cumulative"):
            text.write(f"\n==== by {key}\n")
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(TOP)
    with open(path, "a", encoding="utf-8") as out:
        out.write(text.getvalue())

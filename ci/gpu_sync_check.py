"""Which host-device synchronisations an engine step makes (GPU machine only; `bash ci/gpu_session.sh sync-check`).

A step whose launches include a synchronising call (a pageable copy, .item(), a boolean-mask index) makes the host
wait for all the work already queued, so the GPU then idles while the host prepares the rest of the step: the
overlap scheduler's lead is lost. This runs a short mixed workload (prompts and outputs of different lengths, so
that blocks are handed out mid-decode) on dummy weights with torch's sync debug mode on after warm-up, and prints
each distinct warning with the engine frames that led to it, most frequent first.

    python3 ci/gpu_sync_check.py [--model SHAPE_FOLDER] [--config model.yaml]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import traceback
import warnings

import torch

from tritonllm.commands.generate import build_engine_config
from tritonllm.engine import create_engine
from tritonllm.engine.types import SamplingParams

FRAMES = 6  # engine frames kept per warning


def workload(vocab: int, count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(20, 200))], rng.randint(20, 120)) for _ in range(count)
    ]


def run(engine, requests) -> None:
    handles = [engine.generate_async(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in requests]
    for handle in handles:
        handle.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder (a `tritonllm model shape` one will do)")
    parser.add_argument("--config", help="a model.yaml with engine settings")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu only checks that this script runs (no sync mode there)")
    args = parser.parse_args()
    config = build_engine_config(
        args.model, args.config, load_format="dummy", device=args.device, dtype="bfloat16", max_batch_size=64
    )
    on_cuda = args.device == "cuda"
    engine = create_engine(config)
    try:
        vocab = engine.core.model_config.vocab_size
        run(engine, workload(vocab, args.requests, seed=1))  # warm-up: graphs captured, kernels compiled
        seen: collections.Counter = collections.Counter()
        steps_before = engine.wait_idle().num_steps

        def note(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "tritonllm" in f.filename]
            where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-FRAMES:][::-1])
            seen[(str(message)[:120], where)] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            if on_cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                run(engine, workload(vocab, args.requests, seed=2))
            finally:
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("default")
        steps = engine.wait_idle().num_steps - steps_before
        print(json.dumps({"kind": "sync-check", "steps": steps, "distinct": len(seen), "total": sum(seen.values())}))
        for (message, where), count in seen.most_common():
            print(
                json.dumps(
                    {
                        "kind": "sync",
                        "count": count,
                        "per_step": round(count / max(steps, 1), 2),
                        "message": message,
                        "where": where,
                    }
                )
            )
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

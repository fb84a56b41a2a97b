"""`tritonllm bench spec`: batch-1 greedy decode speed with speculative decoding against the same engine without
it, in one run, on input-grounded prompts (`--task rewrite`: rewrite a given text, where prompt lookup and
lookahead find drafts) or open-ended ones (`--task chat`: questions on topics no shipped training data covers).

One engine runs every prompt twice in turn: once with speculation switched off for the request
(`SamplingParams.speculate=False`), then with it, prompt by prompt, so machine noise hits both alike and both
run on the same thread and thread pool (two engines in one process would each own an OpenMP pool, and on a
small machine the pools slow each other down). Decode speed counts the tokens after the first over the time
from the first token to the last (prefill left out). Mean accepted length: tokens committed per decode step of
the speculative requests. Per-prompt figures come too: one answer that repeats itself can carry a small run's
overall ratio, and the median prompt's ratio shows it. `--rounds N` goes through the prompts N times and pools
every figure over the rounds."""

from __future__ import annotations

import statistics
from dataclasses import replace

from tritonllm.commands.arg_types import count
from tritonllm.commands.bench_report import progress, report
from tritonllm.spec_decode.training.distill import bench_requests, chat_ids


def _draft_len(args, default: int) -> int:
    return default if args.draft_len is None else args.draft_len


METHODS = {
    "ngram": lambda a: {"decoding_type": "NGram", "max_draft_len": _draft_len(a, 6), "max_matching_ngram_size": 3},
    # A one-token window and two candidates: the fastest measured on a 2-core CPU (docs/benchmarks.md), where
    # every extra token in the verification step costs compute.
    "lookahead": lambda a: {
        "decoding_type": "Lookahead",
        "max_window_size": 1,
        "max_ngram_size": 5,
        "max_verification_set_size": 2,
    },
    "drafttarget": lambda a: {
        "decoding_type": "DraftTarget",
        "max_draft_len": _draft_len(a, 6),
        "speculative_model_dir": a.spec_model_dir,
    },
    # The heads' default tree, pruned each step to the nodes the heads give a path probability of at least 0.15:
    # the fastest measured on the 2-core CPU of docs/benchmarks.md, where every verified token costs compute.
    "medusa": lambda a: {
        "decoding_type": "Medusa",
        "speculative_model_dir": a.spec_model_dir,
        "min_path_probability": 0.15,
    },
    # A chain of two: each EAGLE draft pass reads the draft layer and its head, so on the 2-core CPU of
    # docs/benchmarks.md two beat three (and six) on the median prompt.
    "eagle": lambda a: {
        "decoding_type": "Eagle",
        "max_draft_len": _draft_len(a, 2),
        "speculative_model_dir": a.spec_model_dir,
    },
    "eagle3": lambda a: {
        "decoding_type": "Eagle3",
        "max_draft_len": _draft_len(a, 2),
        "speculative_model_dir": a.spec_model_dir,
    },
}


def add_arguments(parser) -> None:
    parser.add_argument(
        "--method",
        choices=sorted(METHODS),
        default="ngram",
        help="when --config has no speculative_config (ngram: max_matching_ngram_size 3; "
        "lookahead: W=1, N=5, G=2; medusa: min_path_probability 0.15; drafttarget, medusa, eagle "
        "and eagle3 need --spec-model-dir, builtin:smollm2 for SmolLM2's shipped Medusa heads or "
        "EAGLE draft)",
    )
    parser.add_argument(
        "--draft-len", type=count, help="max_draft_len for ngram / drafttarget (default 6) / eagle, eagle3 (default 2)"
    )
    parser.add_argument(
        "--spec-model-dir",
        help="draft model, Medusa heads or EAGLE / EAGLE-3 draft folder (drafttarget, medusa, eagle, eagle3)",
    )
    parser.add_argument(
        "--task",
        choices=("rewrite", "chat"),
        default="rewrite",
        help="rewrite: rewrite a shipped text (input-grounded); chat: answer a question on a topic "
        "(open-ended); neither is in any training data",
    )
    parser.add_argument("--prompts", type=count, default=4, help="requests, one at a time")
    parser.add_argument(
        "--rounds",
        type=count,
        default=1,
        help="run every prompt this many times (each time plain, then speculative); all figures "
        "pool the rounds, per prompt too: more rounds steady the ratios on a noisy machine",
    )
    parser.add_argument(
        "--max-tokens",
        type=count,
        default=128,
        help="most tokens generated per request (default 128; the end token stops it earlier)",
    )
    parser.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def timed_request(engine, ids: list[int], params) -> dict:
    steps_before = engine.wait_idle().num_steps
    out = engine.generate(ids, params).outputs[0]
    metrics = out.request_perf_metrics
    decode_steps = engine.wait_idle().num_steps - steps_before - metrics.prefill_steps
    return {
        "tokens": out.token_ids,
        "decode_s": (metrics.last_token_time_ns - metrics.first_token_time_ns) / 1e9,
        "decode_steps": decode_steps,
        "drafted": metrics.total_draft_tokens,
        "accepted": metrics.total_accepted_draft_tokens,
    }


def summarise(runs: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) - 1 for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    steps = sum(r["decode_steps"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    return {
        "decode_tokens": tokens,
        "decode_s": round(seconds, 3),
        "tok_s": round(tokens / seconds, 2) if seconds else None,  # None: the answer ended at its first token
        "mean_accepted_length": round(tokens / steps, 3) if steps else None,
        "acceptance_rate": round(sum(r["accepted"] for r in runs) / drafted, 3) if drafted else None,
    }


def per_prompt(plain: list[dict], spec: list[dict], prompts: list[list[int]]) -> list[dict]:
    """Each prompt's own figures, in prompt order, over all its rounds (the runs are round after round of the
    prompts in order); speedup None where an answer had no decode step."""
    rows = []
    for i, ids in enumerate(prompts):
        base_s, fast_s = summarise(plain[i :: len(prompts)]), summarise(spec[i :: len(prompts)])
        timed = base_s["tok_s"] and fast_s["tok_s"]
        rows.append(
            {
                "prompt_tokens": len(ids),
                "output_tokens": len(spec[i]["tokens"]),
                "speedup": round(fast_s["tok_s"] / base_s["tok_s"], 3) if timed else None,
                "mean_accepted_length": fast_s["mean_accepted_length"],
            }
        )
    return rows


def bench_result(spec: dict, args, prompts: list[list[int]], runs: dict) -> dict:
    import torch

    result = {
        "method": spec.get("decoding_type"),
        "speculative_config": spec,
        "task": args.task,
        "prompts": len(prompts),
        "rounds": len(runs["spec"]) // len(prompts),
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "identical_outputs": all(a["tokens"] == b["tokens"] for a, b in zip(runs["plain"], runs["spec"])),
        "plain": summarise(runs["plain"]),
        "spec": summarise(runs["spec"]),
    }
    timed = result["plain"]["tok_s"] and result["spec"]["tok_s"]
    result["speedup"] = round(result["spec"]["tok_s"] / result["plain"]["tok_s"], 3) if timed else None
    result["per_prompt"] = per_prompt(runs["plain"], runs["spec"], prompts)
    speedups = [row["speedup"] for row in result["per_prompt"] if row["speedup"] is not None]
    result["median_prompt_speedup"] = round(statistics.median(speedups), 3) if speedups else None
    return result


def main(args) -> int:
    from transformers import AutoTokenizer

    from tritonllm.commands.generate import build_engine_config
    from tritonllm.engine import create_engine
    from tritonllm.engine.config import ConfigError, load_yaml_args
    from tritonllm.engine.types import SamplingParams

    spec = (load_yaml_args(args.config) if args.config else {}).get("speculative_config") or METHODS[args.method](args)
    if spec.get("speculative_model_dir", "") is None:
        raise ConfigError(f"--spec-model-dir is required for --method {args.method}")
    overrides = dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size or 1)
    engine = create_engine(build_engine_config(args.model, args.config, speculative_config=spec, **overrides))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    params = {
        "plain": SamplingParams(max_tokens=args.max_tokens, end_id=tokenizer.eos_token_id, speculate=False),
        "spec": SamplingParams(max_tokens=args.max_tokens, end_id=tokenizer.eos_token_id),
    }
    prompts = [chat_ids(tokenizer, request) for request in bench_requests(args.task, args.prompts)]
    try:
        for warm_up in params.values():
            engine.generate(prompts[0][:32], replace(warm_up, max_tokens=8))
        runs: dict[str, list[dict]] = {"plain": [], "spec": []}
        for round_ in range(1, args.rounds + 1):
            for number, ids in enumerate(prompts, 1):
                for side in ("plain", "spec"):
                    runs[side].append(timed_request(engine, ids, params[side]))
                row = per_prompt(runs["plain"][-1:], runs["spec"][-1:], [ids])[0]
                progress(
                    f"round {round_}/{args.rounds}, prompt {number}/{len(prompts)}: {len(ids)} tokens in, "
                    f"{row['output_tokens']} out, {row['speedup']}x, mean accepted length "
                    f"{row['mean_accepted_length']}"
                )
    finally:
        engine.shutdown()
    result = bench_result(spec, args, prompts, runs)
    report(
        result,
        args.json,
        f"{result['method']}: {result['spec']['tok_s']} tok/s vs {result['plain']['tok_s']} "
        f"tok/s without speculation ({result['speedup']}x; median prompt "
        f"{result['median_prompt_speedup']}x), mean accepted length "
        f"{result['spec']['mean_accepted_length']}, "
        f"outputs identical: {result['identical_outputs']}",
    )
    return 0

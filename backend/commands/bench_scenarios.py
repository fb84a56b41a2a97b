"""`tritonllm bench chunked` and `tritonllm bench reuse`: one setting on and off, same requests, one run.

chunked: N streams are decoding when a long prompt arrives; the p99 gap between tokens of the running streams,
from the long prompt's arrival until it produced its first token, with chunked prefill off and on.
reuse: requests sharing a long system prompt arrive together after one request has already used that system
prompt (as in steady traffic); their mean time to first token with KV reuse off and on."""

from __future__ import annotations

import statistics
import threading
import time

from tritonllm.commands.bench_engine import make_requests
from tritonllm.commands.bench_report import progress, report
from tritonllm.commands.generate import build_engine_config
from tritonllm.engine.types import SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class TokenClock:
    """Arrival times of every streamed update, per request, recorded on the engine thread."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.pending = 0
        self.armed = False  # set by the last request tracked: `done` waits for it too

    def track(self, last: bool = False):
        with self.lock:
            self.pending += 1
            self.armed = self.armed or last

        def on_output(handle, item):
            with self.lock:
                self.times.setdefault(handle.request_id, []).append(time.perf_counter())
                if isinstance(item, BaseException) or item.finished:
                    self.pending -= 1
                    if self.pending == 0 and self.armed:
                        self.done.set()

        return on_output


def chunked_run(engine, streams: list[list[int]], long_prompt: list[int], stream_tokens: int) -> dict:
    clock = TokenClock()
    params = SamplingParams(max_tokens=stream_tokens, ignore_eos=True)
    handles = [engine.generate_async(ids, params, streaming=True, on_output=clock.track()) for ids in streams]
    while any(len(clock.times.get(h.request_id, [])) < 3 for h in handles):  # every stream is decoding
        time.sleep(0.01)
    arrival = time.perf_counter()
    long_handle = engine.generate_async(
        long_prompt, SamplingParams(max_tokens=4, ignore_eos=True), streaming=True, on_output=clock.track(last=True)
    )
    clock.done.wait()
    first_token = clock.times[long_handle.request_id][0]
    gaps = []
    for handle in handles:
        times = clock.times[handle.request_id]
        gaps += [b - a for a, b in zip(times, times[1:]) if b > arrival and a < first_token]
    if not gaps:
        raise RuntimeError("the streams ended before the long prompt produced a token: raise --stream-tokens")
    return {
        "p99_itl_s": percentile(gaps, 99),
        "max_itl_s": max(gaps),
        "gaps": len(gaps),
        "long_prompt_ttft_s": first_token - arrival,
    }


def reuse_run(engine, system: list[int], questions: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate_async(system + questions[0], params).result()  # an earlier request with this system prompt
    start = time.perf_counter()
    handles = [engine.generate_async(system + q, params) for q in questions]
    ttfts = []
    for handle in handles:
        metrics = handle.result().outputs[0].request_perf_metrics
        ttfts.append((metrics.first_token_time_ns - metrics.arrival_time_ns) / 1e9)
    reused = sum(h.result().outputs[0].request_perf_metrics.kv_cache_reused_blocks for h in handles)
    return {
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": percentile(ttfts, 50),
        "wall_s": time.perf_counter() - start,
        "reused_blocks": reused,
    }


def _engine(args, **overrides):
    from tritonllm.engine import create_engine

    config = build_engine_config(
        args.model, args.config, dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size, **overrides
    )
    return create_engine(config)


def _tokens(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    return [r.prompt_ids for r in make_requests(tokenizer, count, (length, length), (1, 1), seed)]


def main_chunked(args, tokenizer) -> dict:
    streams = _tokens(tokenizer, args.streams, 32, args.seed)
    long_prompt = _tokens(tokenizer, 1, args.long_prompt, args.seed + 1)[0]
    results = {}
    for mode, overrides in (
        ("off", {"enable_chunked_prefill": False, "max_num_tokens": args.long_prompt + 64}),
        ("on", {"enable_chunked_prefill": True, "max_num_tokens": args.chunk}),
    ):
        progress(f"chunked prefill {mode}: {args.streams} streams, then a {args.long_prompt}-token prompt")
        engine = _engine(args, max_seq_len=args.long_prompt + 512, **overrides)
        try:
            # Warm-up, with streams as long as the real ones: short ones can end before the prompt's first token.
            chunked_run(engine, streams[:1], long_prompt[:64], args.stream_tokens)
            results[mode] = chunked_run(engine, streams, long_prompt, args.stream_tokens)
        finally:
            engine.shutdown()
    return {
        "scenario": "chunked",
        "streams": args.streams,
        "long_prompt_tokens": args.long_prompt,
        "chunk_tokens": args.chunk,
        "off": results["off"],
        "on": results["on"],
        "p99_itl_ratio_on_vs_off": round(results["on"]["p99_itl_s"] / results["off"]["p99_itl_s"], 3),
    }


def main_reuse(args, tokenizer) -> dict:
    system = _tokens(tokenizer, 1, args.system_prompt, args.seed)[0]
    questions = _tokens(tokenizer, args.requests, 16, args.seed + 1)
    results = {}
    for mode, reuse in (("off", False), ("on", True)):
        progress(f"KV reuse {mode}: {args.requests} requests sharing a {args.system_prompt}-token system prompt")
        engine = _engine(args, kv_cache_config={"enable_block_reuse": reuse}, max_seq_len=args.system_prompt + 64)
        try:
            results[mode] = reuse_run(engine, system, questions)
        finally:
            engine.shutdown()
    return {
        "scenario": "reuse",
        "requests": args.requests,
        "system_prompt_tokens": args.system_prompt,
        "off": results["off"],
        "on": results["on"],
        "ttft_speedup_on_vs_off": round(results["off"]["mean_ttft_s"] / results["on"]["mean_ttft_s"], 2),
    }


def main(args) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    result = main_chunked(args, tokenizer) if args.bench_command == "chunked" else main_reuse(args, tokenizer)
    report(result, args.json, "\n".join(f"{key}: {value}" for key, value in result.items()))
    return 0

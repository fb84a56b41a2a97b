"""What the TensorRT-LLM adapter makes of the library's results: our `CompletionOutput`, stop reasons, per-request
metrics and engine stats. Pure functions over the library's objects, which are read, never kept (the library
mutates them in place)."""

from __future__ import annotations

import datetime
from typing import Any, Optional

from .config import EngineConfig
from .seam import EngineStats
from .trtllm_args import STOP_WORD_PREFIX
from .types import CompletionOutput, RequestPerfMetrics

# -- library outputs -> ours --------------------------------------------------------------------------------------


def completion_from_trtllm(
    output: Any, diff_start: int, stop_words: Optional[list[list[int]]], end_id: Optional[int]
) -> CompletionOutput:
    """Our `CompletionOutput` for one of the library's, copied (the library mutates its objects in place)."""
    token_ids = list(output.token_ids or [])
    logprobs = sampled_logprobs(output.logprobs, token_ids)
    cumulative = output.cumulative_logprob if output.cumulative_logprob is not None else sum(logprobs)
    return CompletionOutput(
        index=output.index,
        token_ids=token_ids,
        logprobs=logprobs,
        cumulative_logprob=float(cumulative),
        finish_reason=output.finish_reason,
        stop_reason=stop_reason_from_trtllm(output.stop_reason, output.finish_reason, stop_words, end_id),
        request_perf_metrics=perf_metrics_from_trtllm(getattr(output, "request_perf_metrics", None)),
        _diff_start=min(diff_start, len(token_ids)),
    )


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """One float per token. Depending on backend the library gives floats or, per position, a dict
    {token_id: Logprob} of the top tokens plus the sampled one."""
    values = []
    for position, entry in enumerate(logprobs or []):
        if isinstance(entry, dict):
            token = token_ids[position] if position < len(token_ids) else None
            entry = entry.get(token, float("nan"))
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def stop_reason_from_trtllm(
    reason: Any, finish_reason: Optional[str], stop_words: Optional[list[list[int]]], end_id: Optional[int]
):
    """Our stop_reason: the word's token ids for a stop word, the end id when the end token stopped it."""
    if isinstance(reason, str) and reason.startswith(STOP_WORD_PREFIX) and stop_words:
        return list(stop_words[int(reason[len(STOP_WORD_PREFIX) :])])
    if reason is None and finish_reason == "stop":
        return end_id  # the library leaves stop_reason empty when the end token finished the sequence
    return reason


def perf_metrics_from_trtllm(metrics: Any) -> RequestPerfMetrics:
    """The library's per-request metrics (timings as steady-clock timedeltas) in our fields (ns). Preemptions and
    prefill steps are not reported by the library: they stay 0."""
    if metrics is None:
        return RequestPerfMetrics()
    timing = getattr(metrics, "timing_metrics", None)
    kv = getattr(metrics, "kv_cache_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None)
    return RequestPerfMetrics(
        arrival_time_ns=_timedelta_ns(getattr(timing, "arrival_time", None)),
        first_scheduled_time_ns=_timedelta_ns(getattr(timing, "first_scheduled_time", None)),
        first_token_time_ns=_timedelta_ns(getattr(timing, "first_token_time", None)),
        last_token_time_ns=_timedelta_ns(getattr(timing, "last_token_time", None)),
        kv_cache_alloc_new_blocks=int(getattr(kv, "num_new_allocated_blocks", 0) or 0),
        kv_cache_reused_blocks=int(getattr(kv, "num_reused_blocks", 0) or 0),
        kv_cache_alloc_total_blocks=int(getattr(kv, "num_total_allocated_blocks", 0) or 0),
        total_draft_tokens=int(getattr(spec, "total_draft_tokens", 0) or 0),
        total_accepted_draft_tokens=int(getattr(spec, "total_accepted_draft_tokens", 0) or 0),
    )


def _timedelta_ns(value: Optional[datetime.timedelta]) -> int:
    if value is None:
        return 0
    # Integer arithmetic: total_seconds() would round at microsecond resolution for large steady-clock values.
    return (value.days * 86_400 + value.seconds) * 1_000_000_000 + value.microseconds * 1_000


def engine_stats_from_iteration(latest: Optional[dict], config: EngineConfig, in_flight: int) -> EngineStats:
    """EngineStats from the newest iteration-stats record of `LLM.get_stats` (None when there is none: the
    PyTorch backend records them only with `enable_iter_perf_stats: true`). Without a record the KV numbers are 0
    and every in-flight request counts as running. Records come only from iterations, so when idle the KV numbers
    are those of the last iteration that ran."""
    latest = latest or {}
    kv = latest.get("kvCacheStats", {})
    running = latest.get("numActiveRequests", in_flight) if in_flight else 0
    waiting = latest.get("numQueuedRequests", 0) if in_flight else 0
    return EngineStats(
        num_total_blocks=int(kv.get("maxNumBlocks", 0)),
        num_free_blocks=int(kv.get("freeNumBlocks", 0)),
        tokens_per_block=int(kv.get("tokensPerBlock", config.kv_cache_config.tokens_per_block)),
        num_running=int(running),
        num_waiting=int(waiting),
        num_steps=int(latest.get("iter", 0)),
        max_seq_len=config.max_seq_len or 0,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
    )

"""What an engine setting (a quantization, an FP8 KV cache, a dtype) costs in quality: the same model run with and
without it, one side after the other in one process, on the same shipped text (bench/texts.py).

Each side scores the passages' perplexity through the engine's context logits, in windows of at most `window`
tokens (never longer than the baseline's max_seq_len), and continues the same prompts greedily. The baseline's
continuations are the references: ROUGE-1/2/L and token agreement say how far the candidate's drift from them.
Only one engine is loaded at a time, so two large models need not fit together."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.types import SamplingParams

from .scores import NegLogLikelihood, require_rouge, rouge_f_means, token_agreement, window_nll
from .texts import cut_prompts, load_passages, windows

SIDES = ("baseline", "candidate")
DUMMY_WARNING = (
    "load_format dummy: random weights, so the perplexities say nothing about the model; only the two sides' "
    "agreement means something"
)


@dataclass(frozen=True)
class AccuracySettings:
    prompts: int = 8  # greedy continuations compared
    prompt_tokens: int = 48  # tokens of each prompt
    max_tokens: int = 32  # most tokens of each continuation
    window: int = 1024  # most tokens of a perplexity window


@dataclass(frozen=True)
class Workload:
    """The tokens both sides see: each passage's ids, the prompts cut from them, the end token of continuations."""

    passages: dict[str, list[int]]
    prompts: list[list[int]]
    end_id: int | None


@dataclass
class SideRun:
    facts: dict[str, Any]
    window: int
    nll: NegLogLikelihood = field(default_factory=NegLogLikelihood)
    by_passage: dict[str, NegLogLikelihood] = field(default_factory=dict)
    windows: int = 0
    continuations: list[list[int]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def check_embedded(config: EngineConfig, what: str) -> None:
    """Refuse, before any weights load, a config the embedded engine cannot run (an unknown key among them)."""
    if config.engine == "tensorrt_llm":
        raise ConfigError(f"{what}: engine tensorrt_llm: the accuracy bench runs the embedded engine")
    problems = config.embedded_unsupported()
    if problems:
        raise ConfigError(f"{what}: the embedded engine cannot honour: " + "; ".join(problems))


def prepare_workload(tokenizer, settings: AccuracySettings) -> Workload:
    passages = {name: list(tokenizer.encode(text)) for name, text in load_passages().items()}
    try:
        prompts = cut_prompts(list(passages.values()), settings.prompts, settings.prompt_tokens)
    except ValueError as exc:
        raise ConfigError(f"--prompt-tokens {settings.prompt_tokens}: {exc}") from None
    return Workload(passages, prompts, tokenizer.eos_token_id)


def run_side(
    config: EngineConfig, workload: Workload, settings: AccuracySettings, window: int | None, say: Callable
) -> SideRun:
    """Start an engine for `config`, score the passages and continue the prompts, shut it down. `window`: the
    baseline's, which the candidate reuses so that both perplexities cover the same windows (None: choose it)."""
    from tritonllm.engine.embedded.engine import EmbeddedEngine

    started = time.perf_counter()
    engine = EmbeddedEngine(config)
    try:
        core = engine.core
        if window is None:
            window = _window(settings.window, core.max_seq_len, config)
        run = SideRun(_facts(engine, config), window)
        run.seconds["load"] = time.perf_counter() - started
        say(f"engine ready in {run.seconds['load']:.1f}s ({run.facts['device']}, {run.facts['dtype']})")
        _score_passages(engine, workload, run)
        _continue_prompts(engine, workload, settings, run)
    finally:
        engine.shutdown()
    run.seconds["total"] = time.perf_counter() - started
    say(
        f"perplexity {run.nll.perplexity:.4f} over {run.nll.tokens} tokens in {run.seconds['perplexity']:.1f}s; "
        f"{len(run.continuations)} continuations in {run.seconds['generate']:.1f}s"
    )
    return run


def _window(requested: int, max_seq_len: int, config: EngineConfig) -> int:
    """The requested window, shortened to what one prompt may be: one token below max_seq_len (the request asks
    for one output token), and at most max_num_tokens without chunked prefill."""
    window = min(requested, max_seq_len - 1)
    if not config.enable_chunked_prefill:
        window = min(window, config.max_num_tokens)
    return window


def _facts(engine, config: EngineConfig) -> dict[str, Any]:
    core = engine.core
    return {
        "model": str(config.model),
        "dtype": str(core.dtype).replace("torch.", ""),
        "device": str(core.device),
        "load_format": config.load_format,
        "max_seq_len": core.max_seq_len,
    }


def _score_passages(engine, workload: Workload, run: SideRun) -> None:
    """Every window at once (one batch of prefills); context logits at every prompt position, one output token."""
    started = time.perf_counter()
    params = SamplingParams(max_tokens=1, return_context_logits=True)
    jobs = [(name, ids) for name, passage in workload.passages.items() for ids in windows(passage, run.window)]
    handles = [engine.generate_async(ids, params) for _, ids in jobs]
    for (name, ids), handle in zip(jobs, handles):
        logits = handle.result().context_logits
        assert logits is not None  # asked for above
        scored = window_nll(logits, ids)
        run.nll.add(scored)
        run.by_passage.setdefault(name, NegLogLikelihood()).add(scored)
    run.windows = len(jobs)
    run.seconds["perplexity"] = time.perf_counter() - started


def _continue_prompts(engine, workload: Workload, settings: AccuracySettings, run: SideRun) -> None:
    """Greedy (no sampling knob set), up to max_tokens or the end token."""
    started = time.perf_counter()
    params = SamplingParams(max_tokens=settings.max_tokens, end_id=workload.end_id)
    handles = [engine.generate_async(ids, params) for ids in workload.prompts]
    run.continuations = [list(handle.result().outputs[0].token_ids) for handle in handles]
    run.seconds["generate"] = time.perf_counter() - started


def release_memory(device: str) -> None:
    """Give the last side's weights and KV cache back before the next loads."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure_accuracy(
    configs: dict[str, EngineConfig], tokenizer, settings: AccuracySettings, say: Callable = lambda message: None
) -> dict[str, Any]:
    """`configs`: the baseline's and the candidate's engine config. The result: both sides' perplexities and
    their ratio, the ROUGE and token agreement of the candidate's continuations against the baseline's."""
    for side in SIDES:
        check_embedded(configs[side], side)
    require_rouge()
    workload = prepare_workload(tokenizer, settings)
    say(
        f"{sum(map(len, workload.passages.values()))} passage tokens, {len(workload.prompts)} prompts of "
        f"{settings.prompt_tokens} tokens"
    )
    runs: dict[str, SideRun] = {}
    window = None
    for side in SIDES:
        say(f"{side}: starting the engine ({configs[side].load_format} weights)")
        runs[side] = run_side(configs[side], workload, settings, window, _prefixed(say, side))
        window = runs[side].window
        release_memory(runs[side].facts["device"])
    return accuracy_result(runs, workload, settings, tokenizer)


def _prefixed(say: Callable, side: str) -> Callable:
    return lambda message: say(f"{side}: {message}")


def accuracy_result(
    runs: dict[str, SideRun], workload: Workload, settings: AccuracySettings, tokenizer
) -> dict[str, Any]:
    baseline, candidate = runs["baseline"], runs["candidate"]

    def text(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    rouge = rouge_f_means([text(ids) for ids in baseline.continuations], [text(ids) for ids in candidate.continuations])
    matches, positions = token_agreement(baseline.continuations, candidate.continuations)
    dummy = any(run.facts["load_format"] == "dummy" for run in runs.values())
    return {
        **{side: _side_result(runs[side]) for side in SIDES},
        "perplexity_ratio": _round(candidate.nll.perplexity / baseline.nll.perplexity),
        **{name: _round(value) for name, value in rouge.items()},
        "token_agreement": _round(matches / positions) if positions else None,
        "agreeing_tokens": matches,
        "compared_tokens": positions,
        "identical_continuations": sum(a == b for a, b in zip(baseline.continuations, candidate.continuations)),
        "prompts": len(workload.prompts),
        "prompt_tokens": settings.prompt_tokens,
        "max_tokens": settings.max_tokens,
        "window": baseline.window,
        "passages": {name: len(ids) for name, ids in workload.passages.items()},
        "seconds": round(sum(run.seconds["total"] for run in runs.values()), 3),
        "warnings": [DUMMY_WARNING] if dummy else [],
    }


def _side_result(run: SideRun) -> dict[str, Any]:
    return {
        **run.facts,
        "perplexity": _round(run.nll.perplexity),
        "scored_tokens": run.nll.tokens,
        "windows": run.windows,
        "perplexity_by_passage": {name: _round(nll.perplexity) for name, nll in run.by_passage.items()},
        "continuation_tokens": sum(map(len, run.continuations)),
        "seconds": {name: round(value, 3) for name, value in run.seconds.items()},
    }


def _round(value: float) -> float:
    return round(value, 6)

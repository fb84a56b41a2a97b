"""`tritonllm bench accuracy`: what an engine setting costs in quality, the model with it against the same model
without it, one after the other in one run.

The baseline is --model with the plain flags (--dtype, --device, --max-batch-size, --load-format); the candidate is
the same with --config's engine arguments (model.yaml keys, e.g. `quant_config: {quant_algo: FP8}`,
`kv_cache_config: {dtype: fp8}` or `dtype: bfloat16`) on top. Both score the perplexity of the passages the package
ships (a story, a technical explanation, a dialogue; about 2,000 tokens) through the engine's context logits, in
windows of at most --window tokens, and continue --prompts prompts cut from the same passages greedily. The
baseline's continuations are the references: ROUGE-1/2/L (F-measure, mean over prompts; the rouge-score package)
and token agreement (the share of positions where both sides chose the same token) measure the candidate's drift.
Without --config the candidate is the baseline again: ratio 1 and ROUGE 1 unless the engine is nondeterministic.
--candidate-model DIR makes the candidate another checkpoint (a quantized copy of --model, as `tritonllm quantize`
writes) with the same flags, and --config's keys on top if given; it must share --model's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

from tritonllm.bench.accuracy import AccuracySettings, check_embedded, measure_accuracy
from tritonllm.bench.scores import MissingDependencyError, require_rouge
from tritonllm.commands.arg_types import count
from tritonllm.commands.bench_report import progress, report
from tritonllm.commands.generate import build_engine_config
from tritonllm.engine.config import ConfigError, EngineConfig, load_yaml_args


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument(
        "--config",
        help="engine arguments (model.yaml keys) of the candidate, applied on top of the baseline's; "
        "without it the candidate is the baseline again (a determinism check)",
    )
    parser.add_argument(
        "--candidate-model",
        metavar="DIR",
        help="the candidate's model folder (e.g. a quantized checkpoint of --model; same tokenizer); default: --model",
    )
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="both sides' dtype (default: auto)"
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="both sides' device (default: auto, CUDA if available)"
    )
    parser.add_argument("--max-batch-size", type=int, help="most sequences in one step, both sides")
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="auto (default): the folder's weights; dummy: random weights on both sides, which makes the "
        "perplexities meaningless (a warning says so)",
    )
    parser.add_argument("--prompts", type=count, default=8, help="greedy continuations compared (default 8)")
    parser.add_argument(
        "--prompt-tokens", type=count, default=48, help="tokens of each prompt, cut from the passages (default 48)"
    )
    parser.add_argument(
        "--max-tokens",
        type=count,
        default=32,
        help="most tokens of each continuation (default 32; one stops early at the end token)",
    )
    parser.add_argument(
        "--window",
        type=count,
        default=1024,
        help="most tokens of a perplexity window (default 1024; shortened to the baseline's max_seq_len - 1)",
    )
    parser.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def side_configs(args) -> dict[str, EngineConfig]:
    """The baseline from the flags; the candidate from the flags (its model --candidate-model if given) with
    --config's keys on top. A file that cannot be read, or a key the embedded engine does not know, is a
    ConfigError naming --config (or --candidate-model)."""
    flags = dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size, load_format=args.load_format)
    plain = {key: value for key, value in flags.items() if value is not None}
    baseline = build_engine_config(args.model, None, **plain)
    check_embedded(baseline, "the baseline")
    candidate_model = getattr(args, "candidate_model", None)
    if not args.config and not candidate_model:
        return {"baseline": baseline, "candidate": baseline}
    what = f"--config {args.config}" if args.config else f"--candidate-model {candidate_model}"
    try:
        overrides = load_yaml_args(args.config) if args.config else {}
        candidate = build_engine_config(candidate_model or args.model, None, **{**plain, **overrides})
        check_embedded(candidate, "the candidate")
        if candidate_model and not (Path(str(candidate.model)) / "config.json").is_file():
            raise ConfigError("no config.json there (a Hugging Face model folder is needed)")
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    return {"baseline": baseline, "candidate": candidate}


def summary(result: dict) -> str:
    base, cand = result["baseline"], result["candidate"]
    lines = [
        f"perplexity: baseline {base['perplexity']:.6g}, candidate {cand['perplexity']:.6g} "
        f"(ratio {result['perplexity_ratio']:.4f}; {base['scored_tokens']} tokens, {base['windows']} windows)",
        f"greedy continuations ({result['prompts']} prompts, up to {result['max_tokens']} tokens): "
        f"ROUGE-1 {result['rouge1']:.4f}, ROUGE-2 {result['rouge2']:.4f}, ROUGE-L {result['rougeL']:.4f}, "
        f"token agreement {result['token_agreement']:.4f}, {result['identical_continuations']} identical",
        f"time: {result['seconds']:.1f}s",
    ]
    return "\n".join(lines + [f"warning: {warning}" for warning in result["warnings"]])


def main(args) -> int:
    from transformers import AutoTokenizer

    configs = side_configs(args)
    try:
        require_rouge()
    except MissingDependencyError as exc:
        print(f"tritonllm: error: {exc}", file=sys.stderr)
        return 2
    settings = AccuracySettings(args.prompts, args.prompt_tokens, args.max_tokens, args.window)
    if configs["baseline"].load_format == "dummy" or configs["candidate"].load_format == "dummy":
        progress("warning: load_format dummy: random weights, the perplexities say nothing about the model")
    tokenizer = AutoTokenizer.from_pretrained(configs["baseline"].tokenizer or args.model)
    result = measure_accuracy(configs, tokenizer, settings, progress)
    result["config"] = args.config
    result["candidate_model"] = args.candidate_model
    report(result, args.json, summary(result))
    return 0

"""`tritonllm generate`: run prompts through the embedded engine, concurrently or one after another."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Optional

from tritonllm.engine.config import EngineConfig, load_yaml_args
from tritonllm.engine.types import RequestOutput, SamplingParams


def build_engine_config(model: str, config_path: Optional[str] = None, **overrides) -> EngineConfig:
    """Engine arguments from a model.yaml (if given), then explicit overrides that are not None."""
    args = load_yaml_args(config_path) if config_path else {}
    args["model"] = model
    args.update({key: value for key, value in overrides.items() if value is not None})
    args.setdefault("engine", "embedded")
    return EngineConfig.from_dict(args)


def sampling_params_for(tokenizer, max_tokens: int, **knobs) -> SamplingParams:
    """SamplingParams with the tokenizer's end id; knobs left None keep the engine defaults."""
    return SamplingParams(
        max_tokens=max_tokens, end_id=tokenizer.eos_token_id, **{k: v for k, v in knobs.items() if v is not None}
    )


def run_prompts(
    engine, prompt_ids: list[list[int]], params: SamplingParams, sequential: bool = False, loras: Optional[list] = None
) -> list[RequestOutput]:
    """`loras`: a LoRARequest (or None) per prompt."""
    loras = loras or [None] * len(prompt_ids)
    if sequential:
        return [engine.generate_async(ids, params, lora_request=lora).result() for ids, lora in zip(prompt_ids, loras)]
    handles = [engine.generate_async(ids, params, lora_request=lora) for ids, lora in zip(prompt_ids, loras)]
    return [handle.result() for handle in handles]


def result_record(prompt_ids: list[int], output: RequestOutput, tokenizer) -> dict:
    """One prompt's result as the --json line shows it."""
    samples = []
    for completion in output.outputs:
        perf = completion.request_perf_metrics
        assert perf is not None  # both engines report it with every output
        metrics = dataclasses.asdict(perf)
        metrics["acceptance_rate"] = perf.acceptance_rate
        samples.append(
            {
                "output_token_ids": completion.token_ids,
                "text": tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                "finish_reason": completion.finish_reason,
                "cumulative_logprob": completion.cumulative_logprob,
                "stats": metrics,
            }
        )
    record = {"prompt_token_ids": prompt_ids, **samples[0]}
    if len(samples) > 1:
        record["samples"] = samples
    return record


def _lora_overrides(args, loras: list) -> dict:
    """LoRA on, with room for every distinct adapter of the call, when any prompt has one."""
    distinct = len({lora.lora_int_id for lora in loras if lora is not None})
    if not distinct:
        return {}
    config = dict((load_yaml_args(args.config) if args.config else {}).get("lora_config") or {})
    config["max_loras"] = max(config.get("max_loras", 4), distinct)
    config["max_cpu_loras"] = max(config.get("max_cpu_loras", 4), config["max_loras"])
    return {"enable_lora": True, "lora_config": config}


def main(args) -> int:
    from transformers import AutoTokenizer

    from tritonllm.commands.lora import lora_requests_for
    from tritonllm.engine import choose_engine, create_engine
    from tritonllm.engine.embedded.loader import read_model_config

    loras = lora_requests_for(args, len(args.prompt))
    config = build_engine_config(
        args.model,
        args.config,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size,
        **_lora_overrides(args, loras),
    )
    if choose_engine(config) == "embedded":
        read_model_config(config.model)  # a missing or unsupported model fails here, before the tokenizer
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or args.model)
    params = sampling_params_for(
        tokenizer,
        args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        n=args.n,
    )
    params.validate()  # a bad knob fails before the model loads
    prompt_ids = [tokenizer.encode(text) for text in args.prompt]
    engine = create_engine(config)
    try:
        outputs = run_prompts(engine, prompt_ids, params, args.sequential, loras)
    finally:
        engine.shutdown()
    for ids, output in zip(prompt_ids, outputs):
        record = result_record(ids, output, tokenizer)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"], flush=True)
            print(f"[{record['finish_reason']}, {len(record['output_token_ids'])} tokens]", file=sys.stderr)
    return 0

"""LoRA on the command line: `tritonllm lora convert`, `tritonllm bench lora`, and `generate --lora`."""

from __future__ import annotations

import sys
from typing import Optional

from tritonllm.commands.arg_types import count


def add_lora_command(sub) -> None:
    lora = sub.add_parser("lora", help="LoRA adapters: convert a PEFT folder to TensorRT-LLM's request tensors")
    kinds = lora.add_subparsers(dest="lora_command", required=True)
    convert = kinds.add_parser(
        "convert",
        help="PEFT folder -> model.lora_weights.npy + model.lora_config.npy "
        "(TensorRT-LLM's layout, scale folded into the out-weights)",
    )
    convert.add_argument("peft_dir", help="adapter_config.json + adapter_model.safetensors")
    convert.add_argument("--out", required=True, help="folder to write the two .npy files into")
    convert.add_argument(
        "--dtype",
        choices=["float16", "float32"],
        default="float16",
        help="lora_weights dtype (the contract's input is FP16)",
    )


def add_generate_options(gen) -> None:
    gen.add_argument("--lora", metavar="PEFT_DIR", help="run every prompt with this adapter")
    gen.add_argument(
        "--lora-for",
        action="append",
        default=[],
        metavar="INDEX=PEFT_DIR",
        help="run prompt INDEX (0-based) with this adapter instead; repeatable, so one call mixes "
        "adapters (and the base model, for prompts given none)",
    )


def add_bench_command(kinds, engine_arguments) -> None:
    bench = kinds.add_parser(
        "lora", help="throughput with N adapters mixed in one batch vs the base model alone, same requests"
    )
    engine_arguments(bench)
    bench.add_argument("--adapters", type=count, default=4, help="random adapters, assigned to requests in turn")
    bench.add_argument("--rank", type=count, default=16, help="rank of every random adapter (default 16)")
    bench.add_argument("--requests", type=count, default=16, help="requests, all submitted at once (default 16)")
    bench.add_argument("--prompt", type=count, default=64, help="prompt tokens per request")
    bench.add_argument("--output", type=count, default=64, help="output tokens per request")
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts, cut from the shipped text (default 0; the adapters are fixed)",
    )
    bench.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def lora_requests_for(args, num_prompts: int) -> list[Optional[object]]:
    """One LoRARequest (or None) per prompt, from --lora and --lora-for; one task id per distinct folder."""
    from tritonllm.engine.config import ConfigError
    from tritonllm.engine.types import LoRARequest

    chosen: list[Optional[str]] = [args.lora] * num_prompts
    for item in args.lora_for:
        index, sep, folder = item.partition("=")
        if not sep or not index.strip().isdigit() or not folder:
            raise ConfigError(f"--lora-for expects INDEX=PEFT_DIR, got {item!r}")
        if int(index) >= num_prompts:
            raise ConfigError(f"--lora-for {item}: there are only {num_prompts} prompts (indexes from 0)")
        chosen[int(index)] = folder
    ids = {folder: task_id for task_id, folder in enumerate(dict.fromkeys(f for f in chosen if f), start=1)}
    return [None if folder is None else LoRARequest(folder, ids[folder], folder) for folder in chosen]


def main(args) -> int:
    from tritonllm.lora.convert import convert_peft_folder
    from tritonllm.lora.modules import LoraFormatError

    try:
        weights, config = convert_peft_folder(args.peft_dir, args.out, args.dtype)
    except LoraFormatError as exc:
        print(f"tritonllm: error: {exc}", file=sys.stderr)
        return 2
    print(weights)
    print(config)
    return 0

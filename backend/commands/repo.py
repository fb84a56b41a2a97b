"""`tritonllm repo build` (the ensemble's models, or `--llmapi`) and `tritonllm repo fill`."""

from __future__ import annotations

import yaml

from tritonllm.deploy.repo import RepoError, build_repo, fill_template


def _parameters(pairs: list[str]) -> dict[str, str]:
    parameters = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param expects KEY=VALUE, got {pair!r}")
        parameters[key] = value
    return parameters


def main(args) -> int:
    if args.repo_command == "fill":
        fill_template(args.config, args.substitutions, in_place=True, check=not args.no_check)
        print(f"filled {args.config}")
        return 0
    if args.llmapi:
        return _build_llmapi(args)
    parameters = _parameters(args.param)
    if getattr(args, "lora_dir", None):
        parameters["lora_prefetch_dir"] = _lora_dir(args.lora_dir)
    repo = build_repo(
        args.model,
        args.out,
        streaming=args.streaming,
        max_batch_size=args.max_batch_size,
        engine=args.engine,
        dtype=args.dtype,
        device=args.device,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        kv_cache_max_tokens=args.kv_cache_max_tokens,
        guided_decoding_backend=None if args.guided_decoding_backend == "none" else args.guided_decoding_backend,
        parameters=parameters,
        overwrite=True,
        draft_model_dir=getattr(args, "draft_model", None),
    )
    print(f"model repository ready: {repo}")
    return 0


def _lora_dir(folder: str) -> str:
    """The folder as an absolute path, after listing the adapters it holds and the ids they will get."""
    from pathlib import Path

    from tritonllm.lora.lora_dir import adapters_in
    from tritonllm.lora.modules import LoraFormatError

    path = Path(folder).expanduser().resolve()
    try:
        adapters = adapters_in([path])
    except LoraFormatError as exc:
        raise RepoError(str(exc)) from None
    for adapter in adapters:
        print(f"LoRA adapter '{adapter.name}': lora_task_id {adapter.task_id} (or lora_name \"{adapter.name}\")")
    return str(path)


def _build_llmapi(args) -> int:
    from tritonllm.deploy.llmapi_repo import build_llmapi_repo

    # model.yaml values are typed: "64" is a number, "true" a boolean, as YAML reads them.
    engine_args = {key: yaml.safe_load(value) for key, value in _parameters(args.param).items()}
    repo = build_llmapi_repo(
        args.model,
        args.out,
        streaming=args.streaming,
        engine=args.engine,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        kv_cache_max_tokens=args.kv_cache_max_tokens,
        engine_args=engine_args,
        overwrite=True,
    )
    print(f"model repository ready: {repo} (the LLM-API tensorrt_llm model)")
    return 0

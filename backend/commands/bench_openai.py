"""`tritonllm bench openai`: streamed output tokens/s through the OpenAI endpoint against the same requests sent
straight to Triton's gRPC stream, in one run.

One tritonserver (a repository built for --model, max_batch_size = --requests) and one frontend process next to
it. Each side streams --requests concurrent greedy text completions of exactly --output-tokens tokens
(min_tokens = max_tokens) to the same backend model; the direct side sends the very tensors the frontend builds
(`backend_inputs`). Throughput is generated tokens over the wall time from the first request to the last token;
the ratio is frontend / direct. The direct side counts tokens from the per-token log-probs, the frontend side
from `usage` (stream_options.include_usage): the same numbers, checked equal."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from tritonllm.commands.bench_engine import make_requests
from tritonllm.commands.bench_report import progress, report
from tritonllm.deploy.frontend import FrontendProcess
from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer, free_port
from tritonllm.openai_api.generation import OUTPUTS, PreparedPrompt, backend_inputs
from tritonllm.openai_api.schemas import GenerationRequest, Sampling
from tritonllm.openai_api.triton_client import TritonClient

SERVED_NAME = "bench"


def request_for(prompt: str, output_tokens: int) -> GenerationRequest:
    sampling = Sampling(max_tokens=output_tokens, temperature=0.0, min_tokens=output_tokens)
    return GenerationRequest(
        model=SERVED_NAME,
        prompts=(prompt,),
        n=1,
        sampling=sampling,
        stop=(),
        end_of_turn=(),
        logprobs=False,
        stream=True,
        include_usage=True,
    )


async def direct_run(grpc_url: str, backend_model: str, prompts: list[PreparedPrompt], output_tokens: int):
    client = TritonClient(grpc_url)

    async def one(prompt: PreparedPrompt) -> tuple[str, int]:
        text, tokens = "", 0
        inputs = backend_inputs(prompt, request_for(prompt.text, output_tokens))
        async for response in client.stream(backend_model, inputs, OUTPUTS):
            if "text_output" in response.outputs:
                text += response.outputs["text_output"].reshape(-1)[0].decode("utf-8", errors="replace")
                tokens += int(response.outputs["output_log_probs"].size)
        return text, tokens

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return time.perf_counter() - start, results
    finally:
        await client.close()


async def frontend_run(base_url: str, prompts: list[PreparedPrompt], output_tokens: int):
    """The openai client's raw streaming response, its SSE lines parsed here: the client's per-chunk objects
    would be client cost, which the direct side (a bare gRPC stub) does not pay either."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600) as client:

        async def one(prompt: PreparedPrompt) -> tuple[str, int]:
            text, tokens = "", 0
            async with client.completions.with_streaming_response.create(
                model=SERVED_NAME,
                prompt=prompt.text,
                max_tokens=output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"min_tokens": output_tokens},
            ) as response:
                async for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["text"]
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return text, tokens

        start = time.perf_counter()
        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return time.perf_counter() - start, results


def _side(seconds: float, results: list[tuple[str, int]]) -> dict:
    tokens = sum(count for _, count in results)
    return {"wall_s": round(seconds, 3), "output_tokens": tokens, "tok_s": round(tokens / seconds, 2)}


def _prompts(model_dir: Path, args) -> list[PreparedPrompt]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = make_requests(tokenizer, args.requests, (args.prompt_tokens, args.prompt_tokens), (1, 1), args.seed)
    texts = []
    for r in requests:
        text = tokenizer.decode(r.prompt_ids)
        assert isinstance(text, str)  # one id list decodes to one text (transformers types it str | list[str])
        texts.append(text)
    return [PreparedPrompt(text, len(tokenizer.encode(text)), args.output_tokens) for text in texts]


def measure(args, model_dir: Path, work: Path) -> dict:
    load = os.getloadavg()[0]  # other work on the machine when the run starts
    prompts = _prompts(model_dir, args)
    max_seq_len = max(p.prompt_tokens for p in prompts) + args.output_tokens + 16
    repo = build_repo(
        model_dir, work / "repo", streaming=True, max_batch_size=args.requests, max_seq_len=max_seq_len, overwrite=True
    )
    progress(f"starting tritonserver on {repo} (logs in {work})")
    with TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log") as triton:
        extra = ["--served-model-name", SERVED_NAME, "--backend-model", args.backend_model]
        with FrontendProcess(
            triton.grpc_url, model_dir, free_port(), extra=extra, log_file=work / "openai.log"
        ) as frontend:
            warm = prompts[:2]
            asyncio.run(direct_run(triton.grpc_url, args.backend_model, warm, 4))
            asyncio.run(frontend_run(frontend.base_url, warm, 4))
            progress(f"direct gRPC: {len(prompts)} concurrent streams of {args.output_tokens} tokens")
            direct_s, direct = asyncio.run(direct_run(triton.grpc_url, args.backend_model, prompts, args.output_tokens))
            progress(f"direct: {direct_s:.1f}s; now through the OpenAI endpoint")
            frontend_s, through = asyncio.run(frontend_run(frontend.base_url, prompts, args.output_tokens))
    result = {
        "backend_model": args.backend_model,
        "requests": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens_per_request": args.output_tokens,
        "load_1min": round(load, 2),
        "direct": _side(direct_s, direct),
        "openai": _side(frontend_s, through),
        "texts_equal": [text for text, _ in direct] == [text for text, _ in through],
    }
    result["ratio"] = round(result["openai"]["tok_s"] / result["direct"]["tok_s"], 3)
    return result


def main(args) -> int:
    import logging

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = Path(args.model).resolve()
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, model_dir, work)
    else:
        with tempfile.TemporaryDirectory(prefix="tritonllm-bench-openai-") as folder:
            result = measure(args, model_dir, Path(folder))
    report(
        result,
        args.json,
        f"direct gRPC: {result['direct']['tok_s']} tok/s   through the OpenAI endpoint: "
        f"{result['openai']['tok_s']} tok/s   ratio {result['ratio']}x   texts equal: "
        f"{result['texts_equal']}",
    )
    return 0

"""`tritonllm bench bls-spec`: the tensorrt_llm_bls draft/target loop through a real tritonserver against the same
BLS without drafts, in one run, one request at a time (batch 1).

One repository holds the target (`tensorrt_llm`) and the draft model (`tensorrt_llm_draft`); each prompt runs
plain (num_draft_tokens 0) and then speculative, prompt by prompt, so machine noise hits both alike. Time is the
request's wall time (prefill included; the loop sends every round through Triton, so its overhead shows).
The texts must be equal (greedy); the JSON says so and gives the drafted and accepted token counts."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from tritonllm.commands.arg_types import count
from tritonllm.commands.bench_report import progress, report
from tritonllm.spec_decode.training.distill import bench_requests


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="target Hugging Face model folder")
    parser.add_argument("--draft-model", required=True, help="draft model folder (the target's tokenizer)")
    parser.add_argument("--num-draft-tokens", type=count, default=4, help="draft tokens per round")
    parser.add_argument("--prompts", type=count, default=3, help="texts to rewrite, one request at a time")
    parser.add_argument("--max-tokens", type=count, default=64, help="most tokens generated per request (default 64)")
    parser.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def generate(url: str, body: dict) -> tuple[dict, float]:
    request = urllib.request.Request(
        f"http://{url}/v2/models/tensorrt_llm_bls/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        reply = json.loads(response.read())
    return reply, time.perf_counter() - start


def measure(args, work: Path) -> dict:
    from tritonllm.deploy.repo import build_repo
    from tritonllm.deploy.tritonserver import Ports, TritonServer

    repo = build_repo(
        args.model,
        work / "repo",
        streaming=True,
        max_batch_size=2,
        max_seq_len=2048,
        draft_model_dir=args.draft_model,
        overwrite=True,
    )
    texts = bench_requests("rewrite", args.prompts)  # rewrite a shipped text: input-grounded
    base = {
        "max_tokens": args.max_tokens,
        "bad_words": "",
        "stop_words": "",
        "temperature": 0.0,
        "exclude_input_in_output": True,
        "return_perf_metrics": True,
    }
    plain_s = spec_s = 0.0
    drafted = accepted = 0
    equal = True
    progress(f"starting tritonserver on {repo}")
    with TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log") as triton:
        generate(triton.http_url, {**base, "text_input": texts[0], "max_tokens": 4})  # warm-up
        for index, text in enumerate(texts, 1):
            plain, seconds = generate(triton.http_url, {**base, "text_input": text})
            plain_s += seconds
            spec, seconds = generate(
                triton.http_url, {**base, "text_input": text, "num_draft_tokens": args.num_draft_tokens}
            )
            spec_s += seconds
            equal = equal and spec["text_output"] == plain["text_output"]
            drafted += int(spec.get("total_draft_tokens", 0))
            accepted += int(spec.get("total_accepted_draft_tokens", 0))
            progress(f"prompt {index}/{len(texts)}: plain {plain_s:.1f}s, speculative {spec_s:.1f}s so far")
    return {
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "plain_s": round(plain_s, 3),
        "speculative_s": round(spec_s, 3),
        "ratio": round(plain_s / spec_s, 3),
        "total_draft_tokens": drafted,
        "total_accepted_draft_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "texts_equal": equal,
    }


def main(args) -> int:
    with tempfile.TemporaryDirectory(prefix="tritonllm-bench-bls-spec-") as folder:
        result = measure(args, Path(folder))
    report(
        result,
        args.json,
        f"BLS plain {result['plain_s']}s   BLS draft/target {result['speculative_s']}s   "
        f"speed-up {result['ratio']}x   acceptance {result['acceptance_rate']}   "
        f"texts equal: {result['texts_equal']}",
    )
    return 0 if result["texts_equal"] else 1

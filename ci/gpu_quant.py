"""Quantized weights on one GPU (issue 25), for the lead's GPU session; CI never runs it (no GPU there).

1. The tiny Llama and Qwen3, quantized on load (FP8, W8A16, W4A16 group 32) on CUDA in fp32 and bf16: the
   relative L2 distance of their prefill logits from the same quantization on CPU in fp32 (the tests' reference;
   fp32 should be ~1e-5; bf16 measured 0.02-0.11 on CPU, these tiny models amplify rounding), and whether FP8
   can take the torch._scaled_mm path (fp8_supported).
2. A real model's shape with dummy weights (load_format dummy, bf16): load seconds, weight memory and a forward of
   8 tokens per algorithm, against the unquantized model.
Prints one JSON line per measurement. Run: python3 ci/gpu_quant.py [shape] (default llama-3.1-8b)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tritonllm.checkpoints.shapes import write_model_shape
from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.attention import AttentionMetadata
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.quant.kernels import fp8_supported

ALGOS = ("FP8", "W8A16", "W4A16")
PROMPT = [301, 279, 349, 223, 22, 26, 14, 20, 547, 887, 837, 397, 237, 235, 223, 2, 1, 55]
BLOCK = 16


def prefill_logits(model, config, ids: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    blocks = -(-len(ids) // BLOCK) + 1
    shape = (blocks, BLOCK, config.num_kv_heads, config.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(ids), device=device),
        block_tables=torch.arange(blocks, device=device)[None],
        query_starts=[0],
        query_lens=[len(ids)],
        context_lens=[len(ids)],
        block_size=BLOCK,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), meta, caches)
        return model.compute_logits(hidden).float().cpu()


def tiny_parity(root: Path, cuda: torch.device) -> None:
    for arch in ("llama", "qwen3"):
        folder = build_tiny_model(root / arch, arch=arch)
        for algo in ALGOS:
            quant = {"quant_algo": algo, "group_size": 32}
            reference, config = load_model(folder, torch.float32, "cpu", quant_config=quant)
            expected = prefill_logits(reference, config, PROMPT, torch.float32, torch.device("cpu"))
            for dtype in (torch.float32, torch.bfloat16):
                model, _ = load_model(folder, dtype, cuda, quant_config=quant)
                got = prefill_logits(model, config, PROMPT, dtype, cuda)
                row = {
                    "check": "tiny-parity",
                    "arch": arch,
                    "algo": algo,
                    "dtype": str(dtype).removeprefix("torch."),
                    "relative_l2": float((got - expected).norm() / expected.norm()),
                    "top1_agreement": float((got.argmax(-1) == expected.argmax(-1)).float().mean()),
                    "fp8_supported": fp8_supported(cuda),
                }
                print(json.dumps(row), flush=True)


def dummy_shape(root: Path, shape: str, cuda: torch.device) -> None:
    folder = write_model_shape(shape, root / shape)
    for algo in (None, *ALGOS):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(cuda)
        started = time.monotonic()
        quant = None if algo is None else {"quant_algo": algo}
        model, config = load_model(folder, torch.bfloat16, cuda, "dummy", quant)
        torch.cuda.synchronize()
        loaded = time.monotonic() - started
        weights = torch.cuda.memory_allocated(cuda) - before
        logits = prefill_logits(model, config, list(range(8)), torch.bfloat16, cuda)
        row = {
            "check": "dummy-shape",
            "shape": shape,
            "algo": algo,
            "load_s": round(loaded, 2),
            "weight_gib": round(weights / 2**30, 2),
            "finite": bool(torch.isfinite(logits).all()),
        }
        print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()


def main() -> int:
    cuda = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        tiny_parity(Path(tmp), cuda)
        dummy_shape(Path(tmp), sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b", cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())

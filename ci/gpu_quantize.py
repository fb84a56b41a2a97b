"""`tritonllm quantize` with calibration on CUDA (issue 25), for the lead's GPU session; CI never runs it.

1. The tiny Llama quantized (W4A16_ASYM group 32, FP8) with --device cuda and with --device cpu: the share of
   stored values that agree and the largest scale difference. GPTQ is sensitive to rounding (a column's error moves
   all later ones), so a few values may differ; the CUDA checkpoint must load and run in the engine on CUDA.
2. With a folder argument (e.g. a SmolLM2 folder): its W4A16_ASYM group 64 quantization time on CUDA.
Prints one JSON line per measurement. Run: python3 ci/gpu_quantize.py [MODEL_DIR]."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tritonllm.checkpoints.quantize_model import QuantizeOptions, quantize_checkpoint
from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.loader import load_model


def compare(cpu_dir: Path, cuda_dir: Path) -> dict:
    a, b = load_file(cpu_dir / "model.safetensors"), load_file(cuda_dir / "model.safetensors")
    same = total = 0
    scale_diff = 0.0
    for key, value in a.items():
        if key.endswith(("weight_packed", "weight_zero_point")) or (value.dtype == torch.float8_e4m3fn):
            same += int((value.view(torch.uint8) == b[key].view(torch.uint8)).sum())
            total += value.numel() * value.element_size()
        elif key.endswith("weight_scale"):
            scale_diff = max(scale_diff, float((value.float() - b[key].float()).abs().max()))
    return {"same_bytes_share": same / total, "max_scale_diff": scale_diff}


def main() -> None:
    root = Path(tempfile.mkdtemp())
    tiny = build_tiny_model(root / "tiny", seed=0)
    for algo in ("W4A16_ASYM", "FP8"):
        dirs = {}
        for device in ("cpu", "cuda"):
            dirs[device] = root / f"{algo}-{device}"
            result = quantize_checkpoint(tiny, dirs[device], QuantizeOptions(algo, group_size=32, device=device))
            print(json.dumps({"algo": algo, "device": device, "seconds": result["seconds"]}))
        model, _ = load_model(dirs["cuda"], torch.bfloat16, "cuda")
        print(json.dumps({"algo": algo, **compare(dirs["cpu"], dirs["cuda"]), "engine_loads_on_cuda": True}))
        del model
    if len(sys.argv) > 1:
        started = time.perf_counter()
        options = QuantizeOptions("W4A16_ASYM", group_size=64, device="cuda")
        quantize_checkpoint(Path(sys.argv[1]), root / "model-w4", options, lambda m: print(m, file=sys.stderr))
        print(json.dumps({"model": sys.argv[1], "algo": "W4A16_ASYM", "cuda_seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()

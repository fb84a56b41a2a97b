"""`tritonllm quantize`: an unquantized Hugging Face checkpoint quantized with GPTQ, calibrated on text, into a
compressed-tensors checkpoint the embedded engine loads as it is (no quant_config needed), as vLLM and
transformers (with the compressed-tensors package) do too.

--algo W4A16: 4-bit weights, symmetric, one scale per group of --group-size input columns; W4A16_ASYM: the same
with a zero point per group (the grid quantization on load uses); FP8: float8 e4m3 weights with one scale per
output channel, activations quantized per token at run time. Embeddings, lm_head and norms stay unquantized.

Calibration: --samples windows of --seq-len tokens spread over the text (the shipped calibration text, original
prose written for this and distinct from `bench accuracy`'s evaluation passages, or --calibration FILE), run
through the model in float32 one decoder layer after the other; progress (layer i / n) goes to stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tritonllm.checkpoints.model_ref import resolve_model_ref
from tritonllm.checkpoints.quantize_model import ALGOS, DTYPES, QuantizeError, QuantizeOptions
from tritonllm.commands.arg_types import count
from tritonllm.engine.config import ConfigError


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", required=True, help="unquantized Hugging Face model folder, or a model id in the hub cache"
    )
    parser.add_argument("--out", required=True, help="folder to write the quantized checkpoint into")
    parser.add_argument(
        "--algo",
        required=True,
        help=f"{' | '.join(ALGOS)}: 4-bit weights symmetric or with zero points (groups of --group-size), or FP8 "
        "weights per channel with dynamic per-token activations",
    )
    parser.add_argument(
        "--group-size",
        type=count,
        default=128,
        help="input columns per int4 scale (default 128); must divide every projection's input size",
    )
    parser.add_argument(
        "--samples", type=count, default=16, help="calibration windows (default 16; they overlap past the text)"
    )
    parser.add_argument("--seq-len", type=count, default=256, help="tokens of each calibration window (default 256)")
    parser.add_argument(
        "--calibration", type=Path, help="a UTF-8 text file to calibrate on instead of the shipped text"
    )
    parser.add_argument(
        "--damp", type=float, default=0.01, help="share of the Hessian's mean diagonal added to it (default 0.01)"
    )
    parser.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="quantize columns in order of decreasing activation energy (GPTQ's act-order; the default), groups "
        "kept contiguous with their scales fixed up front (compressed-tensors' actorder: weight; no g_idx); "
        "--no-act-order: columns in order, each group's scale from the error-updated weights",
    )
    parser.add_argument("--device", default="cpu", help="where calibration runs: cpu (default), cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="dtype of the written scales and dense tensors (default: the checkpoint's)",
    )
    parser.add_argument(
        "--exclude-modules",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="modules left unquantized: fnmatch patterns or 're:' regexes of names (model.layers.0.mlp.down_proj); "
        "the engine needs q/k/v and gate/up excluded together",
    )
    parser.add_argument("--json", action="store_true", help="print what was done as one JSON object")


def progress(message: str) -> None:
    print(f"[quantize] {message}", file=sys.stderr, flush=True)


def main(args) -> int:
    from tritonllm.checkpoints.quantize_model import quantize_checkpoint

    folder = resolve_model_ref(args.model, "--model", "the command line")
    assert folder is not None  # --model is required
    options = QuantizeOptions(
        algo=args.algo,
        group_size=args.group_size,
        samples=args.samples,
        seq_len=args.seq_len,
        damp=args.damp,
        act_order=args.act_order,
        device=args.device,
        dtype=args.dtype,
        exclude_modules=tuple(args.exclude_modules),
        calibration=args.calibration,
    )
    try:
        result = quantize_checkpoint(Path(folder), Path(args.out), options, progress)
    except QuantizeError as exc:
        raise ConfigError(str(exc)) from None
    print(json.dumps(result) if args.json else f"wrote {result['out']} ({result['algo']}, {result['seconds']}s)")
    return 0

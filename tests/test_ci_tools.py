"""The GPU calls' reading aids in ci/ (run by hand on the device output; CI has no GPU): bench_summary.py's table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / "ci"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench_lines(tmp_path):
    rows = [
        ("m bf16, merge, 1x128/128", 170.0),
        ("m bf16 1x128/128", 160.0),
        ("m w4a16 1x128/128", None),  # a run that printed nothing
        ("m w4a16 1x128/128", 320.0),
        ("m w4a16 1x128/128", 340.0),
        ("m bf16 256x128/128", 1000.0),
        ("m fp8+fp8kv 256x128/128", 1500.0),
    ]
    path = tmp_path / "bench.jsonl"
    lines = [
        json.dumps({"label": label, "result": None if tok_s is None else {"engine_tok_s": tok_s}})
        for label, tok_s in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_each_variant_is_set_against_the_plain_bf16_of_its_shape(bench_lines):
    summary = _load("bench_summary")
    runs = summary.runs_by_label(bench_lines)
    assert runs["m w4a16 1x128/128"] == [320.0, 340.0]
    lines = {line.split("  ")[0].strip(): line for line in summary.summary(runs, None)}
    assert lines["m w4a16 1x128/128"].endswith("mean   330.00  x bf16 2.062")
    assert lines["m bf16, merge, 1x128/128"].endswith("x bf16 1.062")  # not a base itself
    assert lines["m fp8+fp8kv 256x128/128"].endswith("x bf16 1.500")
    against = {line.split("  ")[0].strip(): line for line in summary.summary(runs, "m bf16, merge, 1x128/128")}
    assert against["m w4a16 1x128/128"].endswith("x bf16 1.941")
    assert against["m fp8+fp8kv 256x128/128"].endswith("x bf16 -")

"""docs/metrics.md and docs/grafana-dashboard.json stay in step with the metrics the models export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tritonllm.triton.llm_metrics import FAMILIES
from tritonllm.triton.request_metrics import HISTOGRAMS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_metrics_page_lists_every_family_label_value_and_bucket():
    page = (DOCS / "metrics.md").read_text()
    for name, (_, label, kinds) in FAMILIES.items():
        assert f"`{name}`" in page and f"`{label}`" in page
        for kind in kinds:
            assert f"`{kind}`" in page, f"{name}{{{label}={kind}}} is not documented"
    for name, (_, _, buckets) in HISTOGRAMS.items():
        assert f"`{name}`" in page
        assert ", ".join(f"{b:g}" for b in buckets) + ", +Inf" in page, f"buckets of {name}"


def test_the_dashboard_queries_only_exported_metrics_and_label_values():
    exported = set(FAMILIES) | {f"{name}_{part}" for name in HISTOGRAMS for part in ("bucket", "sum", "count")}
    for expr in dashboard_expressions():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for metric in re.findall(r"\bnv_\w+", expr):
            assert metric in exported, f"{metric} in {expr!r} is not exported"
        for label, values in re.findall(r'(\w+)=~?"([^"$]+)"', expr):
            known = {kinds for _, lbl, kinds in FAMILIES.values() if lbl == label}
            if known:
                (kinds,) = known
                assert set(values.split("|")) <= set(kinds), f"{label}={values} in {expr!r}"


def test_the_dashboard_covers_requests_kv_blocks_token_lengths_and_latency_quantiles():
    exprs = "\n".join(dashboard_expressions())
    for needed in (
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
        "nv_llm_input_token_len_bucket",
        "nv_llm_output_token_len_bucket",
        "histogram_quantile(0.9, sum by (le) (rate(nv_llm_time_to_first_token_seconds_bucket",
        "nv_llm_inter_token_latency_seconds_bucket",
    ):
        assert needed in exprs

"""What every `tritonllm bench` command shares: progress lines on stderr, and the result on stdout as one JSON
object (`--json`) or a one-line summary."""

from __future__ import annotations

import json
import sys


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def report(result: dict, as_json: bool, summary: str) -> None:
    print(json.dumps(result) if as_json else summary)

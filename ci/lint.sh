#!/usr/bin/env bash
# Lint and type check of the package (rules in pyproject.toml's [tool.ruff] and [tool.mypy]); fails on any finding.
# Needs ci/setup.sh's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check backend lora spec_decode
bash ci/typecheck.sh

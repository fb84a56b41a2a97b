#!/usr/bin/env bash
# Lint, format check and type check (rules in pyproject.toml's [tool.ruff] and [tool.mypy]); fails on any finding.
# Needs ci/setup.sh's .venv. `ruff format backend lora spec_decode tests ci models` fixes what the check finds.
set -euo pipefail
cd "$(dirname "$0")/.."
folders=(backend lora spec_decode tests ci models)
.venv/bin/ruff check "${folders[@]}"
.venv/bin/ruff format --check "${folders[@]}"
bash ci/typecheck.sh

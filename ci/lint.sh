#!/usr/bin/env bash
# Lint of the package (rules in pyproject.toml's [tool.ruff]); fails on any finding. Needs ci/setup.sh's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check backend lora spec_decode

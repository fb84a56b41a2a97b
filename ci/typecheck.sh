#!/usr/bin/env bash
# Type check of the package (rules in pyproject.toml's [tool.mypy]); fails on any finding. Needs ci/setup.sh's .venv.
# The folders install under other names (backend/ -> tritonllm, lora/ -> tritonllm.lora, spec_decode/ ->
# tritonllm.spec_decode), so mypy checks a throw-away tree of symlinks laid out as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/tritonllm"
shopt -s nullglob dotglob
for entry in "$root"/backend/*; do
  ln -s "$entry" "$tree/tritonllm/"
done
ln -s "$root/lora" "$tree/tritonllm/lora"
ln -s "$root/spec_decode" "$tree/tritonllm/spec_decode"
cd "$tree"
# The cache stays in the repo (ignored by git): the stubs of torch and the other libraries are read once, not each run.
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p tritonllm

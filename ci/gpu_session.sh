#!/usr/bin/env bash
# One GPU-machine run (the `device` tool): puts the working tree's package on PYTHONPATH (the machine has torch,
# triton and transformers but no venv of ours), then runs what the arguments name, each logged under $OUT.
#   bash ci/gpu_session.sh kernels|fused|window|guided|parity|features|bench-quick|bench-guided|moe-kernel|families|bench-mixtral|bench-qwen3|profile|profile-1 ...
# Used by hand for the GPU figures in docs/benchmarks.md; CI never runs it (no GPU there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PKG=/tmp/tritonllm-pkg
mkdir -p "$PKG/tritonllm"
for entry in backend/*; do ln -sfn "$PWD/$entry" "$PKG/tritonllm/$(basename "$entry")"; done
ln -sfn "$PWD/lora" "$PKG/tritonllm/lora"
ln -sfn "$PWD/spec_decode" "$PKG/tritonllm/spec_decode"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TRITONLLM=(python3 -c "import sys; from tritonllm.commands.main import main; sys.exit(main())")
SHAPES=/tmp/shapes

shape() {  # shape NAME: a config-only folder for load_format dummy
  [ -d "$SHAPES/$1" ] || "${TRITONLLM[@]}" model shape "$1" --out "$SHAPES/$1" >/dev/null
  echo "$SHAPES/$1"
}

bench() {  # bench LABEL ARGS...: one `bench engine --json` line into $OUT/bench.jsonl
  local label=$1; shift
  echo "== bench $label: $*" | tee -a "$OUT/bench.log"
  local line
  line=$(timeout "${BENCH_TIMEOUT:-240}" "${TRITONLLM[@]}" bench engine --device cuda --dtype bfloat16 \
         --load-format dummy --json "$@" 2>>"$OUT/bench.log" | tail -1)
  echo "{\"label\": \"$label\", \"result\": ${line:-null}}" | tee -a "$OUT/bench.jsonl"
}

run_tests() {
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  TRITONLLM_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1 \
    | tee -a "$OUT/tests.log" | tail -15
}

for what in "$@"; do
  echo "=== $what ($(date +%T))"
  case $what in
    kernels) run_tests tests/engine/test_triton_attention.py ;;
    fused) run_tests tests/engine/test_fused_ops.py ;;
    window) run_tests tests/engine/test_sliding_window.py ;;
    guided) run_tests tests/engine/test_guided.py ;;  # needs xgrammar (its wheels carried, see docs/gpu-runs.md)
    features) run_tests tests/engine/test_beam_search.py tests/lora/test_engine_lora.py tests/spec_decode/test_engine_spec.py \
                -m "not slow" ;;
    parity) run_tests tests/engine/test_engine_parity.py tests/engine/test_cuda_graphs.py tests/engine/test_sampler_batch.py \
              tests/engine/test_engine_triton.py tests/engine/test_overlap.py -m "not slow" ;;
    bench-quick)
      q=$(shape qwen2.5-0.5b)
      bench "qwen2.5 1x128/128" --model "$q" --requests 1 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none
      bench "qwen2.5 256x128/128 hf" --model "$q" --requests 256 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --max-batch-size 256 --hf-batch-size 256 --warmup
      bench "qwen2.5 nano" --model "$q" --workload nano --warmup --baseline none ;;
    bench-guided)  # xgrammar's wheels installed first; GUIDED_MODEL: a SmolLM2 folder without weights (docs/gpu-runs.md)
      printf 'load_format: dummy\n' > /tmp/dummy.yaml
      for n in 8 64; do
        echo "== bench guided, $n requests" | tee -a "$OUT/bench.log"
        timeout "${BENCH_TIMEOUT:-240}" "${TRITONLLM[@]}" bench guided --model "${GUIDED_MODEL:-.whl/smol}" \
          --config /tmp/dummy.yaml --device cuda --dtype bfloat16 --requests "$n" --rounds 5 --json \
          2>>"$OUT/bench.log" | tail -1 | tee -a "$OUT/bench-guided.jsonl"
      done ;;
    moe-kernel) python3 ci/gpu_moe_kernel.py 2>&1 | tee -a "$OUT/moe-kernel.jsonl" ;;
    families) run_tests tests/engine/test_moe.py tests/engine/test_phi3.py tests/engine/test_gemma.py \
                tests/engine/test_softcap_attention.py ${FAMILY_TESTS:-} ;;
    bench-mixtral)
      bench "mixtral-8x7b 256x128/128" --model "$(shape mixtral-8x7b)" --requests 256 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --max-batch-size 256 --warmup --baseline none ;;
    bench-qwen3)
      bench "qwen3 nano" --model "$(shape qwen3-0.6b)" --workload nano --warmup --baseline none ;;
    profile-1)
      bench "qwen2.5 1x128/128 profile" --model "$(shape qwen2.5-0.5b)" --requests 1 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none --profile ;;
    profile)
      bench "qwen2.5 256x128/128 profile" --model "$(shape qwen2.5-0.5b)" --requests 256 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --max-batch-size 256 --baseline none --profile ;;
    *) echo "unknown step $what" >&2 ;;
  esac
done

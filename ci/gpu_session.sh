#!/usr/bin/env bash
# One GPU-machine run (the `device` tool): puts the working tree's package on PYTHONPATH (the machine has torch,
# triton and transformers but no venv of ours), then runs what the arguments name, each logged under $OUT.
#   bash ci/gpu_session.sh kernels|launch-cuts|fused|graphs|decode-steps|step-trace|bench-summary|pdl|mma-tests|race-check|attention|greedy|window|guided|parity|features|bench-quick|bench-guided|bench-accuracy|moe-kernel|moe-sweep|fp8-kv|int4-decode-sweep|int4-gemm|int4-gemm-tests|norm-fold|int4-ncu|int4-layouts|attn-sweep|fp8-sweep|families|bench-mixtral|bench-quant|host-profile|quant|quant-load|quant-tests|quantize|quant-kernels|quant-sweep-decode|quant-sweep-prefill|bench-qwen3|bench-parallel|parallel-tests|sync-check|profile|profile-1 ...
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

bench() {  # bench LABEL ARGS...: one `bench engine --json` line into $OUT/bench.jsonl (BENCH_PRELUDE: python run first)
  local label=$1; shift
  echo "== bench $label: $*" | tee -a "$OUT/bench.log"
  local line cli=("${TRITONLLM[@]}")
  [ -n "${BENCH_PRELUDE:-}" ] && cli=(python3 -c "$BENCH_PRELUDE; import sys; from tritonllm.commands.main import main; sys.exit(main())")
  line=$(timeout "${BENCH_TIMEOUT:-240}" "${cli[@]}" bench engine --device cuda --dtype bfloat16 \
         --load-format dummy --json "$@" 2>>"$OUT/bench.log" | tail -1)
  echo "{\"label\": \"$label\", \"result\": ${line:-null}}" | tee -a "$OUT/bench.jsonl"
}

quant_configs() {  # the model.yaml files of bench-quant and host-profile
  printf 'quant_config:\n  quant_algo: FP8\n  kv_cache_quant_algo: FP8\n' > /tmp/fp8.yaml
  printf 'quant_config:\n  quant_algo: W4A16\n  group_size: 128\n' > /tmp/w4a16.yaml
  printf 'quant_config:\n  quant_algo: FP8\n' > /tmp/fp8w.yaml
}

quant_mods() {  # quant_mods "swept,merge,splits4": one python prelude making each change (bench-quant's variants)
  local mod code=() e=tritonllm.engine.embedded
  for mod in ${1//,/ }; do
    case $mod in
      swept) code+=("import sys; sys.path.insert(0, 'ci'); import gpu_int4_sweeps; gpu_int4_sweeps.use_swept_shapes('$OUT/int4-decode-sweep.jsonl')") ;;
      merge) code+=("from $e.attention import decode_kernels; decode_kernels.MERGE_IN_LAST_SPLIT = True") ;;  # (the default)
      ropestore|ropeapart) code+=("from $e.attention import triton_backend; triton_backend.ROTATE_WHILE_STORING = $([ $mod = ropestore ] && echo True || echo False)") ;;
      silu) code+=("from $e.quant import fusion; fusion.SILU_IN_GATE_UP = True") ;;
      rotqkv) code+=("from $e.quant import fusion; fusion.ROTARY_IN_QKV = True") ;;  # (the default)
      norotqkv) code+=("from $e.quant import fusion; fusion.ROTARY_IN_QKV = False") ;;
      nomerge) code+=("from $e.attention import decode_kernels; decode_kernels.MERGE_IN_LAST_SPLIT = False") ;;
      rowscales) code+=("from $e.quant import linear; linear.INT4_SCALES_GROUP_MAJOR = False") ;;
      nofold) code+=("from $e.quant import fusion; fusion.FOLD_NORMS = False") ;;
      nopdl) code+=("from $e import pdl; pdl.ENABLED = False") ;;
      splits*) code+=("from $e.attention import decode_kernels; decode_kernels.MAX_DECODE_SPLITS = ${mod#splits}") ;;
      *) echo "quant_mods: unknown change '$mod'" >&2; return 1 ;;
    esac
  done
  local IFS=';'; echo "${code[*]}"
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
    launch-cuts)  # the merging splits, RoPE in the KV store, the SiLU in gate_up: kernels, the engine eager and in graphs
      run_tests tests/engine/test_rotate_store.py tests/engine/test_gate_up_runs.py tests/engine/test_triton_attention.py ;;
    fused) run_tests tests/engine/test_fused_ops.py ;;
    graphs) run_tests tests/engine/test_cuda_graphs.py ;;  # decode steps and short prompts in CUDA graphs
    decode-steps)  # a decode step's own launches: graph inputs by slices, the rotary table, no logits gathers
      run_tests tests/engine/test_cuda_graphs.py tests/engine/test_rotary_table.py tests/engine/test_step_rows.py \
        tests/engine/test_qkv_rotary.py ;;
    bench-summary) python3 ci/bench_summary.py "$OUT/bench.jsonl" ;;  # each variant's runs, mean and x bf16
    step-trace)  # W4A16 at batch 1 under the profiler (TRACE_VARIANT, default w4a16-1): each kernel of a decode step
      QUANT_BENCH_ARGS="--profile-trace $OUT/trace.json" QUANT_VARIANTS=${TRACE_VARIANT:-w4a16-1} bash "$0" bench-quant >/dev/null
      gzip -f "$OUT/trace.json" && python3 ci/trace_steps.py "$OUT/trace.json.gz" --top 16 ;;
    pdl)  # PDL chains in CUDA graphs against the same kernels launched without it, bit for bit
      run_tests tests/engine/test_pdl.py tests/engine/test_quant_kernels.py -k "pdl or word or sm90" ;;
    attention)  # the Triton attention kernels at real sizes and in CUDA graphs, the FP8 cache in the engine
      run_tests tests/engine/test_triton_attention.py tests/engine/test_fp8_kv_engine.py ;;
    greedy) run_tests tests/engine/test_greedy_kernel.py tests/engine/test_fp8_rows.py ;;
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
    bench-accuracy)  # rouge-score's wheels carried first (rouge_score built here: `pip wheel --no-deps rouge-score==0.1.2`;
      # absl-py, nltk, six, joblib, defusedxml from pip download). ACC_MODEL: a folder with real weights, if the
      # machine has one (SmolLM2's 98 MB GGUF is over the carry limit); else SmolLM2's shape with identical dummy
      # weights on both sides, where only the drift between them means something (perplexities do not).
      if [ -n "${ACC_MODEL:-}" ]; then acc_model=(--model "$ACC_MODEL"); else acc_model=(--model "$(shape smollm2-135m)" --load-format dummy); fi
      for name in ${ACC_CANDIDATES:-float32 fp8 fp8-kv w8a16 w4a16}; do
        case $name in
          float32) yaml='dtype: float32' ;;
          fp8) yaml='quant_config: {quant_algo: FP8}' ;;
          fp8-kv) yaml='kv_cache_config: {dtype: fp8}' ;;
          w8a16) yaml='quant_config: {quant_algo: W8A16}' ;;
          w4a16) yaml='quant_config: {quant_algo: W4A16}' ;;
          *) echo "unknown accuracy candidate $name" >&2; continue ;;
        esac
        printf '%s\n' "$yaml" > "/tmp/acc-$name.yaml"
        echo "== bench accuracy, bfloat16 vs $name ($yaml)" | tee -a "$OUT/bench.log"
        line=$(timeout "${BENCH_TIMEOUT:-240}" "${TRITONLLM[@]}" bench accuracy "${acc_model[@]}" --device cuda \
               --dtype bfloat16 --config "/tmp/acc-$name.yaml" --json 2>>"$OUT/bench.log" | tail -1)
        echo "{\"candidate\": \"$name\", \"result\": ${line:-null}}" | tee -a "$OUT/bench-accuracy.jsonl"
      done ;;
    moe-kernel) python3 ci/gpu_moe_kernel.py 2>&1 | tee -a "$OUT/moe-kernel.jsonl" ;;
    moe-sweep) python3 ci/gpu_moe_kernel.py --sweep 2>&1 | tee -a "$OUT/moe-sweep.jsonl" ;;
    quant-load) python3 ci/gpu_quant.py "${QUANT_SHAPE:-llama-3.1-8b}" 2>&1 | tee -a "$OUT/quant-load.jsonl" ;;
    quant-tests) run_tests tests/engine/test_quant_kernels.py ;;
    mma-tests) run_tests tests/engine/test_quant_kernels.py -k "tensor_core or pdl_reads" ;;  # int4_mma.py on CUDA
    race-check)  # split-K int4 launches repeated: the worst error of each (ci/gpu_int4_sweeps.py race_check)
      python3 ci/gpu_quant_kernels.py --race-check 2>&1 | tee -a "$OUT/race-check.jsonl" ;;
    quantize)  # tritonllm quantize calibrating on CUDA against CPU; QUANTIZE_MODEL: a folder to time (e.g. SmolLM2)
      python3 ci/gpu_quantize.py ${QUANTIZE_MODEL:-} 2>&1 | tee -a "$OUT/quantize.jsonl" ;;
    quant-kernels)  # the default paths checked and timed against bf16; QUANT_ARGS e.g. "--formats int4 --ms 1,8"
      python3 ci/gpu_quant_kernels.py ${QUANT_ARGS:-} 2>&1 | tee -a "$OUT/quant-kernels.jsonl" ;;
    quant-sweep-decode)  # the program shapes at M = 1 and 8 (some 100 compiles a format: a few minutes)
      python3 ci/gpu_quant_kernels.py --sweep --ms 1,8 --formats "${QUANT_FORMATS:-int4,int8}" 2>&1 \
        | tee -a "$OUT/quant-sweep.jsonl" | grep -v '"sweep"' ;;
    int4-decode-sweep)  # the int4 decode kernel's variants (int4_decode_kernel.py) at M = 1 and 8
      python3 ci/gpu_quant_kernels.py --sweep-decode --ms "${QUANT_MS:-1,8}" ${QUANT_ARGS:-} 2>&1 \
        | tee -a "$OUT/int4-decode-sweep.jsonl" | grep -v '"kind": "decode"' ;;
    int4-gemm)  # int4_gemm.py's tiles against bf16, dequantize + cuBLAS and the decode kernel (QUANT_MS, default 128), then its tests
      python3 ci/gpu_quant_kernels.py --int4-gemm --ms "${QUANT_MS:-128}" 2>&1 \
        | tee -a "$OUT/int4-gemm.jsonl" | grep -v '"kind": "gemm"'
      run_tests tests/engine/test_int4_gemm.py ;;
    norm-fold) run_tests tests/engine/test_norm_fold.py ;;  # norms folded into one-row int4 GEMVs, compiled
    int4-gemm-tests) run_tests tests/engine/test_int4_gemm.py tests/engine/test_quant_kernels.py -k "gemm or leading_shape" ;;
    int4-ncu)  # Nsight Compute on each projection's one-row int4 kernel and bf16 GEMV (the second launch of each)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      "$ncu" --clock-control none --kernel-name regex:"_int4_decode_kernel|nvjet|gemv|gemm" --launch-skip 0 \
        --launch-count 16 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 ci/gpu_quant_kernels.py --ncu-once > "$OUT/int4-ncu.txt" 2>&1; tail -5 "$OUT/int4-ncu.txt" ;;
    int4-layouts)  # the int4 decode kernel with row- against group-major scales and zeros
      python3 ci/gpu_quant_kernels.py --scale-layouts --ms "${QUANT_MS:-1,8}" 2>&1 | tee -a "$OUT/int4-layouts.jsonl" ;;
    attn-sweep)  # decode attention's tile width, warps and stages over bf16 and fp8 caches
      python3 ci/gpu_fp8_kv.py --sweep-decode 2>&1 | tee -a "$OUT/attn-sweep.jsonl" ;;
    fp8-sweep)  # _scaled_mm row-wise / per tensor against the Triton FP8 matmul's tiles
      python3 ci/gpu_quant_kernels.py --sweep-fp8 --ms "${QUANT_MS:-64,256,1024,4096}" 2>&1 | tee -a "$OUT/fp8-sweep.jsonl" ;;
    quant-sweep-prefill)  # the tiled shapes against dequantize + F.linear at M = 64, 256, 2048
      python3 ci/gpu_quant_kernels.py --sweep --ms 64,256,2048 --formats "${QUANT_FORMATS:-int4,int8}" 2>&1 \
        | tee -a "$OUT/quant-sweep.jsonl" | grep -v '"sweep"' ;;
    fp8-kv)  # the FP8 KV cache: kernels against the portable path, decode time fp8 vs bf16; then its tests on CUDA
      python3 ci/gpu_fp8_kv.py 2>&1 | tee -a "$OUT/fp8-kv.jsonl"
      run_tests tests/engine/test_fp8_kv_cache.py tests/engine/test_fp8_kv_engine.py ;;
    families) run_tests tests/engine/test_moe.py tests/engine/test_phi3.py tests/engine/test_gemma.py \
                tests/engine/test_softcap_attention.py ${FAMILY_TESTS:-} ;;
    bench-mixtral)
      bench "mixtral-8x7b 256x128/128" --model "$(shape mixtral-8x7b)" --requests 256 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --max-batch-size 256 --warmup --baseline none ;;
    bench-quant)  # issue 25: Llama-3.1-8B's shape, bf16 against FP8 weights + FP8 KV (256x128/128), and W4A16 at batch 1
      l=$(shape llama-3.1-8b)
      quant_configs
      fp8_run() { BENCH_PRELUDE="$1" bench "llama-3.1-8b fp8+fp8kv, $2, 256x128/128" --model "$l" --config /tmp/fp8.yaml "${many[@]}"; }
      bf16_run() { BENCH_PRELUDE="$1" bench "llama-3.1-8b bf16, $2, 256x128/128" --model "$l" "${many[@]}"; }
      lengths=(--min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none ${QUANT_BENCH_ARGS:-})
      many=(--requests 256 --max-batch-size 256 "${lengths[@]}")
      one=(--requests 1 "${lengths[@]}")
      for variant in ${QUANT_VARIANTS:-bf16-256 fp8-256 bf16-1 w4a16-1 fp8-1}; do
        case $variant in
          bf16-256) bench "llama-3.1-8b bf16 256x128/128" --model "$l" "${many[@]}" ;;
          fp8-256) bench "llama-3.1-8b fp8+fp8kv 256x128/128" --model "$l" --config /tmp/fp8.yaml "${many[@]}" ;;
          fp8-256-norows) fp8_run "from tritonllm.engine.embedded.quant import fusion; fusion.FP8_ROWS = False" "no fp8 rows" ;;
          fp8-256-nogc) fp8_run "import gc; gc.disable()" "garbage collector off" ;;
          bf16-256-nogc) bf16_run "import gc; gc.disable()" "garbage collector off" ;;
          fp8-256-nodefer) fp8_run "from tritonllm.engine.embedded.quant import fusion; fusion.DEFER_SCALES = False" "no deferred scales" ;;
          fp8-256-exact) fp8_run "from tritonllm.engine.embedded.quant import kernels; kernels.FP8_FAST_ACCUM = False" "fp32-promoted accumulation" ;;
          fp8-256-torchgreedy) fp8_run "from tritonllm.engine.embedded import sampler; sampler.GREEDY_KERNEL = False" "greedy by torch ops" ;;
          bf16-256-torchgreedy) bf16_run "from tritonllm.engine.embedded import sampler; sampler.GREEDY_KERNEL = False" "greedy by torch ops" ;;
          fp8-256-silu1) fp8_run "from tritonllm.engine.embedded.network import fused_ops; fused_ops.SILU_FP8_SPLIT = False" "SiLU rows in one launch" ;;
          fp8w-256) bench "llama-3.1-8b fp8 weights 256x128/128" --model "$l" --config /tmp/fp8w.yaml "${many[@]}" ;;
          bf16-1) bench "llama-3.1-8b bf16 1x128/128" --model "$l" "${one[@]}" ;;
          w4a16-1) bench "llama-3.1-8b w4a16 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-dequantize)  # the prompt's projections through dequantize + cuBLAS, as before int4_gemm.py
            BENCH_PRELUDE="from tritonllm.engine.embedded.quant import kernels; kernels.LARGE_M_STRATEGY = 'dequantize'" \
            bench "llama-3.1-8b w4a16, dequantized prompt, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-bytes) BENCH_PRELUDE="from tritonllm.engine.embedded.quant import kernels; kernels.ONE_ROW_SHAPES.clear()" \
            bench "llama-3.1-8b w4a16, byte GEMV, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-swept)  # each projection's best one-row shape from this call's int4-decode-sweep, with PDL
            BENCH_PRELUDE="$(quant_mods swept)" \
            bench "llama-3.1-8b w4a16, swept one-row shapes, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-swept-nopdl)  # the same without programmatic dependent launch (pdl.py)
            BENCH_PRELUDE="$(quant_mods swept,nopdl)" \
            bench "llama-3.1-8b w4a16, swept one-row shapes, no PDL, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-pdl-all|bf16-1-pdl-all|fp8-256-pdl-all|bf16-256-pdl-all)  # the small kernels launched with PDL too
            base=${variant%-pdl-all}; config=(); [ "${base%-*}" = w4a16 ] && config=(--config /tmp/w4a16.yaml)
            [ "${base%-*}" = fp8 ] && config=(--config /tmp/fp8.yaml)
            if [ "${base#*-}" = 1 ]; then shape_args=("${one[@]}"); else shape_args=("${many[@]}"); fi
            BENCH_PRELUDE="from tritonllm.engine.embedded import pdl; pdl.SMALL_KERNELS = True" \
              bench "llama-3.1-8b $base, small kernels with PDL" --model "$l" "${config[@]}" "${shape_args[@]}" ;;
          w4a16-1-rowscales)  # int4 scales and zero points stored row-major, as before group-major (quant/linear.py)
            BENCH_PRELUDE="$(quant_mods rowscales)" \
            bench "llama-3.1-8b w4a16, row-major scales, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-nofold)  # each norm its own launch, not folded into the int4 GEMVs around it (quant/norm_fold.py)
            BENCH_PRELUDE="$(quant_mods nofold)" \
            bench "llama-3.1-8b w4a16, norms not folded, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-merge|bf16-1-merge|w4a16-1-ropestore|bf16-1-ropestore|w4a16-1-ropeapart|bf16-1-ropeapart|w4a16-1-silu|w4a16-1-cuts|bf16-1-cuts)
            # a small launch fewer a layer each: decode's splits merged by the last of them
            # (decode_kernels.MERGE_IN_LAST_SPLIT), RoPE in the KV store's launch (triton_backend.ROTATE_WHILE_STORING),
            # the SiLU in gate_up's one-row GEMV (fusion.SILU_IN_GATE_UP, W4A16 only), or all of them ("cuts");
            # "ropeapart": RoPE in its own launch (the store's rotation is the default now)
            base=${variant%-*}; config=(); [ "${base%-*}" = w4a16 ] && config=(--config /tmp/w4a16.yaml)
            mods=${variant##*-}; [ "$mods" = cuts ] && mods=merge,ropestore,silu
            BENCH_PRELUDE="$(quant_mods $mods)" bench "llama-3.1-8b $base, ${variant##*-}, 1x128/128" --model "$l" "${config[@]}" "${one[@]}" ;;
          w4a16-1-nopdl)  # the default one-row shapes without programmatic dependent launch (pdl.py)
            BENCH_PRELUDE="$(quant_mods nopdl)" \
            bench "llama-3.1-8b w4a16, no PDL, 1x128/128" --model "$l" --config /tmp/w4a16.yaml "${one[@]}" ;;
          w4a16-1-eagerprompt|bf16-1-eagerprompt)  # the prompt's prefill eager, as before prompts took graphs
            config=(); [ "${variant%%-*}" = w4a16 ] && config=(--config /tmp/w4a16.yaml)
            BENCH_PRELUDE="from tritonllm.engine.embedded import cuda_graphs; cuda_graphs.PROMPT_GRAPH_ROWS = 0" \
              bench "llama-3.1-8b ${variant%%-*}, eager prefill, 1x128/128" --model "$l" "${config[@]}" "${one[@]}" ;;
          fp8-1) bench "llama-3.1-8b fp8+fp8kv 1x128/128" --model "$l" --config /tmp/fp8.yaml "${one[@]}" ;;
          bf16-*:*|w4a16-*:*|fp8-*:*)  # DTYPE-REQUESTS:MOD,MOD... several changes in one run (quant_mods; none after
            # the colon: the defaults), the requests all in one batch, e.g. bf16-16:nomerge
            base=${variant%%:*}; dtype=${base%-*}; n=${base#*-}; config=()
            [ "$dtype" = w4a16 ] && config=(--config /tmp/w4a16.yaml)
            [ "$dtype" = fp8 ] && config=(--config /tmp/fp8.yaml)
            shape_args=("${one[@]}"); [ "$n" != 1 ] && shape_args=(--requests "$n" --max-batch-size "$n" "${lengths[@]}")
            mods=${variant#*:}
            BENCH_PRELUDE="$(quant_mods "$mods")" \
              bench "llama-3.1-8b $dtype${mods:+, $mods,} ${n}x128/128" --model "$l" "${config[@]}" "${shape_args[@]}" ;;
          *) echo "bench-quant: unknown variant '$variant'" | tee -a "$OUT/bench.log" >&2 ;;
        esac
      done ;;
    host-profile)  # cProfile of the engine thread (ci/host_profile.py): W4A16 and bf16 at batch 1, prefill then decode
      l=$(shape llama-3.1-8b)
      quant_configs
      one=(--requests 1 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none)
      for name in ${HOST_PROFILE_MODELS:-w4a16 bf16}; do
        config=(); [ $name = w4a16 ] && config=(--config /tmp/w4a16.yaml)
        for mode in prefill decode; do
          BENCH_PRELUDE="import sys; sys.path.insert(0, 'ci'); import host_profile; host_profile.install('$OUT/host-profile-$name.txt', '$mode')" \
            bench "llama-3.1-8b $name, $mode steps under cProfile" --model "$l" "${config[@]}" "${one[@]}"
        done
        grep "^profiled" "$OUT/host-profile-$name.txt"
      done ;;
    bench-parallel)  # issue 24 (nvidia-h200-x2 or more): Llama-3.1-8B's shape, nano and batch 1, one rank against two
      l=$(shape llama-3.1-8b)
      printf 'kv_cache_config:\n  free_gpu_memory_fraction: 0.8\n' > /tmp/parallel.yaml  # a rank does not profile activations
      one=(--requests 1 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none)
      for variant in ${PARALLEL_VARIANTS:-tp1-nano tp2-nano tp1-1 tp2-1 pp2-nano}; do
        case $variant in
          tp1-nano) bench "llama-3.1-8b nano, one GPU" --model "$l" --config /tmp/parallel.yaml --workload nano --warmup --baseline none ;;
          tp2-nano) BENCH_TIMEOUT=400 bench "llama-3.1-8b nano, tensor parallel 2" --model "$l" --config /tmp/parallel.yaml --workload nano --warmup --baseline none --tensor-parallel-size 2 ;;
          pp2-nano) BENCH_TIMEOUT=400 bench "llama-3.1-8b nano, pipeline parallel 2" --model "$l" --config /tmp/parallel.yaml --workload nano --warmup --baseline none --pipeline-parallel-size 2 ;;
          tp1-1) bench "llama-3.1-8b 1x128/128, one GPU" --model "$l" --config /tmp/parallel.yaml "${one[@]}" ;;
          tp2-1) bench "llama-3.1-8b 1x128/128, tensor parallel 2" --model "$l" --config /tmp/parallel.yaml "${one[@]}" --tensor-parallel-size 2 ;;
        esac
      done ;;
    parallel-tests) run_tests tests/engine/test_tensor_parallel.py tests/engine/test_pipeline_parallel.py ;;
    sync-check)  # the host-device synchronisations a step makes, bf16 and FP8 + FP8 KV (ci/gpu_sync_check.py)
      q=$(shape qwen2.5-0.5b)
      printf 'quant_config:\n  quant_algo: FP8\n  kv_cache_quant_algo: FP8\n' > /tmp/fp8.yaml
      python3 ci/gpu_sync_check.py --model "$q" 2>>"$OUT/sync-check.log" | tee -a "$OUT/sync-check.jsonl"
      python3 ci/gpu_sync_check.py --model "$q" --config /tmp/fp8.yaml 2>>"$OUT/sync-check.log" \
        | tee -a "$OUT/sync-check.jsonl" ;;
    quant) run_tests tests/engine/test_quant*.py ${QUANT_TESTS:-} ;;
    bench-qwen3)
      bench "qwen3 nano" --model "$(shape qwen3-0.6b)" --workload nano --warmup --baseline none ;;
    profile-1)
      bench "qwen2.5 1x128/128 profile" --model "$(shape qwen2.5-0.5b)" --requests 1 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --warmup --baseline none --profile ;;
    profile)
      bench "qwen2.5 256x128/128 profile" --model "$(shape qwen2.5-0.5b)" --requests 256 --min-prompt 128 --max-prompt 128 --min-output 128 --max-output 128 --max-batch-size 256 --baseline none --profile ;;
    *) echo "unknown step $what" >&2 ;;
  esac
done

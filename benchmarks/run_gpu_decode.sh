#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the decode paths. PARTS (default all) picks:
#   tests   every GPU kernel test;
#   kernels the decode kernel benchmark (medians of 3 passes) -> $OUT/kernels_h100_decode.json, and
#           decode-only steps at the runner's buckets, decode kernel vs ragged -> kernels_h100_route.json;
#           decode attention alone at Qwen3-4B / 30B-A3B / 3.5-4B shapes, 1k context, kernel time from a profile,
#           row vs page gather -> decode_attention_<shape>_h100.json;
#   forward the raw Qwen3-4B forward's decode step, decode-only executable vs the ragged kernel's
#           attention (bench_forward, alternating passes) at batch 64 x 2k and 32 x 1k;
#   engine  the engine's TTFT/TPOT and offline throughput (run_gpu_prefill.sh, backend pallas);
#   local   (on request) Qwen3-4B's decode step at batch 1 / 8 / 32 with op variants (bench_local_step: $VARIANTS,
#           default "default no_norm_qkv skinny_o"), the engine's 128-page table (max_model_len 2048) and each
#           kernel's GPU time from a profile -> local_step_variants_qwen3-4b_h100.json;
#   gemv    (on request) one-token projections as kernel time, XLA / Triton / Mosaic GPU -> gemv_h100.json.
set -uo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-tests kernels forward engine}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -2
fi
if [[ $PARTS == *kernels* ]]; then
  python3 benchmarks/bench_kernels.py --only decode --repeat 3 --out "$OUT/kernels_h100_decode.json" | grep -v '^{'
  python3 benchmarks/bench_kernels.py --only route --out "$OUT/kernels_h100_route.json" | tail -1
  for shape in qwen3-4b qwen3-30b-a3b qwen3.5-4b; do
    python3 -m benchmarks.bench_decode_attention --shape $shape --kernel-times --batch-sizes 1 8 32 \
        --out "$OUT/decode_attention_${shape}_h100.json" > /dev/null && echo "decode attention $shape: done"
  done
fi
if [[ $PARTS == *forward* ]]; then
  for bp in "64 2048" "32 1024"; do
    set -- $bp
    python3 -m benchmarks.bench_forward --shape qwen3-4b --batch $1 --prompt-len $2 --iters 20 \
        --out "$OUT/forward_decode_b$1_qwen3-4b_h100.json" | grep -E '"decode_(pipelined_ms|step_ms_median)'
  done
fi
if [[ $PARTS == *engine* ]]; then
  BACKENDS=pallas bash benchmarks/run_gpu_prefill.sh
fi
if [[ $PARTS == *local* ]]; then
  timeout 900 python3 -m benchmarks.bench_local_step --shape qwen3-4b --tp 1 --batch-sizes 1 8 32 --table-pages 128 \
      --variants ${VARIANTS:-default no_norm_qkv skinny_o} --profile /tmp/jinfer-local-step \
      --out "$OUT/local_step_variants_qwen3-4b_h100.json" | grep "^{'tp'" | cut -c1-200
fi
if [[ $PARTS == *gemv* ]]; then
  timeout 300 python3 -m benchmarks.bench_gemv --out "$OUT/gemv_h100.json" | grep "^{'shape'"
fi

#!/usr/bin/env bash
# FP8 weights against bf16 on one GPU: the FP8 kernel tests, the decode kernels at Qwen3-8B's shapes
# (bench_dense fp8), then engine TPOT of dummy:<shape> and dummy:<shape>-fp8 in alternating processes, ROUNDS each:
# $OUT/fp8_latency_<shape>.json (every process, the medians, FP8 / bf16; benchmarks/latency_summary.py).
#   SHAPE=qwen3-8b ROUNDS=3 BATCHES="1 8" bash benchmarks/run_gpu_fp8.sh
set -uo pipefail
source benchmarks/gpu_env.sh
mkdir -p /tmp/fp8ab
SHAPE=${SHAPE:-qwen3-8b}; ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1 8}; TIMEOUT=${TIMEOUT:-150}
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider \
  tests/kernels/test_fused_mlp.py tests/kernels/test_skinny_gemm.py tests/kernels/test_norm_qkv_rope.py 2>&1 | tail -2
timeout 180 python3 -m benchmarks.kernels.bench_dense fp8 "$OUT/dense_fp8_${SHAPE}.json" 2>&1 | grep -v '^{' | tail -20
for r in $(seq "$ROUNDS"); do
  for s in "$SHAPE" "$SHAPE-fp8"; do
    timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$s" --batch-sizes $BATCHES --input-len 1024 \
      --output-len 128 --repeat 1 --out "/tmp/fp8ab/${s}_$r.json" 2>&1 | grep -E "^batch|Error" | sed "s/^/[$s $r] /"
  done
  python3 -m benchmarks.latency_summary "$OUT/fp8_latency_${SHAPE}.json" bf16="/tmp/fp8ab/${SHAPE}_*.json" \
    fp8="/tmp/fp8ab/${SHAPE}-fp8_*.json"  # after every round (time limits)
done

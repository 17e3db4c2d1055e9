#!/usr/bin/env bash
# FP8 KV cache (--kv-cache-dtype fp8) against bf16 KV on one H100 (device tool, carrying .whl): the GPU kernel tests of
# the FP8 paths (decode, Triton prefill, Mosaic prefill's routing, the K/V-writing front ends), then with
# dummy:<shape> (bf16 weights):
# - offline throughput, 512 prompts of 1k in / 128 out, where the KV pool limits the batch: at GPU_UTIL (default
#   36 GB of the device's memory for weights + pool, 0.45 of an H100, 0.26 of an H200: ~120 running sequences of
#   Qwen3-8B with bf16 KV, twice the pages in FP8; at 0.45 of an H200 both pools reach 256 sequences x 1152 tokens)
#   -> $OUT/fp8kv_throughput_<shape>_{bf16,fp8}.json (num_pages in each: the pool doubles);
# - engine TPOT at batch 1 and 32 (1k in / 128 out), bf16 KV and FP8 KV in alternating processes, ROUNDS each
#   -> $OUT/fp8kv_latency_<shape>.json (every process, the medians, FP8 / bf16; benchmarks/latency_summary.py).
#   SHAPE=qwen3-8b ROUNDS=3 PARTS="tests throughput latency" bash benchmarks/run_gpu_fp8kv.sh
set -uo pipefail
source benchmarks/gpu_env.sh
SHAPE=${SHAPE:-qwen3-8b}; ROUNDS=${ROUNDS:-3}; TIMEOUT=${TIMEOUT:-240}
GPU_UTIL=${GPU_UTIL:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 \
  | awk '{printf "%.2f", 36 * 1024 / $1}')}  # (36 GB whatever the device)
PARTS=${PARTS:-tests throughput latency}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
mkdir -p /tmp/fp8kv
if [[ " $PARTS " == *" tests "* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -n 4 -m gpu \
    -p no:cacheprovider tests/kernels/test_paged_attention.py tests/kernels/test_prefill_attention.py \
    tests/kernels/test_prefill_attention_mgpu.py tests/kernels/test_qkv_rope.py tests/kernels/test_norm_qkv_rope.py \
    2>&1 | tail -3
fi
if [[ " $PARTS " == *" throughput "* ]]; then
  for kv in auto fp8; do
    name=$([ "$kv" = auto ] && echo bf16 || echo fp8)
    timeout "$TIMEOUT" python3 -m benchmarks.bench_throughput --model "dummy:$SHAPE" --num-prompts 512 --input-len 1024 \
      --output-len 128 --kv-cache-dtype "$kv" --gpu-memory-utilization "$GPU_UTIL" \
      --out "$OUT/fp8kv_throughput_${SHAPE}_${name}.json" 2>&1 | grep -E "^throughput|Error" | sed "s/^/[$name KV] /"
  done
fi
if [[ " $PARTS " == *" latency "* ]]; then
  for r in $(seq "$ROUNDS"); do
    for kv in auto fp8; do
      name=$([ "$kv" = auto ] && echo bf16 || echo fp8)
      timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$SHAPE" --kv-cache-dtype "$kv" --batch-sizes 1 32 \
        --input-len 1024 --output-len 128 --repeat 1 --out "/tmp/fp8kv/${name}_$r.json" 2>&1 \
        | grep -E "^batch|Error" | sed "s/^/[$name KV $r] /"
    done
    python3 -m benchmarks.latency_summary "$OUT/fp8kv_latency_${SHAPE}.json" bf16="/tmp/fp8kv/bf16_*.json" \
      fp8="/tmp/fp8kv/fp8_*.json"  # after every round (time limits)
  done
fi

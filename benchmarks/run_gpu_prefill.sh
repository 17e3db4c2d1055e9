#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the engine with the Mosaic GPU prefill kernel
# (attention backend "pallas", the default on GPU) against Triton-only prefill ("pallas-triton"):
# TTFT of a 1k prompt (batch 1) and offline throughput (512 prompts, 1k in / 128 out), Qwen3-4B
# shape, dummy weights, bf16. Results land in $OUT. BACKENDS=pallas runs only the default.
set -uo pipefail
source benchmarks/gpu_env.sh
for backend in ${BACKENDS:-pallas pallas-triton}; do
  tag=$([ $backend = pallas ] && echo "" || echo "_triton")
  python3 -m benchmarks.bench_latency --shape qwen3-4b --batch-sizes 1 8 32 --input-len 1024 --output-len 128 \
      --attention-backend $backend --out "$OUT/latency_qwen3-4b_h100$tag.json" | grep "^batch"
  python3 -m benchmarks.bench_throughput --model dummy:qwen3-4b --num-prompts 512 --input-len 1024 \
      --output-len 128 --max-num-batched-tokens 8192 --attention-backend $backend \
      --out "$OUT/throughput_qwen3-4b_h100_512x1k$tag.json" | tail -1
done

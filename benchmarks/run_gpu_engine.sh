#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the raw forward step and offline throughput of a
# Qwen3-4B-shaped dummy model. Results land in $OUT (copy them to benchmarks/results/).
set -euo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m benchmarks.roofline --shape qwen3-4b --batch 1 --context 1024 --prompt-len 1024 --out "$OUT/roofline_qwen3-4b_h100.json"
python3 -m benchmarks.bench_forward --shape qwen3-4b --prompt-len 1024 --batch 1 --iters 20 \
    --out "$OUT/forward_qwen3-4b_h100.json"
python3 -m benchmarks.bench_throughput --model dummy:qwen3-4b --num-prompts 256 --input-len 512 --output-len 128 \
    --out "$OUT/throughput_qwen3-4b_h100_ref.json"

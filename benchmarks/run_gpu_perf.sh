#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the GPU kernel tests, then engine latency
# (batch 1/8/32, 1k in / 128 out), offline throughput at the configuration (512 prompts,
# 1k in / 128 out) and the raw forward step (sync vs pipelined), Qwen3-4B-shaped dummy model, bf16.
# Results land in $OUT (copy them to benchmarks/results/). Part 2: run_gpu_serving.sh.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -m gpu tests/kernels tests/unit/test_executable_cache.py \
    -p no:cacheprovider 2>&1 | tail -2
BACKENDS=pallas bash benchmarks/run_gpu_prefill.sh  # latency and throughput, written by one script
python3 -m benchmarks.bench_forward --shape qwen3-4b --prompt-len 1024 --batch 1 --iters 30 --attention-backend pallas \
    --out "$OUT/forward_qwen3-4b_h100_pallas.json" | grep -E "prefill_step|decode_step_ms_median|pipelined"
# A Perfetto trace of batch-1 decode steps (summarize with `python -m benchmarks.trace_summary FILE`).
python3 -m benchmarks.bench_latency --shape qwen3-4b --batch-sizes 1 --input-len 1024 --output-len 16 \
    --profile /tmp/jinfer-trace --out /tmp/jinfer-trace/latency.json | grep "^batch"
cp "$(find /tmp/jinfer-trace -name '*.trace.json.gz' | head -1)" "$OUT/profile_latency_b1_qwen3-4b_h100.trace.json.gz"

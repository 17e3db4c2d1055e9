#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): decode/prefill forward timings (sync vs pipelined,
# XLA command buffers on/off), engine latency at batch 1 (async vs sync scheduling) and offline
# throughput at the configuration (512 prompts, 1k in / 128 out), Qwen3-4B-shaped dummy model.
# Results (and Perfetto traces) land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JINFER_COMPILATION_CACHE=/tmp/jinfer-xla
OUT=${OUT:-benchmarks/results}
NOCB=--xla_gpu_enable_command_buffer=
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
FWD="python3 -m benchmarks.bench_forward --shape qwen3-4b --prompt-len 1024 --batch 1 --iters 30 --attention-backend pallas"
$FWD --profile "$OUT/trace_forward" --out "$OUT/forward_qwen3-4b_h100_pallas.json" | tail -8
XLA_FLAGS=$NOCB $FWD --out "$OUT/forward_qwen3-4b_h100_pallas_nocb.json" | tail -8
LAT="python3 -m benchmarks.bench_latency --shape qwen3-4b --batch-sizes 1 --input-len 1024 --output-len 128"
$LAT --profile "$OUT/trace_latency" --out "$OUT/latency_qwen3-4b_h100_pallas.json" | grep "^batch"
$LAT --no-async-scheduling --out "$OUT/latency_qwen3-4b_h100_pallas_sync.json" | grep "^batch"
XLA_FLAGS=$NOCB $LAT --out "$OUT/latency_qwen3-4b_h100_pallas_nocb.json" | grep "^batch"
python3 -m benchmarks.bench_throughput --model dummy:qwen3-4b --num-prompts 512 --input-len 1024 --output-len 128 \
    --max-num-batched-tokens 8192 --out "$OUT/throughput_qwen3-4b_h100_512x1k.json" | tail -1

#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the KV host tier (--kv-offload-gb) on a Qwen3-4B-shaped
# dummy model, bf16: (a) a 16k-token prefix restored from host vs recomputed vs a warm HBM hit, and the
# restore's host-to-device rate against a plain pinned-host device_put; (b) warm-hit TTFT at 1k/16k/32k;
# (c) 64 sessions x 8 turns of chat with the HBM pool at ~1/4 of the histories, with the tier and without.
# One JSON in $OUT (copy it to benchmarks/results/). About 4-6 minutes (most of it compiles on a cold cache).
set -euo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m benchmarks.bench_kv_offload --shape qwen3-4b --out "$OUT/kv_offload_qwen3-4b_h100.json" | grep -v '^ \|^[{}]'

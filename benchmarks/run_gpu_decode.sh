#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the decode paths. Every GPU kernel test, the
# decode kernel benchmark (medians of 3 passes) into $OUT/kernels_h100_decode.json, and the raw
# Qwen3-4B forward's decode step with the decode-only executable against the ragged kernel's
# attention (bench_forward) at batch 64 x 2k and 32 x 1k.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -2
python3 benchmarks/bench_kernels.py --only decode --repeat 3 --out "$OUT/kernels_h100_decode.json" | grep -v '^{'
for bp in "64 2048" "32 1024"; do
  set -- $bp
  python3 -m benchmarks.bench_forward --shape qwen3-4b --batch $1 --prompt-len $2 --iters 20 \
      --out "$OUT/forward_decode_b$1_qwen3-4b_h100.json" | grep -E '"decode_(pipelined|step_ms_median)'
done

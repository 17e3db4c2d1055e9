#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): every GPU kernel test, then the kernel benchmark
# (decode / prefill / MLP against their peers) into $OUT/kernels_h100.json.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -2
python3 benchmarks/bench_kernels.py ${SWEEP:+--sweep $SWEEP} --out "$OUT/kernels_h100.json" | grep -v '^{'

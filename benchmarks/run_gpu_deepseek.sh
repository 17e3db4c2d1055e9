#!/usr/bin/env bash
# On the GPU machine (device tool, carrying .whl): DeepSeek on one GPU, its routed experts on the MoE kernels
# (moe_route_chosen + the Triton grouped GEMMs; the Mosaic GPU grouped GEMM for steps of >= 128 rows per expert).
# PARTS (comma list; default tests,routing,v2,v3), each within one 10-minute device call:
#   tests    the MoE kernel tests compiled for the GPU (routing, chosen-expert routing, front end, grouped GEMMs)
#   routing  routing time, kernel vs XLA: moe_route at 128 experts top-8, moe_route_chosen at 64 top-6 / 256 top-8
#   v2       engine TTFT / TPOT on dummy:deepseek-v2-lite, batch $BATCHES (default "1 32"), 1k in / 128 out
#   v3       the same on DeepSeek-V3's layer shapes, 5 layers deep (3 dense, 2 with 256 experts top-8: ~53 GB bf16)
# JSON lands in $OUT (copy to benchmarks/results/); $TAG names the device in the file names (default h100).
set -uo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-tests,routing,v2,v3}
TAG=${TAG:-h100}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=cuda timeout 500 python3 -m pytest -q -m gpu tests/kernels/test_moe_routing.py \
      tests/kernels/test_moe_router.py tests/kernels/test_moe_gemm.py tests/kernels/test_moe_gemm_mgpu.py \
      -p no:cacheprovider 2>&1 | tail -4
fi
if [[ $PARTS == *routing* ]]; then
  timeout 300 python3 -m benchmarks.kernels.bench_moe routing | tee "$OUT/moe_routing_$TAG.txt"
fi
if [[ $PARTS == *v2* ]]; then
  timeout 540 python3 -m benchmarks.bench_latency --shape deepseek-v2-lite --batch-sizes ${BATCHES:-1 32} \
      --input-len 1024 --output-len 128 --out "$OUT/latency_deepseek-v2-lite_$TAG.json" | grep "^batch"
fi
if [[ $PARTS == *v3* ]]; then
  timeout 540 python3 -m benchmarks.bench_latency --shape deepseek-v3,num_layers=5 --batch-sizes ${BATCHES:-1 32} \
      --input-len 1024 --output-len 128 --out "$OUT/latency_deepseek-v3-5l_$TAG.json" | grep "^batch"
fi

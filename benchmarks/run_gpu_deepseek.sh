#!/usr/bin/env bash
# On the GPU machine (device tool, carrying .whl): DeepSeek on one GPU, its routed experts on the MoE kernels
# (moe_route_chosen + the Triton grouped GEMMs; the Mosaic GPU grouped GEMM for steps of >= 128 rows per expert).
# PARTS (comma list; default tests,routing,v2,v3), each within one 10-minute device call:
#   tests    the MoE kernel tests compiled for the GPU (routing, chosen-expert routing, front end, grouped GEMMs)
#   routing  routing time, kernel vs XLA: moe_route at 128 experts top-8, moe_route_chosen at 64 top-6 / 256 top-8
#   v2       engine TTFT / TPOT on dummy:deepseek-v2-lite, batch $BATCHES (default "1 32"), 1k in / 128 out
#   v3       the same on DeepSeek-V3's layer shapes, 5 layers deep (3 dense, 2 with 256 experts top-8: ~53 GB bf16)
#   mla_kernels  the ragged MLA kernels' GPU tests, then `bench_attention mla_prefill` (ModelOps.mla_attention at
#            V2-Lite's sizes per policy: absorbed, expanded from 16 / 64 / 256 new tokens, the jnp reference)
#   mla      V2-Lite TTFT / TPOT at batch $BATCHES, 1k in / 32 out, under one MLA policy $MLA: kernel (the default:
#            a sequence's own >= 64 new tokens expanded, the rest absorbed), absorbed (JINFER_MLA_EXPAND_MIN_QUERY_LEN=0)
#            or reference (JINFER_MLA_RAGGED_KERNEL=0: the jnp reference, the path before)
#   mla_long the same for one 8k prompt (2048-token chunks, up to 6k tokens of context before a chunk)
#   hostprof where a batch-1 decode step of dummy:deepseek-v2-lite goes: the host (cProfile, XLA's host events) and the
#            GPU's kernels (benchmarks/host_profile.py --profile, then trace_summary): $OUT/host_profile_deepseek-v2-lite_$TAG.txt
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
mla_env() {
  case ${MLA:-kernel} in
    kernel) ;;
    absorbed) echo JINFER_MLA_EXPAND_MIN_QUERY_LEN=0 ;;
    reference) echo JINFER_MLA_RAGGED_KERNEL=0 ;;
  esac
}
[[ ${MLA:-kernel} =~ ^(kernel|absorbed|reference)$ ]] || { echo "MLA=$MLA: kernel, absorbed or reference" >&2; exit 2; }
if [[ ,$PARTS, == *,mla_kernels,* ]]; then
  JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_mla_prefill.py -p no:cacheprovider \
      2>&1 | tail -4
  timeout 360 python3 -m benchmarks.kernels.bench_attention mla_prefill --out "$OUT/mla_prefill_$TAG.json" \
      | grep '^{"seqs'
fi
if [[ ,$PARTS, == *,mla,* ]]; then
  env $(mla_env) timeout 420 python3 -m benchmarks.bench_latency --shape deepseek-v2-lite --batch-sizes ${BATCHES:-1 32} \
      --input-len 1024 --output-len 32 --repeat 2 --out "$OUT/latency_deepseek-v2-lite_mla-${MLA:-kernel}_$TAG.json" \
      | grep "^batch"
fi
if [[ ,$PARTS, == *,mla_long,* ]]; then
  env $(mla_env) timeout 540 python3 -m benchmarks.bench_latency --shape deepseek-v2-lite --batch-sizes 1 \
      --input-len 8192 --output-len 32 --repeat 2 \
      --out "$OUT/latency_deepseek-v2-lite_8k_mla-${MLA:-kernel}_$TAG.json" | grep "^batch"
fi
if [[ ,$PARTS, == *,hostprof,* ]]; then
  timeout 300 python3 -m benchmarks.host_profile --shape deepseek-v2-lite --batch-size 1 --output-len 128 --top 40 \
    --profile /tmp/hostprof_ds --out "$OUT/host_profile_deepseek-v2-lite_$TAG.txt" > /tmp/hostprof_ds.log 2>&1
  steps=$(grep -h "^trace" /tmp/hostprof_ds.log | awk '{print $2}')
  grep -h "^median" /tmp/hostprof_ds.log; echo "== $steps steps"; tail -3 /tmp/hostprof_ds.log
  [[ -n $steps ]] && python3 -m benchmarks.trace_summary "$(find /tmp/hostprof_ds -name '*.trace.json.gz' | head -1)" \
    --steps "$steps" --top 40 > "$OUT/trace_summary_deepseek-v2-lite_b1_$TAG.txt"
  sed -n 1,75p "$OUT/trace_summary_deepseek-v2-lite_b1_$TAG.txt"
fi

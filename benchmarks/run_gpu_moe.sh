#!/usr/bin/env bash
# On the GPU machine (device tool, carrying .whl): Qwen3-MoE on one GPU. PARTS (comma list; default
# tests,kernels,latency,throughput; front and hfpeer on request):
#   tests       the MoE kernel tests compiled for the GPU, and the MoE model goldens with the kernels
#   kernels     bench_moe: routing + grouped GEMMs vs torch._grouped_mm and lax.ragged_dot ($SWEEP: tile grid;
#               $BENCH_ARGS passed on, e.g. SWEEP=1 TOKENS=1 BENCH_ARGS="--no-torch --skip ragged --sweep-n 16 32 64
#               --sweep-warps 4"),
#               then the Mosaic GPU grouped GEMM at 512 / 1024 / 4096 tokens (moe_mgpu_$TAG.json)
#   latency     engine TTFT / TPOT on dummy:qwen3-30b-a3b, batch $BATCHES (default "1 8 32"), 1k in / 128 out
#   throughput  offline 512 prompts x 1k in / 128 out
#   front       the MoE block's front end at 1 / 8 / 64 tokens: XLA's norm + router dot + routing (routing kernel at
#               1 / 2 / 4 warps) vs the moe_norm_route kernel (moe_front_$TAG.json); the decode step with each
#               (bench_local_step variants, batch 1 / 8 / 16) and its per-kernel times
#   hfpeer      the HF transformers peer (Qwen3MoeForCausalLM, random bf16 weights) at batch 1 and 8, 1k in / 128 out
# JSON lands in $OUT (copy to benchmarks/results/); $TAG names the device in the file names (default h100).
set -uo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-tests,kernels,latency,throughput}
TAG=${TAG:-h100}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=cuda timeout 400 python3 -m pytest -q -m gpu tests/kernels/test_moe_routing.py tests/kernels/test_moe_router.py \
      tests/kernels/test_moe_gemm.py $(ls tests/kernels/test_moe_gemm_mgpu.py 2>/dev/null) -p no:cacheprovider 2>&1 | tail -4
fi
if [[ $PARTS == *kernels* ]]; then
  timeout 900 python3 -m benchmarks.bench_moe ${SWEEP:+--sweep} ${TOKENS:+--tokens $TOKENS} ${BENCH_ARGS:-} \
      --out "$OUT/moe_kernels_$TAG.json" | grep '^{"' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if "tokens" in r:
        cfg = {k: r[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages") if k in r}
        print(r["tokens"], r.get("what"), r["impl"], cfg or "", r.get("time_us"), "us", r.get("tb_per_s"), "TB/s",
              r.get("tflop_per_s"), "TFLOP/s", r.get("error", "")[:120], "err", r.get("max_abs_err_vs_ref"))
    else:
        print(r)'
  timeout 300 python3 -m benchmarks.kernels.bench_moe gemm_mgpu > "$OUT/moe_mgpu_$TAG.json"
fi
if [[ $PARTS == *latency* ]]; then
  timeout 900 python3 -m benchmarks.bench_latency --shape qwen3-30b-a3b --batch-sizes ${BATCHES:-1 8 32} \
      --input-len 1024 --output-len 128 --out "$OUT/latency_qwen3-30b-a3b_$TAG.json" | grep "^batch"
fi
if [[ $PARTS == *throughput* ]]; then
  timeout 900 python3 -m benchmarks.bench_throughput --model dummy:qwen3-30b-a3b --num-prompts 512 --input-len 1024 \
      --output-len 128 --warmup --out "$OUT/throughput_qwen3-30b-a3b_${TAG}_512x1k.json" | grep "^throughput"
fi
if [[ $PARTS == *hfpeer* ]]; then
  timeout 900 python3 -m benchmarks.bench_hf_peer --shape qwen3-30b-a3b --input-len 1024 --output-len 128 \
      --batch-sizes 1 8 --out "$OUT/hf_peer_qwen3-30b-a3b_$TAG.json" 2>&1 | grep -E "^HF|Error"
fi
if [[ $PARTS == *front* ]]; then
  timeout 600 python3 -m benchmarks.bench_moe --front-only --tokens 1 8 64 --out "$OUT/moe_front_$TAG.json" \
      | grep '^{"what' | cut -c1-400
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 timeout 900 python3 -m benchmarks.bench_local_step --shape qwen3-30b-a3b \
      --tp 1 --batch-sizes 1 8 16 --table-pages 128 --variants default no_front route_w1 front16 \
      --out "$OUT/local_step_front_qwen3-30b-a3b_$TAG.json" | grep "^{'tp'"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 timeout 300 python3 -m benchmarks.bench_local_step --shape qwen3-30b-a3b \
      --tp 1 --batch-sizes 1 8 --table-pages 128 --profile /tmp/jinfer-local-step --top 30 \
      --out "$OUT/local_step_front_profile_qwen3-30b-a3b_$TAG.json" | grep "^{'tp'" | cut -c1-600
fi

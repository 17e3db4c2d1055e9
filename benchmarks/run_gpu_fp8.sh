#!/usr/bin/env bash
# FP8 weights against bf16 on one GPU. PARTS (comma list; default tests,dense,latency):
#   tests    the FP8 kernel tests compiled for the GPU (dense kernels, the e4m3 GEMM, the MoE grouped GEMMs)
#   dense    the decode kernels at Qwen3-8B's shapes (bench_dense fp8): $OUT/dense_fp8_${SHAPE}.json
#   moe      the MoE grouped GEMMs with block-FP8 experts vs bf16 at Qwen3-30B-A3B's shapes, 1 / 8 / 16 / 4096 tokens
#            (bench_moe --fp8: Triton on [E, out, in] and [E, in, out] experts; the Mosaic GPU grouped GEMMs, bf16 and
#            e4m3, at 4096; MOE_TOKENS="4096": only those, within the time limit): $OUT/moe_fp8_$TAG.json
#   latency  engine TPOT of dummy:<shape> and dummy:<shape>-fp8 in alternating processes, ROUNDS each:
#            $OUT/fp8_latency_<shape>.json (every process, the medians, FP8 / bf16; benchmarks/latency_summary.py)
#   ttft     TTFT of one 4096-token prompt, dummy:<shape> and <shape>-fp8, ROUNDS alternating processes x 3 runs:
#            $OUT/ttft4k_<shape>[-fp8]_<round>.json, the medians in $OUT/ttft4k_<shape>.json (benchmarks/latency_summary.py)
#   prefill  the Mosaic GPU FP8 GEMM for prefill (pallas_kernels/dense/fp8_gemm_mgpu.py): its GPU tests and the kernel
#            sweep against dequantize + XLA's GEMM and bf16 (bench_dense fp8_prefill: $OUT/dense_fp8_prefill_$TAG.json)
#   hostprof where the host's time of a batch-1 decode step goes, <shape> and <shape>-fp8 (benchmarks/host_profile.py:
#            cProfile and XLA's host events; FP8 passes 180 more buffers to the forward): $OUT/host_profile_<shape>*.txt
#   SHAPE=qwen3-8b ROUNDS=3 BATCHES="1 8" bash benchmarks/run_gpu_fp8.sh
#   PARTS=tests,moe,latency SHAPE=qwen3-30b-a3b TIMEOUT=600 ROUNDS=2 bash benchmarks/run_gpu_fp8.sh   # the MoE
set -uo pipefail
source benchmarks/gpu_env.sh
mkdir -p /tmp/fp8ab
PARTS=${PARTS:-tests,dense,latency}; TAG=${TAG:-h200}
SHAPE=${SHAPE:-qwen3-8b}; ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1 8}; TIMEOUT=${TIMEOUT:-150}
if [[ $PARTS == *tests* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 400 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider \
    tests/kernels/test_fused_mlp.py tests/kernels/test_skinny_gemm.py tests/kernels/test_norm_qkv_rope.py \
    tests/kernels/test_moe_gemm.py tests/kernels/test_fp8_gemm_mgpu.py 2>&1 | tail -2
fi
if [[ $PARTS == *dense* ]]; then
  timeout 180 python3 -m benchmarks.kernels.bench_dense fp8 "$OUT/dense_fp8_${SHAPE}.json" 2>&1 | grep -v '^{' | tail -20
fi
if [[ $PARTS == *ttft* ]]; then  # TTFT of one 4096-token prompt, bf16 vs FP8 weights, alternating processes
  for r in $(seq "$ROUNDS"); do
    for s in "$SHAPE" "$SHAPE-fp8"; do
      timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$s" --batch-sizes 1 --input-len 4096 --output-len 8 \
        --max-num-batched-tokens 4096 --repeat 3 --out "$OUT/ttft4k_${s}_$r.json" 2>&1 | grep -E "^batch|Error" | sed "s/^/[$s $r] /"
    done
    python3 -m benchmarks.latency_summary "$OUT/ttft4k_${SHAPE}.json" bf16="$OUT/ttft4k_${SHAPE}_[0-9]*.json" \
      fp8="$OUT/ttft4k_${SHAPE}-fp8_[0-9]*.json" > /dev/null
  done
fi
if [[ $PARTS == *moe* ]]; then
  timeout 600 python3 -m benchmarks.bench_moe --fp8 --tokens ${MOE_TOKENS:-1 8 16 4096} --out "$OUT/moe_fp8_$TAG.json" \
    | grep '^{"what' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["tokens"], r["impl"], r.get("time_us"), "us", r.get("tb_per_s"), "TB/s", r.get("tflop_per_s"), "TFLOP/s",
          r.get("max_abs_err_vs_ref", ""), r.get("error", "")[:160])'
fi
if [[ $PARTS == *latency* ]]; then
  for r in $(seq "$ROUNDS"); do
    for s in "$SHAPE" "$SHAPE-fp8"; do
      timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$s" --batch-sizes $BATCHES --input-len 1024 \
        --output-len 128 --repeat 1 --out "/tmp/fp8ab/${s}_$r.json" 2>&1 | grep -E "^batch|Error" | sed "s/^/[$s $r] /"
    done
    python3 -m benchmarks.latency_summary "$OUT/fp8_latency_${SHAPE}.json" bf16="/tmp/fp8ab/${SHAPE}_*.json" \
      fp8="/tmp/fp8ab/${SHAPE}-fp8_*.json"  # after every round (time limits)
  done
fi
if [[ $PARTS == *prefill* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_fp8_gemm_mgpu.py 2>&1 | tail -2
  timeout 400 python3 -m benchmarks.kernels.bench_dense fp8_prefill "$OUT/dense_fp8_prefill_$TAG.json" | grep '^{' \
    | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["kernel"], r["tokens"], r["impl"], {k: r[k] for k in ("wg_dim", "max_steps", "grid_minor", "k_splits")
          if k in r}, r.get("time_us"), r.get("tflop_per_s"), r.get("weight_tb_per_s"), r.get("rel_err_vs_ref"),
          r.get("error", "")[:160])'
fi
if [[ $PARTS == *hostprof* ]]; then
  for s in "$SHAPE" "$SHAPE-fp8"; do
    timeout "$TIMEOUT" python3 -m benchmarks.host_profile --shape "$s" --batch-size 1 --output-len 128 --top 40 \
      --profile "/tmp/hostprof_$s" --out "$OUT/host_profile_${s}_$TAG.txt" > "/tmp/hostprof_$s.log" 2>&1
    steps=$(grep -h "^trace" "/tmp/hostprof_$s.log" | awk '{print $2}')
    grep -h "^median" "/tmp/hostprof_$s.log"; echo "== $s: $steps steps"
    [[ -n $steps ]] && python3 -m benchmarks.trace_summary "$(find "/tmp/hostprof_$s" -name '*.trace.json.gz' | head -1)" \
      --steps "$steps" --top 30 | grep -v "^ *[0-9.]* + " | head -50
  done
fi

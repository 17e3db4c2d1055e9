#!/usr/bin/env bash
# On a multi-GPU machine (device tool kind nvidia-h200-x2, carrying .whl): the sharded forward.
# PARTS (comma list, default all):
#   tests       the parallel goldens with the kernels compiled for the GPUs (tp/ep up to the GPUs present)
#   step        bench_parallel: decode step time at tp 1 vs $TP, per variant of the collectives' XLA options,
#               Qwen3-8B (tensor parallel) and Qwen3-30B-A3B (expert parallel); the psum alone
#   latency     engine TTFT / TPOT, Qwen3-8B tp 1 vs $TP and Qwen3-30B-A3B one GPU vs ep $TP, batch $BATCHES
#   throughput  offline 512 prompts x 1k in / 128 out, the same pairs
# JSON lands in $OUT; $TAG names the machine in the file names (default h200x2).
set -uo pipefail
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared machine
PARTS=${PARTS:-tests,step,latency,throughput}
TAG=${TAG:-h200x2}
TP=${TP:-2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 python3 -m pytest -q tests/models/test_parallel_golden.py -p no:cacheprovider \
      > "$OUT/tests_parallel_$TAG.log" 2>&1; tail -3 "$OUT/tests_parallel_$TAG.log"
fi
STEP_SHAPES=${STEP_SHAPES:-dense,moe}
if [[ $PARTS == *step* && $STEP_SHAPES == *dense* ]]; then
  timeout 400 python3 -m benchmarks.bench_parallel --shape qwen3-8b --tp 1 $TP --batch-sizes 1 16 \
      ${VARIANTS:+--variants $VARIANTS} --out "$OUT/parallel_step_qwen3-8b_$TAG.json" 2>&1 | grep "^{'"
fi
if [[ $PARTS == *step* && $STEP_SHAPES == *moe* ]]; then
  timeout 400 python3 -m benchmarks.bench_parallel --shape qwen3-30b-a3b --tp 1 $TP --expert-parallel \
      --batch-sizes 1 16 ${MOE_VARIANTS:+--variants $MOE_VARIANTS} --out "$OUT/parallel_step_qwen3-30b-a3b_$TAG.json" \
      2>&1 | grep "^{'"
fi
if [[ $PARTS == *latency* ]]; then
  for tp in 1 $TP; do
    timeout 300 python3 -m benchmarks.bench_latency --shape qwen3-8b --batch-sizes ${BATCHES:-1 16} -tp $tp \
        --input-len 1024 --output-len 128 --out "$OUT/latency_qwen3-8b_tp${tp}_$TAG.json" | grep "^batch"
  done
  for ep in 1 $TP; do
    timeout 400 python3 -m benchmarks.bench_latency --shape qwen3-30b-a3b --batch-sizes ${BATCHES:-1 16} -tp $ep \
        $([ $ep -gt 1 ] && echo --enable-expert-parallel) --input-len 1024 --output-len 128 \
        --out "$OUT/latency_qwen3-30b-a3b_ep${ep}_$TAG.json" | grep "^batch"
  done
fi
if [[ $PARTS == *throughput* ]]; then
  for tp in 1 $TP; do
    timeout 400 python3 -m benchmarks.bench_throughput --model dummy:qwen3-8b --num-prompts 512 --input-len 1024 \
        --output-len 128 --warmup -tp $tp --out "$OUT/throughput_qwen3-8b_tp${tp}_${TAG}_512x1k.json" | grep "^throughput"
  done
  for ep in 1 $TP; do
    timeout 500 python3 -m benchmarks.bench_throughput --model dummy:qwen3-30b-a3b --num-prompts 512 --input-len 1024 \
        --output-len 128 --warmup -tp $ep $([ $ep -gt 1 ] && echo --enable-expert-parallel) \
        --out "$OUT/throughput_qwen3-30b-a3b_ep${ep}_${TAG}_512x1k.json" | grep "^throughput"
  done
fi

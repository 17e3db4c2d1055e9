#!/usr/bin/env bash
# Qwen3-235B-A22B (dummy bf16 weights, ~470 GB) on a whole H200 node (device tool kind nvidia-h200-x8, carrying
# .whl), one process. Attention tensor parallel over the $TP GPUs; experts whole on each GPU
# (--enable-expert-parallel, 16 of 128 per GPU at 8) or split by columns (MOE_LAYOUTS=tp,ep compares both).
# PARTS (comma list, default all):
#   tests       the 235B-layout goldens (tests/models/test_parallel_235b_layout.py) on the GPUs, kernels compiled
#   latency     batch $BATCHES (default "1 8 32") TTFT / TPOT, 1k in / 128 out, per expert layout; the JSON rows
#               hold the roofline of the bytes a step reads per GPU over the copy rate measured in the same run:
#               roofline_tpot_ms (the step's bytes split evenly) and roofline_tpot_ms_busiest_device (our layout:
#               replicated kv heads and router, and with ep the GPU most of the 8 routed experts land on)
#   throughput  offline 512 prompts x 1k in / 128 out (total tokens/s), per expert layout
#   serving     `jinfer serve` + bench_serving at each of $RATES req/s (default "1 2 4 8"), 1k / 128: the TTFT p99
# $SHAPE (default qwen3-235b-a22b) and $TP (default: the GPUs present); PROCS=$TP runs latency as one process per GPU
# (R0_ARGS: more flags for the first, e.g. "--profile DIR --profile-no-python"). The half-size run on nvidia-h200-x4:
#   SHAPE=qwen3-235b-a22b,num_layers=47 bash benchmarks/run_gpu_235b.sh    (47 of the 94 layers, real shapes)
# JSON lands in $OUT; $TAG names the machine in the file names (default h200x$TP). DRY=1 prints the commands only.
# The device tool allows 10 minutes a command: run one part and one layout per call, e.g.
#   PARTS=latency MOE_LAYOUTS=ep bash benchmarks/run_gpu_235b.sh   (then MOE_LAYOUTS=tp; then PARTS=throughput ...)
# each command's timeout is 570 s; a warm machine keeps the compilation cache (/tmp/jinfer-xla) between calls.
set -uo pipefail
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT:-/tmp/run_gpu_235b}; TP=${TP:-8}
  run() { echo "+ $*"; }
else
  source benchmarks/gpu_env.sh
  export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared machine
  TP=${TP:-$(nvidia-smi --list-gpus | wc -l)}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  run() { "$@"; }
fi
mkdir -p "$OUT"
source benchmarks/per_gpu.sh
SHAPE=${SHAPE:-qwen3-235b-a22b}
PARTS=${PARTS:-tests,latency,throughput,serving}
MOE_LAYOUTS=${MOE_LAYOUTS:-ep,tp}
TAG=${TAG:-h200x$TP}
NAME=${SHAPE//,num_layers=/-L}  # file names: qwen3-235b-a22b-L47 for the half-depth shape
NAME=${NAME//[,=]/-}
ep_flag() { [ "$1" = ep ] && echo --enable-expert-parallel; }
show() { grep -E "^(\+ |batch|throughput:|serving:|server ready|Traceback|[A-Za-z]*Error)" || true; }  # not the JSON

if [[ $PARTS == *tests* ]]; then
  run env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 570 python3 -m pytest -q \
      tests/models/test_parallel_235b_layout.py -p no:cacheprovider > "$OUT/tests_235b_layout_$TAG.log" 2>&1
  tail -3 "$OUT/tests_235b_layout_$TAG.log" 2>/dev/null
fi
if [[ $PARTS == *latency* ]]; then
  for moe in ${MOE_LAYOUTS//,/ }; do
    if [ "${PROCS:-1}" = 1 ]; then
      run timeout 570 python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes ${BATCHES:-1 8 32} -tp $TP \
          $(ep_flag $moe) --input-len 1024 --output-len 128 --out "$OUT/latency_${NAME}_${moe}${TP}_$TAG.json" 2>&1 | show
    else  # one process per GPU
      RUN=run latency_per_gpu $TP "$OUT/latency" "$OUT/latency_${NAME}_${moe}${TP}_${TP}proc_$TAG.json" \
          --shape "$SHAPE" --batch-sizes ${BATCHES:-1 8 32} $(ep_flag $moe) --input-len 1024 --output-len 128
    fi
  done
fi
if [[ $PARTS == *throughput* ]]; then
  for moe in ${MOE_LAYOUTS//,/ }; do
    run timeout 570 python3 -m benchmarks.bench_throughput --model "dummy:$SHAPE" --num-prompts 512 --input-len 1024 \
        --output-len 128 --warmup -tp $TP $(ep_flag $moe) --out "$OUT/throughput_${NAME}_${moe}${TP}_${TAG}_512x1k.json" 2>&1 | show
  done
fi
if [[ $PARTS == *serving* ]]; then
  moe=${MOE_LAYOUTS%%,*}  # the first layout (ep unless told otherwise)
  DEVICE="$( [ "${DRY:-0}" = 1 ] || nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $TP"
  run python3 -m server.launcher "dummy:$SHAPE" --port 8000 -tp $TP $(ep_flag $moe) --max-model-len 2048 \
      --max-num-seqs 256 --max-num-batched-tokens 2048 --log-level warning > "$OUT/serve_${NAME}_$TAG.log" 2>&1 &
  SERVER=$!
  run env JAX_PLATFORMS=cpu python3 -m benchmarks.wait_ready --timeout 400 --interval 0.5
  for rate in ${RATES:-1 2 4 8}; do
    run env JAX_PLATFORMS=cpu timeout 120 python3 -m benchmarks.bench_serving --num-prompts $((rate * 30)) \
        --input-len 1024 --output-len 128 --request-rate $rate --vocab-size 151936 --warmup 8 --device "$DEVICE" \
        --out "$OUT/serving_${NAME}_${moe}${TP}_${TAG}_rate$rate.json" 2>&1 | show
  done
  kill -TERM $SERVER 2>/dev/null; wait $SERVER
fi

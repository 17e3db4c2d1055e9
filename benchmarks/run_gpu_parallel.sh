#!/usr/bin/env bash
# On a multi-GPU machine (device tool kind nvidia-h200-x2, carrying .whl): the sharded forward.
# PARTS (comma list, default all):
#   kernels     the one-shot all-reduce kernel against XLA's psum on the GPUs (pallas_kernels/all_reduce.py)
#   tests       the parallel goldens with the kernels compiled for the GPUs (tp/ep up to the GPUs present)
#   step        bench_parallel: decode step time at tp 1 vs $TP, reducing with XLA's psum and our one-shot kernel,
#               Qwen3-8B (tensor parallel) and Qwen3-30B-A3B (expert parallel); the psum alone
#   latency     engine TTFT / TPOT, Qwen3-8B tp 1 vs $TP and Qwen3-30B-A3B one GPU vs ep $TP, batch $BATCHES; at $TP
#               both with XLA's collectives and with the one-shot kernels (files *_ar.json)
#   throughput  offline 512 prompts x 1k in / 128 out, the same pairs
#   cbmode      Qwen3-8B TPOT at tp 1 and $TP with XLA's command buffers keeping their buffers' addresses by VMM
#               remapping (--xla_gpu_command_buffer_update_mode=SKIP_TEMP | SKIP_PROFILED, XLA's VMM allocator) against
#               the default, batch $BATCHES ($CB_MODES, $CB_TP, $CB_SHAPE)
#   profile     a Perfetto trace of the Qwen3-8B decode step at tp 1 and $TP (batch 1), summarized per device
#   multiprocess $MP_SHAPE (Qwen3-8B) TPOT with one process per GPU ($TP processes, jax.distributed) vs one process, and whether
#               both gave the same greedy tokens (MP_ONE_PROCESS=0: the processes only)
#   hostprof    where the host's time of a batch-1 decode step goes ($MP_SHAPE, benchmarks/host_profile.py: cProfile and
#               XLA's host events): process 0 of a $TP-process group, and one GPU
#   serve_tp    `jinfer serve dummy:$SERVE_SHAPE -tp $TP` (Qwen3-8B), one process per GPU (mp) vs one process (uni): the
#               time to full speed and serving at saturation (512 x 1k / 128)
#   dp          serving at saturation, Qwen3-4B: one replica vs $TP replicas (--data-parallel-size) behind one server
# JSON lands in $OUT; $TAG names the machine in the file names (default h200x2).
set -uo pipefail
source benchmarks/gpu_env.sh
source benchmarks/per_gpu.sh
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared machine
PARTS=${PARTS:-tests,step,latency,throughput,profile,multiprocess,dp}
TAG=${TAG:-h200x2}
TP=${TP:-2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $PARTS == *kernels* ]]; then
  JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_all_reduce.py -p no:cacheprovider -x 2>&1 | tail -25
fi
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 python3 -m pytest -q tests/models/test_parallel_golden.py -p no:cacheprovider \
      > "$OUT/tests_parallel_$TAG.log" 2>&1; tail -3 "$OUT/tests_parallel_$TAG.log"
fi
STEP_SHAPES=${STEP_SHAPES:-dense,moe}
if [[ $PARTS == *step* && $STEP_SHAPES == *dense* ]]; then
  PYTHONFAULTHANDLER=1 timeout -s ABRT ${STEP_TIMEOUT:-400} python3 -m benchmarks.bench_parallel --shape qwen3-8b \
      --tp ${STEP_TP:-1 $TP} --batch-sizes ${STEP_BATCHES:-1 16} ${STEP_ARGS:-} \
      ${VARIANTS:+--variants $VARIANTS} --out "$OUT/parallel_step_qwen3-8b_$TAG.json" 2>&1 \
      | grep -E "^\{'|^(Fatal|Thread|Current thread|  File)" | grep -v "site-packages/jax/_src" | head -60
fi
if [[ $PARTS == *step* && $STEP_SHAPES == *moe* ]]; then
  timeout 400 python3 -m benchmarks.bench_parallel --shape qwen3-30b-a3b --tp 1 $TP --expert-parallel \
      --batch-sizes 1 16 ${MOE_VARIANTS:+--variants $MOE_VARIANTS} --out "$OUT/parallel_step_qwen3-30b-a3b_$TAG.json" \
      2>&1 | grep "^{'"
fi
SHAPES=${SHAPES:-dense,moe}  # for latency and throughput
if [[ $PARTS == *latency* && $SHAPES == *dense* ]]; then
  for tp in ${LAT_TPS:-1 $TP ${TP}_ar}; do
    JINFER_ONE_SHOT_ALL_REDUCE_BYTES=$([[ $tp == *_ar ]] && echo 1048576 || echo 0) \
    JINFER_ONE_SHOT_ALL_GATHER_BYTES=$([[ $tp == *_ar ]] && echo 1048576 || echo 0) timeout 300 \
      python3 -m benchmarks.bench_latency --shape qwen3-8b --batch-sizes ${BATCHES:-1 16} -tp ${tp%_ar} \
        --input-len 1024 --output-len 128 --out "$OUT/latency_qwen3-8b_tp${tp}_$TAG.json" | grep "^batch"
  done
fi
if [[ $PARTS == *latency* && $SHAPES == *moe* ]]; then
  for ep in ${LAT_TPS:-1 $TP ${TP}_ar}; do
    JINFER_ONE_SHOT_ALL_REDUCE_BYTES=$([[ $ep == *_ar ]] && echo 1048576 || echo 0) \
    JINFER_ONE_SHOT_ALL_GATHER_BYTES=$([[ $ep == *_ar ]] && echo 1048576 || echo 0) timeout 400 \
      python3 -m benchmarks.bench_latency --shape qwen3-30b-a3b --batch-sizes ${BATCHES:-1 16} -tp ${ep%_ar} \
        $([ ${ep%_ar} -gt 1 ] && echo --enable-expert-parallel) --input-len 1024 --output-len 128 \
        --out "$OUT/latency_qwen3-30b-a3b_ep${ep}_$TAG.json" | grep "^batch"
  done
fi
if [[ $PARTS == *throughput* && $SHAPES == *dense* ]]; then
  for tp in 1 $TP; do
    timeout 400 python3 -m benchmarks.bench_throughput --model dummy:qwen3-8b --num-prompts 512 --input-len 1024 \
        --output-len 128 --warmup -tp $tp --out "$OUT/throughput_qwen3-8b_tp${tp}_${TAG}_512x1k.json" | grep "^throughput"
  done
fi
if [[ $PARTS == *throughput* && $SHAPES == *moe* ]]; then
  for ep in 1 $TP; do
    timeout 500 python3 -m benchmarks.bench_throughput --model dummy:qwen3-30b-a3b --num-prompts 512 --input-len 1024 \
        --output-len 128 --warmup -tp $ep $([ $ep -gt 1 ] && echo --enable-expert-parallel) \
        --out "$OUT/throughput_qwen3-30b-a3b_ep${ep}_${TAG}_512x1k.json" | grep "^throughput"
  done
fi
if [[ $PARTS == *cbmode* ]]; then
  # CB_MODES: allocator:update-mode pairs; SKIP_TEMP / SKIP_PROFILED keep the command buffers' buffers at stable
  # addresses by VMM remapping, which needs XLA's VMM allocator (XLA_PYTHON_CLIENT_ALLOCATOR=vmm)
  for tp in ${CB_TP:-1 $TP}; do
    for mode in ${CB_MODES:-default:ALWAYS_UPDATE vmm:SKIP_TEMP vmm:SKIP_PROFILED}; do
      XLA_PYTHON_CLIENT_ALLOCATOR=${mode%%:*} XLA_FLAGS="--xla_gpu_command_buffer_update_mode=${mode#*:}" timeout 300 \
        python3 -m benchmarks.bench_latency --shape ${CB_SHAPE:-qwen3-8b} --batch-sizes ${BATCHES:-1 16} -tp $tp \
          --input-len 1024 --output-len 128 --out "$OUT/latency_${CB_SHAPE:-qwen3-8b}_tp${tp}_cb${mode/:/_}_$TAG.json" \
          2>&1 | grep -E "^batch|Error|error:" | head -5
    done
  done
fi
if [[ $PARTS == *profile* ]]; then
  timeout 300 python3 -m benchmarks.bench_parallel --shape qwen3-8b --tp 1 $TP --batch-sizes 1 \
      --variants ${PROFILE_VARIANTS:-psum one_shot} --profile "$OUT/profile_parallel" --out "$OUT/parallel_profile_qwen3-8b_$TAG.json" 2>&1 | grep "^{'"
  for d in "$OUT"/profile_parallel/*/; do
    echo "== $d"; python3 -m benchmarks.trace_summary "$(find "$d" -name '*.trace.json.gz' | head -1)" --steps 30 --top ${TOP:-25}
  done
fi
if [[ $PARTS == *multiprocess* ]]; then
  MPS=${MP_SHAPE:-qwen3-8b}  # MP_ARGS: e.g. --enable-expert-parallel
  MP_ARGS=${MP_ARGS:-}
  latency_per_gpu $TP /tmp/multiprocess "$OUT/latency_${MPS}_tp${TP}_${TP}proc_$TAG.json" --shape $MPS \
      --batch-sizes ${BATCHES:-1 16} $MP_ARGS --input-len 1024 --output-len 128
  # the same layout in one process, and whether both gave the same greedy tokens (same prompts, same sums)
  # MP_1PROC_AR_BYTES: the one process's one-shot all-reduce limit (default 16 KB there, 1 MB in the group): equal
  # limits run the same reduction kernels in both layouts
  [[ ${MP_ONE_PROCESS:-1} == 1 ]] && env ${MP_1PROC_AR_BYTES:+JINFER_ONE_SHOT_ALL_REDUCE_BYTES=$MP_1PROC_AR_BYTES} \
      timeout 300 python3 -m benchmarks.bench_latency --shape $MPS --batch-sizes ${BATCHES:-1 16} -tp $TP \
      $MP_ARGS --input-len 1024 --output-len 128 --out "$OUT/latency_${MPS}_tp${TP}_1proc_$TAG.json" | grep "^batch"
  [[ ${MP_ONE_PROCESS:-1} == 1 ]] && python3 -c "import json, sys; a, b = (json.load(open(f))['rows'] for f in sys.argv[1:]); \
print('same tokens ($TP processes vs 1):', [x['tokens_sha_runs'] == y['tokens_sha_runs'] for x, y in zip(a, b)])" \
      "$OUT/latency_${MPS}_tp${TP}_${TP}proc_$TAG.json" "$OUT/latency_${MPS}_tp${TP}_1proc_$TAG.json"
fi
if [[ $PARTS == *hostprof* ]]; then
  MPS=${MP_SHAPE:-qwen3-8b}
  for tp in $TP 1; do
    HP="--shape $MPS --batch-size 1 --output-len 128 --top 40 --profile /tmp/hostprof$tp ${MP_ARGS:-}"
    if [[ $tp == 1 ]]; then
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m benchmarks.host_profile $HP --out "$OUT/host_profile_${MPS}_tp1_$TAG.txt" \
          > /tmp/hostprof1_rank0.log 2>&1
    else
      MODULE=host_profile latency_per_gpu $tp /tmp/hostprof$tp "$OUT/host_profile_${MPS}_tp${tp}_${tp}proc_$TAG.txt" $HP
    fi
    steps=$(grep -h "^trace" /tmp/hostprof${tp}_rank0.log | awk '{print $2}')
    grep -h "^median" /tmp/hostprof${tp}_rank0.log
    echo "== tp $tp: $steps steps"
    [[ -n $steps ]] && python3 -m benchmarks.trace_summary "$(find /tmp/hostprof$tp -name '*.trace.json.gz' | head -1)" \
        --steps $steps --top 30 | grep -v "^ *[0-9.]* + " | head -70
  done
fi
if [[ $PARTS == *serve_tp* ]]; then  # `jinfer serve -tp $TP`: one process per GPU (the default) against one process
  ARGS="--max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --log-level warning"
  for backend in ${BACKENDS:-mp uni}; do
    t0=$(date +%s.%N)
    python3 -m server.launcher dummy:${SERVE_SHAPE:-qwen3-8b} --port 8000 -tp $TP --distributed-executor-backend $backend \
        $ARGS > "$OUT/serve_tp${TP}_$backend.log" 2>&1 &
    SERVER=$!
    JAX_PLATFORMS=cpu python3 -m benchmarks.wait_ready --timeout 400 --interval 0.2 --full-speed
    echo "$backend: ready $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s after the launch"
    JAX_PLATFORMS=cpu timeout 300 python3 -m benchmarks.bench_serving --num-prompts 512 --input-len 1024 --output-len 128 \
        --vocab-size 151936 --warmup 16 --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $TP" \
        --out "$OUT/serving_${SERVE_SHAPE:-qwen3-8b}_tp${TP}_${backend}_${TAG}_saturation.json" | tail -1
    echo "$backend: followers while serving: $(ps -eo args | grep -c '[w]orker_proc')"
    kill -TERM $SERVER; wait $SERVER; sleep 2
    echo "$backend: stopped, followers left: $(ps -eo args | grep -c '[w]orker_proc')"
  done
fi
if [[ $PARTS == *dp* ]]; then
  ARGS="--max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --log-level warning"
  for dp in $TP 1; do  # the replicas compile together first; the single replica then starts warm
    python3 -m server.launcher dummy:qwen3-4b --port 8000 -dp $dp $ARGS > "$OUT/serve_dp$dp.log" 2>&1 &
    SERVER=$!
    JAX_PLATFORMS=cpu python3 -m benchmarks.wait_ready --timeout 400 --interval 0.2 --full-speed
    JAX_PLATFORMS=cpu timeout 300 python3 -m benchmarks.bench_serving --num-prompts 512 --input-len 1024 --output-len 128 \
        --vocab-size 151936 --warmup 16 --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $dp" \
        --out "$OUT/serving_qwen3-4b_dp${dp}_${TAG}_saturation.json" | tail -1
    kill -TERM $SERVER; wait $SERVER
  done
fi

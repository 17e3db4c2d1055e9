#!/usr/bin/env bash
# XLA's GPU allocator and command-buffer update mode, A/B on engine TPOT (one GPU). A command buffer (CUDA graph)
# records device addresses; when an execution's temp buffer lands elsewhere than the last one's, XLA re-records
# every command that uses it (~1 ms a step for Qwen3-8B's 297 commands). VARIANTS (space list) of:
#   default      the engine's own choice (jinfer/engine/spawn.py set_jax_env_defaults: CUDA's stream-ordered pool)
#   bfc          XLA's default allocator (BFC)
#   cuda_async   CUDA's stream-ordered pool, set from outside
#   skip_temp    --xla_gpu_command_buffer_update_mode=SKIP_TEMP: temps at stable virtual addresses (VMM allocator)
#   vmm          XLA's VMM allocator alone
#   deterministic  CUDA's pool without opportunistic reuse (TF_DETERMINISTIC_ALLOCATOR=1)
# PARTS (comma list; default latency):
#   latency    for every round, variant and shape (SHAPES): bench_latency at BATCHES; $OUT/alloc_latency_<shape>.json
#              (benchmarks/latency_summary.py: every process, TPOT and TTFT medians, each variant over the first)
#   cbupdates  XLA's log of command-buffer updates during a batch-$CB_BATCH (default 1) decode (host_profile, variant
#              $CB_VARIANT, default the engine's; CB_SEQS: its max_num_seqs, e.g. 1 as bench_latency's at batch 1): how
#              often a step's command buffer is re-recorded, for how many allocations and commands, and in how many us;
#              $OUT/command_buffer_updates_<shape>_b<batch>_<variant>.txt
#   alloctrace for every variant and shape: a batch-$CB_BATCH decode of 48 tokens with the CUDA pool's allocations and
#              frees and the command-buffer updates logged: which allocation sits where the last step's temp buffer was
#              (benchmarks/cb_alloc_trace.py; allocations under CB_MIN_SIZE bytes, default 64 KiB, only counted);
#              $OUT/cb_alloc_trace_<shape>_b<batch>_<variant>.txt
#   hostprof   for every variant and shape: a batch-$CB_BATCH decode's host events per step (host_profile --profile, then
#              trace_summary: the execution, command buffer update and cuGraphLaunch) and the GPU's busy time;
#              $OUT/host_trace_<shape>_b<batch>_<variant>.txt
# SPEC=K:P (cbupdates, alloctrace, hostprof): speculative decoding with the replay drafter, K drafts accepted each with
# probability P (host_profile --replay-acceptance); their files get the suffix _spec. SPEC_METHOD=mtp (or eagle3 with
# SPEC_MODEL=DIR): that method's head drafting, its verifications' outcomes forced at P (suffix _spec_<method>).
#   ROUNDS=3 SHAPES="qwen3-8b-fp8 qwen3-8b" bash benchmarks/run_gpu_alloc.sh
set -uo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-latency}; VARIANTS=${VARIANTS:-default bfc skip_temp}; SHAPES=${SHAPES:-qwen3-8b-fp8 qwen3-8b}
ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1 8}; TIMEOUT=${TIMEOUT:-120}; OUTPUT_LEN=${OUTPUT_LEN:-128}; CB_BATCH=${CB_BATCH:-1}
CB_VARIANT=${CB_VARIANT:-default}
# (CB_VMODULE with command_buffer_cmd=5 also logs every recorded kernel argument's allocation slice and address: which
# allocation moved between two updates; the whole log stays in /tmp/vlog_<shape>.txt)
CB_VMODULE=${CB_VMODULE:-command_buffer_thunk=3,command_executor=1}
mkdir -p /tmp/allocab
HP=(); SFX=""
if [[ -n ${SPEC:-} ]]; then
  M=${SPEC_METHOD:-ngram}; MODEL=${SPEC_MODEL:+, \"model\": \"$SPEC_MODEL\"}
  HP=(--speculative-config "{\"method\": \"$M\", \"num_speculative_tokens\": ${SPEC%%:*}$MODEL}" --replay-acceptance "${SPEC#*:}")
  SFX=_spec${SPEC_METHOD:+_$SPEC_METHOD}
fi
variant_env() {
  case $1 in
    default) ;;
    bfc) echo "XLA_PYTHON_CLIENT_ALLOCATOR=bfc" ;;
    cuda_async) echo "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async" ;;
    skip_temp) echo "XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP" ;;
    vmm) echo "XLA_PYTHON_CLIENT_ALLOCATOR=vmm" ;;
    deterministic) echo "TF_DETERMINISTIC_ALLOCATOR=1" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
if [[ $PARTS == *cbupdates* ]]; then
  for s in $SHAPES; do
    env $(variant_env "$CB_VARIANT") TF_CPP_VMODULE=$CB_VMODULE TF_CPP_MIN_LOG_LEVEL=0 \
      timeout "$TIMEOUT" \
      python3 -m benchmarks.host_profile --shape "$s" --batch-size "$CB_BATCH" ${CB_SEQS:+--max-num-seqs "$CB_SEQS"} \
      --output-len 64 --runs 1 --top 3 "${HP[@]}" \
      > "/tmp/vlog_$s.txt" 2>&1
    { grep -E "^median" "/tmp/vlog_$s.txt"; grep -E "Update command buffer|Updated [0-9]+ commands" "/tmp/vlog_$s.txt" \
      | sed 's/^.*\] //' | sort | uniq -c | sort -rn; } > "$OUT/command_buffer_updates_${s}_b${CB_BATCH}_$CB_VARIANT$SFX.txt"
    echo "== $s"; head -8 "$OUT/command_buffer_updates_${s}_b${CB_BATCH}_$CB_VARIANT$SFX.txt"
  done
fi
if [[ $PARTS == *alloctrace* ]]; then
  for v in $VARIANTS; do
    for s in $SHAPES; do
      t=/tmp/atrace_$s@$v.txt; f=cb_alloc_trace_${s}_b${CB_BATCH}_$v$SFX
      env $(variant_env "$v") TF_CPP_VMODULE=command_buffer_thunk=3,gpu_cudamallocasync_allocator=10 \
        TF_CPP_MIN_LOG_LEVEL=0 JINFER_STEP_MARK=1 timeout "$TIMEOUT" python3 -m benchmarks.host_profile --shape "$s" \
        --batch-size "$CB_BATCH" --output-len 48 --runs 1 --top 3 "${HP[@]}" > "$t" 2>&1
      { grep -E "^median" "$t"; python3 -m benchmarks.cb_alloc_trace "$t" --steps 60 --min-size "${CB_MIN_SIZE:-65536}"; } \
        > "$OUT/$f.txt" 2>&1
      grep -E "Allocated|Freed ptr|command buffer|== " "$t" | gzip > "$OUT/$f.log.gz"  # (the raw events, for a re-read)
      echo "== $s $v"; head -12 "$OUT/$f.txt"
    done
  done
fi
if [[ $PARTS == *hostprof* ]]; then
  for v in $VARIANTS; do
    for s in $SHAPES; do
      rm -rf "/tmp/hp_$s@$v"
      env $(variant_env "$v") timeout "$TIMEOUT" python3 -m benchmarks.host_profile --shape "$s" --batch-size "$CB_BATCH" \
        --output-len 128 --runs 1 --top 3 "${HP[@]}" --profile "/tmp/hp_$s@$v" > "/tmp/hp_$s@$v.log" 2>&1
      steps=$(grep -h "^trace" "/tmp/hp_$s@$v.log" | awk '{print $2}')
      { grep -h "^median" "/tmp/hp_$s@$v.log"
        [[ -n $steps ]] && python3 -m benchmarks.trace_summary "$(find "/tmp/hp_$s@$v" -name '*.trace.json.gz' | head -1)" \
          --steps "$steps" --top 12; } > "$OUT/host_trace_${s}_b${CB_BATCH}_$v$SFX.txt" 2>&1
      echo "== $s $v"; head -16 "$OUT/host_trace_${s}_b${CB_BATCH}_$v$SFX.txt"
    done
  done
fi
[[ $PARTS == *latency* ]] || exit 0
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    for s in $SHAPES; do
      env $(variant_env "$v") timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$s" --batch-sizes $BATCHES \
        --input-len 1024 --output-len "$OUTPUT_LEN" --repeat 1 --out "/tmp/allocab/${s}@${v}_$r.json" 2>&1 \
        | grep -E "^batch|Error" | sed "s/^/[$s $v $r] /"
    done
  done
  for s in $SHAPES; do  # after every round (time limits)
    python3 -m benchmarks.latency_summary "$OUT/alloc_latency_${s}.json" \
      $(for v in $VARIANTS; do echo "$v=/tmp/allocab/${s}@${v}_*.json"; done) > /dev/null
  done
done
for s in $SHAPES; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps({k: v for k, v in d.items() if k.startswith('median_over')}))" "$OUT/alloc_latency_${s}.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, c['tpot_ms']) for k, c in d['configurations'].items()]" "$OUT/alloc_latency_${s}.json"
done

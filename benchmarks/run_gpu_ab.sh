#!/usr/bin/env bash
# A/B of two source trees on one GPU machine, in one device call: the decode step (bench_local_step) and engine
# latency (bench_latency), processes alternating between the trees, so both sides see the same machine state.
#   BASE=.base ROUNDS=3 bash benchmarks/run_gpu_ab.sh qwen3-4b qwen3-30b-a3b
# BASE is the other tree (e.g. `git archive <commit> | tar -x -C .base`, carried to the device as an ignored path);
# the current tree is "new". Writes $OUT/ab_<shape>.json (every process's rows, per tree) via benchmarks/ab_summary.py,
# and every process's whole log in $OUT/ab_<shape>_logs.txt. SPEC=JSON (with REPLAY=P): bench_latency with that
# --speculative-config (and --replay-acceptance P). BENCHES with "hostprof": in round 1 each tree's host_profile --profile
# at the first batch size (max_num_seqs as bench_latency's; the base tree needs host_profile's --max-num-seqs), read by
# this tree's trace_summary (busy time, the device's gaps by the kernels around them) into $OUT/host_trace_<shape>_<side>.txt.
set -uo pipefail
source benchmarks/gpu_env.sh
BASE=${BASE:?set BASE to the other tree}
ROUNDS=${ROUNDS:-3}
BATCHES=${BATCHES:-1 8 32}
OUTPUT_LEN=${OUTPUT_LEN:-64}
LOCAL_TIMEOUT=${LOCAL_TIMEOUT:-300}  # seconds per process
LATENCY_TIMEOUT=${LATENCY_TIMEOUT:-400}
BENCHES=${BENCHES:-local latency}  # which of the two to run
NEW=$PWD
SPEC_ARGS=(); [[ -z ${SPEC:-} ]] || SPEC_ARGS=(--speculative-config "$SPEC" ${REPLAY:+--replay-acceptance "$REPLAY"})
mkdir -p /tmp/ab /tmp/ab_logs
for shape in "$@"; do
  for r in $(seq "$ROUNDS"); do
    for side in base new; do
      tree=$NEW; [ "$side" = base ] && tree=$(cd "$BASE" && pwd)
      ( cd "$tree" && export PYTHONPATH=/tmp/site:$tree JINFER_COMPILATION_CACHE=/tmp/jinfer-xla-$side &&
        [[ " $BENCHES " != *" local "* ]] || { timeout "$LOCAL_TIMEOUT" python3 -m benchmarks.bench_local_step --shape "$shape" --tp 1 --batch-sizes $BATCHES \
          --table-pages 128 --runs 3 --out "/tmp/ab/${side}_local_${shape}_$r.json" > "/tmp/ab_logs/${side}_local_${shape}_$r.log" 2>&1 ;
        grep -E "^\{|Error" "/tmp/ab_logs/${side}_local_${shape}_$r.log" ; }
        [[ " $BENCHES " != *" latency "* ]] || { timeout "$LATENCY_TIMEOUT" python3 -m benchmarks.bench_latency --shape "$shape" --batch-sizes $BATCHES --input-len 1024 \
          --output-len "$OUTPUT_LEN" --repeat 1 "${SPEC_ARGS[@]}" --out "/tmp/ab/${side}_latency_${shape}_$r.json" \
          > "/tmp/ab_logs/${side}_latency_${shape}_$r.log" 2>&1 ;
        grep -E "^batch|Error" "/tmp/ab_logs/${side}_latency_${shape}_$r.log" ; }
        [[ " $BENCHES " != *" hostprof "* || $r != 1 ]] || { rm -rf "/tmp/hp_$side"; b=${BATCHES%% *}
          timeout "$LATENCY_TIMEOUT" python3 -m benchmarks.host_profile --shape "$shape" --batch-size "$b" --max-num-seqs "$b" \
            --output-len "$OUTPUT_LEN" --runs 1 --top 30 "${SPEC_ARGS[@]}" --profile "/tmp/hp_$side" \
            > "/tmp/ab_logs/${side}_hostprof_${shape}_$r.log" 2>&1
          steps=$(grep -h "^trace" "/tmp/ab_logs/${side}_hostprof_${shape}_$r.log" | awk '{print $2}')
          [[ -z $steps ]] || PYTHONPATH=/tmp/site:$NEW python3 -m benchmarks.trace_summary \
            "$(find "/tmp/hp_$side" -name '*.trace.json.gz' | head -1)" --steps "$steps" --top 30 > "$OUT/host_trace_${shape}_$side.txt" 2>&1
          grep -E "^median|Error" "/tmp/ab_logs/${side}_hostprof_${shape}_$r.log"; grep -A4 "device:GPU:0:" "$OUT/host_trace_${shape}_$side.txt"; }
      ) | sed "s/^/[$shape $side $r] /"
    done
    python3 benchmarks/ab_summary.py /tmp/ab "$shape" > "$OUT/ab_${shape}.json"  # after every round (time limits)
    for f in /tmp/ab_logs/*_"${shape}"_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/ab_${shape}_logs.txt"
    ls /tmp/ab
  done
done

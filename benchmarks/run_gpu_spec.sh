#!/usr/bin/env bash
# Speculative decoding's engine cost on one GPU: TPOT of plain decode (async and synchronous) and with the replay
# drafter (jinfer/spec/replay.py) at k drafts, each accepted with probability P (mean acceptance length
# 1 + P + ... + P^k; P = 0.742 at k = 4 gives 3.0), on dummy weights, one process per configuration, ROUNDS rounds.
#   SHAPE=qwen3-8b K=4 P=0.742 ROUNDS=3 bash benchmarks/run_gpu_spec.sh
set -uo pipefail
source benchmarks/gpu_env.sh
SHAPE=${SHAPE:-qwen3-8b}; K=${K:-4}; P=${P:-0.742}; ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1 32}
OUTPUT_LEN=${OUTPUT_LEN:-128}; TIMEOUT=${TIMEOUT:-300}
SPEC="{\"method\": \"ngram\", \"num_speculative_tokens\": $K}"
for r in $(seq "$ROUNDS"); do
  for mode in plain sync replay; do
    extra=(); case $mode in sync) extra=(--no-async-scheduling);;
      replay) extra=(--speculative-config "$SPEC" --replay-acceptance "$P");; esac
    timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes $BATCHES --input-len 1024 \
      --output-len "$OUTPUT_LEN" --repeat 1 "${extra[@]}" --out "$OUT/spec_${SHAPE}_${mode}_$r.json" 2>&1 \
      | grep -E "^batch|Error" | sed "s/^/[$mode $r] /"
  done
done

#!/usr/bin/env bash
# Speculative decoding's engine cost on one GPU: TPOT of plain decode (async and synchronous) and with the replay
# drafter (jinfer/spec/replay.py) at k drafts, each accepted with probability P (mean acceptance length
# 1 + P + ... + P^k; P = 0.742 at k = 4 gives 3.0), on dummy weights, one process per configuration, ROUNDS rounds:
# $OUT/spec_<shape>.json (every process, the medians, each mode over plain; benchmarks/latency_summary.py).
# replay_ragged: the replay drafter with verify steps on the ragged prefill kernel (JINFER_VERIFY_MAX_QUERY_LEN=0), the
# A/B of the verify steps' paged decode kernel. MODES="plain replay" skips the synchronous plain decode and the A/B.
# mtp: a Qwen3.5 shape's MTP layer (random) drafting K tokens, each verification's outcome forced at P as replay's;
# eagle: a random EAGLE-3 head at the shape's layer shapes (speculative_config.model "dummy") the same way.
# mtp_fp8, eagle_fp8: the same heads with speculative_config.quantization "fp8" (the head's weights in block FP8).
#   SHAPE=qwen3-8b K=4 P=0.742 ROUNDS=3 bash benchmarks/run_gpu_spec.sh
#   SHAPE=qwen3.5-4b K=1 P=0.8 MODES="plain mtp" BATCHES=1 ROUNDS=3 bash benchmarks/run_gpu_spec.sh
#   SHAPE=qwen3-8b K=4 P=0.742 MODES="plain eagle" ROUNDS=3 bash benchmarks/run_gpu_spec.sh
#   SHAPE=qwen3-8b K=4 P=0.742 MODES="plain eagle_fp8" ROUNDS=3 bash benchmarks/run_gpu_spec.sh
set -uo pipefail
source benchmarks/gpu_env.sh
SHAPE=${SHAPE:-qwen3-8b}; K=${K:-4}; P=${P:-0.742}; ROUNDS=${ROUNDS:-3}; BATCHES=${BATCHES:-1 32}
OUTPUT_LEN=${OUTPUT_LEN:-128}; TIMEOUT=${TIMEOUT:-300}; MODES=${MODES:-plain sync replay replay_ragged}
mkdir -p /tmp/spec
SPEC="{\"method\": \"ngram\", \"num_speculative_tokens\": $K}"
for r in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    extra=(); policy=(); q=""; [[ $mode == *_fp8 ]] && q=', "quantization": "fp8"'
    case $mode in sync) extra=(--no-async-scheduling);;
      replay) extra=(--speculative-config "$SPEC" --replay-acceptance "$P");;
      replay_ragged) extra=(--speculative-config "$SPEC" --replay-acceptance "$P"); policy=(JINFER_VERIFY_MAX_QUERY_LEN=0);;
      mtp|mtp_fp8) extra=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $K$q}"
                          --replay-acceptance "$P");;
      eagle|eagle_fp8) extra=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"dummy\", \"num_speculative_tokens\": $K$q}"
                    --replay-acceptance "$P");;
    esac
    env "${policy[@]}" timeout "$TIMEOUT" python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes $BATCHES --input-len 1024 \
      --output-len "$OUTPUT_LEN" --repeat 1 "${extra[@]}" --out "/tmp/spec/${SHAPE}_${mode}_$r.json" 2>&1 \
      | grep -E "^batch|Error" | sed "s/^/[$mode $r] /"
  done
  python3 -m benchmarks.latency_summary "$OUT/spec_${SHAPE}.json" $(for m in $MODES; do echo "$m=/tmp/spec/${SHAPE}_${m}_[0-9]*.json"; done)
done

#!/usr/bin/env bash
# On the GPU machine (device tool, carrying .whl): Qwen3.5 (hybrid Gated DeltaNet + gated attention) on one GPU.
# PARTS (comma list, default all):
#   tests       the Gated DeltaNet kernel tests compiled for the GPU (recurrent, intra-chunk, chunked, gated norm), then
#               the tiny HF goldens through the kernels
#   kernels     the recurrent delta-rule kernel alone at Qwen3.5-4B's shapes: decode batches 1..256 (TB/s on state
#               bytes), one-sequence prefills of 1k and 16k tokens (TFLOP/s), block_v 16 / 32 / 64 (gdn_kernels_*.json);
#               then the chunked (WY) prefill form on 1k and 16k tokens: whole, its XLA intra-chunk part and
#               its recurrence kernel alone, block_v 16 / 32 / 64, 4 / 8 warps, TF32 / exact f32 dots
#               (gdn_chunked_*.json; TFLOP/s of the rule's 6 Hv Dk Dv FLOPs per token, as the recurrent one's;
#               time_us with the fused intra-chunk kernel, time_jnp_intra_us with XLA's)
#   intra       the intra-chunk part alone on 1k and 16k tokens: XLA's (product form, triangular solve) vs
#               the fused kernel: 4 / 8 warps, diagonal-block inverse by products / substitution, bf16 / f32
#               parts, TF32 / exact dots; time, GB/s of its least HBM traffic, error vs XLA's solve
#               (gdn_intra_*.json)
#   decode      one linear layer's decode step: the fused conv + gates + delta rule (+ gated norm) kernel (warps)
#               against the general path (XLA conv + recurrent kernel + gated norm), batches 1..256, TB/s on state
#               bytes (gdn_decode_*.json); the ragged causal conv kernel against XLA's form over prefill, mixed
#               and decode steps (gdn_conv_*.json); then the decode MLP over 32 layers at T = 1: the fused kernel's norm
#               prologue variants against XLA, GPU kernel time from a profile (decode_mlp_variants_*.json)
#   profile     a profiled batch-1 decode (1k context) and its summary: GPU busy per step, kernels by time
#   latency     engine TPOT / TTFT at batch 1, 1k in / 128 out, against the roofline measured in the same run
#   long        TTFT of one 16k-token prompt (chunked by max_num_batched_tokens)
#   throughput  offline $PROMPTS prompts x $IN in / $OUT_LEN out, $MNBT tokens a step (default 8192: 2048 leaves the
#               decode rows of every step to the recurrent kernel and the prefill kernels one or two sequences a
#               launch, 34.5k vs 40.5k tok/s; README)
# JSON lands in $OUT (copy to benchmarks/results/); $TAG names the device in the file names (default h100).
# SHAPE: a named shape (default qwen3.5-4b) or a model directory; on CPU, to check the script:
#   OUT=/tmp/q35 SHAPE=tests/data/tiny-qwen3_5 IN=32 OUT_LEN=8 LONG=64 PROMPTS=8 bash benchmarks/run_gpu_qwen35.sh
set -uo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-tests,kernels,intra,decode,latency,long,throughput,profile}
TAG=${TAG:-h100}
SHAPE=${SHAPE:-qwen3.5-4b}
NAME=$(basename "$SHAPE")
MODEL=$([[ $SHAPE == */* ]] && echo "$SHAPE" || echo "dummy:$SHAPE")
IN=${IN:-1024}
OUT_LEN=${OUT_LEN:-128}
LONG=${LONG:-16384}
PROMPTS=${PROMPTS:-512}
MNBT=${MNBT:-8192}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
if [[ $PARTS == *tests* ]]; then
  JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} timeout 600 python3 -m pytest -q -m gpu tests/kernels/test_gated_delta_rule.py \
      tests/kernels/test_gated_delta_rule_intra.py tests/kernels/test_gated_delta_rule_chunked.py \
      tests/kernels/test_gated_delta_rule_decode.py tests/kernels/test_causal_conv.py \
      tests/kernels/test_gated_rms_norm.py -p no:cacheprovider 2>&1 | tail -4
  # the goldens with the kernels compiled natively (f32 dots may run as TF32 there: informative)
  timeout 600 python3 -m pytest -q tests/models/test_golden_qwen3_5.py -k pallas -p no:cacheprovider 2>&1 | tail -4
fi
if [[ $PARTS == *kernels* ]]; then
  timeout 900 python3 -m benchmarks.kernels.bench_linear_attention recurrent > "$OUT/gdn_kernels_$TAG.json"
  cat "$OUT/gdn_kernels_$TAG.json"
  timeout 900 python3 -m benchmarks.kernels.bench_linear_attention chunked > "$OUT/gdn_chunked_$TAG.json"
  cat "$OUT/gdn_chunked_$TAG.json"
fi
if [[ $PARTS == *intra* ]]; then
  timeout 900 python3 -m benchmarks.kernels.bench_linear_attention intra > "$OUT/gdn_intra_$TAG.json"
  cat "$OUT/gdn_intra_$TAG.json"
fi
if [[ $PARTS == *decode* ]]; then
  timeout 900 python3 -m benchmarks.kernels.bench_linear_attention_decode decode > "$OUT/gdn_decode_$TAG.json"
  cat "$OUT/gdn_decode_$TAG.json"
  timeout 600 python3 -m benchmarks.kernels.bench_linear_attention_decode conv > "$OUT/gdn_conv_$TAG.json"
  cat "$OUT/gdn_conv_$TAG.json"
  timeout 600 python3 -m benchmarks.bench_decode_mlp --shapes qwen3.5-4b --block-i 128 --num-warps 8 --num-stages 3 \
      --profile /tmp/decode_mlp_profile --out "$OUT/decode_mlp_variants_$TAG.json" | grep "'shape'"
fi
if [[ $PARTS == *profile* ]]; then
  rm -rf /tmp/decode_profile
  timeout 900 python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes 1 --input-len "$IN" --output-len 64 \
      --profile /tmp/decode_profile --out "$OUT/latency_profiled_${NAME}_$TAG.json" | grep "^batch"
  trace=$(find /tmp/decode_profile -name "*.trace.json.gz" | head -1)
  cp "$trace" "$OUT/profile_decode_b1_${NAME}_$TAG.trace.json.gz"
  python3 -m benchmarks.trace_summary "$trace" --top 30 | sed -n '1p;/GPU time per step/,$p'
fi
if [[ $PARTS == *latency* ]]; then
  timeout 900 python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes ${BATCHES:-1} \
      --input-len "$IN" --output-len "$OUT_LEN" --out "$OUT/latency_${NAME}_$TAG.json" | grep "^batch"
fi
if [[ $PARTS == *long* ]]; then
  timeout 900 python3 -m benchmarks.bench_latency --shape "$SHAPE" --batch-sizes 1 --input-len "$LONG" \
      --output-len 8 --out "$OUT/latency_${NAME}_${TAG}_16k.json" | grep "^batch"
fi
if [[ $PARTS == *throughput* ]]; then
  timeout 900 python3 -m benchmarks.bench_throughput --model "$MODEL" --num-prompts "$PROMPTS" --input-len "$IN" \
      --output-len "$OUT_LEN" --max-num-batched-tokens "$MNBT" --warmup \
      --out "$OUT/throughput_${NAME}_${TAG}_${PROMPTS}x${IN}_mnbt${MNBT}.json" | grep "^throughput"
fi

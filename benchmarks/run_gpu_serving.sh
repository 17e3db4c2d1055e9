#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): `jinfer serve` with a Qwen3-4B-shaped dummy model:
# start-up (first run cold, then warm executable/compilation caches) and idle RSS per process
# (bench_startup), then the serving benchmark at 16 req/s (1k in / 128 out) against a warm server.
# HF_PEER=1 also runs the HF transformers peers (generate(), and the StaticCache + torch.compile decode loop).
# Results in $OUT.
set -uo pipefail
source benchmarks/gpu_env.sh
ARGS="--max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048"
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader)

if [ "${HF_PEER:-0}" = 1 ]; then
  python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 32 \
      --out "$OUT/hf_peer_qwen3-4b_h100.json" 2>&1 | grep -E "^HF|Error"
  # #17's decode peer: StaticCache + torch.compile(mode="reduce-overhead") decode loop, gpt-fast style
  python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 8 32 \
      --static-compile --out "$OUT/hf_peer_static_compile_qwen3-4b_h100.json" 2>&1 | grep -E "^HF|Error|fullgraph"
fi

python3 -m benchmarks.bench_startup --model dummy:qwen3-4b --runs 3 --probe-tokens 1000 --out "$OUT/startup_qwen3-4b_h100.json" \
    -- $ARGS | tail -1

python3 -m server.launcher dummy:qwen3-4b --port 8000 $ARGS --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
JAX_PLATFORMS=cpu python3 -m benchmarks.wait_ready --timeout 600 --interval 0.2
JAX_PLATFORMS=cpu python3 -m benchmarks.bench_serving --num-prompts 160 --input-len 1024 --output-len 128 \
    --request-rate 16 --vocab-size 151936 --warmup 8 --device "$DEVICE" \
    --out "$OUT/serving_qwen3-4b_h100_rate16.json" | tail -1
kill -TERM $SERVER; wait $SERVER

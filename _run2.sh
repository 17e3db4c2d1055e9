source benchmarks/gpu_env.sh
export OUT JINFER_COMMIT=02712eb PYTHONUNBUFFERED=1
ARGS="--max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048"
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo $DEVICE
python3 -m benchmarks.bench_startup --model dummy:qwen3-4b --runs 3 --probe-tokens 1000 --log-dir $OUT/startup_logs \
    --out "$OUT/startup_qwen3-4b_h100.json" -- $ARGS 2>&1 | grep -E "^run|jinfer serve"
python3 -m server.launcher dummy:qwen3-4b --port 8000 $ARGS --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
JAX_PLATFORMS=cpu python3 -m benchmarks.wait_ready --timeout 600 --interval 0.2
JAX_PLATFORMS=cpu python3 -m benchmarks.bench_serving --num-prompts 160 --input-len 1024 --output-len 128 \
    --request-rate 16 --vocab-size 151936 --warmup 8 --device "$DEVICE" \
    --out "$OUT/serving_qwen3-4b_h100_rate16.json" | tail -1
kill -TERM $SERVER; wait $SERVER

#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the HF transformers peer, then `jinfer serve`
# with a Qwen3-4B-shaped dummy model: cold and warm-cache start-up, idle RSS, and the serving
# benchmark at 16 req/s (1k in / 128 out). Results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JINFER_COMPILATION_CACHE=/tmp/jinfer-xla
OUT=${OUT:-benchmarks/results}
SERVE="python3 -m server.launcher dummy:qwen3-4b --port 8000 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --log-level warning"

python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 32 \
    --out "$OUT/hf_peer_qwen3-4b_h100.json" 2>&1 | grep -E "^HF|Error"

start_server() {  # prints seconds until /health answers 200
  $SERVE > "$OUT/serve_$1.log" 2>&1 &
  echo $! > /tmp/serve.pid
  JAX_PLATFORMS=cpu python3 - <<'PY'
import time, httpx
t = time.time()
while time.time() - t < 900:
    try:
        if httpx.get("http://127.0.0.1:8000/health", timeout=1).status_code == 200:
            print(f"{time.time() - t:.1f}"); break
    except httpx.HTTPError:
        pass
    time.sleep(0.2)
PY
}
stop_server() { kill -TERM "$(cat /tmp/serve.pid)"; wait "$(cat /tmp/serve.pid)" 2>/dev/null; }
rss_mb() {  # RSS of the launcher and its engine child, MB
  local p; p=$(cat /tmp/serve.pid)
  ps -o rss= -p "$p" $(pgrep -P "$p" | sed 's/^/-p /') | awk '{s+=$1} END {print s/1024}'
}

cold=$(start_server cold); echo "start-up, cold compile cache: ${cold} s"
JAX_PLATFORMS=cpu python3 -m benchmarks.bench_serving --num-prompts 160 --input-len 1024 --output-len 128 \
    --request-rate 16 --vocab-size 151936 --warmup 8 --device "$(nvidia-smi --query-gpu=name --format=csv,noheader)" \
    --out "$OUT/serving_qwen3-4b_h100_rate16.json" | tail -1
stop_server
warm=$(start_server warm); echo "start-up, warm compile cache: ${warm} s"
sleep 3; rss=$(rss_mb); echo "idle RSS (launcher + engine): ${rss} MB"
stop_server
printf '{"benchmark": "startup", "shape": "qwen3-4b", "cold_cache_s": %s, "warm_cache_s": %s, "idle_rss_mb": %s, "commit": "%s"}\n' \
    "${cold:-null}" "${warm:-null}" "${rss:-null}" "${JINFER_COMMIT:-unknown}" > "$OUT/startup_qwen3-4b_h100.json"
cat "$OUT/startup_qwen3-4b_h100.json"

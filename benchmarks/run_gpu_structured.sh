#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl with the llguidance wheel, and build/tokenizer-bench):
# the host cost of the structured-output masks per step at batch 1, 32 and 256, and the TPOT of a
# Qwen3-4B-shaped dummy model with and without a JSON schema (benchmarks/bench_structured.py).
# Before the run, where the default GGUF is (models/ is not carried):
#   python -m benchmarks.bench_structured export-tokenizer --out build/tokenizer-bench --vocab-size 151643
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl "llguidance>=1.9,<2"
# Results in $OUT/structured_qwen3-4b_h100.json.
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -c "import llguidance" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site .whl/llguidance-*.whl
TOKENIZER=${TOKENIZER:-build/tokenizer-bench}
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no $TOKENIZER/tokenizer.json: run export-tokenizer and carry it"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m benchmarks.bench_structured run --tokenizer "$TOKENIZER" --shape qwen3-4b --batch-sizes 1 32 256 --mask-schemas stress typical \
    --input-len 128 --output-len 128 --out "$OUT/structured_qwen3-4b_h100.json" | grep -E "^(masks|tpot)|Error"

#!/usr/bin/env bash
# On the H100 machine (device tool, carrying .whl): the KV host tier (--kv-offload-gb) on a Qwen3-4B-shaped
# dummy model, bf16: (a) a 16k-token prefix restored from host vs recomputed vs a warm HBM hit, and the
# restore's host-to-device rate against a plain pinned-host device_put; (b) warm-hit TTFT at 1k/16k/32k
# with its host phases and a profile of three warm hits per length; (c) 64 sessions x 8 turns of chat with
# the HBM pool at ~1/4 of the histories, with the tier and without.
# PARTS=p: probes of whether copies to / from pinned host memory hold up later computations.
# PARTS=b2 (or PARTS=abc,b2): part (b) again with XLA's command buffers (CUDA graphs) off, to see what the
# graph costs a lone step. JSONs in $OUT (copy them to benchmarks/results/). About 5-7 minutes (most of it
# compiles on a cold cache), plus ~2.5 minutes for b2.
set -euo pipefail
source benchmarks/gpu_env.sh
PARTS=${PARTS:-abc}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
summary() {  # the host phases and kernels of the profiled warm hits at one length ($OUT/profile_kv_warm$L...)
    cp "$(ls "$OUT/kv_profile/warm$1"/plugins/profile/*/*.trace.json.gz | head -1)" \
        "$OUT/profile_kv_warm$1_qwen3-4b_h100.trace.json.gz"
    python3 -m benchmarks.trace_summary "$OUT/profile_kv_warm$1_qwen3-4b_h100.trace.json.gz" --skip 0 --top 12 || true
}
if [[ $PARTS == *p* ]]; then  # the copy probes: does a copy to / from pinned host memory hold up the compute?
    python3 -m benchmarks.bench_kv_offload --parts p --out "$OUT/kv_copy_overlap_h100.json" | grep -v '^ \|^[{}]'
fi
if [[ $PARTS == *[abc]* ]]; then
    main=$(echo "$PARTS" | tr -cd 'abc')
    python3 -m benchmarks.bench_kv_offload --shape qwen3-4b --parts "$main" --profile "$OUT/kv_profile" \
        --out "$OUT/kv_offload_qwen3-4b_h100.json" | grep -v '^ \|^[{}]'
    [[ $main == *b* ]] && for L in 1024 32768; do echo "== profile, warm hit at $L"; summary $L; done
    rm -rf "$OUT/kv_profile"
fi
if [[ $PARTS == *b2* ]]; then
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" python3 -m benchmarks.bench_kv_offload \
        --shape qwen3-4b --parts b --out "$OUT/kv_offload_qwen3-4b_h100_no_graphs.json" | grep -v '^ \|^[{}]'
fi

#!/usr/bin/env bash
# On the GPU machine (device tool, carrying .whl): what the idle engine's host memory (#17: <= 1 GB) is made of,
# and what moves it. Builds the executables a staged warm start holds (every bucket of $MODEL) twice, as is and with
# XLA compiling each module in one piece (--xla_gpu_force_compilation_parallelism=1: fewer GPU code images, a longer
# compile), timing each build; then loads each set in fresh processes that have only started JAX's backend, as is,
# with CUDA_MODULE_LOADING=EAGER and with MALLOC_ARENA_MAX=2, recording RSS per executable and per mapped file
# (benchmarks/executable_memory.py). One JSON: $OUT/executable_memory_variants_${MODEL#dummy:}_$TAG.json.
# Then (STARTUP=1, the default) the idle RSS of `jinfer serve` itself, as is and with MALLOC_ARENA_MAX=2 in its
# environment (bench_startup, 3 runs each, 20 s idle so the staged warm-up's loads are done; the first run of the
# first set may be cold): $OUT/startup_memory_{default,arena2}_${MODEL#dummy:}_$TAG.json.
# On CPU, to check the script: OUT=/tmp/em MODEL=dummy:smollm2-135m bash benchmarks/run_gpu_memory.sh
set -uo pipefail
source benchmarks/gpu_env.sh
MODEL=${MODEL:-dummy:qwen3-4b}; TAG=${TAG:-h100}; WORK=${WORK:-/tmp/jinfer-exe-mem}
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"
build() {  # $1 = name, $2 = XLA_FLAGS for the build; prints the build's wall seconds
  local t0; t0=$(python3 -c 'import time; print(time.time())')
  XLA_FLAGS="$2" python3 -m benchmarks.executable_memory --model "$MODEL" --dir "$WORK/$1" --load-env "" \
      > /dev/null 2> "$WORK/$1.build.log" || { tail -20 "$WORK/$1.build.log" >&2; return 1; }
  python3 -c "import time; print(round(time.time() - $t0, 1))"
}
t_default=$(build default "") || exit 1
t_single=$(build single "--xla_gpu_force_compilation_parallelism=1") || t_single=null
python3 -m benchmarks.executable_memory --model "$MODEL" --dir "$WORK/default" --out "$WORK/default.json" \
    --load-env "" "CUDA_MODULE_LOADING=EAGER" "MALLOC_ARENA_MAX=2" > /dev/null
[ "$t_single" = null ] || python3 -m benchmarks.executable_memory --model "$MODEL" --dir "$WORK/single" \
    --out "$WORK/single.json" --load-env "" > /dev/null
python3 - "$WORK" "$OUT/executable_memory_variants_${MODEL#dummy:}_$TAG.json" "$t_default" "$t_single" <<'PY'
import json, os, subprocess, sys
work, out, t_default, t_single = sys.argv[1:]
res = {"model": os.environ.get("MODEL", "dummy:qwen3-4b"), "commit": os.environ.get("JINFER_COMMIT") or
       subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip() if os.path.exists("/usr/bin/nvidia-smi") else "cpu",
       "builds": {}}
for name, secs, flags in (("default", t_default, ""), ("single", t_single, "--xla_gpu_force_compilation_parallelism=1")):
    path = os.path.join(work, name + ".json")
    if os.path.exists(path):
        res["builds"][name] = {"xla_flags": flags, "build_seconds": None if secs == "null" else round(float(secs), 1),
                               "variants": json.load(open(path))["variants"]}
json.dump(res, open(out, "w"), indent=1)
for name, b in res["builds"].items():
    for env, v in b["variants"].items():
        print(f"{name:8s} build {b['build_seconds']} s  {env:24s} backend {v['backend_rss_mb']} MB  "
              f"+{v['rss_added_mb']} MB for {v['loaded']} executables, {v['cubin_images']} images "
              f"({v['rss_mb_per_image']} MB each)")
    v = b["variants"]["(as is)"]
    print("  backend:", v["rss_by_mapping_backend_mb"]); print("  after:  ", v["rss_by_mapping_after_mb"])
PY
if [ "${STARTUP:-1}" = 1 ]; then
  for v in default arena2; do
    env $([ $v = arena2 ] && echo MALLOC_ARENA_MAX=2) python3 -m benchmarks.bench_startup --model "$MODEL" --runs 3 \
        --idle-s 20 --out "$OUT/startup_memory_${v}_${MODEL#dummy:}_$TAG.json" -- --max-model-len 2048 | tail -1
  done
fi

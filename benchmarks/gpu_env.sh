# Sourced by the benchmarks/run_gpu_*.sh scripts on the H100 machine (device tool, carrying .whl):
# installs the carried wheels once, sets the environment and $OUT (default benchmarks/results).
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JINFER_COMPILATION_CACHE=/tmp/jinfer-xla
OUT=${OUT:-benchmarks/results}

# Sourced by the benchmarks/run_gpu_*.sh scripts. latency_per_gpu N LOG OUT [bench_latency args...]: bench_latency
# as N processes of one group, one GPU each (its own CUDA_VISIBLE_DEVICES: the layout `jinfer serve -tp N` runs),
# started last rank first; rank 0 writes OUT and also takes $R0_ARGS (e.g. "--profile DIR --profile-no-python").
# Logs go to LOG_rank<r>.log; prints rank 0's figures and the others' last lines. $RUN prefixes each command (the
# scripts' DRY=1 printer); $MODULE runs another benchmark with bench_latency's group arguments (host_profile).
latency_per_gpu() {
  local n=$1 log=$2 out=$3 r
  shift 3
  for r in $(seq $((n - 1)) -1 0); do
    local extra=()
    [[ $r == 0 ]] && extra=(--out "$out" ${R0_ARGS:-})
    ${RUN:-} env CUDA_VISIBLE_DEVICES=$r timeout 570 python3 -m benchmarks.${MODULE:-bench_latency} "$@" -tp "$n" --nnodes "$n" \
        --node-rank $r --master-port 29555 "${extra[@]}" > "${log}_rank$r.log" 2>&1 &
  done
  wait
  grep -E "^batch|^median|collectives: |Error" "${log}_rank0.log" | head -8
  tail -n 2 "$log"_rank[1-9].log
}

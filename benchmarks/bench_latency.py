"""Latency of the engine: TTFT and TPOT at batch sizes 1..N, input length L, output length O.

    python -m benchmarks.bench_latency --shape qwen3-4b --batch-sizes 1 8 32 --input-len 1024 --output-len 128

Drives EngineCore directly (no server): all requests of a batch arrive together; TTFT is the time
until every request of the batch has its first token, TPOT the mean time per later decode step
(p50/p99 over steps). Each batch size runs once untimed, so no compile lands in a figure, then
`--repeat` timed runs (default 3): the row is the run of median TPOT, with every run's TTFT and TPOT
beside it (`ttft_runs_ms`, `tpot_runs_ms`: two runs of one tree on one H100 differed by up to 0.6 ms at
batch 1). The decode roofline uses the bandwidth measured in the same run.

Speculative decoding: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` runs the engine with
it; with `--replay-acceptance P` the drafter is instead the benchmark-only replay drafter (jinfer/spec/replay.py),
which decides each verification's outcome (k drafts, each accepted with probability P up to the first rejection),
so the engine's TPOT at mean acceptance length 1 + P + ... + P^k is measured on dummy weights (whose own greedy
tokens a verification row does not reproduce). A model drafter (`"method": "mtp"` on dummy:qwen3.5-*, whose MTP layer
is random then; `"eagle3"`) keeps its head and does its device work; only the verifications' outcomes are forced
(jinfer/spec/replay.py `ForcedAcceptance`). With drafts TPOT is the decode time over the tokens per sequence
(a step emits several), `step_ms` the mean step.

Per step read back while decoding: `device_wait_ms_per_step` (the host blocked reading it back), `host_ms_per_step`
(the rest of the loop's time), and `serial_host_ms_per_step`, the host's time from a read-back to the next forward's
dispatch while no step is in flight (the device idles then: speculative decoding, `--no-async-scheduling`).

`--expert-load-stats` (MoE shapes): each row's `expert_load` has the decode steps' expert-load imbalance
(jinfer/engine/expert_load.py), mean and max over the steps: over the run's expert-parallel ranks (`imbalance_*`: 1.0
without expert parallel), over single experts, and what an ep = 2 / 4 / 8 split would see of the same routing
(`ep{R}_imbalance_*`); dummy weights route like random ones, a checkpoint as it does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import time

import numpy as np

from benchmarks.common import ReplayDrafts, add_profile_argument, environment, profiled, write_result
from benchmarks.roofline import (
    decode_bytes,
    decode_bytes_per_device,
    floors,
    measure_copy_bandwidth,
    measure_matmul,
    measure_torch_copy,
)
from jinfer.config.engine import EngineConfig
from jinfer.config.kernels import KernelPolicy
from jinfer.config.speculative import SpeculativeConfig
from jinfer.engine.args import compilation_cache_dir_from_env
from jinfer.engine.core import EngineCore
from jinfer.engine.expert_load import summarize
from jinfer.sampling_params import SamplingParams


def run_batch(core: EngineCore, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    counters = lambda: (core.device_wait_seconds_total, core.num_steps_total,  # noqa: E731
                        core.serial_host_seconds_total)
    loads = lambda: core.expert_load.steps if core.expert_load is not None else 0  # noqa: E731
    spec0 = core.spec.stats() if core.spec is not None else {}
    t0 = time.perf_counter()
    first_seen: set[str] = set()
    ttft = None
    step_times = []
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        t = time.perf_counter()
        outs = core.step()  # returns once a step's tokens reached the host (with async scheduling, the
        # previous step's, after this one was launched): the time between returns is the time per token
        step_times.append(time.perf_counter() - t)
        first_seen.update(o.request_id for o in outs if o.new_token_ids)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if ttft is None and len(first_seen) == len(prompts):
            ttft = time.perf_counter() - t0
            decode_start, decode0, load0 = len(step_times), counters(), loads()
    decode = np.asarray(step_times[decode_start:]) * 1e3
    # per step read back while decoding: the host blocked reading it (waiting for the device), the host's own time
    # (the rest), and of that the time from a read-back to the next forward's dispatch with no step in flight (the
    # device idles: speculative decoding, async scheduling off)
    wait, steps, serial = (b - a for a, b in zip(decode0, counters()))
    load = {}
    if core.expert_load is not None:  # the decode steps' expert load (the recorder keeps the last steps' summaries)
        n = min(loads() - load0, len(core.expert_load.history))
        load = {"expert_load": summarize(list(core.expert_load.history)[len(core.expert_load.history) - n:])}
    steps = max(steps, 1)
    spec = {}
    if core.spec is not None:  # a step emits several tokens: TPOT is the decode time per token of a sequence
        spec = {"step_ms": float(decode.mean()), "tpot_ms": float(decode.sum() / max(output_len - 1, 1)),
                **{k: v - spec0[k] for k, v in core.spec.stats().items()}}  # this run's counters
    # the greedy ids, hashed: two layouts of the same model (1 process x 2 GPUs, 2 x 1) must give the same
    digest = hashlib.sha1(json.dumps([tokens[f"{tag}-{i}"] for i in range(len(prompts))]).encode()).hexdigest()[:16]
    return {"ttft_ms": ttft * 1e3, "tpot_ms": float(decode.mean()), **spec, "tokens_sha": digest,
            "tpot_p50_ms": float(np.percentile(decode, 50)),
            "tpot_p99_ms": float(np.percentile(decode, 99)), "decode_steps": int(len(decode)),
            "decode_step_ms": [round(float(x), 3) for x in decode],
            "total_s": time.perf_counter() - t0,
            "device_wait_ms_per_step": wait * 1e3 / steps, "host_ms_per_step": (decode.sum() - wait * 1e3) / steps,
            "serial_host_ms_per_step": serial * 1e3 / steps, **load}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", help="named shape (dummy weights) or a model path")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 (e4m3 pages with scales)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's max_model_len (its page tables' width); default input + output len")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--no-executable-cache", action="store_true")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--nnodes", type=int, default=1, help="processes the mesh spans (jinfer/parallel/multihost.py)")
    ap.add_argument("--node-rank", type=int, default=0, help="> 0: follow process 0's steps, measure nothing")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    ap.add_argument("--replay-acceptance", type=float, default=None, metavar="P",
                    help="with --speculative-config: the benchmark-only replay drafter, whose num_speculative_tokens "
                         "drafts are each accepted with probability P up to the first rejection (mtp, eagle3: the "
                         "method's own drafts, accepted so)")
    ap.add_argument("--expert-load-stats", action="store_true",
                    help="MoE shapes: count the experts' load each step; rows get the decode steps' imbalance")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per batch size (the median-TPOT run is kept)")
    add_profile_argument(ap)
    ap.add_argument("--out")
    args = ap.parse_args()

    model = args.shape if "/" in args.shape else f"dummy:{args.shape}"
    follower = args.node_rank > 0
    torch_copy = None if follower else measure_torch_copy()  # before the engine's JAX holds the GPU's memory
    t0 = time.perf_counter()
    max_model_len = args.max_model_len or args.input_len + args.output_len
    spec_config = SpeculativeConfig.parse(args.speculative_config)
    if args.replay_acceptance is not None and spec_config is None:
        ap.error("--replay-acceptance needs --speculative-config (its num_speculative_tokens)")
    drafts = ReplayDrafts(spec_config, args.replay_acceptance)
    core = EngineCore(EngineConfig(model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                   max_model_len=max_model_len,
                                   max_num_seqs=max(args.batch_sizes),
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   attention_backend=args.attention_backend, warmup=False,
                                   kernel_policy=KernelPolicy.from_env(),
                                   async_scheduling=not args.no_async_scheduling,
                                   executable_cache=not args.no_executable_cache,
                                   tensor_parallel_size=args.tensor_parallel_size,
                                   enable_expert_parallel=args.enable_expert_parallel,
                                   nnodes=args.nnodes, node_rank=args.node_rank, master_port=args.master_port,
                                   speculative_config=drafts.speculative_config,
                                   expert_load_stats=args.expert_load_stats,
                                   **compilation_cache_dir_from_env({})),
                      proposer=drafts.proposer)
    drafts.apply(core)
    if core.runner.collectives:
        print(f"collectives: {core.runner.collectives}", flush=True)
    if follower:
        raise SystemExit(core.group.serve(core.runner))
    startup_s = time.perf_counter() - t0
    cfg = core.model_config
    copy = measure_copy_bandwidth(torch_copy)  # the device's copy rate (torch's copy where available), same run
    bandwidth = copy["best_Bps"]
    matmul = measure_matmul()
    pf = floors(cfg, 1, args.input_len, args.input_len, bandwidth, matmul)  # one prompt's prefill floors
    rng = np.random.default_rng(0)
    rows = []
    for bs in args.batch_sizes:
        make = lambda n=bs: [rng.integers(0, cfg.vocab_size, args.input_len).tolist() for _ in range(n)]
        run_batch(core, make(), args.output_len, f"warm{bs}")  # compiles every shape this batch uses
        profiled_run = None
        if args.profile:  # a run of its own: the profiler slows the host, so it is not among the timed runs
            with profiled(f"{args.profile}/batch{bs}"):
                profiled_run = run_batch(core, make(), args.output_len, f"profiled{bs}")
        runs = [run_batch(core, make(), args.output_len, f"run{bs}.{r}") for r in range(max(1, args.repeat))]
        row = sorted(runs, key=lambda run: run["tpot_ms"])[(len(runs) - 1) // 2]
        row = {**row, "ttft_runs_ms": [round(run["ttft_ms"], 3) for run in runs],
               "tpot_runs_ms": [round(run["tpot_ms"], 4) for run in runs],
               "tokens_sha_runs": [run["tokens_sha"] for run in runs]}
        if profiled_run is not None:
            row["profiled_run"] = {k: profiled_run[k] for k in ("ttft_ms", "tpot_ms")}
        mid_context = args.input_len + args.output_len // 2
        # each device reads its share of the bytes (split evenly: weights, KV heads and vocab)
        kv_bytes = 1 if args.kv_cache_dtype == "fp8" else None
        floor = (decode_bytes(cfg, bs, mid_context, kv_bytes=kv_bytes)["total"] / args.tensor_parallel_size
                 / bandwidth * 1e3)
        # what the busiest device reads under our layout (replicated kv heads, router; expert parallel: the
        # device most of the hit experts land on): the floor the step can reach with this layout
        busiest = None
        if args.tensor_parallel_size == 1 or (cfg.num_layers == len(cfg.attention_layers) and not cfg.kv_lora_rank):
            busiest = decode_bytes_per_device(cfg, bs, mid_context, args.tensor_parallel_size,
                                              args.enable_expert_parallel, kv_bytes=kv_bytes)["total"] / bandwidth * 1e3
        ttft_floor = {k: bs * pf[k] for k in ("prefill_flop_floor_ms", "prefill_byte_floor_ms")}
        if bs > 1:  # one batch of bs prompts reads the weights once
            ttft_floor["prefill_byte_floor_ms"] = pf["prefill_byte_floor_ms"]
        rows.append({"batch_size": bs, **row, "roofline_tpot_ms": floor, "tpot_over_roofline": row["tpot_ms"] / floor,
                     "roofline_tpot_ms_busiest_device": busiest,
                     "ttft_flop_floor_ms": ttft_floor["prefill_flop_floor_ms"],
                     "ttft_byte_floor_ms": ttft_floor["prefill_byte_floor_ms"],
                     "ttft_over_flop_floor": row["ttft_ms"] / ttft_floor["prefill_flop_floor_ms"]})
        print(f"batch {bs}: TTFT {row['ttft_ms']:.1f} ms (FLOP floor {ttft_floor['prefill_flop_floor_ms']:.1f}, "
              f"byte floor {ttft_floor['prefill_byte_floor_ms']:.1f}), TPOT {row['tpot_ms']:.2f} ms "
              f"[runs {' '.join(f'{t:.2f}' for t in row['tpot_runs_ms'])}] "
              f"(roofline {floor:.2f} ms, {row['tpot_ms'] / floor:.2f}x; "
              f"device wait {row['device_wait_ms_per_step']:.2f} ms/step, host {row['host_ms_per_step']:.2f} ms/step"
              + (f" of which {row['serial_host_ms_per_step']:.2f} in series" if row['serial_host_ms_per_step'] else "")
              + (f"; busiest device {busiest:.2f} ms" if busiest and args.tensor_parallel_size > 1 else "") + ")")
        if load := row.get("expert_load"):
            print(f"batch {bs}: expert load over {load['steps']} decode steps: imbalance mean / max "
                  f"{load['imbalance_mean']:.3f} / {load['imbalance_max']:.3f} (experts "
                  f"{load['expert_imbalance_mean']:.2f} / {load['expert_imbalance_max']:.2f}"
                  + "".join(f", ep{r} {load[f'ep{r}_imbalance_mean']:.3f} / {load[f'ep{r}_imbalance_max']:.3f}"
                            for r in (2, 4, 8) if f"ep{r}_imbalance_mean" in load) + ")")
    result = {"benchmark": "latency", **environment(), "shape": args.shape, "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype,
              "tensor_parallel_size": args.tensor_parallel_size, "expert_parallel": args.enable_expert_parallel,
              "processes": args.nnodes, "collectives": core.runner.collectives,
              "num_pages": core.kv.num_usable_pages,
              "input_len": args.input_len, "output_len": args.output_len, "max_model_len": max_model_len,
              "attention_backend": core.runner.ops.backend, "mosaic_prefill": core.runner.ops.mosaic_prefill,
              "async_scheduling": core.config.async_scheduling,
              "speculative_config": args.speculative_config, "replay_acceptance": args.replay_acceptance,
              "expert_load_stats": args.expert_load_stats,
              "executable_cache": core.config.executable_cache,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"), "startup_s": startup_s,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "repeat": args.repeat,
              "measured_bandwidth_Bps": bandwidth, "copy_bandwidth": copy, "measured_matmul_flops": matmul,
              "executables": {"hits": core.runner.executables.hits, "misses": core.runner.executables.misses,
                              "compile_s": core.runner.compile_seconds,
                              "compiles_after_warmup": core.runner.compiles_after_warmup},
              "rows": rows}
    write_result(result, args.out)
    core.close()  # a multi-process group: the followers stop


if __name__ == "__main__":
    main()

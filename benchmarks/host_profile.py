"""cProfile of the engine's host loop during decode (dummy weights): where a step's host time goes.

    python -m benchmarks.host_profile --shape qwen3-4b --batch-size 1 --out host_profile.txt
    python -m benchmarks.host_profile --model tests/data/tiny-qwen3 --batch-size 1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --replay-acceptance 0.742

Runs one untimed batch (compiles), then a profiled one and unprofiled ones; prints the unprofiled runs' median
step time, device wait, serial host time per step (from a read-back to the next forward's dispatch, with no step in
flight) and the engine thread's CPU time per step, and the profiled run's top functions by own and cumulative time.
`--profile DIR`: one more run under jax.profiler without the Python tracer (XLA's host events and the GPU
timeline at the host's own speed); `python -m benchmarks.trace_summary TRACE --steps N` (N: the run's steps,
printed) gives the host's runtime events per step (executions, command buffer launches and updates).
`--speculative-config` with `--replay-acceptance P`: the replay drafter (jinfer/spec/replay.py, forced; a model
drafter's own drafts with forced outcomes for "mtp" and "eagle3"), as in
bench_latency. `--model`: a checkpoint directory instead of a named shape (on CPU: tests/data/tiny-qwen3).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import numpy as np

from benchmarks.common import ReplayDrafts, add_profile_argument
from benchmarks.common import profiled as jax_trace
from jinfer.config.engine import EngineConfig
from jinfer.config.speculative import SpeculativeConfig
from jinfer.engine.core import EngineCore
from jinfer.sampling_params import SamplingParams

MARK = os.environ.get("JINFER_STEP_MARK") == "1"


def mark_calls(runner, proposer=None) -> None:
    """JINFER_STEP_MARK=1 (benchmarks/cb_alloc_trace.py): a line on stderr before each forward and sampler call, a
    model drafter's head (`proposer`'s jitted step) and each engine step (`run`), in order with XLA's own log lines."""
    call_forward, sampler_executable = runner._call_forward, runner.sampler_executable
    if (head := getattr(proposer, "_head", None)) is not None:
        def call_head(*a, **kw):
            os.write(2, b"== head\n")
            return head(*a, **kw)
        proposer._head = call_head

    def forward(*args, **kwargs):
        os.write(2, b"== forward\n")
        return call_forward(*args, **kwargs)

    def sampler(*args, **kwargs):
        sample = sampler_executable(*args, **kwargs)

        def call(*a):
            os.write(2, b"== sample\n")
            return sample(*a)
        return call

    runner._call_forward, runner.sampler_executable = forward, sampler


def run(core, prompts, output_len, tag):
    """(median step ms, device wait ms per read-back, serial host ms per read-back, median CPU ms of the engine's thread
    per step: its host work, whatever other threads and processes take of the cores) over the decode steps. Serial:
    the host's time from a read-back to the next forward's dispatch while no step is in flight (speculative decoding,
    `--no-async-scheduling`), when the device idles (EngineCore.serial_host_seconds_total)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    times, cpu = [], []
    wait0, steps0, serial0 = core.device_wait_seconds_total, core.num_steps_total, core.serial_host_seconds_total
    while core.has_unfinished_requests():
        t, c = time.perf_counter(), time.thread_time()
        if MARK:
            os.write(2, b"== step\n")
        core.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    steps = max(core.num_steps_total - steps0, 1)
    wait = (core.device_wait_seconds_total - wait0) / steps
    serial = (core.serial_host_seconds_total - serial0) / steps
    skip = len(prompts) + 1
    return (float(np.median(times[skip:]) * 1e3), wait * 1e3, serial * 1e3, float(np.median(cpu[skip:]) * 1e3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of dummy:<shape>")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--speculative-config", default=None, metavar="JSON")
    ap.add_argument("--replay-acceptance", type=float, default=None, metavar="P")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--nnodes", type=int, default=1, help="processes the mesh spans (as bench_latency's)")
    ap.add_argument("--node-rank", type=int, default=0, help="> 0: follow process 0's steps, profile nothing")
    ap.add_argument("--master-port", type=int, default=29500)
    add_profile_argument(ap)
    ap.add_argument("--runs", type=int, default=2, help="unprofiled runs")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: max(batch size, 8); bench_latency's is "
                    "the batch size")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out")
    args = ap.parse_args()
    spec = SpeculativeConfig.parse(args.speculative_config)
    drafts = ReplayDrafts(spec, args.replay_acceptance)
    core = EngineCore(EngineConfig(model=args.model or f"dummy:{args.shape}", dtype=args.dtype,
                                   max_model_len=args.input_len + args.output_len,
                                   max_num_seqs=args.max_num_seqs or max(args.batch_size, 8),
                                   async_scheduling=not args.no_async_scheduling, warmup=False,
                                   tensor_parallel_size=args.tensor_parallel_size,
                                   enable_expert_parallel=args.enable_expert_parallel,
                                   nnodes=args.nnodes, node_rank=args.node_rank, master_port=args.master_port,
                                   speculative_config=drafts.speculative_config), proposer=drafts.proposer)
    if args.node_rank > 0:
        raise SystemExit(core.group.serve(core.runner))
    if MARK:
        mark_calls(core.runner, core.spec.proposer if core.spec is not None else None)
    drafts.apply(core)
    rng = np.random.default_rng(0)
    make = lambda: [rng.integers(0, min(core.model_config.vocab_size, 256), args.input_len).tolist()  # noqa: E731
                    for _ in range(args.batch_size)]
    run(core, make(), 16, "warm")
    prof = cProfile.Profile()
    prof.enable()
    profiled = run(core, make(), args.output_len, "prof")[0]
    prof.disable()
    plain = [run(core, make(), args.output_len, f"plain{i}") for i in range(args.runs)]
    if args.profile:
        steps0 = core.num_steps_total
        with jax_trace(args.profile, python=False):
            run(core, make(), args.output_len, "trace")
        print(f"trace: {core.num_steps_total - steps0} engine steps in {args.profile}")
    s = io.StringIO()
    s.write(f"median step ms: unprofiled {[round(p[0], 3) for p in plain]}, profiled {profiled:.3f}; "
            f"device wait ms/step {[round(p[1], 3) for p in plain]}; "
            f"serial host ms/step {[round(p[2], 3) for p in plain]}; "
            f"median engine-thread CPU ms/step {[round(p[3], 3) for p in plain]}\n")
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    text = s.getvalue().replace("/usr/local/lib/python3.12/site-packages/", "").replace("/tmp/site/", "")
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()

"""One device's share of a tensor-parallel decode step, on one GPU, with no collectives.

    python -m benchmarks.bench_local_step --shape qwen3-8b --tp 1 2 --batch-sizes 1 16 --variants default mlp_i64
    python -m benchmarks.bench_local_step --shape qwen3-8b-fp8 --tp 1 --batch-sizes 1 8 --variants default jnp_dense
    python -m benchmarks.bench_local_step --shape qwen3-8b --tp 1 --batch-sizes 1 8 --query-len 1 5  # verify steps

The model's forward runs at the shapes one device of a `tp`-way mesh holds (q and kv heads,
intermediate columns and vocabulary divided by tp; dummy weights), as a decode step with `--context`
tokens per sequence, dispatched back to back and synced once. `--query-len Q` > 1: each sequence has Q new tokens and
Q logits rows (speculative decoding's verify step of 1 + k drafts), as the engine runs such a step: its verify
executable (`ModelOps.verify_query_len`: the paged decode kernel with Q query rows per sequence, XLA's MLP; the variant
ragged_verify: the ragged prefill kernel instead, the path before). `tp` devices each doing this share plus
the collectives is what bench_parallel times; so the ratio step(tp) / step(1) here says how well the
kernels keep their speed at the narrower shapes, apart from communication. Each variant is a KernelPolicy (the
environment's `KernelPolicy.from_env` changed in one choice), or for the o projection's experiments a ModelOps
subclass:

- mlp_tokens{N}[_{M}...]: the fused MLP kernel at steps of N [, M, ...] tokens (`pallas_mlp_tokens`; default 1);
- mlp_i{N}[_w{W}][_s{S}]: the fused MLP kernel with N intermediate columns per program (default 128: at tp 2 an 8B
  layer gives it 48 programs for 132 SMs) [, W warps, S pipeline stages];
- o_barrier: an optimization barrier between attention and the o projection;
- vector_dots: batch-1 projections left as XLA makes them (`pad_vector_dots` off: the small ones
  become a multiply + reduce);
- no_qkv_rope: q/k norm, RoPE and the K/V write as XLA ops instead of the qkv_rope kernel;
- no_merge: the decode kernel's split-K partials merged by XLA instead of the merge kernel;
- ragged_verify: verify steps (--query-len > 1) on the ragged prefill kernel instead of the paged decode kernel;
- unfused: both of the above;
- no_front: a MoE block's norm + router + routing as XLA ops and the routing kernel instead of one kernel
  (`moe_front_max_tokens` 0);
- front{N}_w{W}_s{S}: that kernel (`moe_router.moe_norm_route`) for steps of up to N tokens (`moe_front_max_tokens`;
  N omitted: the default) at W warps and S K splits (the `_w{W}_s{S}` omitted or S 0: its defaults);
- route_w{N}: no_front, with the MoE routing kernel at N warps (default 4 for decode steps);
- no_norm_qkv: the input norm and q|k|v projection as XLA ops, then the qkv_rope kernel, instead of the
  norm_qkv_rope kernel (`norm_qkv_max_tokens` 0);
- nqkv_k{K}_w{W}_s{S}[_x{N}]: the norm_qkv_rope kernel at block_k K, W warps, S pipeline stages [, N K splits];
- attn_ppb{P}_w{W}_st{S}: the decode attention kernel at P pages per block, W warps, S pipeline stages;
- attn_target{N}: split-K decode attention planned for N programs (`paged_decode_attention(target_programs=)`);
- nqkv_split{N}: the norm_qkv_rope kernel with N K splits per head (default: `default_k_splits`);
- prefetch_o[{P}] / no_prefetch_o: the norm_qkv_rope kernel's idle SMs reading the o weight (its first P%, default
  100) into L2 (`prefetch_o`) / not (the same from extra programs of the decode attention kernel was measured
  slower, `local_step_attn_prefetch_o_qwen3-4b_h100.json`);
- jnp_dense: no fused MLP, no norm + q|k|v kernel, o on the skinny GEMM only under XLA's strength-reduction size
  (`fp8_skinny_o` off): with FP8 weights (`--shape <name>-fp8`) what ran before the dense kernels read FP8 (the
  jnp path: dequantize + XLA's GEMMs);
- fp8_xla_o: FP8 o weights over the strength-reduction size on the jnp path (`fp8_skinny_o` off);
- skinny_o: the o projection of steps of <= 32 tokens on the Pallas skinny GEMM (pallas_kernels/dense/skinny_gemm.py,
  ahead of XLA on o in its own benchmark: 27.4 vs 31.2 us, skinny_gemm_h100.json), its split-K sum and the
  residual add left to XLA.

Variants joined with "+" apply together. Each variant is run once untimed first (clocks, autotuning), then
timed `--runs` times (the best kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time

import jax
import numpy as np

from benchmarks.common import add_profile_argument, environment, profiled, write_result
from jinfer.cache.layout import init_kv_cache
from jinfer.config.kernels import KernelPolicy
from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, shard_weights
from jinfer.ops import ModelOps, select_ops
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import DTYPES, ModelSource, load_weights, resolve_model


def local_shapes(cfg, tp: int):
    """The config whose full-size weights are one device's shards of `cfg` on a tp-way mesh."""
    kv = max(cfg.num_kv_heads, tp) // tp
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=kv,
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp)


@dataclasses.dataclass(frozen=True)
class SkinnyOOps(ModelOps):
    """skinny_o: the o projection of steps of <= 32 tokens on the Pallas skinny GEMM."""

    def out_proj(self, attn, wo, residual):
        from jinfer.ops.dense import fp8_operands
        from pallas_kernels.dense.skinny_gemm import MAX_TOKENS, skinny_gemm

        if attn.shape[0] > MAX_TOKENS or (operands := fp8_operands("skinny_gemm", wo)) is None:
            return super().out_proj(attn, wo, residual)
        (w,), scales, block = operands  # (FP8: [out, in], fp8.kernel_layout)
        out = skinny_gemm(attn, w, scales and scales[0], scale_block=block, interpret=self.interpret)
        return residual + self.reduce(out.astype(attn.dtype))


@dataclasses.dataclass(frozen=True)
class BarrierOOps(ModelOps):
    """o_barrier: an optimization barrier between attention and the o projection."""

    def out_proj(self, attn, wo, residual):
        return residual + self.reduce(self.project(jax.lax.optimization_barrier(attn), wo))


def variant_ops(name: str, ops: ModelOps) -> ModelOps:
    """`ops` with the variant `name` applied (parts joined with "+" apply in order)."""
    for part in name.split("+"):
        ops = _apply(part, ops)
    return ops


def _apply(name: str, ops: ModelOps) -> ModelOps:
    p = ops.policy
    if name == "default":
        pass
    elif name == "ragged_verify":
        return dataclasses.replace(ops, verify_query_len=0)
    elif name.startswith(("prefetch_o", "no_prefetch_o")):
        p = dataclasses.replace(p, prefetch_o=0.0 if name == "no_prefetch_o"
                                else int(name.removeprefix("prefetch_o") or 100) / 100)
    elif name in ("no_merge", "no_qkv_rope", "unfused"):
        if name != "no_qkv_rope":
            p = p.with_launch("paged_decode_attention", merge_kernel=False)
        if name != "no_merge":
            p = dataclasses.replace(p, qkv_rope_max_tokens=0)
    elif name == "no_front":
        p = dataclasses.replace(p, moe_front_max_tokens=0)
    elif name.startswith("route_w"):
        p = dataclasses.replace(p, moe_front_max_tokens=0).with_launch(
            "moe_route", num_warps=int(name.removeprefix("route_w")))
    elif m := re.fullmatch(r"front(\d*)(?:_w(\d+)_s(\d+))?", name):
        n, w, sp = m.groups()
        if n:
            p = dataclasses.replace(p, moe_front_max_tokens=int(n))
        if w:
            p = p.with_launch("moe_norm_route", num_warps=int(w), k_splits=int(sp) or None)
    elif name == "no_norm_qkv":
        p = dataclasses.replace(p, norm_qkv_max_tokens=0)
    elif m := re.fullmatch(r"attn_ppb(\d+)_w(\d+)_st(\d+)", name):
        pp, w, st = (int(x) for x in m.groups())
        p = p.with_launch("paged_decode_attention", pages_per_block=pp, num_warps=w, num_stages=st)
    elif name.startswith("attn_target"):
        p = p.with_launch("paged_decode_attention", target_programs=int(name.removeprefix("attn_target")))
    elif name.startswith("nqkv_split"):
        p = dataclasses.replace(p, norm_qkv_k_splits=int(name.removeprefix("nqkv_split")))
    elif name.startswith("nqkv_"):
        k, w, st, *splits = (int(x[1:]) for x in name.split("_")[1:])
        p = p.with_launch("norm_qkv_rope", block_k=k, num_warps=w, num_stages=st)
        if splits:
            p = dataclasses.replace(p, norm_qkv_k_splits=splits[0])
    elif name == "jnp_dense":
        p = dataclasses.replace(p, pallas_mlp_tokens=(), norm_qkv_max_tokens=0, fp8_skinny_o=False)
    elif name.startswith("mlp_tokens"):
        p = dataclasses.replace(p, pallas_mlp_tokens=tuple(int(x) for x in name.removeprefix("mlp_tokens").split("_")))
    elif name == "fp8_xla_o":
        p = dataclasses.replace(p, fp8_skinny_o=False)
    elif name == "vector_dots":
        p = dataclasses.replace(p, pad_vector_dots=False)
    elif name.startswith("mlp_i"):
        i, *rest = name.removeprefix("mlp_i").split("_")
        kw = {{"w": "num_warps", "s": "num_stages"}[x[0]]: int(x[1:]) for x in rest}
        p = p.with_launch("fused_mlp", block_i=int(i), **kw)
    elif name in ("skinny_o", "o_barrier"):
        cls = SkinnyOOps if name == "skinny_o" else BarrierOOps
        return cls(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)})
    else:
        raise ValueError(f"unknown variant {name!r}")
    return dataclasses.replace(ops, policy=p)


def kernel_summary(trace_dir: str, steps: int, top: int = 16) -> dict:
    """GPU busy time per step and the `top` kernels' time per step (us), from the profile of one timed run."""
    from benchmarks.trace_summary import gpu_kernel_times

    per, count = gpu_kernel_times(trace_dir, steps)
    ranked = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    return {"gpu_busy_us": sum(per.values()), "kernels_per_step": count / steps, "kernels_us": dict(ranked)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--table-pages", type=int, default=0,
                    help="page-table width per sequence (the engine's is max_model_len / page_size); default: the "
                         "context's pages")
    ap.add_argument("--query-len", type=int, nargs="+", default=[1],
                    help="new tokens per sequence (1 + drafts for a verify step); one row set per value")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=["default"])
    add_profile_argument(ap)
    ap.add_argument("--top", type=int, default=16, help="kernels listed per profiled row")
    ap.add_argument("--out")
    args = ap.parse_args()

    full = resolve_model(f"dummy:{args.shape}").config
    dtype = DTYPES[args.dtype]
    step_ops = select_ops(policy=KernelPolicy.from_env())
    mesh = make_mesh(1)
    rows = []
    for tp in args.tp:
        cfg = local_shapes(full, tp)
        w = shard_weights(cfg, load_weights(ModelSource("dummy", None, cfg), args.dtype, mesh,
                                                      progress=False), mesh)
        q_max = max(args.query_len)
        pages_per_seq = max((args.context + args.iters * q_max + 2) // args.page_size + 1, args.table_pages)
        kv = init_kv_cache(cfg, pages_per_seq * max(args.batch_sizes) + 1, args.page_size, dtype, mesh,
                           num_state_slots=max(args.batch_sizes) + 1)  # linear-attention layers: slot b + 1
        for bs, q in ((bs, q) for bs in args.batch_sizes for q in args.query_len):
            verify = q if 1 < q <= step_ops.policy.verify_max_query_len and step_ops.backend == "pallas" else 0
            ops = dataclasses.replace(step_ops, decode_step=q == 1, verify_query_len=verify)
            pages = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(bs)]
            batches = [jax.device_put(make_batch([([1] * q, args.context + i * q, pg) for pg in pages], args.page_size,
                                                 pages_per_seq=pages_per_seq, all_logits=q > 1))
                       for i in range(args.iters)]
            for name in args.variants:
                step = jax.jit(functools.partial(forward, cfg=cfg, ops=variant_ops(name, ops)), donate_argnums=(2,))
                logits, kv = step(w, batches[0], kv)
                runs = []
                for r in range(args.runs + 1):
                    jax.block_until_ready((logits, kv))
                    trace = args.profile and r == args.runs and f"{args.profile}/tp{tp}_b{bs}_q{q}_{name}"
                    with profiled(trace):
                        t = time.perf_counter()
                        for b in batches:
                            logits, kv = step(w, b, kv)
                        jax.block_until_ready(logits)
                    runs.append((time.perf_counter() - t) / args.iters * 1e3)
                runs = runs[1:]  # the first pass is the warm-up
                row = {"tp": tp, "batch_size": bs, "query_len": q, "variant": name, "step_ms": float(np.min(runs)),
                       "step_ms_runs": runs}
                if args.profile:
                    row.update(kernel_summary(f"{args.profile}/tp{tp}_b{bs}_q{q}_{name}", args.iters, args.top))
                rows.append(row)
                print({k: v for k, v in row.items() if k != "step_ms_runs"}, flush=True)
        del w, kv
    base = {(r["batch_size"], r["query_len"], r["variant"]): r["step_ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        if r["tp"] > 1 and (r["batch_size"], r["query_len"], "default") in base:
            r["vs_tp1_default"] = r["step_ms"] / base[(r["batch_size"], r["query_len"], "default")]
        if r["query_len"] > 1 and (r["batch_size"], 1, r["variant"]) in base and r["tp"] == 1:
            r["vs_one_token"] = r["step_ms"] / base[(r["batch_size"], 1, r["variant"])]
    write_result({"benchmark": "local_step", **environment(), "shape": args.shape, "dtype": args.dtype,
                  "context": args.context, "rows": rows}, args.out)


if __name__ == "__main__":
    main()

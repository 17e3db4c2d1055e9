"""Registers, spills and shared memory of our Pallas Triton kernels, and their SASS, without a GPU.

Occupancy decides a memory-bound kernel's rate (the decode kernel's 255-register programs leave two per SM;
the same at 8 warps leaves one, 1.6x slower), and ptxas reorders what the kernel's source orders. This lowers a
kernel for an H100 on the CPU (the Pallas Triton lowering, with the GPU's description patched in), prints its
Triton IR, compiles that IR with a separately installed `triton` (its ptxas; the wheel needs no GPU to compile)
and reports `ptxas -v`'s registers, spill bytes and shared memory; `--sass DIR` keeps each kernel's SASS.

Setup (once; triton is not a dependency of jinfer):
    PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
Use:
    .venv/bin/python -m benchmarks.pallas_regs decode:128:4 decode:64:4 intra:8 conv:16x128:4 recurrent:64:4
(Triton's own compiler, not the one inside XLA: close to what runs, not identical.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp

COMPILE = """
import os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, sass = sys.argv[1], int(sys.argv[2]), sys.argv[3]
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
ptx = path + ".ptx"
open(ptx, "w").write(k.asm["ptx"])
bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
r = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", path + ".cubin"],
                   capture_output=True, text=True)
info = [line.split("info    : ")[-1] for line in r.stderr.splitlines() if "registers" in line or "spill" in line]
print(f"shared {k.metadata.shared} B | " + " | ".join(info))
if sass:
    out = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path + ".cubin"], capture_output=True,
                         text=True).stdout
    open(sass, "w").write(out)
"""


def ttir(fn) -> str:
    """The Triton IR of the last pallas_call in fn(), lowered for an H100 on any host, locations stripped."""
    from jax._src.pallas.triton import gpu_info
    from jax.experimental import pallas as pl

    get_info, call = gpu_info.get_gpu_info, pl.pallas_call
    gpu_info.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    pl.pallas_call = lambda *a, **k: call(*a, **(k | {"debug": True, "interpret": False}))
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            jax.jit(fn).trace().lower(lowering_platforms=("cuda",))
    finally:
        gpu_info.get_gpu_info, pl.pallas_call = get_info, call
    out = buf.getvalue()
    asm = out[out.index("module @", out.rindex("The Triton module")):]
    asm = "\n".join(line for line in asm[:asm.rindex("}") + 1].splitlines() if not line.startswith("#loc"))
    while True:  # the printed (pretty) locations do not parse
        new = re.sub(r"\s*loc\([^()]*(\([^()]*\))*[^()]*\)", "", asm)
        new = re.sub(r' "[^"\n]*"\(#loc\d*\)', "", new)
        new = re.sub(r" \(#loc\d*\)| #loc\d*\b| \[unknown\]", "", new)
        if new == asm:
            return asm
        asm = new


def cases(spec: str):
    """(name, warps, fn) for `kind:options` at Qwen3.5-4B's linear-layer shapes (batch 64, 1k-token prefill)."""
    kind, *opts = spec.split(":")
    B, T, hk, hv, dk, dv, taps = 64, 1024, 16, 32, 128, 128, 4
    C, vs = 2 * hk * dk + hv * dv, hv * dv
    bf16 = jnp.bfloat16
    if kind == "decode":  # decode:BLOCK_V:WARPS
        from pallas_kernels.linear_attention.gated_delta_rule_decode import fused_decode_step
        bv, warps = int(opts[0]), int(opts[1])
        return warps, lambda: fused_decode_step(
            jnp.zeros((B, C + vs + 2 * hv), bf16), jnp.zeros((B + 1, taps, C), bf16), jnp.zeros((C, 1, taps), bf16),
            jnp.zeros(hv), jnp.ones(hv), jnp.zeros((B + 1, hv, dk, dv)), jnp.arange(1, B + 1, dtype=jnp.int32),
            jnp.full((B,), 5, jnp.int32), jnp.zeros(B, bool), num_k_heads=hk, key_dim=dk, value_dim=dv,
            b_col=C + vs, a_col=C + vs + hv, z_col=C, norm_weight=jnp.ones(dv, bf16), block_v=bv, num_warps=warps)
    if kind == "recurrent":  # recurrent:BLOCK_V:WARPS (decode rows)
        from pallas_kernels.linear_attention.gated_delta_rule import recurrent_gated_delta_rule
        bv, warps = int(opts[0]), int(opts[1])
        g = jnp.zeros((B, hv))
        return warps, lambda: recurrent_gated_delta_rule(
            jnp.zeros((B, 2 * hk + hv, dk), bf16), None, None, g, g, jnp.zeros((B + 1, hv, dk, dv)),
            jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, bool), jnp.arange(B + 1, dtype=jnp.int32),
            packed_k_heads=hk, block_v=bv, num_warps=warps)
    if kind == "intra":  # intra:WARPS
        from pallas_kernels.linear_attention.gated_delta_rule_intra import intra_chunk_pallas
        warps = int(opts[0])
        g = jnp.zeros((T, hv))
        return warps, lambda: intra_chunk_pallas(jnp.zeros((T, 2 * hk + hv, dk), bf16), None, None, g, g,
                                                 jnp.arange(T, dtype=jnp.int32).reshape(-1, 64), num_warps=warps,
                                                 packed_k_heads=hk)
    if kind == "conv":  # conv:BTxBC:WARPS
        from pallas_kernels.linear_attention.causal_conv import causal_conv
        bt, bc = map(int, opts[0].split("x"))
        warps = int(opts[1])
        return warps, lambda: causal_conv(jnp.zeros((T, C), bf16), jnp.zeros((9, taps, C), bf16),
                                          jnp.zeros((C, 1, taps), bf16), jnp.zeros(T, jnp.int32),
                                          jnp.zeros(8, jnp.int32), jnp.arange(1, 9, dtype=jnp.int32),
                                          jnp.arange(T, dtype=jnp.int32), block_t=bt, block_c=bc, num_warps=warps)
    if kind == "route":  # route:TOKENS:WARPS at Qwen3-30B-A3B's routing (128 experts, top-8)
        from pallas_kernels.moe.moe_routing import moe_route
        tokens, warps = int(opts[0]), int(opts[1])
        return warps, lambda: moe_route(jnp.zeros((tokens, 128)), top_k=8, block_m=16, num_warps=warps)
    if kind == "front":  # front:TOKENS:WARPS: Qwen3-30B-A3B's norm + router projection (2048 -> 128) + routing
        from pallas_kernels.moe.moe_router import moe_norm_route
        tokens, warps = int(opts[0]), int(opts[1])
        return warps, lambda: moe_norm_route(jnp.zeros((tokens, 2048), bf16), jnp.ones(2048, bf16),
                                             jnp.zeros((2048, 128), bf16), jnp.zeros(16, jnp.int32), top_k=8,
                                             renormalize=True, block_m=16, eps=1e-6, num_warps=warps)
    raise SystemExit(f"unknown kernel {spec!r}: decode, recurrent, intra, conv, route or front")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="+", help="decode:BLOCK_V:WARPS, recurrent:BLOCK_V:WARPS, intra:WARPS, "
                                               "conv:BTxBC:WARPS, route:TOKENS:WARPS, front:TOKENS:WARPS")
    ap.add_argument("--triton-python", default=os.environ.get("TRITON_PY", "/tmp/tvenv/bin/python"))
    ap.add_argument("--sass", help="a directory for each kernel's SASS")
    ap.add_argument("--work", default="/tmp/pallas_regs")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    for spec in args.kernels:
        warps, fn = cases(spec)
        path = os.path.join(args.work, spec.replace(":", "_") + ".ttir")
        with open(path, "w") as f:
            f.write(ttir(fn))
        sass = os.path.join(args.sass, spec.replace(":", "_") + ".sass") if args.sass else ""
        r = subprocess.run([args.triton_python, "-c", COMPILE, path, str(warps), sass], capture_output=True,
                           text=True)
        print(f"{spec}: " + (r.stdout.strip() or "failed: " + r.stderr.strip().splitlines()[-1]), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

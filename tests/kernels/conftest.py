"""Shared helpers for the kernel tests: execution modes and random paged KV caches.

Every kernel test runs in two modes: "interpret" (Pallas interpreter, any backend, part of the CPU
suite) and "gpu" (compiled for the GPU, marker `gpu`, skipped when JAX has no GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HAS_GPU = jax.default_backend() == "gpu"

MODES = [
    pytest.param("interpret", id="interpret"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU")]),
]


def by_mode(interpret_cases, gpu_cases=None):
    """Parameters "mode, *case" for both modes: the interpret cases (small shapes: the interpreter's cost is its
    compiles, one per distinct shape) and the GPU cases (`interpret_cases` unless given: larger shapes cost the GPU
    nothing), each a pytest.param with an id."""
    gpu_marks = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU")]
    return ([pytest.param("interpret", *c.values, id=f"interpret-{c.id}", marks=c.marks) for c in interpret_cases]
            + [pytest.param("gpu", *c.values, id=f"gpu-{c.id}", marks=[*c.marks, *gpu_marks])
               for c in (interpret_cases if gpu_cases is None else gpu_cases)])


def normal(rng: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0, loc: float = 0.0):
    """Random normal test data drawn by numpy (jax.random compiles its generator anew for every shape: ~0.15 s each
    on CPU), converted to `dtype` on the host."""
    return jnp.asarray((loc + scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def tolerance(dtype, mode: str) -> float:
    """atol = rtol for outputs of magnitude ~1: bf16 rounding, or TF32 dots for f32 on the GPU."""
    if dtype == jnp.bfloat16:
        return 2e-2
    return 1e-2 if mode == "gpu" else 2e-5


def paged_kv(rng: np.random.Generator, ctx_lens, page_size: int, num_kv_heads: int, head_dim: int,
             dtype, *, pages_per_seq: int | None = None, extra_pages: int = 3):
    """Random K/V caches and a shuffled page table holding contexts of `ctx_lens` tokens.

    Returns (k_cache, v_cache, page_table [B, P]); unused table entries point at page 0.
    """
    need = [-(-n // page_size) for n in ctx_lens]
    pages_per_seq = pages_per_seq or max(1, max(need))
    num_pages = sum(need) + extra_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    perm = rng.permutation(num_pages)
    table = np.zeros((len(ctx_lens), pages_per_seq), np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    return k, v, jnp.asarray(table)


def fp8_kv(rng: np.random.Generator, k, v):
    """The caches k, v quantized to an FP8 cache with a random scale per kv head (between 1/4 and 2, so the scales
    matter): (k8, v8, k_scale, v_scale)."""
    from pallas_kernels.kv_fp8 import KV_FP8_DTYPE, quantize_kv

    heads = k.shape[2]
    ks, vs = (jnp.asarray(2.0 ** rng.uniform(-2, 1, heads), jnp.float32) for _ in range(2))
    return quantize_kv(k, ks[:, None], KV_FP8_DTYPE), quantize_kv(v, vs[:, None], KV_FP8_DTYPE), ks, vs


def assert_close(out, ref, dtype, mode: str) -> None:
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "kernel produced non-finite values"
    tol = tolerance(dtype, mode)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


def assert_unwritten_rows_kept(slots, *caches) -> None:
    """Cache rows ([pages, page_size, ...]) no token wrote (slot < 0 writes nothing) keep their contents exactly:
    each (cache after the call, float32 numpy copy from before it)."""
    slots = np.asarray(slots)
    shape = caches[0][1].shape[:2]
    written = np.zeros(shape, bool).reshape(-1)
    written[slots[slots >= 0]] = True
    kept = ~written.reshape(shape)
    for after, before in caches:
        np.testing.assert_array_equal(np.asarray(after.astype(jnp.float32))[kept], before[kept])


def lower_for_cuda(fn, *shapes) -> str:
    """Lower `fn` for CUDA on a machine without a GPU and return the module text: the Pallas Triton
    lowering (our kernel -> Triton IR) runs, against an abstract H100. (PTX compilation happens on the
    GPU only.)"""
    from jax import export
    from jax._src import mesh as mesh_lib

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
    return exp.mlir_module()

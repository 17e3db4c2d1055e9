"""moe_grouped_matmul_mgpu (Mosaic GPU: TMA + wgmma, persistent, warp-specialized) vs the jnp reference.

"interpret" runs jax's Mosaic GPU interpreter on CPU (warpgroups as threads, SMEM, barriers, TMA
simulated); "gpu" compiles for the H100. A CPU test also lowers the GPU path for CUDA at Qwen3-30B-A3B's
expert shapes (Mosaic GPU's layout inference, TMA legality and SMEM budget run there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernels.bench_moe import random_layout
from pallas_kernels.moe.moe_gemm_mgpu import (
    check_supported,
    default_config,
    moe_grouped_matmul_mgpu,
    moe_grouped_matmul_reference,
)
from tests.kernels.conftest import MODES, assert_close, by_mode, normal


def _problem(seed, blocks, experts, k, n, block_m, gated, dtype=jnp.bfloat16):
    """x [len(blocks) * block_m, k], w (and w2) [experts, k, n], block_expert = blocks."""
    rng = np.random.default_rng(seed)
    x = normal(rng, (len(blocks) * block_m, k), dtype)
    w = normal(rng, (experts, k, n), dtype, k**-0.5)
    w2 = normal(rng, (experts, k, n), dtype, k**-0.5) if gated else None
    return x, w, jnp.asarray(blocks, jnp.int32), w2


def _used_rows(out, blocks, block_m):
    """The rows of used blocks (the others are unspecified)."""
    rows = np.concatenate([np.arange(b * block_m, (b + 1) * block_m) for b, e in enumerate(blocks) if e >= 0])
    return np.asarray(out.astype(jnp.float32))[rows]


# blocks: expert of each block of block_m rows (-1 = unused, all at the end)
CASES = [
    # several blocks of one expert, an expert without blocks (1), unused tail; 2 column tiles of 128
    pytest.param([0, 0, 2, 3, -1], 4, 128, 256, 128, False, {"block_n": 128}, id="plain-m128-n2x128"),
    pytest.param([0, 0, 2, 3, -1], 4, 128, 256, 128, True, {}, id="swiglu-m128"),
    # 64-row blocks: the warpgroups split the columns
    pytest.param([0, 1, 1, 1, 3, -1, -1], 4, 128, 128, 64, False, {}, id="plain-m64"),
    pytest.param([0, 2, 2, 3, -1], 4, 256, 256, 64, True, {}, id="swiglu-m64"),
    # column split at block_m 128; K = 256 runs 4 steps through a 2-slot ring across tiles
    pytest.param([1, 1, 2, -1], 4, 256, 256, 128, True, {"wg_split": "n", "max_steps": 2}, id="swiglu-splitn-ring2"),
    pytest.param([0, 3, 3, 3, -1, -1], 4, 256, 128, 128, False, {"max_steps": 3, "num_ctas": 2}, id="plain-ring3"),
]


# The interpreter (3 persistent CTAs unless a case says otherwise: an odd count) leaves out swiglu-m128: SwiGLU at
# 128-row blocks and the default tiles runs in test_mgpu_moe_gemm_persistent_grid and test_mgpu_moe_gemm_block_rows.
@pytest.mark.parametrize("mode,blocks,experts,k,n,block_m,gated,knobs",
                         by_mode([c for c in CASES if c.id != "swiglu-m128"], CASES))
def test_mgpu_moe_gemm_matches_reference(mode, blocks, experts, k, n, block_m, gated, knobs):
    x, w, be, w2 = _problem(len(blocks) + k + n, blocks, experts, k, n, block_m, gated)
    interpret = mode == "interpret"
    if interpret:
        knobs = {"num_ctas": 3, **knobs}
    out = moe_grouped_matmul_mgpu(x, w, be, w2, block_m=block_m, interpret=interpret, **knobs)
    ref = moe_grouped_matmul_reference(x, w, be, w2, block_m=block_m)
    assert out.shape == (x.shape[0], n) and out.dtype == x.dtype
    assert_close(_used_rows(out, blocks, block_m), _used_rows(ref, blocks, block_m), jnp.bfloat16, mode)


# (the interpreter: SwiGLU only; the skip is in the warpgroups' row loop, shared by both epilogues)
@pytest.mark.parametrize("mode,gated", by_mode([pytest.param(True, id="swiglu")],
                                               [pytest.param(False, id="plain"), pytest.param(True, id="swiglu")]))
def test_mgpu_moe_gemm_block_rows(mode, gated):
    """With block_rows, the warpgroup whose 64 rows of a block are all padding skips them (blocks of 40
    and 64 valid rows here; 65 needs both); the valid rows still match."""
    blocks, rows = [0, 0, 2, 3, 1, -1], [128, 40, 64, 65, 128, 0]
    x, w, be, w2 = _problem(11 + gated, blocks, 4, 256, 256, 128, gated)
    knobs = {"num_ctas": 3} if mode == "interpret" else {}
    out = moe_grouped_matmul_mgpu(x, w, be, w2, block_m=128, block_rows=jnp.asarray(rows, jnp.int32), block_n=128,
                                  max_steps=3, interpret=mode == "interpret", **knobs)
    ref = moe_grouped_matmul_reference(x, w, be, w2, block_m=128)
    valid = np.concatenate([np.arange(b * 128, b * 128 + r) for b, r in enumerate(rows)])
    out = np.asarray(out.astype(jnp.float32))
    assert_close(out[valid], np.asarray(ref.astype(jnp.float32))[valid], jnp.bfloat16, mode)
    if mode == "interpret":  # the skipped halves were never written (the interpreter fills outputs with NaN)
        assert np.isnan(out[128 + 64:256]).all() and np.isnan(out[256 + 64:384]).all()
        assert not np.isnan(out[384 + 64:512]).any()


@pytest.mark.parametrize("num_ctas", [1, 64])
def test_mgpu_moe_gemm_persistent_grid(num_ctas):
    """Any number of persistent CTAs: one CTA walking every tile (its ring running on across tiles and
    skipping the unused blocks' tiles), more CTAs than tiles. (An odd count: test_mgpu_moe_gemm_matches_reference's
    3 CTAs.)"""
    blocks = [0, 1, 1, 2, -1, -1]
    x, w, be, w2 = _problem(num_ctas, blocks, 3, 128, 256, 128, True)
    out = moe_grouped_matmul_mgpu(x, w, be, w2, block_m=128, max_steps=2, num_ctas=num_ctas, interpret=True)
    ref = moe_grouped_matmul_reference(x, w, be, w2, block_m=128)
    assert_close(_used_rows(out, blocks, 128), _used_rows(ref, blocks, 128), jnp.bfloat16, "interpret")


def test_mgpu_moe_gemm_fp16_and_no_used_blocks():
    blocks = [1, -1]
    x, w, be, _ = _problem(7, blocks, 2, 128, 128, 128, False, jnp.float16)
    out = moe_grouped_matmul_mgpu(x, w, be, block_m=128, block_n=128, num_ctas=2, interpret=True)
    ref = moe_grouped_matmul_reference(x, w, be, block_m=128)
    assert out.dtype == jnp.float16
    # (half-precision output: the bf16 tolerance; `tolerance` gives fp16 the fp32 one)
    assert_close(_used_rows(out, blocks, 128), _used_rows(ref, blocks, 128), jnp.bfloat16, "interpret")
    # every block unused: nothing to compute, the kernel must still finish (ring drain of zero steps)
    out = moe_grouped_matmul_mgpu(x, w, jnp.full((2,), -1, jnp.int32), block_m=128, num_ctas=2, interpret=True)
    assert out.shape == x.shape[:1] + (128,)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in MODES if m.id == "gpu"])
@pytest.mark.parametrize("block_m,use_rows", [(128, False), (128, True), (64, False)], ids=["m128", "m128-rows", "m64"])
def test_mgpu_moe_gemm_qwen3_moe_shapes(mode, block_m, use_rows):
    """Qwen3-30B-A3B's expert GEMMs (gate|up with SwiGLU, then down on its output) at 512 routed
    tokens x top-8, checked on the valid rows of a sample of blocks."""
    x, be, br, _ = random_layout(jax.random.key(block_m), 512, 8, 128, block_m, 2048)
    _, wg, _, wu = _problem(1, [0], 128, 2048, 768, 128, True)
    _, wd, _, _ = _problem(2, [0], 128, 768, 2048, 128, False)
    rows_kw = {"block_rows": br} if use_rows else {}
    h = moe_grouped_matmul_mgpu(x, wg, be, wu, block_m=block_m, **rows_kw)
    y = moe_grouped_matmul_mgpu(h, wd, be, block_m=block_m, **rows_kw)
    used = np.flatnonzero(np.asarray(be) >= 0)[::7]
    rows = (used[:, None] * block_m + np.arange(block_m)[None]).ravel()
    valid = (np.arange(block_m)[None] < np.asarray(br)[used][:, None]).ravel()
    sub = jnp.asarray(np.asarray(be)[used])
    h_ref = moe_grouped_matmul_reference(x[rows], wg, sub, wu, block_m=block_m)
    y_ref = moe_grouped_matmul_reference(jnp.where(valid[:, None], h[rows], 0), wd, sub, block_m=block_m)
    assert_close(h[rows][valid], h_ref[valid], jnp.bfloat16, mode)
    assert_close(y[rows][valid], y_ref[valid], jnp.bfloat16, mode)


@pytest.mark.parametrize("gated,k,n,block_m,knobs", [
    pytest.param(True, 2048, 768, 128, {}, id="gate_up-m128"),
    pytest.param(False, 768, 2048, 128, {}, id="down-m128"),
    pytest.param(True, 2048, 768, 64, {}, id="gate_up-m64"),
    pytest.param(False, 768, 2048, 64, {}, id="down-m64"),
    pytest.param(True, 2048, 768, 128, {"wg_split": "n", "max_steps": 3}, id="gate_up-splitn"),
    pytest.param(False, 768, 2048, 128, {"block_n": 128, "max_steps": 6}, id="down-n128-ring6"),
    pytest.param(True, 2048, 768, 128, {"block_rows": True}, id="gate_up-block_rows"),
])
def test_mgpu_moe_gemm_lowers_for_cuda(gated, k, n, block_m, knobs):
    """Mosaic GPU's own compile steps (layout inference, TMA legality, the SMEM budget) run at
    lowering: exporting for CUDA checks them on a machine without a GPU (the interpreter does not).
    Rows: 4096 tokens x top-8 plus the worst case's padding (E x (block_m - 1)), as in the engine."""
    from jax import export

    experts, rows = 128, 4096 * 8
    m = -(-(rows + experts * (block_m - 1)) // block_m) * block_m
    s = jax.ShapeDtypeStruct
    args = [s((m, k), jnp.bfloat16), s((experts, k, n), jnp.bfloat16), s((m // block_m,), jnp.int32)]
    if gated:
        args.append(s((experts, k, n), jnp.bfloat16))
    knobs = dict(knobs)
    if knobs.pop("block_rows", False):
        args.append(s((m // block_m,), jnp.int32))
        fn = jax.jit(lambda *a: moe_grouped_matmul_mgpu(*a[:-1], block_m=block_m, block_rows=a[-1], **knobs))
    else:
        fn = jax.jit(lambda *a: moe_grouped_matmul_mgpu(*a, block_m=block_m, **knobs))
    exp = export.export(fn, platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exp.mlir_module()
    assert exp.out_avals[0].shape == (m, n)


def test_mgpu_moe_gemm_defaults():
    """The defaults at Qwen3-30B-A3B's shapes: what the module docstring describes."""
    assert default_config(768, True) == dict(block_n=128, block_k=64, max_steps=4, wg_split="m")
    assert default_config(2048, False) == dict(block_n=256, block_k=64, max_steps=3, wg_split="m")
    assert default_config(768, True, block_m=64)["wg_split"] == "n"


def test_mgpu_moe_gemm_argument_checks():
    x, w, be, w2 = _problem(0, [0, -1], 2, 128, 128, 128, True)
    call = lambda *a, **kw: moe_grouped_matmul_mgpu(*a, **{"interpret": True, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="x must be"):
        call(x[None], w, be)
    with pytest.raises(ValueError, match="w must be"):
        call(x, w[:, :64], be)
    with pytest.raises(ValueError, match="w2 must"):
        call(x, w, be, w2[:, :, :64])
    with pytest.raises(ValueError, match="block_expert"):
        call(x, w, be[:1])
    with pytest.raises(ValueError, match="block_expert"):
        call(x, w, be.astype(jnp.int16))
    with pytest.raises(ValueError, match="block_m"):
        call(x, w, be, block_m=96)
    with pytest.raises(ValueError, match="max_steps"):
        call(x, w, be, max_steps=1)
    with pytest.raises(ValueError, match="num_ctas"):
        call(x, w, be, num_ctas=0)
    with pytest.raises(ValueError, match="block_rows"):
        call(x, w, be, block_rows=be[:1])
    with pytest.raises(ValueError, match="wg_split"):
        call(x, w, be, wg_split="k")
    with pytest.raises(ValueError, match="registers"):
        wide = jnp.zeros((2, 128, 256), x.dtype)
        call(x, wide, be, wide, block_n=256)
    with pytest.raises(ValueError, match="SMEM"):
        call(x, w, be, w2, block_n=128, max_steps=6)
    with pytest.raises(ValueError, match="dtype"):
        call(x.astype(jnp.float32), w.astype(jnp.float32), be)
    with pytest.raises(ValueError, match="K 96"):
        call(x[:, :96], w[:, :96], be)
    with pytest.raises(ValueError, match="N 192"):
        call(x, jnp.zeros((2, 128, 192), x.dtype), be, block_n=128, wg_split="n")
    assert check_supported(x, w) is None
    assert check_supported(x, w, w2, block_m=64) is None
    assert check_supported(x[:, :96], w[:, :96]) is not None
    assert check_supported(x[:100], w) is not None  # rows not a multiple of block_m

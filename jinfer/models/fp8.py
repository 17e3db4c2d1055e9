"""Block-FP8 weights as one pytree leaf pair: `Fp8Weight(w, scale, block)`.

A quantized linear weight keeps its values in float8_e4m3fn (half the bytes of bf16 in device memory) and one
float32 scale per `block` = (rows, columns) of jinfer's [in, out] layout (the checkpoint's [out, in] `weight_scale_inv`
transposed): value = w * scale[block]. Scales are a separate leaf with the weight's logical axes, so they shard with
it (a shard must hold whole blocks: `check_shardable`). Stacked expert weights [E, in, out] have scales
[E, in / bk, out / bn].

Every projection reads a weight through `dense(w, dtype)`: a plain array passes through, an Fp8Weight is
dequantized per block (in float32, then rounded to the activation dtype: on CPU in float32 that equals HF's matmul on
the dequantized weights up to summation order). XLA fuses the dequantization into the consumer where it can; kernels
that do not read FP8 are refused by jinfer/ops/ (`refuse_fp8`) and the jnp path runs instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FP8", "FP8_MAX", "Fp8Weight", "concat_columns", "dense", "dequantize_np", "in_kernel_layout", "is_fp8",
           "kernel_layout", "map_columns", "quantize", "quantize_fields", "quantize_np", "refuse_fp8", "transpose",
           "transposed_sharding"]

log = logging.getLogger(__name__)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


@dataclass
class Fp8Weight:
    w: jax.Array  # [..., K, N] float8_e4m3fn (jinfer's [in, out] layout); transposed: [..., N, K]
    scale: jax.Array  # [..., ceil(K / bk), ceil(N / bn)] float32 (the [in, out] blocks either way)
    block: tuple[int, int]  # (bk, bn): static (part of the tree's structure, not a leaf)
    # the values [out, in] as checkpoints store them (`kernel_layout`): the decode kernels' dots then take the
    # weight's rows as M (pallas_kernels/dense/fp8_tiles.py, weight_dot_swapped)
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape, whatever the values' layout."""
        return (*self.w.shape[:-2], self.w.shape[-1], self.w.shape[-2]) if self.transposed else self.w.shape

    @property
    def ndim(self) -> int:
        return self.w.ndim

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["w", "scale"], meta_fields=["block", "transposed"])


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)


def _expand(scale: jax.Array, block: tuple[int, int], k: int, n: int) -> jax.Array:
    """scale [..., K/bk, N/bn] -> [..., K, N] (partial last blocks cut)."""
    bk, bn = block
    return jnp.repeat(jnp.repeat(scale, bk, axis=-2), bn, axis=-1)[..., :k, :n]


def dequantize(q: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """The weight's values [..., K, N] in `dtype`: each block's FP8 values times its scale, in float32."""
    *lead, k, n = q.shape
    bk, bn = q.block
    values = jnp.swapaxes(q.w, -1, -2) if q.transposed else q.w  # (XLA folds the transpose into the dot)
    if k % bk == 0 and n % bn == 0:  # the blocked view: a broadcast multiply XLA can fuse into the matmul
        w = values.astype(jnp.float32).reshape(*lead, k // bk, bk, n // bn, bn)
        return (w * q.scale[..., :, None, :, None]).reshape(q.shape).astype(dtype)
    return (values.astype(jnp.float32) * _expand(q.scale, q.block, k, n)).astype(dtype)


def dense(w, dtype) -> jax.Array:
    """A weight as a plain array for jnp matmuls: an Fp8Weight dequantized to `dtype`, anything else unchanged."""
    return dequantize(w, dtype) if isinstance(w, Fp8Weight) else w


def _block_scales(w: jax.Array, block: tuple[int, int], xp):
    """(padded blocks [..., K/bk, bk, N/bn, bn], scales [..., K/bk, N/bn]) of a float array, for numpy or jnp."""
    *lead, k, n = w.shape
    bk, bn = block
    kb, nb = -(-k // bk), -(-n // bn)
    pad = [(0, 0)] * len(lead) + [(0, kb * bk - k), (0, nb * bn - n)]
    blocks = xp.pad(w.astype(xp.float32), pad).reshape(*lead, kb, bk, nb, bn)
    amax = xp.max(xp.abs(blocks), axis=(-3, -1))
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)  # an all-zero block: any scale is exact
    return blocks, scale


def _quantize(w: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    *lead, k, n = w.shape
    blocks, scale = _block_scales(w, block, jnp)
    q = jnp.clip(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(*lead, scale.shape[-2] * block[0], scale.shape[-1] * block[1])[..., :k, :n], scale


def quantize(w: jax.Array, block: tuple[int, int], shardings=None) -> Fp8Weight:
    """A float weight [..., K, N] -> Fp8Weight with one scale per `block` (amax / 448, vLLM's and DeepSeek's
    rule), on the device; `shardings`: (values', scales') placement."""
    q, scale = _quantizer(shardings)(w, block=tuple(block))
    return Fp8Weight(q, scale, tuple(block))


@cache
def _quantizer(shardings):
    return jax.jit(_quantize, static_argnames=("block",), out_shardings=shardings)


def quantize_fields(weights, fields: tuple[str, ...], blocks: tuple[int, ...] = (128, 64, 32, 16)):
    """The weights with each 2-D float leaf named in `fields` (a dataclass field's name) quantized to block FP8 where it
    lies (a draft head's online FP8: replicated), in square blocks of the largest of `blocks` that divides both sides
    of every such leaf (that any does: 128 on real shapes, so the kernels take them all in one block shape); a leaf
    not in whole blocks, and every other leaf, as it is."""
    def named(path, leaf) -> bool:
        name = getattr(path[-1], "name", None) if path else None
        return name in fields and not is_fp8(leaf) and getattr(leaf, "ndim", 0) == 2
    flat, _ = jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_fp8)
    leaves = [leaf for path, leaf in flat if named(path, leaf)]
    sides = [d for leaf in leaves for d in leaf.shape]
    size = next((b for b in blocks if all(d % b == 0 for d in sides)), None) \
        or next((b for b in blocks if any(all(d % b == 0 for d in leaf.shape) for leaf in leaves)), None)

    def quantized(path, leaf):
        if size and named(path, leaf) and all(d % size == 0 for d in leaf.shape):
            return quantize(leaf, (size, size))
        return leaf
    return jax.tree_util.tree_map_with_path(quantized, weights, is_leaf=is_fp8)


def quantize_np(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The same on the host (numpy + ml_dtypes): (float8_e4m3fn values, float32 scales)."""
    *lead, k, n = w.shape
    blocks, scale = _block_scales(np.asarray(w), block, np)
    q = np.clip(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(*lead, scale.shape[-2] * block[0], scale.shape[-1] * block[1])[..., :k, :n], scale


def dequantize_np(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Host dequantization of a checkpoint's FP8 tensor (values [..., R, C], scales per `block` of them): float32."""
    *_, r, c = q.shape
    s = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=-2), block[1], axis=-1)[..., :r, :c]
    return q.astype(np.float32) * s


def check_shardable(name: str, shape: tuple[int, ...], block: tuple[int, int], parts: tuple[int, int]) -> None:
    """ValueError unless each shard of the weight's last two axes (split `parts` ways) holds whole blocks: its scales
    must split with it."""
    for axis, (dim, b, p) in enumerate(zip(shape[-2:], block, parts, strict=True)):
        if p > 1 and (dim % p or (dim // p) % b):
            raise ValueError(f"tensor {name!r}: axis {len(shape) - 2 + axis} of size {dim} split {p} ways is not "
                             f"a whole number of FP8 blocks of {b}")


def map_columns(w, fn, unit: int):
    """Apply `fn` (a reshape / repeat / concat of the last axis in groups of `unit` columns) to a weight; an
    Fp8Weight's scales get the same with `unit / bn` scale columns. None where `unit` is not whole blocks."""
    if not isinstance(w, Fp8Weight):
        return fn(w, unit)
    bn = w.block[1]
    if unit % bn or w.transposed:
        return None
    return Fp8Weight(fn(w.w, unit), fn(w.scale, unit // bn), w.block)


def concat_columns(parts: list) -> jax.Array | Fp8Weight | None:
    """Weights [K, N_i] side by side on the output axis (a fused q|k|v). FP8 parts are joined with their scales;
    None where they cannot be (a mix of FP8 and plain, other blocks, a part that is not whole blocks): the caller
    keeps them apart."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return jnp.concatenate(parts, axis=-1)
    block = parts[0].block if isinstance(parts[0], Fp8Weight) else None
    if any(not isinstance(p, Fp8Weight) or p.block != block or p.shape[-1] % block[1] or p.transposed
           or p.shape[-2] != parts[0].shape[-2] for p in parts):
        return None
    return Fp8Weight(jnp.concatenate([p.w for p in parts], axis=-1),
                     jnp.concatenate([p.scale for p in parts], axis=-1), block)


# The FP8 weights the kernels read [out, in] (`kernel_layout`): the dense MLP's (a MoE layer's shared experts' too),
# o's and the fused q|k|v's, an lm_head's and a draft head's fc (the skinny GEMM), and a MoE layer's routed experts
# ([E, out, in]: the grouped GEMMs' K-major tiles).
KERNEL_LAYOUT_FIELDS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down", "wo", "wqkv", "lm_head", "fc")
EXPERT_FIELDS = ("w_gate", "w_up", "w_down")


def in_kernel_layout(name: str, ndim: int) -> bool:
    """Whether a weight field of this name and rank is kept [out, in] when FP8 (`kernel_layout`)."""
    return name in KERNEL_LAYOUT_FIELDS and ndim == 2 or name in EXPERT_FIELDS and ndim == 3


def transposed_sharding(sharding, ndim: int):
    """A NamedSharding with its last two axes' partitioning swapped (anything else: None, placement left to JAX)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = (*sharding.spec, *([None] * (ndim - len(sharding.spec))))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:-2], spec[-1], spec[-2]))


def transpose(q: Fp8Weight) -> Fp8Weight:
    """The weight with its values [out, in] (`Fp8Weight.transposed`), placed on the devices of the [in, out] ones with
    their sharding's spec transposed."""
    out = transposed_sharding(getattr(q.w, "sharding", None), q.w.ndim)
    return Fp8Weight(_transposer(out)(q.w), q.scale, q.block, not q.transposed)


@cache
def _transposer(sharding):
    # (the [in, out] values donated: no second copy of the weights at load; CPU backends do not take donations)
    donate = () if jax.default_backend() == "cpu" else (0,)
    return jax.jit(lambda w: jnp.swapaxes(w, -1, -2), out_shardings=sharding, donate_argnums=donate)


def kernel_layout(weights):
    """The weights with each FP8 weight of a dense MLP, o or q|k|v projection and of the routed experts
    (`in_kernel_layout`) stored [out, in], the layout the decode kernels read fastest (Qwen3-8B's fused MLP at one
    token: 59 vs 100 us on the H200, docs/performance.md) and the one FP8 tensor cores take as a GEMM's right side
    (8-bit wgmma operands are K-major); every other weight as it is."""
    def relayout(path, leaf):
        name = getattr(path[-1], "name", None) if path else None
        if isinstance(leaf, Fp8Weight) and not leaf.transposed and in_kernel_layout(name, leaf.ndim):
            return transpose(leaf)
        return leaf
    return jax.tree_util.tree_map_with_path(relayout, weights, is_leaf=lambda x: isinstance(x, Fp8Weight))


_refused: set[str] = set()


def refuse_fp8(kernel: str, *weights) -> bool:
    """True (and one log line per kernel per process) where a kernel that reads bf16 weights is offered an FP8 one:
    the caller takes the jnp path, which dequantizes, instead of letting the kernel misread the bytes."""
    if not any(isinstance(w, Fp8Weight) for w in weights):
        return False
    if kernel not in _refused:
        _refused.add(kernel)
        log.info("FP8 weights: the %s kernel does not read them; using the jnp path (dequantize + XLA matmul)", kernel)
    return True

"""FP8 checkpoints in vLLM's compressed-tensors format against HF transformers: the tiny checkpoints written by
scripts/make_compressed_tensors_golden.py (tiny-qwen3-ct-tensor: one scale per weight, static activation scales not
read; tiny-qwen3_moe-ct-mixed: attention per tensor, the MLPs and experts per output channel) and HF's logits on
their dequantized weights. Each loads onto the block-FP8 path exactly (no second rounding), so the logits match to
float32 noise on one device and tp=2; the Pallas kernels (interpreted) reading per-column scales meet them with e4m3
activations, within W8A8_ATOL."""

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.models import fp8
from jinfer.models.fp8 import Fp8Weight
from jinfer.models.registry import forward, fuse_qkv
from jinfer.weights.loader import load_weights, resolve_model, with_online_fp8

from ..conftest import DATA
from .test_golden_tiny import (
    check_batched_chunked_prefill,
    check_prompt_and_decodes,
    decode_batch,
    empty_cache,
    scrambled_pages,
    sharded_model,
)

DECODES = 4  # greedy tokens the interpreted Pallas steps check
# |logit - HF| bound for the Pallas kernels' e4m3 activations (HF's reference keeps them unquantized; logits' std
# ~0.8): about twice the largest difference measured, 0.189.
W8A8_ATOL = 0.4


def load(name):
    src = resolve_model(DATA / f"tiny-{name}")
    return src, load_weights(src, "float32", progress=False), np.load(DATA / "golden" / f"tiny-{name}.npz")


def stored(name):
    """The checkpoint's non-FP8 tensors as float32 numpy (bf16 ones widened), read without jinfer's reader."""
    from safetensors import safe_open

    with safe_open(str(DATA / f"tiny-{name}" / "model.safetensors"), framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys() if not k.endswith(".weight")}


def test_per_tensor_checkpoint_matches_hf():
    """One scale per weight becomes one per 128 x 128 block (every block of the tiny weights holds it); layer 1's
    o_proj, ignored by name, and the lm_head stay unquantized; the static activation scales (`input_scale`) are not
    read; prompt 0's prefill and 32 greedy steps (every step's logits and token HF's), the three prompts' batched
    chunked prefill."""
    src, w, gold = load("qwen3-ct-tensor")
    cfg = src.config
    assert cfg.quantization.block == (128, 128) and cfg.quantization.scale_suffix == "_scale"
    assert with_online_fp8(src) is src  # `quantization="fp8"` keeps the checkpoint's own format
    wq = w.layers[0].wq
    assert isinstance(wq, Fp8Weight) and wq.w.dtype == jnp.float8_e4m3fn and wq.scale.shape == (1, 2)
    scales = stored("qwen3-ct-tensor")
    want = scales["model.layers.0.self_attn.q_proj.weight_scale"]
    assert want.shape == (1,) and np.all(np.asarray(wq.scale) == want[0])
    assert "model.layers.0.self_attn.q_proj.input_scale" in scales
    assert not isinstance(w.layers[1].wo, Fp8Weight) and isinstance(w.layers[0].wo, Fp8Weight)
    assert not isinstance(w.lm_head, Fp8Weight)
    step = jax.jit(partial(forward, cfg=cfg), donate_argnames=("kv_cache",))
    check_prompt_and_decodes(step, w, empty_cache(cfg), gold, 0)
    check_batched_chunked_prefill(step, w, empty_cache(cfg), gold)


def test_mixed_tensor_and_channel_moe_checkpoint_matches_hf():
    """Per-channel groups: blocks one [out, in] row high, i.e. a scale per output column of jinfer's [in, out] weight
    (each expert's, stacked [E, 1, out]); the per-tensor attention weights in the same blocks, so q|k|v fuse with
    their scales; the routers (ignored by a regular expression) and lm_head unquantized. The prefill steps."""
    src, w, gold = load("qwen3_moe-ct-mixed")
    cfg = src.config
    assert cfg.quantization.block == (1, 128)
    layer = w.layers[0]
    assert isinstance(layer.wq, Fp8Weight) and layer.wq.block == (128, 1) and layer.wq.scale.shape == (1, 256)
    assert len(np.unique(np.asarray(layer.wq.scale))) == 1  # per tensor
    gate = layer.w_gate
    assert isinstance(gate, Fp8Weight) and gate.scale.shape == (8, 1, 32)
    want = stored("qwen3_moe-ct-mixed")["model.layers.0.mlp.experts.3.gate_proj.weight_scale"]  # [32, 1] bf16
    np.testing.assert_array_equal(np.asarray(gate.scale[3, 0]), want[:, 0])
    assert isinstance(w.layers[1].w_down, Fp8Weight) and w.layers[1].w_down.scale.shape == (1, 64)  # dense layer
    assert not isinstance(layer.router, Fp8Weight) and not isinstance(w.lm_head, Fp8Weight)
    w = fuse_qkv(cfg, w)
    assert isinstance(w.layers[0].wqkv, Fp8Weight) and w.layers[0].wqkv.scale.shape == (1, 384)
    step = jax.jit(partial(forward, cfg=cfg), donate_argnames=("kv_cache",))
    check_batched_chunked_prefill(step, w, empty_cache(cfg), gold)


def test_per_channel_tp2_matches_hf():
    """tp=2 on fake devices, per-channel scales spread over blocks of 1 x 16 (the tiny shards are not whole 128-column
    blocks: the loader spreads a stored per-channel scale over whatever block the config names): values and scales
    split alike, column- and row-parallel, experts by their intermediate columns."""
    src = resolve_model(DATA / "tiny-qwen3_moe-ct-mixed")
    quant = dataclasses.replace(src.config.quantization, block=(1, 16))
    src = dataclasses.replace(src, config=src.config.replace(quantization=quant))
    _, _, w, step, new_kv = sharded_model(src, 2, False, "ref")
    down = w.layers[0].w_down  # (values [E, out, in]: fp8.kernel_layout)
    assert down.transposed and down.w.sharding.spec == fp8.transposed_sharding(down.scale.sharding, 3).spec
    assert down.scale.sharding.shard_shape(down.scale.shape) == (8, 1, 64)  # [E, 32 / 2 / 16, 64]
    check_batched_chunked_prefill(step, w, new_kv(), np.load(DATA / "golden" / "tiny-qwen3_moe-ct-mixed.npz"))


def test_pallas_kernels_read_per_column_scales(caplog):
    """The Pallas backend (interpreted) on the mixed checkpoint, one device: norm + q|k|v, the skinny o GEMM, layer 1's
    fused MLP and the experts' grouped GEMMs read the FP8 weights with one scale per output column and meet them
    with e4m3 activations. Prompt 0 a token a step, then DECODES of our greedy tokens: every position's logits within
    W8A8_ATOL of HF's and every token HF's (the interpreted steps are slow: a few decodes, not HF's 32)."""
    src = resolve_model(DATA / "tiny-qwen3_moe-ct-mixed")
    cfg, _, w, step, new_kv = sharded_model(src, 1, False, "pallas")
    kv = new_kv()
    decode = str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), kv))
    for kernel in ("norm_qkv_rope_write", "skinny_gemm", "fused_swiglu_mlp", "moe_gate_up", "moe_down"):
        assert any(kernel in line and "fp8" in line for line in decode.splitlines()), kernel
    assert "ragged_dot" not in decode
    gold = np.load(DATA / "golden" / "tiny-qwen3_moe-ct-mixed.npz")
    prompt, greedy = gold["prompt_0"].tolist(), gold["greedy_0"].tolist()
    want = np.concatenate([gold["prefill_logits_0"], gold["decode_logits_0"][1:DECODES]])
    pages, tokens = scrambled_pages(0, 4), list(prompt)
    with caplog.at_level(logging.INFO, logger="jinfer.models.fp8"):
        for pos in range(len(want)):
            logits, kv = step(w, decode_batch(tokens[pos], pos, pages), kv)
            np.testing.assert_allclose(np.asarray(logits[0]), want[pos], atol=W8A8_ATOL, rtol=0, err_msg=f"pos {pos}")
            if pos >= len(prompt) - 1:
                tokens.append(int(np.argmax(logits[0])))
    assert tokens[len(prompt):] == greedy[:DECODES] and "does not read them" not in caplog.text

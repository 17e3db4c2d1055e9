"""Block-FP8 weights against HF transformers: the tiny checkpoints quantized by scripts/make_fp8_golden.py
(tests/data/tiny-*-fp8: float8_e4m3fn weights with a scale per 16 x 16 block) and HF's logits on the dequantized
weights, on one device and tp=2; online FP8 (`quantization="fp8"`) against the unquantized model's goldens; FP8
dummy weights; the Pallas backend's kernels reading FP8 against e4m3 activations (the MoE experts too, one device and
ep=2: HF's logits within the activations' rounding), and refusing what they cannot read; DeepSeek-V3's FP8 format."""

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.cache.layout import init_kv_cache
from jinfer.config.quantization import Fp8Config
from jinfer.models import fp8
from jinfer.models.fp8 import Fp8Weight, dequantize, kernel_layout
from jinfer.models.registry import forward, fuse_qkv, shard_weights
from jinfer.parallel.mesh import array_specs, make_mesh, mesh_forward
from jinfer.weights.loader import load_weights, resolve_model, with_online_fp8

from ..conftest import DATA
from . import test_golden_qwen3_5 as q35
from .test_golden_tiny import (
    NUM_PAGES,
    OPS,
    PAGE,
    check_batched_chunked_prefill,
    check_prompt_and_decodes,
    decode_batch,
    empty_cache,
    placed_as_outputs,
    prefill_batch,
    scrambled_pages,
    sharded_model,
)


def load(name, mesh=None, online=False):
    src = resolve_model(DATA / f"tiny-{name}")
    if online:
        src = dataclasses.replace(src, config=src.config.replace(quantization=Fp8Config((16, 16), online=True)))
    return src.config, load_weights(src, "float32", mesh, progress=False)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(arch):
    """Logits equal HF's on the dequantized weights to float32 noise (the same products, other summation order); every
    greedy token as HF's. The weights stay FP8 on the device, what the checkpoint keeps unquantized stays so."""
    cfg, w = load(f"{arch}-fp8")
    gold = np.load(DATA / "golden" / f"tiny-{arch}-fp8.npz")
    layer = w.layers[0]
    assert cfg.quantization.block == (16, 16) and isinstance(layer.wq, Fp8Weight)
    assert layer.wq.w.dtype == jnp.float8_e4m3fn and layer.wq.scale.shape == (64 // 16, 256 // 16)
    assert not isinstance(w.lm_head, Fp8Weight) and not isinstance(layer.attn_norm, Fp8Weight)
    if arch == "qwen3":  # stored unquantized though the config does not list it: kept as stored
        assert not isinstance(w.layers[1].wo, Fp8Weight) and isinstance(w.layers[0].wo, Fp8Weight)
    else:  # experts stacked with their scales [E, in / 16, out / 16]; the router as stored (bf16 scales read too)
        assert layer.w_gate.scale.shape == (8, 4, 2) and not isinstance(layer.router, Fp8Weight)
    w = fuse_qkv(cfg, w)  # q|k|v joined with their scales, as the engine runs one device
    assert isinstance(w.layers[0].wqkv, Fp8Weight) and w.layers[0].wq is None
    step = jax.jit(partial(forward, cfg=cfg), donate_argnames=("kv_cache",))
    if arch == "qwen3":  # (each step shape is a compile: the MoE model's prefill steps only, to keep this file fast)
        check_prompt_and_decodes(step, w, empty_cache(cfg), gold, 1)
    check_batched_chunked_prefill(step, w, empty_cache(cfg), gold)


def test_fp8_qwen3_5_matches_hf():
    """Qwen3.5: FP8 in_proj_qkv / z, out_proj, attention and MLP; in_proj_a / b unquantized (modules_to_not_convert),
    so the linear layers' input projections stay apart. Prefill only (one compile): decode steps read the same
    projections."""
    cfg, w = q35.load(DATA / "tiny-qwen3_5-fp8")
    gold = np.load(DATA / "golden" / "tiny-qwen3_5-fp8.npz")
    assert isinstance(w.layers[0].lin_qkv, Fp8Weight) and not isinstance(w.layers[0].lin_a, Fp8Weight)
    w = fuse_qkv(cfg, w)
    assert w.layers[0].lin_in is None and isinstance(w.layers[1].wqkv, Fp8Weight)
    step = jax.jit(partial(forward, cfg=cfg), donate_argnames=("kv_cache",))
    prompt, greedy = gold["prompt_0"].tolist(), gold["greedy_0"].tolist()
    pages, slot = q35.pages_for(0, (len(prompt) + len(greedy)) // PAGE + 1), [5]
    kv = q35.placed_as_outputs(q35.empty_cache(cfg), w)
    logits, kv = step(w, q35.bucket_batch([(prompt, 0, pages)], q35.SMALL, slot), kv)
    np.testing.assert_allclose(np.asarray(logits[:len(prompt)]), gold["prefill_logits_0"], atol=q35.ATOL, rtol=1e-4)
    assert int(np.argmax(logits[len(prompt) - 1])) == greedy[0]


def test_fp8_checkpoint_tp2_matches_hf():
    """tp=2 on fake devices: values and scales split alike (column-parallel q|k|v / gate / up by output blocks,
    row-parallel o / down by input blocks), q|k|v fused per shard with its scales."""
    mesh = make_mesh(2)
    cfg, w = load("qwen3-fp8", mesh)
    w = shard_weights(cfg, w, mesh)
    layer = w.layers[0]
    assert isinstance(layer.wqkv, Fp8Weight)
    assert layer.wo.scale.sharding.shard_shape(layer.wo.scale.shape) == (256 // 16 // 2, 64 // 16)
    # q|k|v's, the MLP's and o's values [out, in] (fp8.kernel_layout), their shards the [in, out] ones' transposed
    for wt in (layer.wqkv, layer.wo, layer.w_gate, layer.w_down):
        scale_shard = wt.scale.sharding.shard_shape(wt.scale.shape)
        assert wt.transposed and wt.w.sharding.shard_shape(wt.w.shape)[::-1] == \
            tuple(int(n) * b for n, b in zip(scale_shard, wt.block, strict=True))
    kv = init_kv_cache(cfg, NUM_PAGES, PAGE, "float32", mesh)
    step = jax.jit(mesh_forward(forward, cfg, OPS["ref"], mesh, array_specs(w), array_specs(kv)), donate_argnums=(2,))
    check_batched_chunked_prefill(step, w, kv, np.load(DATA / "golden" / "tiny-qwen3-fp8.npz"))


# Online FP8 (16 x 16 blocks) of the tiny float32 models against their own HF goldens: e4m3's 3 mantissa bits give
# each weight ~2-3% relative error; on these random-weight models (logits' std ~0.8) the logits move by ~0.1 RMS.
ONLINE_RMS = 0.12  # RMS of (FP8 - float) logits over every prompt position, relative to the logits' RMS (~0.08)
ONLINE_ARGMAX = 0.8  # fraction of positions whose argmax (next token) is unchanged (~0.9 here)


def test_online_fp8_close_to_unquantized(arch="qwen3_moe"):
    """(The MoE model: its experts [E, in, out] and its dense layer 1.)"""
    cfg, w = load(arch, online=True)
    assert isinstance(w.layers[0].wq, Fp8Weight) and isinstance(w.layers[0].w_down, Fp8Weight)
    gold = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    step = jax.jit(partial(forward, cfg=cfg))
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(2)]
    pages = [scrambled_pages(3, 8), scrambled_pages(4, 8)[::-1]]
    logits, _ = step(w, prefill_batch([(p, 0, pg) for p, pg in zip(prompts, pages, strict=True)]), empty_cache(cfg))
    n0, n1 = len(prompts[0]), len(prompts[1])
    got = np.concatenate([np.asarray(logits[:n0]), np.asarray(logits[n0:n0 + n1])])
    want = np.concatenate([gold["prefill_logits_0"], gold["prefill_logits_1"]])
    rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
    same = np.mean(got.argmax(-1) == want.argmax(-1))
    assert rel < ONLINE_RMS and same >= ONLINE_ARGMAX, (rel, same)


def test_online_fp8_keeps_a_checkpoints_own_format():
    """`quantization="fp8"` on a block-FP8 checkpoint reads it as it is (its blocks); on a float one, 128 x 128."""
    fp8 = resolve_model(DATA / "tiny-qwen3-fp8")
    assert with_online_fp8(fp8) is fp8
    assert with_online_fp8(resolve_model(DATA / "tiny-qwen3")).config.quantization == Fp8Config(online=True)


def test_dummy_fp8_shape():
    """`dummy:<shape>-fp8`: a named shape with FP8 linear weights (128 x 128 blocks), made on the device."""
    src = resolve_model("dummy:smollm2-135m-fp8,num_layers=1,vocab_size=256")
    assert src.config.quantization == Fp8Config(online=True) and src.config.num_layers == 1
    w = load_weights(src, "bfloat16", progress=False)
    wq = w.layers[0].wq
    assert isinstance(wq, Fp8Weight) and wq.w.dtype == jnp.float8_e4m3fn and wq.scale.shape == (5, 5)  # 576 / 128
    assert 0.01 < float(jnp.std(dequantize(wq))) < 0.03 and w.embed.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown shape"):
        resolve_model("dummy:nope-fp8")


# |logit - HF| bounds where the Pallas kernels read the FP8 weights: they quantize the activations to e4m3 per row and K
# tile (pallas_kernels/dense/fp8_tiles.py), HF's reference does not (logits' std ~0.8). About twice the largest
# difference measured: tiny-qwen3-fp8's two decode steps 0.059; tiny-qwen3_moe-fp8's 8 positions 0.276 (one device and
# ep=2 alike; RMS 0.035-0.093 a position).
W8A8_ATOL = 0.12
MOE_W8A8_ATOL = 0.55
# A greedy token may differ from HF's only where HF's two best logits are this close: measured, one flip at a gap of
# 0.069 (tiny-qwen3_moe-fp8, prompt 0's fourth greedy token).
NEAR_TIE = 0.1


def test_fp8_pallas_decode_close_to_hf(caplog):
    """The Pallas backend (interpreted) on the FP8 checkpoint's decode steps: the fused MLP, the skinny o GEMM and the
    norm + q|k|v kernel read the FP8 weights with their 16 x 16 block scales (the MLP's and o's [out, in], as the
    engine keeps them: fp8.kernel_layout; layer 1's o is stored unquantized:
    plain) and meet them with e4m3 activations, the norm + q|k|v kernel's idle programs prefetch layer 0's FP8 o;
    after the reference's prefill, two decode steps stay within W8A8_ATOL of HF's logits on the dequantized weights
    and pick HF's greedy tokens. (Decode steps only: a Pallas prefill step is one more interpreter compile.)"""
    cfg, w = load("qwen3-fp8")
    w = kernel_layout(fuse_qkv(cfg, w))  # (as the engine: the MLP's and o's FP8 values [out, in])
    gold = np.load(DATA / "golden" / "tiny-qwen3-fp8.npz")
    prefill, step = (jax.jit(partial(forward, cfg=cfg, ops=OPS[o]), donate_argnames=("kv_cache",))
                     for o in ("ref", "pallas"))
    prompt = gold["prompt_0"].tolist()
    pages = scrambled_pages(0, len(prompt) // PAGE + 2)
    logits, kv = prefill(w, prefill_batch([(prompt, 0, pages)]), placed_as_outputs(empty_cache(cfg), w))
    token = int(np.argmax(logits[len(prompt) - 1]))
    decode = str(step.trace(w, decode_batch(token, len(prompt), pages), kv).jaxpr)
    for kernel in ("fused_swiglu_mlp_t16_i16_norm_fp8_nk2", "skinny_gemm_n16_k16_s2_fp8_nk",
                   "norm_qkv_rope_write_k16_s1_pf120_fp8_nk"):  # (FP8: splits keep 4 K tiles)
        assert kernel in decode, kernel
    with caplog.at_level(logging.INFO, logger="jinfer.models.fp8"):
        for s in range(1, 3):
            logits, kv = step(w, decode_batch(token, len(prompt) + s - 1, pages), kv)
            got, want = np.asarray(logits[0]), gold["decode_logits_0"][s]
            print(f"FP8 decode step {s}: max |logit - HF| {np.abs(got - want).max():.4f}, logits std {want.std():.3f}")
            np.testing.assert_allclose(got, want, atol=W8A8_ATOL, rtol=0, err_msg=f"decode step {s}")
            assert int(np.argmax(got)) == int(np.argmax(want)) == gold["greedy_0"][s]
            token = int(np.argmax(got))
    assert "does not read them" not in caplog.text


# Greedy tokens the interpreted FP8 expert steps check (each step ~0.3 s interpreted, one compile for all): HF's 32 add
# steps, not code paths (every step is the same decode executable).
DECODES = 4


def check_token_by_token(step, w, kv, gold, i, atol, decodes=DECODES):
    """Prompt i fed one token a step, then HF's first `decodes` greedy tokens (HF's, so that a near tie the FP8
    activations flip does not change the later positions' inputs): every step is the decode executable (one compile).
    Each position's logits within `atol` of HF's (the prompt's prefill logits, then its decode logits), and its
    greedy token HF's unless HF's two best are within NEAR_TIE."""
    prompt, greedy = gold[f"prompt_{i}"].tolist(), gold[f"greedy_{i}"][:decodes].tolist()
    pages = scrambled_pages(i, (len(prompt) + len(greedy)) // PAGE + 1)
    want = np.concatenate([gold[f"prefill_logits_{i}"], gold[f"decode_logits_{i}"][1:decodes]])
    tokens, kv, diff = prompt + greedy, placed_as_outputs(kv, w), 0.0
    for pos in range(len(want)):
        logits, kv = step(w, decode_batch(tokens[pos], pos, pages), kv)
        got = np.asarray(logits[0])
        diff = max(diff, float(np.abs(got - want[pos]).max()))
        np.testing.assert_allclose(got, want[pos], atol=atol, rtol=0, err_msg=f"position {pos}")
        best, second = np.sort(want[pos])[-2:][::-1]
        assert np.argmax(got) == np.argmax(want[pos]) or best - second < NEAR_TIE, f"position {pos}"
    print(f"prompt {i}, {len(want)} positions: max |logit - HF| {diff:.4f}")


@pytest.mark.parametrize("devices,ep", [(1, False), (2, True)], ids=["one-device", "ep2"])
def test_fp8_moe_experts_on_the_kernels_match_hf(devices, ep, caplog):
    """The MoE checkpoint's FP8 experts read by the grouped GEMMs (interpreted) with their 16 x 16 block scales, not
    dequantized for the reference's ragged dots; on one device and with the experts split over two (each device's
    experts and scales): HF's logits at every position of prompt 0 and its first DECODES greedy tokens, within
    MOE_W8A8_ATOL (the kernels' e4m3 activations)."""
    src = resolve_model(DATA / "tiny-qwen3_moe-fp8")
    cfg, _, w, step, new_kv = sharded_model(src, devices, ep, "pallas")
    if ep:
        assert w.layers[0].w_gate.scale.sharding.shard_shape(w.layers[0].w_gate.scale.shape) == (4, 4, 2)
    kv = new_kv()
    decode = str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), kv))
    assert "moe_gate_up_m16_n32_k16_fp8" in decode and "moe_down_m16_n64_k16_fp8" in decode
    assert "ragged_dot" not in decode
    with caplog.at_level(logging.INFO, logger="jinfer.models.fp8"):
        check_token_by_token(step, w, kv, np.load(DATA / "golden" / "tiny-qwen3_moe-fp8.npz"), 0, MOE_W8A8_ATOL)
    assert "does not read them" not in caplog.text


def test_fp8_moe_tp2_splits_expert_scales_with_their_blocks():
    """tp=2 (the ep2 run above splits whole experts): each expert's intermediate columns split, gate / up by output
    blocks and down by input blocks, their scales alike, so each device's grouped GEMMs get their blocks' scales. The
    values are [E, out, in] (fp8.kernel_layout), split along the same logical axis."""
    mesh = make_mesh(2)
    cfg, w = load("qwen3_moe-fp8", mesh)
    layer = shard_weights(cfg, w, mesh).layers[0]
    for name, shard in (("w_gate", (8, 4, 1)), ("w_up", (8, 4, 1)), ("w_down", (8, 1, 4))):
        q = getattr(layer, name)
        assert q.transposed and q.scale.sharding.shard_shape(q.scale.shape) == shard
        assert q.w.sharding.spec == fp8.transposed_sharding(q.scale.sharding, 3).spec


def test_pallas_kernels_refuse_mixed_fp8(caplog, monkeypatch):
    """A fused MLP whose weights are not all FP8 in one block shape and layout takes the jnp path (one log line), with
    the reference's result."""
    cfg, w = load("qwen3-fp8")
    layer, x = w.layers[0], jax.random.normal(jax.random.key(0), (1, 64), jnp.float32)
    mixed = (fp8.transpose(layer.w_gate), fp8.transpose(layer.w_up), dequantize(layer.w_down))
    monkeypatch.setattr(fp8, "_refused", set())  # (one line per kernel per process)

    def mlp(ops, x, weights):
        return ops.mlp_block(x, layer.mlp_norm, *weights, 1e-6)

    with caplog.at_level(logging.INFO, logger="jinfer.models.fp8"):
        got = jax.jit(partial(mlp, OPS["pallas"]))(x, mixed)
    np.testing.assert_allclose(got, jax.jit(partial(mlp, OPS["ref"]))(x, mixed), rtol=1e-6)
    assert caplog.text.count("does not read them") == 1


def test_fp8_deepseek_v3_matches_hf():
    """DeepSeek-V3's own FP8 format (every projection block-FP8, MLA's q_a / q_b / kv_a / kv_b too, in partial 16 x 16
    blocks at the 24- and 40-row shapes; the routed experts [E, out, in]): logits as HF's on the dequantized weights
    through a batched chunked prefill, one device, and with the experts split over two devices; the Pallas kernels
    (interpreted: the grouped GEMMs on the [E, out, in] experts, the fused MLP, the skinny GEMM, MLA decode) a token a
    step within the e4m3 activations' rounding."""
    src, gold = resolve_model(DATA / "tiny-deepseek_v3-fp8"), np.load(DATA / "golden" / "tiny-deepseek_v3-fp8.npz")
    for devices, ep in ((1, False), (2, True)):
        cfg, _, w, step, new_kv = sharded_model(src, devices, ep, "ref")
        layer = w.layers[1]
        assert all(isinstance(q, Fp8Weight) for q in (w.layers[0].wq_a, w.layers[0].wkv_a, layer.wkv_b, layer.w_gate))
        assert layer.w_gate.transposed and not isinstance(layer.router, Fp8Weight)
        check_batched_chunked_prefill(step, w, new_kv(), gold)
    _, _, w, step, new_kv = sharded_model(src, 1, False, "pallas")
    decode = str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), new_kv()))
    assert all(k in decode for k in ("moe_gate_up_m16_n32_k16_fp8", "fused_swiglu_mlp", "mla_decode_attention"))
    check_token_by_token(step, w, new_kv(), gold, 0, MOE_W8A8_ATOL, decodes=4)

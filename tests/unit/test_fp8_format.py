"""The block-FP8 format without a model: config parsing, which weights a spec marks FP8, block quantization and
dequantization (partial blocks), joining and sharding FP8 weights, the engine's `quantization="fp8"`."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.config.model import ModelConfig
from jinfer.config.quantization import Fp8Config, quantization_from_hf
from jinfer.models import llama, qwen3_moe
from jinfer.models.fp8 import (
    Fp8Weight,
    check_shardable,
    concat_columns,
    dequantize,
    dequantize_np,
    quantize,
    quantize_np,
)
from jinfer.models.spec import quantize_specs
from jinfer.weights.safetensors import block_scales

from ..conftest import DATA

QC = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def test_quantization_config_parsed_and_refused():
    assert quantization_from_hf(None) is None
    assert quantization_from_hf(QC) == Fp8Config((128, 128))
    assert quantization_from_hf(QC | {"modules_to_not_convert": ["lm_head"]}).modules_to_not_convert == ("lm_head",)
    for bad, field in [({"quant_method": "gptq"}, "quant_method"), (QC | {"fmt": "e5m2"}, "fmt"),
                       (QC | {"activation_scheme": "static"}, "activation_scheme"),
                       (QC | {"weight_block_size": [128]}, "weight_block_size"),
                       (QC | {"weight_block_size": [0, 128]}, "weight_block_size")]:
        with pytest.raises(ValueError, match=field):
            quantization_from_hf(bad)
    cfg = ModelConfig.from_hf_config(DATA / "tiny-qwen3-fp8")
    assert cfg.quantization.block == (16, 16) and hash(cfg)  # static under jit


def test_specs_mark_linear_weights_only():
    cfg = ModelConfig.from_hf_config(DATA / "tiny-qwen3_moe").replace(quantization=Fp8Config(
        (16, 32), ("model.layers.2.mlp.experts",)))
    specs = quantize_specs(qwen3_moe.weight_specs(cfg), cfg.quantization)
    fp8 = {k for k, s in specs.items() if s.fp8_block is not None}
    assert "layers.0.wq" in fp8 and "layers.0.w_gate" in fp8 and "layers.1.w_down" in fp8
    assert specs["layers.0.wq"].fp8_block == (32, 16)  # HF's [out, in] block -> jinfer's (in, out)
    assert specs["layers.0.w_gate"].scale_shape() == (8, 2, 2)  # [E, 64 / 32, 32 / 16]
    for kept in ("embed", "lm_head", "final_norm", "layers.0.router", "layers.0.attn_norm", "layers.2.w_up"):
        assert kept not in fp8
    assert quantize_specs(llama.weight_specs(cfg), None) == llama.weight_specs(cfg)
    skip = Fp8Config(modules_to_not_convert=("mlp.gate", "model.language_model.layers.0.self_attn.q_proj"))
    assert not skip.converts("model.layers.3.mlp.gate") and skip.converts("model.layers.3.mlp.gate_proj")
    assert not skip.converts("model.layers.0.self_attn.q_proj") and skip.converts("model.layers.1.self_attn.q_proj")


@pytest.mark.parametrize("shape,block", [((64, 96), (16, 32)), ((2, 40, 50), (16, 16)), ((576, 7), (128, 128))])
def test_quantize_roundtrip_with_partial_blocks(shape, block):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32) * np.linspace(0.01, 3, shape[-1])
    q = quantize(jnp.asarray(w), block)
    assert q.w.dtype == jnp.float8_e4m3fn and q.w.shape == shape
    assert q.scale.shape == (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    got = np.asarray(dequantize(q))
    # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 of each block's values above its amax / 2^6
    assert np.all(np.abs(got - w) <= np.abs(w) * 2**-4 + np.asarray(q.scale).max() * 2**-3)
    hq, hs = quantize_np(w, block)  # the host twin gives the same values
    np.testing.assert_allclose(dequantize_np(hq, hs, block), got, rtol=1e-6)


def test_concat_and_shard_checks():
    a, b = (quantize(jnp.ones((32, n)), (16, 16)) for n in (32, 16))
    both = concat_columns([a, b])
    assert isinstance(both, Fp8Weight) and both.shape == (32, 48) and both.scale.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(dequantize(both)), np.ones((32, 48)))
    assert concat_columns([a, jnp.ones((32, 8))]) is None  # FP8 beside unquantized: kept apart
    assert concat_columns([a, quantize(jnp.ones((32, 8)), (16, 16))]) is None  # a part that is not whole blocks
    check_shardable("w", (64, 256), (16, 16), (1, 2))
    with pytest.raises(ValueError, match="FP8 blocks"):
        check_shardable("w", (64, 48), (16, 16), (1, 2))


def test_engine_accepts_fp8():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        EngineConfig(quantization="awq")


W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def ct(*strategies, **top):
    """A compressed-tensors quantization_config: one group per weight strategy (a list: its block_structure)."""
    groups = {f"group_{i}": {"targets": ["Linear"], "input_activations": ACTS,
                             "weights": W | ({"strategy": "block", "block_structure": s} if isinstance(s, list)
                                             else {"strategy": s})}
              for i, s in enumerate(strategies)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups,
            "ignore": ["lm_head", "re:.*mlp.gate$"], "sparsity_config": {}, "transform_config": {}} | top


def test_compressed_tensors_config_parsed():
    """The blocks each strategy lands on (see jinfer/config/quantization.py), `weight_scale` names, `ignore` as
    modules_to_not_convert with regular expressions."""
    assert quantization_from_hf(ct("tensor")) == Fp8Config((128, 128), ("lm_head", "re:.*mlp.gate$"), False, "_scale")
    assert quantization_from_hf(ct("channel")).block == (1, 128)
    assert quantization_from_hf(ct("tensor", "channel")).block == (1, 128)
    assert quantization_from_hf(ct([64, 32], [64, 32])).block == (64, 32)
    assert quantization_from_hf(ct("channel", format="naive-quantized")).scale_suffix == "_scale"
    static = ct("tensor")
    static["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                               "dynamic": False}
    assert quantization_from_hf(static).block == (128, 128)  # static activation scales: accepted, not read
    weight_only = ct("channel")
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    assert quantization_from_hf(weight_only).block == (1, 128)
    q = quantization_from_hf(ct("channel"))
    assert not q.converts("model.layers.0.mlp.gate") and q.converts("model.layers.0.mlp.gate_proj")
    assert not q.converts("lm_head") and q.converts("model.layers.0.self_attn.q_proj")


def test_compressed_tensors_config_refused():
    def group(**kw):
        qc = ct("channel")
        qc["config_groups"]["group_0"] |= kw
        return qc

    cases = [
        (group(weights=W | {"strategy": "channel", "type": "int"}), "config_groups.group_0.weights: type='int'"),
        (group(weights=W | {"strategy": "group", "num_bits": 4, "group_size": 16}), "num_bits=4"),
        (group(weights=W | {"strategy": "group"}), "weights.strategy='group'"),
        (group(weights=W | {"strategy": "channel", "symmetric": False}), "symmetric=False"),
        (group(weights=W | {"strategy": "channel", "dynamic": True}), "dynamic=True"),
        (group(weights=W | {"strategy": "block", "block_structure": [128]}), "block_structure"),
        (group(weights=None), "group_0.weights=None"),
        (group(input_activations={"num_bits": 8, "type": "int", "strategy": "token"}), "input_activations"),
        (group(output_activations=ACTS), "output_activations"),
        (group(format="pack-quantized"), "group_0.format='pack-quantized'"),
        (group(targets="Linear"), "targets"),
        (ct("channel", format="int-quantized"), "quantization_config.format='int-quantized'"),
        (ct("channel", format=None), "quantization_config.format=None"),
        (ct("channel", sparsity_config={"format": "sparse-24"}), "sparsity_config"),
        (ct("channel", transform_config={"config_groups": {}}), "transform_config"),
        (ct("channel", config_groups={}), "config_groups"),
        (ct("channel", ignore="lm_head"), "ignore"),
        (ct("channel", [128, 128]), "mix weight strategies"),
        (ct([128, 128], [64, 64]), "mix weight strategies"),
    ]
    for bad, field in cases:
        with pytest.raises(ValueError, match=re.escape(field)):
            quantization_from_hf(bad)


def test_block_scales_spread_tensor_and_channel_scales():
    """A checkpoint's scales as one per block: stored blocks pass, one scale fills them, per-channel ones repeat along
    `in` (one-row blocks); the dequantized weight is the stored values times the stored scales, exactly."""
    rng = np.random.default_rng(0)
    out, inp = 40, 300
    q = (rng.normal(size=(out, inp)) * 50).astype(np.float32).astype(jnp.float8_e4m3fn)
    row = rng.uniform(0.001, 0.01, size=(out, 1)).astype(np.float32)
    # (stored scales, the config's block, the block scales' shape, each weight value's scale [out, in])
    for stored, block, shape, per_value in [
            (np.float32(0.02), (128, 128), (1, 3), np.full((out, inp), 0.02, np.float32)),  # [] (AutoFP8's)
            (np.array([0.02], np.float32), (1, 128), (40, 3), np.full((out, inp), 0.02, np.float32)),
            (row, (1, 128), (40, 3), np.broadcast_to(row, (out, inp))),
            (row[:, 0], (1, 100), (40, 3), np.broadcast_to(row, (out, inp)))]:
        got = block_scales("s", stored, (out, inp), block)
        assert got.shape == shape and got.dtype == np.float32
        np.testing.assert_array_equal(dequantize_np(q, got, block), q.astype(np.float32) * per_value)
    blocks = rng.uniform(size=(3, 5)).astype(np.float32)
    np.testing.assert_array_equal(block_scales("s", blocks, (out, inp), (16, 64)), blocks)
    experts = rng.uniform(size=(8, out, 1)).astype(np.float32)
    assert block_scales("s", experts, (8, out, inp), (1, 128)).shape == (8, 40, 3)
    with pytest.raises(ValueError, match="tensor 's' has shape \\(40, 1\\), expected \\(1, 3\\)"):
        block_scales("s", row, (out, inp), (128, 128))  # per-channel scales where the config says per tensor

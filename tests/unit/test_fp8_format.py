"""The block-FP8 format without a model: config parsing, which weights a spec marks FP8, block quantization and
dequantization (partial blocks), joining and sharding FP8 weights, the engine's `quantization="fp8"`."""

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

"""Dummy weights: N(0, 0.02) / ones, deterministic under the seed, the same on any mesh, two compiles."""

import json

import jax
import numpy as np

from jinfer.parallel.mesh import make_mesh
from jinfer.weights import dummy
from jinfer.weights.loader import load_weights, resolve_model

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 256, "intermediate_size": 512,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
       "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False}


def _source(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    return resolve_model(tmp_path, load_format="dummy")


def _leaves(w):
    return [np.asarray(x) for x in jax.tree.leaves(w)]


def test_dummy_weights_deterministic_and_mesh_independent(tmp_path):
    src = _source(tmp_path)
    dummy._group_init.cache_clear()
    a = load_weights(src, "float32", seed=1, progress=False)
    assert dummy._group_init.cache_info().currsize == 2  # one jitted init for the 3 layers, one for the rest
    b = load_weights(src, "float32", mesh=make_mesh(2), seed=1, progress=False)
    c = load_weights(src, "float32", seed=2, progress=False)
    assert b.layers[0].wq.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    for x, y, z in zip(_leaves(a), _leaves(b), _leaves(c), strict=True):
        np.testing.assert_array_equal(x, y)
        if not (x == 1).all():  # a norm weight (ones) is the same for every seed
            assert not np.array_equal(x, z)
    np.testing.assert_array_equal(np.asarray(a.layers[0].attn_norm), 1.0)
    assert not np.array_equal(np.asarray(a.layers[0].wq), np.asarray(a.layers[1].wq))


def test_dummy_weights_are_normal_with_std_002(tmp_path):
    w = load_weights(_source(tmp_path), "bfloat16", progress=False)
    assert w.embed.dtype == jax.numpy.bfloat16
    x = np.concatenate([np.asarray(v, np.float32).ravel() for v in jax.tree.leaves(w) if v.ndim == 2])
    assert abs(x.std() - 0.02) < 0.0005 and abs(x.mean()) < 0.0005
    assert np.isfinite(x).all() and np.abs(x).max() < 6 * 0.02
    assert abs((np.abs(x) < 0.02).mean() - 0.6827) < 0.01  # the normal's share within one sigma

"""Qwen3-235B-A22B's layout at toy sizes on 8 fake CPU devices (the CPU half of the 8-GPU run): 64 q heads
over 4 kv heads, so tensor parallel 8 stores each kv head on two devices; 128 experts, top-8, every layer
sparse, so expert parallel 8 holds 16 whole experts per device and tensor parallel 8 splits every expert's
columns eight ways. The sharded forward must give one device's logits and greedy tokens (one device runs
the jnp reference ops; the sharded runs use the reference ops or the Pallas kernels, interpreted here)."""

from functools import partial

import jax
import numpy as np
import pytest

from jinfer.cache.layout import init_kv_cache
from jinfer.config.model import NAMED_SHAPES
from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, shard_weights
from jinfer.parallel.mesh import array_specs, check_parallel, make_mesh, mesh_forward
from jinfer.weights.loader import ModelSource, load_weights

from .test_golden_tiny import OPS

# The 235B shape with every size but the layout shrunk: heads, kv heads, experts and top-k are the real ones.
CFG = NAMED_SHAPES["qwen3-235b-a22b"].replace(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                num_layers=2, head_dim=16, moe_intermediate_size=128,
                                                max_position_embeddings=256)
PAGE, NUM_PAGES = 4, 32
PROMPTS = [[(7 * i + 3) % CFG.vocab_size for i in range(13)], [(11 * i + 5) % CFG.vocab_size for i in range(6)]]
PAGES = [[3, 9, 1, 12, 5, 7, 20], [2, 15, 8, 30, 11]]  # non-contiguous, disjoint
DECODES = 8
ATOL = 1e-4  # float32, a different summation order (psum over 8 shards): logits are ~0.1 in size


def run(step, w, kv) -> tuple[list[np.ndarray], list[list[int]]]:
    """Both prompts in one prefill, then DECODES greedy steps of both: every step's logits, and the tokens."""
    logits, kv = step(w, make_batch([(p, 0, pg) for p, pg in zip(PROMPTS, PAGES, strict=True)], PAGE,
                                    all_logits=True), kv)
    got = [np.asarray(logits)]
    ends = np.cumsum([len(p) for p in PROMPTS]) - 1
    tokens = [[int(np.argmax(got[0][e]))] for e in ends]
    for s in range(DECODES):
        seqs = [([t[-1]], len(p) + s, pg) for t, p, pg in zip(tokens, PROMPTS, PAGES, strict=True)]
        logits, kv = step(w, make_batch(seqs, PAGE, pages_per_seq=max(map(len, PAGES))), kv)
        got.append(np.asarray(logits))
        for t, row in zip(tokens, got[-1], strict=True):
            t.append(int(np.argmax(row)))
    return got, tokens


def weights(mesh, ep):
    return load_weights(ModelSource("dummy", None, CFG), "float32", mesh, progress=False, expert_parallel=ep)


@pytest.fixture(scope="module")
def one_device():
    mesh = make_mesh(1)
    step = jax.jit(partial(forward, cfg=CFG, ops=OPS["ref"]), donate_argnums=(2,))
    return run(step, weights(mesh, False), init_kv_cache(CFG, NUM_PAGES, PAGE, "float32", mesh))


def test_the_layout_is_235bs():
    full = NAMED_SHAPES["qwen3-235b-a22b"]
    for field in ("architecture", "num_heads", "num_kv_heads", "num_experts", "num_experts_per_tok", "qk_norm",
                  "mlp_only_layers", "decoder_sparse_step", "tie_word_embeddings"):
        assert getattr(CFG, field) == getattr(full, field), field
    assert all(CFG.is_moe_layer(i) for i in range(CFG.num_layers))
    assert (CFG.num_heads, CFG.num_kv_heads, CFG.num_experts, CFG.num_experts_per_tok) == (64, 4, 128, 8)


@pytest.mark.parametrize("ep,ops", [(False, "ref"), (True, "ref"), (False, "pallas"), (True, "pallas")],
                         ids=["tp8-ref", "ep8-ref", "tp8-pallas", "ep8-pallas"])
def test_eight_devices_match_one(one_device, ep, ops):
    if len(jax.devices()) < 8:
        pytest.skip(f"8 devices needed, {len(jax.devices())} here")
    check_parallel(CFG, 8, ep)
    mesh = make_mesh(8)
    w = shard_weights(CFG, weights(mesh, ep), mesh, expert_parallel=ep)
    layer = w.layers[0]
    # each device: 8 q heads and one kv head (each of the 4 stored twice); 16 whole experts (ep) or 16 of
    # every expert's 128 columns (tp; 16 is the Pallas MoE kernels' smallest tile: below it they fall back)
    assert layer.wqkv.sharding.shard_shape(layer.wqkv.shape)[1] == (8 + 2) * CFG.head_dim
    assert layer.w_gate.sharding.shard_shape(layer.w_gate.shape) == ((16, 64, 128) if ep else (128, 64, 16))
    kv = init_kv_cache(CFG, NUM_PAGES, PAGE, "float32", mesh)
    step = jax.jit(mesh_forward(forward, CFG, OPS[ops], mesh, array_specs(w), array_specs(kv)), donate_argnums=(2,))
    got, tokens = run(step, w, kv)
    want, want_tokens = one_device
    for s, (g, r) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=1e-4, err_msg=f"step {s}")
    assert tokens == want_tokens

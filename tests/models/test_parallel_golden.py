"""The tiny HF goldens on several (fake CPU) devices: the forward under shard_map with tensor parallel
attention / MLP / vocab, and tensor or expert parallel MoE, must give HF's logits and greedy tokens like
one device does. Layouts covered: kv heads split (tp <= kv heads) and replicated (tp > kv heads), a fused
q|k|v per shard, q/k/v biases (qwen2), a tied vocab-parallel embedding (qwen2), experts split by columns
(tp) and whole (ep, down to one expert per device); the jnp reference ops and the Pallas kernels
(interpreted here)."""


import jax
import pytest

from jinfer.weights.loader import resolve_model

from ..conftest import DATA
from .test_golden_tiny import check_batched_chunked_prefill, check_fp8_prompt, check_prompt_and_decodes, sharded_model

# (arch, devices, expert parallel, ops): every layout at least once with each ops, every model at least once (the
# tiny models have 2 kv heads: tp=2 splits them, tp=4 and 8 replicate them); tp=8 needs 8 q heads (qwen3, qwen3_moe).
# The Pallas kernels (interpreted, each case's compiles several times the reference's) here for kv heads split (with
# q/k/v biases, a dense MLP, a tied vocab) and whole experts, one per device; kv heads replicated and experts split by
# columns with the Pallas kernels: test_parallel_235b_layout.py's tp8-pallas (against one device's jnp forward,
# which test_golden_tiny.py checks against HF), and at the engine level test_parallel_engine.py's qwen3_moe ep4
# Pallas case (kv heads replicated, against HF's ids).
CASES = [
    ("llama", 4, False, "ref"),
    ("qwen2", 2, False, "pallas"), ("qwen2", 4, False, "ref"),
    ("qwen3", 8, False, "ref"),
    ("qwen3_moe", 2, False, "ref"), ("qwen3_moe", 8, False, "ref"),
    ("qwen3_moe", 2, True, "ref"), ("qwen3_moe", 8, True, "pallas"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'ep' if c[2] else 'tp'}{c[1]}-{c[3]}")
def sharded(request):
    import numpy as np

    arch, n, ep, ops = request.param
    if n > len(jax.devices()):
        pytest.skip(f"{n} devices needed, {len(jax.devices())} here")
    src = resolve_model(DATA / f"tiny-{arch}")
    cfg, mesh, w, step, new_kv = sharded_model(src, n, ep, ops)
    gold = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    return cfg, mesh, ep, w, gold, step, new_kv


def split(a, axis):
    """How many ways an array's axis is split over its devices."""
    return a.shape[axis] // a.sharding.shard_shape(a.shape)[axis]


def test_weights_are_split(sharded):
    cfg, mesh, ep, w, *_ = sharded
    n, layer = mesh.size, w.layers[0]
    assert layer.wqkv is not None and split(layer.wqkv, 1) == n and split(layer.wo, 0) == n
    assert split(w.embed, 0) == n
    if cfg.num_experts:  # whole experts (ep) or each expert's intermediate columns (tp)
        assert (split(layer.w_gate, 0), split(layer.w_gate, 2), split(layer.w_down, 1)) == ((n, 1, 1) if ep
                                                                                           else (1, n, n))


def test_prompt_and_decodes_match_hf(sharded):
    cfg, mesh, ep, w, gold, step, kv = sharded
    check_prompt_and_decodes(step, w, kv(), gold, 1)


def test_batched_chunked_prefill_matches_hf(sharded):
    cfg, mesh, ep, w, gold, step, kv = sharded
    check_batched_chunked_prefill(step, w, kv(), gold)


def test_fp8_kv_cache_with_kv_heads_replicated():
    """An FP8 cache on 4 devices (tiny Qwen3's 2 kv heads each stored twice, their scales too): HF's greedy tokens,
    the logits within test_golden_tiny.FP8_ATOL."""
    import jax.numpy as jnp
    import numpy as np

    if len(jax.devices()) < 4:
        pytest.skip("4 devices needed")
    cfg, mesh, w, step, new_kv = sharded_model(resolve_model(DATA / "tiny-qwen3"), 4, False, "ref",
                                               kv_dtype=jnp.float8_e4m3fn)
    kv = new_kv()
    assert kv[0][2].shape == (4,) and kv[0][2].sharding.spec[0] == "tp"
    check_fp8_prompt(step, w, kv, np.load(DATA / "golden" / "tiny-qwen3.npz"), 2)

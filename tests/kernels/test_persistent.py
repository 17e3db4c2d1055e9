"""persistent.o_proj_mlp_block (one dataflow launch for o + residual + the MLP block) vs the jnp model ops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.persistent import COUNTERS, o_proj_mlp_block, o_proj_mlp_block_reference
from tests.kernels.conftest import MODES, assert_close


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,ko,hidden,inter,kw", [
    (1, 256, 256, 512, {"o_block_n": 32, "o_block_k": 64, "block_i": 128, "preload": 1}),
    (5, 128, 256, 384, {"o_block_n": 16, "block_i": 64, "preload": 2}),
    (16, 192, 256, 256, {}),
])
def test_o_proj_mlp_block_matches_reference(mode, tokens, ko, hidden, inter, kw):
    """The counters come back zero, so a second launch on them (the next layer's) gives the same result."""
    rng = np.random.default_rng(tokens)
    dtype = jnp.bfloat16

    def arr(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    args = (arr((tokens, ko)), arr((ko, hidden), ko**-0.5), arr((tokens, hidden), 2.0), arr((hidden,), 0.5) + 1,
            arr((hidden, inter), hidden**-0.5), arr((hidden, inter), hidden**-0.5), arr((inter, hidden), inter**-0.5))
    want, _ = o_proj_mlp_block_reference(*args)
    counters = jnp.zeros((8,), jnp.int32)
    for _ in range(2):
        out, counters = o_proj_mlp_block(*args, counters, interpret=mode == "interpret", **kw)
        assert out.shape == (tokens, hidden) and out.dtype == dtype
        assert_close(out, want, dtype, mode)
        np.testing.assert_array_equal(np.asarray(counters), 0)
    # a layer's own slot (block indices as ids, the phase count left in the slot: hidden / o_block_n programs)
    for slot in (5, 6):
        out, counters = o_proj_mlp_block(*args, counters, slot=slot, interpret=mode == "interpret", **kw)
        assert_close(out, want, dtype, mode)
    assert counters[5] == counters[6] == hidden // kw.get("o_block_n", 32) and not np.asarray(counters)[:5].any()


def test_o_proj_mlp_block_checks():
    z = jnp.zeros
    args = [z((2, 128), jnp.bfloat16), z((128, 128), jnp.bfloat16), z((2, 128), jnp.bfloat16), z((128,), jnp.bfloat16),
            z((128, 256), jnp.bfloat16), z((128, 256), jnp.bfloat16), z((256, 128), jnp.bfloat16)]
    with pytest.raises(ValueError, match="counters"):
        o_proj_mlp_block(*args, z((COUNTERS - 1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="tokens"):
        o_proj_mlp_block(z((17, 128), jnp.bfloat16), *args[1:], z((4,), jnp.int32), interpret=True)
    bad = list(args)
    bad[6] = z((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="w_down"):
        o_proj_mlp_block(*bad, z((4,), jnp.int32), interpret=True)

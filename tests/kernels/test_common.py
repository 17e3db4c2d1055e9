"""The kernels' shared helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import search_right


def test_search_right_is_searchsorted_without_a_loop():
    """`search_right` gives numpy's searchsorted(side="right") (duplicates, values outside the range) and compiles to
    no while loop (which a GPU executable drives from the host, cutting its command buffer)."""
    rng = np.random.default_rng(0)
    bounds = np.sort(rng.integers(0, 50, 17)).astype(np.int32)  # (a batch's query starts: repeats at padding)
    x = np.arange(-3, 60, dtype=np.int32)
    f = jax.jit(search_right)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(bounds), jnp.asarray(x))),
                                  np.searchsorted(bounds, x, side="right"))
    assert "while" not in f.lower(jnp.asarray(bounds), jnp.asarray(x)).compile().as_text()

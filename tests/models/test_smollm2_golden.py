"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers.

HF loaded the same GGUF (dequantized to float32) and recorded greedy continuations
(tests/data/golden/smollm2_greedy.json, from scripts/make_golden.py). We decode all prompts in one
batch in float32 and must produce the same 32 ids for every prompt.
"""

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.batch import make_batch
from jinfer.models.llama import forward
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

PAGE = 16


@pytest.fixture(scope="module")
def smollm2(default_gguf):
    src = resolve_model(default_gguf)
    return src.config, load_weights(src, "float32", progress=False)


@pytest.fixture(scope="module")
def golden():
    return json.loads((DATA / "golden" / "smollm2_greedy.json").read_text())["records"]


def test_greedy_ids_equal_hf_for_32_tokens(smollm2, golden):
    cfg, w = smollm2
    step = jax.jit(partial(forward, cfg=cfg), donate_argnames=("kv_cache",))
    n_new = 32
    prompts = [r["prompt_ids"] for r in golden]
    pages_each = (max(map(len, prompts)) + n_new) // PAGE + 1
    # interleave page ids across sequences so no sequence's pages are contiguous
    # (page 0 is reserved for padding)
    pages = [list(range(b + 1, len(prompts) * pages_each + 1, len(prompts))) for b in range(len(prompts))]
    shape = (len(prompts) * pages_each + 1, PAGE, cfg.num_kv_heads, cfg.head_dim)
    kv = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers))
    logits, kv = step(w, make_batch([(p, 0, pg) for p, pg in zip(prompts, pages)], PAGE), kv)
    first_logits = np.asarray(logits[0])
    outs = [[int(t)] for t in np.argmax(np.asarray(logits), axis=-1)]
    for s in range(1, n_new):
        batch = make_batch([([o[-1]], len(p) + s - 1, pg) for o, p, pg in zip(outs, prompts, pages)], PAGE)
        logits, kv = step(w, batch, kv)
        for o, t in zip(outs, np.argmax(np.asarray(logits), axis=-1)):
            o.append(int(t))
    for rec, out in zip(golden, outs):
        assert out == rec["output_ids"][:n_new], f"{rec['kind']} prompt {rec.get('text') or rec.get('messages')}"
    # and the logits themselves, at the France prompt's last position
    ref = np.load(DATA / "golden" / "smollm2_chat0_last_logits.npy")
    np.testing.assert_allclose(first_logits, ref, atol=2e-3, rtol=1e-3)


def test_france_answer(golden):
    france = golden[0]
    assert france["messages"][-1]["content"] == "What is the capital of France?"
    assert france["output_text_until_eos"].startswith("The capital of France is Paris.")

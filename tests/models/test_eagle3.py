"""The EAGLE-3 draft head (jinfer/models/eagle3.py) against a PyTorch reference, and the target's export of the hidden
states it reads.

tests/data/tiny-eagle3-qwen3 is a random head for tiny-qwen3 (draft vocabulary of 64 of its 256 ids, no embedding
of its own); its goldens (scripts/make_eagle3_golden.py: SpecForge's head on transformers' Llama blocks, fed HF's
`output_hidden_states`) hold, for three prompts, the target's states at the head's boundaries, the head's first
pass over the prompt (its output before the final norm and its logits at every row) and a greedy chain of five
drafts (each step's logits and output). Every step is padded to one bucket (PREFILL_* rows, then NUM_SEQS one-token
rows), so the module compiles a few programs only.
"""

import json
import shutil
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jinfer.config.model import ModelConfig
from jinfer.models import eagle3, llama
from jinfer.models.batch import make_batch
from jinfer.ops import ModelOps
from jinfer.weights.eagle3 import load_eagle3
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

PAGE, NUM_PAGES, PAGES_PER_SEQ = 4, 64, 8
PREFILL_TOKENS, NUM_SEQS = 48, 4
ATOL = 2e-4  # float32 against PyTorch float32
HEAD = DATA / "tiny-eagle3-qwen3"


@pytest.fixture(scope="module")
def setup():
    src = resolve_model(DATA / "tiny-qwen3")
    target = load_weights(src, "float32", progress=False)
    cfg, head = load_eagle3(HEAD, src.config, target, dtype="float32")
    golden = np.load(DATA / "golden" / "tiny-eagle3-qwen3.npz")
    n = sum(1 for k in golden.files if k.startswith("prompt_"))
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(n)]
    scrambled = np.random.default_rng(0).permutation(NUM_PAGES - 1) + 1  # page 0 is reserved
    pages = [scrambled[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ].tolist() for i in range(n)]  # non-contiguous
    return src.config, target, cfg, head, golden, prompts, pages


def head_cache(cfg, head):
    """The head's empty KV, placed as the steps return it (else a second input signature: a second compile)."""
    shape = (NUM_PAGES, PAGE, cfg.layer.num_kv_heads, cfg.layer.head_dim)
    sharding = jax.sharding.NamedSharding(head.fc.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put((jnp.zeros(shape), jnp.zeros(shape)), sharding)


def all_rows(batch):
    return replace(batch, logits_indices=np.arange(PREFILL_TOKENS, dtype=np.int32))


def packed(seqs):
    """The prefill bucket's batch of (tokens, cached, pages) per sequence; logits at each sequence's last row."""
    return make_batch(seqs, PAGE, num_tokens=PREFILL_TOKENS, num_seqs=NUM_SEQS, pages_per_seq=PAGES_PER_SEQ)


def shifted(golden, prompts, i):
    """The head's tokens for prompt i's first pass: the token after each position, the target's next at the end."""
    return prompts[i][1:] + [int(golden[f"next_{i}"])]


def stacked_aux(golden, n, rows=PREFILL_TOKENS):
    aux = np.concatenate([golden[f"aux_{i}"] for i in range(n)])
    return jnp.asarray(np.pad(aux, ((0, rows - len(aux)), (0, 0))))


forward = jax.jit(eagle3.draft_forward, static_argnames=("cfg", "ops"))
propose = jax.jit(eagle3.propose, static_argnames=("cfg", "num_steps", "ops"))


def test_config_conventions(setup):
    target_cfg, _, cfg, *_ = setup
    assert (cfg.aux_layers, cfg.draft_vocab_size, cfg.target_hidden_size) == ((0, 1, 2), 64, 64)
    assert (cfg.layer.num_heads, cfg.layer.head_dim, cfg.layer.rope_theta) == (4, 16, 1e4)  # its own, not the target's
    # SpecForge's published config for Qwen3-8B (no layer ids: the default boundaries 2, 18, 33)
    qwen3_8b = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 40960, 1e-6, 1e6, qk_norm=True)
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096, "intermediate_size": 12288,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936, "draft_vocab_size": 32000}
    c = eagle3.eagle3_config(raw, qwen3_8b)
    assert (c.aux_layers, c.draft_vocab_size, c.layer.q_size, c.layer.intermediate_size) == ((2, 18, 33), 32000,
                                                                                          4096, 12288)
    # "output of layer k" ids (SpecForge's [1, L//2 - 1, L - 4]) name the same boundaries; others are boundaries
    assert eagle3.eagle3_config(raw | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}},
                                qwen3_8b).aux_layers == (2, 18, 33)
    assert eagle3.eagle3_config(raw | {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}, qwen3_8b).aux_layers == (
        2, 18, 33)
    # vLLM's speculators export nests the layer's config
    speculators = {"architectures": ["Eagle3Speculator"], "transformer_layer_config": raw | {"model_type": "llama"},
                   "draft_vocab_size": 32000, "eagle_aux_hidden_state_layer_ids": [1, 17, 32],
                   "norm_before_residual": True}
    s = eagle3.eagle3_config(speculators, qwen3_8b)
    assert (s.aux_layers, s.draft_vocab_size, s.norm_before_residual, s.layer) == ((2, 18, 33), 32000, True, c.layer)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        eagle3.eagle3_config(raw | {"eagle_aux_hidden_state_layer_ids": [2, 18, 40]}, qwen3_8b)
    with pytest.raises(ValueError, match="architectures"):
        eagle3.eagle3_config(raw | {"architectures": ["LlamaForCausalLM"]}, qwen3_8b)


def test_first_pass_and_chain_match_reference(setup):
    """All prompts in one packed batch: the first pass's outputs and logits at every row, then each chain step
    (one token per sequence through the page tables) against the reference's."""
    _, _, cfg, head, golden, prompts, pages = setup
    n = len(prompts)
    batch = packed([(shifted(golden, prompts, i), 0, pages[i]) for i in range(n)])
    rows = int(batch.query_start[n])
    hidden = eagle3.combine_hidden(head, stacked_aux(golden, n))
    logits, x, kv = forward(head, cfg, all_rows(batch), hidden, head_cache(cfg, head))
    np.testing.assert_allclose(x[:rows], np.concatenate([golden[f"first_hidden_{i}"] for i in range(n)]), atol=ATOL)
    np.testing.assert_allclose(logits[:rows], np.concatenate([golden[f"first_logits_{i}"] for i in range(n)]),
                               atol=ATOL)
    last = jnp.asarray(batch.logits_indices)
    hidden, positions = x[last], jnp.asarray(batch.positions)[last]
    tokens = head.draft_to_target[jnp.argmax(logits[last], axis=-1)]
    step_forward = jax.jit(lambda h, ids, pos, kv: forward(head, cfg, eagle3.chain_batch(batch, ids, pos, PAGE), h, kv))
    for step in range(1, golden["chain_ids_0"].shape[0]):
        positions = positions + 1
        logits, hidden, kv = step_forward(hidden, tokens, positions, kv)
        for i in range(n):
            np.testing.assert_allclose(logits[i], golden[f"chain_logits_{i}"][step], atol=ATOL)
            np.testing.assert_allclose(hidden[i], golden[f"chain_hidden_{i}"][step], atol=ATOL)
        tokens = head.draft_to_target[jnp.argmax(logits, axis=-1)]


def test_target_exports_states_and_chain_drafts(setup):
    """The target's forward with `aux_layers` gives HF's states (its logits are the plain program's: see
    test_aux_export_adds_only_the_concatenation); the head's chain from them is the reference's."""
    target_cfg, target, cfg, head, golden, prompts, pages = setup
    n = len(prompts)
    batch = packed([(prompts[i], 0, pages[i]) for i in range(n)])
    shape = (NUM_PAGES, PAGE, target_cfg.num_kv_heads, target_cfg.head_dim)
    kv = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(target_cfg.num_layers))
    step = jax.jit(llama.forward, static_argnames=("cfg", "ops", "aux_layers"))
    logits, _, aux = step(target, batch, kv, target_cfg, aux_layers=cfg.aux_layers)
    rows = int(batch.query_start[n])
    assert aux.shape == (PREFILL_TOKENS, 3 * target_cfg.hidden_size)
    np.testing.assert_allclose(aux[:rows], np.concatenate([golden[f"aux_{i}"] for i in range(n)]), atol=ATOL)
    np.testing.assert_array_equal(np.argmax(logits[:n], axis=-1), [golden[f"next_{i}"] for i in range(n)])

    draft = packed([(shifted(golden, prompts, i), 0, pages[i]) for i in range(n)])
    drafts, _ = propose(head, cfg, draft, aux, head_cache(cfg, head), num_steps=golden["chain_ids_0"].shape[0])
    np.testing.assert_array_equal(drafts[:n], np.stack([golden[f"chain_ids_{i}"] for i in range(n)]))


def test_rejected_rows_are_overwritten(setup):
    """A chain after a verification step: the prompts' first rows in one pass, the rest in a second whose rows
    after each sequence's last accepted one are rejected drafts (junk tokens and states). The chain writes over
    their KV before reading it, so it is the reference's."""
    _, _, cfg, head, golden, prompts, pages = setup
    n, junk, rng = len(prompts), 3, np.random.default_rng(7)
    split = [len(p) // 2 for p in prompts]
    first = packed([(shifted(golden, prompts, i)[:split[i]], 0, pages[i]) for i in range(n)])
    aux = [golden[f"aux_{i}"] for i in range(n)]
    _, _, kv = forward(head, cfg, all_rows(first), eagle3.combine_hidden(head, stacked_aux_rows([a[:s] for a, s in zip(
        aux, split, strict=True)])), head_cache(cfg, head))
    seqs, rows, last, t = [], [], [], 0
    for i in range(n):
        toks = shifted(golden, prompts, i)[split[i]:]
        seqs.append((toks + rng.integers(3, 256, junk).tolist(), split[i], pages[i]))
        rows.append(np.concatenate([aux[i][split[i]:], rng.normal(size=(junk, aux[i].shape[1]))]))
        t += len(toks) + junk
        last.append(t - junk - 1)
    verify = replace(packed(seqs), logits_indices=np.asarray(last + [0] * (NUM_SEQS - n), np.int32))
    drafts, _ = propose(head, cfg, verify, stacked_aux_rows(rows), kv, num_steps=golden["chain_ids_0"].shape[0])
    np.testing.assert_array_equal(drafts[:n], np.stack([golden[f"chain_ids_{i}"] for i in range(n)]))


def stacked_aux_rows(parts):
    aux = np.concatenate(parts).astype(np.float32)
    return jnp.asarray(np.pad(aux, ((0, PREFILL_TOKENS - len(aux)), (0, 0))))


def test_checkpoint_naming_variants(setup, tmp_path):
    """`layers.0.` for `midlayer.`, a `model.` prefix and an own `embed_tokens` load as the same head; a head
    without its embedding needs the target's."""
    target_cfg, target, _, head, *_ = setup
    tensors = load_file(HEAD / "model.safetensors")
    renamed = {("model." + k.replace("midlayer.", "layers.0.")) if k.startswith("midlayer.") else k: v
               for k, v in tensors.items()}
    renamed["embed_tokens.weight"] = np.asarray(target.embed)
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(HEAD / "config.json", tmp_path / "config.json")
    _, other = load_eagle3(tmp_path, target_cfg, dtype="float32")
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="embed_tokens"):
        load_eagle3(HEAD, target_cfg, dtype="float32")
    raw = json.loads((HEAD / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"draft_vocab_size": 100}))
    with pytest.raises(ValueError, match="shape"):
        load_eagle3(tmp_path, target_cfg, dtype="float32")


def test_aux_export_adds_only_the_concatenation(setup):
    """With `aux_layers` the target's program is the plain one plus one concatenate (the states are values the
    plain step computes anyway); without, nothing is traced for it."""
    target_cfg, target, *_ = setup
    batch = make_batch([([5, 6, 7], 0, [1])], PAGE, pages_per_seq=2)
    shape = (NUM_PAGES, PAGE, target_cfg.num_kv_heads, target_cfg.head_dim)
    kv = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(target_cfg.num_layers))
    off = jax.make_jaxpr(lambda w, b, c: llama.forward(w, b, c, target_cfg))(target, batch, kv)
    on = jax.make_jaxpr(lambda w, b, c: llama.forward(w, b, c, target_cfg, aux_layers=(0, 1, 2)))(target, batch, kv)
    assert [e.primitive.name for e in on.eqns] == [e.primitive.name for e in off.eqns] + ["concatenate"]
    with pytest.raises(ValueError, match="aux_layers"):
        llama.forward(target, batch, kv, target_cfg, aux_layers=(3,))


@pytest.mark.slow
def test_chain_on_pallas_kernels(setup):
    """The chain with the Pallas kernels (interpreted off GPU; the one-token steps take the paged decode kernel)."""
    _, _, cfg, head, golden, prompts, pages = setup
    n = len(prompts)
    ops = ModelOps("pallas", interpret=jax.default_backend() != "gpu")
    batch = packed([(shifted(golden, prompts, i), 0, pages[i]) for i in range(n)])
    drafts, _ = propose(head, cfg, batch, stacked_aux(golden, n), head_cache(cfg, head), num_steps=3, ops=ops)
    np.testing.assert_array_equal(drafts[:n], np.stack([golden[f"chain_ids_{i}"][:3] for i in range(n)]))

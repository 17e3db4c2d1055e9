"""Tiny random-weight Qwen3.5 (3 Gated DeltaNet layers + 1 gated attention layer) and Qwen3.5-MoE (one of each, both
with 8 routed experts top-2 and a gated shared expert) against HF transformers.

tests/data/golden/tiny-qwen3_5{,_moe}.npz come from scripts/make_golden.py (HF's Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM on the same safetensors: chunked delta rule for the prompts, the recurrent one for each decode
step). Prompts of 5, 37 and 80 tokens: the last spans two of HF's 64-token chunks. Sequences sit in non-trivial state
slots and scrambled pages; chunked prefill cuts through the conv window (K - 1 = 3 rows) and the 64-row chunk.

Steps are padded to a few shapes, as the engine pads to its buckets (SMALL: under the delta rule's 64-row chunk,
so the recurrent kernel alone; LARGE: both kernels), all PAGES_PER_SEQ pages wide: a compile costs far more than
a step on CPU, and one per prompt length made this file several times slower.
"""

import json
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, fuse_qkv, state_specs
from jinfer.models.shared_experts import stack_shared_experts
from jinfer.ops import REFERENCE_OPS, ModelOps
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

PAGE = 4
NUM_PAGES = 80
NUM_SLOTS = 8
PAGES_PER_SEQ = 45  # the 80-token prompt and its 32 decodes (or 5 of them in a shared pool) fit
SMALL, LARGE = dict(num_tokens=8, num_seqs=4), dict(num_tokens=128, num_seqs=4)  # (buckets, as the engine's)
ATOL = 2e-4
OPS = {"ref": REFERENCE_OPS, "pallas": ModelOps("pallas", interpret=jax.default_backend() != "gpu")}


def load(path=DATA / "tiny-qwen3_5"):
    src = resolve_model(path)
    return src.config, load_weights(src, "float32", progress=False)


def empty_cache(cfg):
    """Per layer: (k, v) pages, or each state array's pool of NUM_SLOTS slots filled with garbage (a slot's
    old content must never leak into a sequence that starts at position 0)."""
    states = state_specs(cfg)
    shape = (NUM_PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(0)
    return tuple(tuple(jnp.asarray(rng.standard_normal((NUM_SLOTS, *s.shape)), s.dtype or jnp.float32)
                       for s in states[i]) if i in states else (jnp.zeros(shape), jnp.zeros(shape))
                 for i in range(cfg.num_layers))


def pages_for(seed, n):
    return [int(p) + 1 for p in np.random.default_rng(seed).permutation(NUM_PAGES - 1)[:n]]


def bucket_batch(seqs, bucket, state_slots):
    """(new tokens, cached tokens, pages) per sequence padded to `bucket`, with the logits of every row (padding rows
    too, so the logits' shape is the bucket's): the caller takes the real ones."""
    batch = make_batch(seqs, PAGE, **bucket, pages_per_seq=PAGES_PER_SEQ, state_slots=state_slots)
    return replace(batch, logits_indices=np.arange(bucket["num_tokens"], dtype=np.int32))


def placed_as_outputs(kv, w):
    """The cache placed as the step returns it (replicated over the weights' mesh): a fresh cache would otherwise
    be another input signature than a returned one, and compile the same step twice."""
    mesh = jax.tree.leaves(w)[0].sharding.mesh
    return jax.device_put(kv, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def golden(arch):
    return np.load(DATA / "golden" / f"tiny-{arch}.npz")


def step_fn(cfg, ops):
    return jax.jit(partial(forward, cfg=cfg, ops=ops), donate_argnames=("kv_cache",))


# (checkpoint, ops): the MoE model with the reference ops only (its expert kernels are qwen3_moe's, tested there;
# those of its shared expert stacked with the routed ones in tests/models/test_shared_experts.py), its shared expert
# apart (as under tensor or expert parallel) and stacked after the routed experts (one device: the engine's load)
CASES = [("qwen3_5", "ref"), pytest.param(("qwen3_5", "pallas"), marks=pytest.mark.slow), ("qwen3_5_moe", "ref"),
         ("qwen3_5_moe", "stacked")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def model(request):
    arch, ops = request.param
    cfg, w = load(DATA / f"tiny-{arch}")
    if ops == "pallas":
        w = fuse_qkv(cfg, w)
        assert w.layers[0].lin_in is not None and w.layers[1].wqkv is not None
    if ops == "stacked":  # 48 shared columns over experts of 32: two stacked experts, the second half zeros
        w, ops = stack_shared_experts(w, cfg.num_experts), "ref"
        assert w.layers[0].w_gate.shape[0] == cfg.num_experts + 2 and w.layers[0].ws_gate is None
    return cfg, w, step_fn(cfg, OPS[ops])


@pytest.fixture(scope="module")
def gold(model):
    return golden(model[0].architecture)


def test_config_read_from_hf():
    cfg, w = load()
    assert cfg.architecture == "qwen3_5"
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention")
    assert (cfg.rotary_dim, cfg.linear_conv_dim, cfg.attention_layers) == (8, 128, (1,))
    assert w.layers[0].conv_w.shape == (128, 1, 4) and w.layers[0].wq is None and w.layers[2].wq is None
    assert w.layers[1].wq.shape == (64, 2 * 4 * 32) and w.layers[1].lin_qkv is None
    assert set(state_specs(cfg)) == {0, 2}


def test_moe_config_read_from_hf():
    """Qwen3.5-MoE: every layer sparse (the config has no intermediate_size: it takes the experts'), the shared
    expert's width, its gate, the routed experts stacked from save_pretrained's per-expert tensors."""
    cfg, w = load(DATA / "tiny-qwen3_5_moe")
    assert (cfg.architecture, cfg.layer_types) == ("qwen3_5_moe", ("linear_attention", "full_attention"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.intermediate_size) == (32, 48, 32)
    for layer in w.layers:
        assert (layer.router.shape, layer.w_gate.shape, layer.w_down.shape) == ((64, 8), (8, 64, 32), (8, 32, 64))
        assert (layer.ws_gate.shape, layer.ws_down.shape, layer.shared_gate.shape) == ((64, 48), (48, 64), (64, 1))
    assert w.layers[0].lin_qkv is not None and w.layers[1].wq is not None


@pytest.mark.parametrize("i", [0, 1, 2])
def test_prefill_and_every_decode_step_match_hf(model, gold, i):
    cfg, w, step = model
    prompt, greedy = gold[f"prompt_{i}"].tolist(), gold[f"greedy_{i}"].tolist()
    pages = pages_for(i, (len(prompt) + len(greedy)) // PAGE + 1)
    slot = [5]
    kv = placed_as_outputs(empty_cache(cfg), w)
    bucket = SMALL if len(prompt) <= SMALL["num_tokens"] else LARGE
    logits, kv = step(w, bucket_batch([(prompt, 0, pages)], bucket, slot), kv)
    logits = logits[:len(prompt)]
    np.testing.assert_allclose(np.asarray(logits), gold[f"prefill_logits_{i}"], atol=ATOL, rtol=1e-4)
    ours = [int(np.argmax(logits[-1]))]
    for s in range(1, len(greedy)):
        logits, kv = step(w, bucket_batch([([ours[-1]], len(prompt) + s - 1, pages)], SMALL, slot), kv)
        np.testing.assert_allclose(np.asarray(logits[0]), gold[f"decode_logits_{i}"][s], atol=ATOL, rtol=1e-4,
                                   err_msg=f"decode step {s}")
        ours.append(int(np.argmax(logits[0])))
    assert ours == greedy


def three_sequences(cfg, gold, seed):
    """The three golden prompts, their scrambled pages (10 / 20 / 45 of them) and an empty cache."""
    perm = pages_for(seed, 75)
    return [gold[f"prompt_{i}"].tolist() for i in range(3)], [perm[0:10], perm[10:30], perm[30:75]], empty_cache(cfg)


def test_batched_chunked_prefill_then_batched_decode_match_hf(model, gold):
    """Three prompts in flattened batches, the 80-token one in chunks of 2 (< the conv window), 65
    (across the 64-row chunk) and 13 rows, next to the others; then all three decode together."""
    cfg, w, step = model
    prompts, pages, kv = three_sequences(cfg, gold, 7)
    kv = placed_as_outputs(kv, w)
    slots = [3, 7, 1]

    def run(seqs, bucket):
        nonlocal kv
        logits, kv = step(w, bucket_batch([s[:3] for s in seqs], bucket, [s[3] for s in seqs]), kv)
        return np.asarray(logits)

    a = run([(prompts[2][:2], 0, pages[2], slots[2]), (prompts[0], 0, pages[0], slots[0])], SMALL)
    b = run([(prompts[1], 0, pages[1], slots[1]), (prompts[2][2:67], 2, pages[2], slots[2])], LARGE)
    c = run([(prompts[2][67:], 67, pages[2], slots[2])], LARGE)
    n1 = len(prompts[1])
    np.testing.assert_allclose(a[2:7], gold["prefill_logits_0"], atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(b[:n1], gold["prefill_logits_1"], atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(np.concatenate([a[:2], b[n1:n1 + 65], c[:13]]), gold["prefill_logits_2"],
                               atol=ATOL, rtol=1e-4)
    for s in range(1, 6):  # every sequence's next greedy token, all three in one step
        seqs = [([int(gold[f"greedy_{i}"][s - 1])], len(prompts[i]) + s - 1, pages[i]) for i in range(3)]
        logits, kv = step(w, bucket_batch(seqs, SMALL, slots), kv)
        for i in range(3):
            np.testing.assert_allclose(np.asarray(logits[i]), gold[f"decode_logits_{i}"][s], atol=ATOL, rtol=1e-4,
                                       err_msg=f"sequence {i}, decode step {s}")


def fuse_experts(tensors, num_layers, num_experts):
    """transformers' in-memory expert layout, as some published checkpoints keep it: per layer one
    `experts.gate_up_proj` [E, 2 * I, hidden] (gate rows first) and one `experts.down_proj` [E, hidden, I]."""
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts."
        pop = [[tensors.pop(f"{p}{e}.{n}_proj.weight") for e in range(num_experts)] for n in ("gate", "up", "down")]
        tensors[p + "gate_up_proj"] = np.concatenate([np.stack(pop[0]), np.stack(pop[1])], axis=1)
        tensors[p + "down_proj"] = np.stack(pop[2])
    return tensors


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_conditional_generation_layout_loads_the_text_model(tmp_path, arch):
    """A published checkpoint's layout (Qwen3_5{,Moe}ForConditionalGeneration): config under text_config, text
    weights under model.language_model., plus vision / MTP tensors that are not read; the MoE one with its experts
    fused as transformers holds them in memory."""
    src, hf = DATA / f"tiny-{arch}", "Qwen3_5Moe" if arch == "qwen3_5_moe" else "Qwen3_5"
    tensors = load_file(src / "model.safetensors")
    if arch == "qwen3_5_moe":
        tensors = fuse_experts(tensors, 2, 8)
    renamed = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [f"{hf}ForConditionalGeneration"], "model_type": arch,
        "tie_word_embeddings": False, "text_config": {**text, "model_type": f"{arch}_text"},
        "vision_config": {"depth": 1}, "image_token_id": 248056}))
    cfg, w = load(tmp_path)
    assert cfg == load(src)[0]
    gold = golden(arch)
    prompt = gold["prompt_1"].tolist()
    # the model fixture's LARGE step: the same program, loaded from the compilation cache
    kv = placed_as_outputs(empty_cache(cfg), w)
    logits, _ = step_fn(cfg, REFERENCE_OPS)(w, bucket_batch([(prompt, 0, pages_for(0, 10))], LARGE, [5]), kv)
    np.testing.assert_allclose(np.asarray(logits[:len(prompt)]), gold["prefill_logits_1"], atol=ATOL, rtol=1e-4)


def test_one_row_per_sequence_decode_steps_match_hf(model, gold):
    """Decode steps of one new row per sequence take the fused decode path (pallas: the fused conv + delta
    rule kernel; ref: its jnp reference): the runner's decode-only executables (B = T, a padding sequence
    included) and a lone sequence's T = 1 step."""
    cfg, w, step = model
    if cfg.num_experts:
        pytest.skip("the decode-only executables add no MoE path: moe_block takes its rows alike")
    ops = OPS["pallas" if w.layers[0].lin_in is not None else "ref"]
    decode = jax.jit(partial(forward, cfg=cfg, ops=replace(ops, decode_step=True)), donate_argnames=("kv_cache",))
    prompts, pages, kv = three_sequences(cfg, gold, 9)
    kv = placed_as_outputs(kv, w)
    slots = [6, 2, 4]
    P = PAGES_PER_SEQ
    for i in range(3):
        _, kv = step(w, bucket_batch([(prompts[i], 0, pages[i])], LARGE, [slots[i]]), kv)
    for s in range(1, 5):  # all three in a 4-row decode-only step (row 3: a padding sequence)
        seqs = [([int(gold[f"greedy_{i}"][s - 1])], len(prompts[i]) + s - 1, pages[i]) for i in range(3)]
        batch = make_batch(seqs, PAGE, num_tokens=4, num_seqs=4, pages_per_seq=P, state_slots=slots)
        logits, kv = decode(w, batch, kv)
        for i in range(3):
            np.testing.assert_allclose(np.asarray(logits[i]), gold[f"decode_logits_{i}"][s], atol=ATOL, rtol=1e-4,
                                       err_msg=f"sequence {i}, decode step {s}")
    for s in range(5, 8):  # sequence 1 alone: T = 1, B = 1
        batch = make_batch([([int(gold["greedy_1"][s - 1])], len(prompts[1]) + s - 1, pages[1])], PAGE,
                           num_tokens=1, num_seqs=1, pages_per_seq=P, state_slots=[slots[1]])
        logits, kv = step(w, batch, kv)
        np.testing.assert_allclose(np.asarray(logits[0]), gold["decode_logits_1"][s], atol=ATOL, rtol=1e-4,
                                   err_msg=f"T = 1 decode step {s}")

"""Qwen3.5's MTP head (jinfer/models/qwen3_5_mtp.py) against a PyTorch port of vLLM's module
(scripts/make_mtp_golden.py) on tests/data/tiny-qwen3_5-mtp (tiny-qwen3_5 plus a random `mtp.*` layer): the target's
forward exports its last layer's output (`aux_layers=(num_layers,)`), whose final norm is HF's last hidden state;
the head's first pass over each prompt (logits at every row) and a greedy chain of drafts equal the reference's."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.cache.layout import init_kv_cache
from jinfer.models import qwen3_5, qwen3_5_mtp
from jinfer.models.batch import make_batch
from jinfer.models.eagle3 import chain_batch
from jinfer.models.layers import rms_norm
from jinfer.ops import ModelOps
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import load_weights, resolve_model
from jinfer.weights.mtp import load_mtp

from ..conftest import DATA

PAGE, NUM_PAGES, PAGES_PER_SEQ = 4, 64, 8
PREFILL_TOKENS, NUM_SEQS = 48, 4
ATOL = 2e-4  # float32 against PyTorch float32
CKPT = DATA / "tiny-qwen3_5-mtp"


@pytest.fixture(scope="module")
def setup():
    src = resolve_model(CKPT)
    target = load_weights(src, "float32", progress=False)
    head = load_mtp(CKPT, src.config, target, dtype="float32")
    golden = np.load(DATA / "golden" / "tiny-qwen3_5-mtp.npz")
    n = sum(1 for k in golden.files if k.startswith("prompt_"))
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(n)]
    scrambled = np.random.default_rng(0).permutation(NUM_PAGES - 1) + 1  # page 0 is reserved
    pages = [scrambled[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ].tolist() for i in range(n)]
    return src.config, target, head, golden, prompts, pages


def packed(seqs):
    return make_batch(seqs, PAGE, num_tokens=PREFILL_TOKENS, num_seqs=NUM_SEQS, pages_per_seq=PAGES_PER_SEQ)


def kv(cfg):
    shape = (NUM_PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape), jnp.zeros(shape)


def test_loader_refuses_a_checkpoint_without_mtp(setup):
    cfg, target, *_ = setup
    with pytest.raises(ValueError, match="no MTP layer"):
        load_mtp(DATA / "tiny-qwen3_5", cfg, target, dtype="float32")


@pytest.fixture(scope="module")
def target_aux(setup):
    """The target's forward over the prompts with `aux_layers=(num_layers,)`: its last layer's output [T, H]."""
    cfg, target, head, golden, prompts, pages = setup
    batch = packed([(p, 0, pages[i]) for i, p in enumerate(prompts)])
    batch = replace(batch, state_slots=np.arange(1, NUM_SEQS + 1, dtype=np.int32))
    cache = init_kv_cache(cfg, NUM_PAGES, PAGE, jnp.float32, make_mesh(1), NUM_SEQS + 1)
    fwd = jax.jit(qwen3_5.forward, static_argnames=("cfg", "aux_layers"))
    _, _, aux = fwd(target, batch, cache, cfg=cfg, aux_layers=(cfg.num_layers,))
    return aux, int(batch.query_start[len(prompts)])


def test_target_hidden_first_pass_and_chain_match_reference(setup, target_aux):
    cfg, target, head, golden, prompts, pages = setup
    n = len(prompts)
    aux, rows = target_aux  # normed: HF's last hidden state
    hidden = rms_norm(aux, head.target_norm, cfg.rms_norm_eps)
    np.testing.assert_allclose(hidden[:rows], np.concatenate([golden[f"hidden_{i}"] for i in range(n)]), atol=ATOL)
    # the head's first pass over the shifted tokens, every row's logits, then the chain
    shifted = [prompts[i][1:] + [int(golden[f"next_{i}"])] for i in range(n)]
    batch = packed([(shifted[i], 0, pages[i]) for i in range(n)])
    forward = jax.jit(qwen3_5_mtp.draft_forward, static_argnames=("cfg",))
    logits, y, head_kv = forward(head, cfg, replace(batch, logits_indices=np.arange(PREFILL_TOKENS, dtype=np.int32)),
                                 jnp.asarray(golden_hidden(golden, n)), kv(cfg))
    np.testing.assert_allclose(logits[:rows], np.concatenate([golden[f"first_logits_{i}"] for i in range(n)]),
                               atol=ATOL)
    last = jnp.asarray(batch.logits_indices)
    h, positions, tokens = y[last], jnp.asarray(batch.positions)[last], jnp.argmax(logits[last], axis=-1)
    step = jax.jit(lambda h, ids, pos, kv: forward(head, cfg, chain_batch(batch, ids, pos, PAGE), h, kv))
    for j in range(1, golden["chain_ids_0"].shape[0]):
        positions = positions + 1
        logits, h, head_kv = step(h, tokens.astype(jnp.int32), positions, head_kv)
        for i in range(n):
            np.testing.assert_allclose(logits[i], golden[f"chain_logits_{i}"][j], atol=ATOL)
        tokens = jnp.argmax(logits, axis=-1)


def golden_hidden(golden, n):
    h = np.concatenate([golden[f"hidden_{i}"] for i in range(n)])
    return np.pad(h, ((0, PREFILL_TOKENS - len(h)), (0, 0)))


def test_propose_gives_the_golden_chain(setup, target_aux):
    """`propose` from the target's exported states: the reference's greedy drafts."""
    cfg, target, head, golden, prompts, pages = setup
    n = len(prompts)
    shifted = [prompts[i][1:] + [int(golden[f"next_{i}"])] for i in range(n)]
    batch = packed([(shifted[i], 0, pages[i]) for i in range(n)])
    aux = target_aux[0]
    k = golden["chain_ids_0"].shape[0]
    propose = jax.jit(qwen3_5_mtp.propose, static_argnames=("cfg", "num_steps"))
    drafts, _ = propose(head, cfg, batch, aux, kv(cfg), num_steps=k)
    for i in range(n):
        margin = golden[f"chain_margin_{i}"]
        sure = margin > 1e-3
        assert (np.asarray(drafts[i])[sure] == golden[f"chain_ids_{i}"][sure]).all(), i


def test_chain_on_pallas_kernels(setup, target_aux):
    """The chain with the Pallas kernels (interpreted off GPU; the one-token steps take the paged decode kernel)."""
    cfg, target, head, golden, prompts, pages = setup
    n = len(prompts)
    shifted = [prompts[i][1:] + [int(golden[f"next_{i}"])] for i in range(n)]
    batch = packed([(shifted[i], 0, pages[i]) for i in range(n)])
    ops = ModelOps("pallas", interpret=jax.default_backend() != "gpu")
    propose = jax.jit(qwen3_5_mtp.propose, static_argnames=("cfg", "num_steps", "ops"))
    drafts, _ = propose(head, cfg, batch, target_aux[0], kv(cfg), num_steps=3, ops=ops)
    for i in range(n):
        sure = golden[f"chain_margin_{i}"][:3] > 1e-3
        assert (np.asarray(drafts[i])[sure] == golden[f"chain_ids_{i}"][:3][sure]).all(), i


def test_fp8_head_on_pallas_kernels(setup, target_aux):
    """speculative_config quantization "fp8" (the engine's builder: `quantize_fields`, then the kernels' [out, in]
    layout): the layer's projections and an FP8 copy of the target's lm_head (the target's own untouched), read by the
    FP8 kernels (interpreted off GPU); the chain's drafts stay the reference's where its top two logits are apart."""
    from jinfer.models.fp8 import KERNEL_LAYOUT_FIELDS, is_fp8, kernel_layout, quantize_fields

    cfg, target, head, golden, prompts, pages = setup
    fp8 = kernel_layout(quantize_fields(head, KERNEL_LAYOUT_FIELDS))
    assert all(is_fp8(w) and w.transposed and w.block == (64, 64) for w in (fp8.lm_head, fp8.fc, fp8.layer.wqkv,
                                                                            fp8.layer.wo, fp8.layer.w_down))
    assert fp8.embed is head.embed and not is_fp8(target.lm_head) and not is_fp8(head.lm_head)
    n = len(prompts)
    shifted = [prompts[i][1:] + [int(golden[f"next_{i}"])] for i in range(n)]
    batch = packed([(shifted[i], 0, pages[i]) for i in range(n)])
    every_row = replace(batch, logits_indices=np.arange(PREFILL_TOKENS, dtype=np.int32))
    logits, _, _ = jax.jit(qwen3_5_mtp.draft_forward, static_argnames=("cfg",))(
        fp8, cfg, every_row, jnp.asarray(golden_hidden(golden, n)), kv(cfg))  # (the prompt's rows: dequantized)
    want = np.concatenate([golden[f"first_logits_{i}"] for i in range(n)])
    err = np.sqrt(np.mean((np.asarray(logits[:len(want)]) - want) ** 2) / np.mean(want**2))
    assert 1e-4 < err < 0.08, err  # (FP8's rounding: 0.044 here; not another model)
    ops = ModelOps("pallas", interpret=jax.default_backend() != "gpu")
    propose = jax.jit(qwen3_5_mtp.propose, static_argnames=("cfg", "num_steps", "ops"))
    assert "skinny_gemm_" in str(propose.trace(fp8, cfg, batch, target_aux[0], kv(cfg), num_steps=2, ops=ops).jaxpr)
    drafts, _ = propose(fp8, cfg, batch, target_aux[0], kv(cfg), num_steps=2, ops=ops)
    for i in range(n):
        sure = golden[f"chain_margin_{i}"][:2] > 0.1
        assert (np.asarray(drafts[i])[sure] == golden[f"chain_ids_{i}"][:2][sure]).all(), i


# ---- in the engine ------------------------------------------------------------------------------------------------

GREEDY_IDS = [np.load(DATA / "golden" / "tiny-qwen3_5.npz")[f"greedy_{i}"].tolist() for i in range(3)]  # same target
ENGINE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              compilation_cache_dir="", warmup=False)


@pytest.fixture(scope="module")
def mtp_engine():
    from jinfer.config.engine import EngineConfig
    from jinfer.engine.core import EngineCore

    return EngineCore(EngineConfig(str(CKPT), **ENGINE,
                                   speculative_config={"method": "mtp", "num_speculative_tokens": 4}))


def test_engine_drafts_are_the_golden_chain(setup, mtp_engine):
    """The drafts the engine's MTP proposer hands over after a prompt's prefill (as the device holds them: their ids
    as the first verification checks them): the reference's chain."""
    from jinfer.sampling_params import SamplingParams

    _, _, _, golden, prompts, _ = setup
    spec, seen = mtp_engine.spec, {}
    original = spec.accept

    def accept(rid, drafts, sampled):
        if drafts:
            seen.setdefault(rid, list(drafts))
        return original(rid, drafts, sampled)

    spec.accept = accept
    try:
        for i, p in enumerate(prompts):
            mtp_engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        while mtp_engine.has_unfinished_requests():
            mtp_engine.step()
    finally:
        del spec.accept
    for i in range(len(prompts)):
        sure = golden[f"chain_margin_{i}"] > 1e-3
        assert (np.asarray(seen[f"g{i}"])[sure] == golden[f"chain_ids_{i}"][sure]).all(), i


def test_engine_greedy_with_mtp_equals_hf(mtp_engine):
    """Batch 3, mixed prompt lengths (5, 37, 80 tokens): HF's greedy ids with MTP drafts, all rejected here (the
    random layer guesses poorly; kept drafts: `test_forced_acceptance_on_the_mtp_head`). The head launched behind each
    step kept as many drafts as the host's verification: every sequence that sampled in a step gets drafts for the
    next, handed over as the device holds them."""
    from jinfer.sampling_params import SamplingParams

    gold = np.load(DATA / "golden" / "tiny-qwen3_5.npz")
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(3)]
    before = mtp_engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(prompts):
        mtp_engine.add_request(str(i), p, params)
    got, handed = {}, watch_handed(mtp_engine.spec.proposer)
    try:
        while mtp_engine.has_unfinished_requests():
            for d in mtp_engine.step():
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
    finally:
        del mtp_engine.spec.proposer.propose
    assert [got[str(i)] for i in range(3)] == [g[:16] for g in GREEDY_IDS]
    assert len(handed) > 20 and all(handed)
    after = mtp_engine.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted < drafted
    assert any(d[0] <= -2 for d in handed)  # (handed over as the device holds them: request.device_input)
    kv = mtp_engine.kv
    assert kv.num_free_state_slots == kv.num_state_slots - 1 and kv.num_free_pages == kv.num_usable_pages


def watch_handed(proposer) -> list[list[int]]:
    """Wrap `proposer.propose` (undone by deleting the attribute): for each request that sampled in the last launch,
    the drafts it got (empty: none), appended to the list returned."""
    handed, original = [], proposer.propose

    def propose(requests, *on_device):
        sampled = proposer._launched[1] if proposer._launched else {}
        drafts = original(requests, *on_device)
        handed.extend(list(d) for r, d in zip(requests, drafts) if r.request_id in sampled)
        return drafts

    proposer.propose = propose
    return handed


def test_forced_acceptance_on_the_mtp_head(mtp_engine):
    """The benchmarks' forced outcomes around the engine's MTP drafter (bench_latency --replay-acceptance with
    "method": "mtp"): at P = 1 every draft is kept, at 0 none, the head drafting each step either way. Kept drafts
    become the outputs, so the drafts the next steps read on the device (`request.device_input`) must be the ids the
    host recorded: at P = 1 and 0.6 (some kept, then a rejection: the row goes on from its first draft, recomputing
    those kept) the same tokens as with every draft read back first (device_drafts off)."""
    from jinfer.sampling_params import SamplingParams
    from jinfer.spec.decoding import SpecDecoding
    from jinfer.spec.replay import ForcedAcceptance

    own = mtp_engine.spec
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    try:
        for p, device in ((1.0, True), (1.0, False), (0.6, True), (0.6, False), (0.0, True)):
            own.proposer.device_drafts = device
            mtp_engine.spec = SpecDecoding(ForcedAcceptance(own.proposer, p))
            rid = f"forced{p}"  # (the same id in both modes: the forced outcomes are drawn per request)
            mtp_engine.add_request(rid, list(range(3, 20)), params)
            handed = watch_handed(own.proposer)  # (the head keeps the forced drafts too)
            try:
                while mtp_engine.has_unfinished_requests():
                    outputs[(p, device)] = outputs.get((p, device), []) + [
                        t for d in mtp_engine.step() if d.request_id == rid for t in d.new_token_ids]
            finally:
                del own.proposer.propose
            assert handed and all(handed) and all((d[0] <= -2) == device for d in handed)
            s = mtp_engine.spec.stats()
            assert s["spec_decode_num_draft_tokens"] > 0
            if p in (0.0, 1.0):
                assert s["spec_decode_num_accepted_tokens"] == (s["spec_decode_num_draft_tokens"] if p else 0)
            else:
                assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    finally:
        mtp_engine.spec = own
        del own.proposer.device_drafts
    for p in (1.0, 0.6):
        assert outputs[(p, True)] == outputs[(p, False)] and len(outputs[(p, True)]) == 12


def test_dummy_target_gets_a_random_mtp_layer(setup):
    """A dummy target (no checkpoint): the layer at the checkpoint's shapes, random, norms 1 + 0."""
    cfg, target = setup[0], setup[1]
    ckpt = load_mtp(CKPT, cfg, target, dtype="float32")
    rand = load_mtp(None, cfg, target, dtype="float32", seed=1)
    assert jax.tree.map(jnp.shape, rand) == jax.tree.map(jnp.shape, ckpt)
    assert not np.allclose(rand.fc, ckpt.fc) and np.asarray(rand.fc).std() > 0
    np.testing.assert_array_equal(rand.final_norm, np.ones_like(rand.final_norm))


def test_speculative_steps_keep_their_buffers(mtp_engine):
    """Stable step buffers with a head (runner.py): the sampler's staged inputs and the forward's logits and hidden
    states (which the head reads) stay at the same device addresses from step to step; the head's step writes its
    outputs into the buffers it is given (every donated input aliased to an output: on this CPU backend a buffer read
    into numpy is copied instead, so its address is not checked here)."""
    from jinfer.sampling_params import SamplingParams

    runner = mtp_engine.runner
    mtp_engine.add_request("stable", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=16,
                                                                        ignore_eos=True))
    addresses, held = {}, []
    while mtp_engine.has_unfinished_requests():
        mtp_engine.step()
        for kind, table in (("sampling", runner._staged_sampling), ("logits", runner._logits_out),
                            ("aux", runner._aux_out)):
            for size, a in table.items():
                addresses.setdefault((kind, size), set()).add(a.unsafe_buffer_pointer())
                held.append(a)
    assert {kind for kind, _ in addresses} == {"sampling", "logits", "aux"}
    assert all(len(a) == 1 for a in addresses.values()), addresses
    assert sum(a.is_deleted() for a in held) > 10  # (donated to the steps after: not kept by chance)
    proposer, calls = mtp_engine.spec.proposer, []
    head = proposer._head
    proposer._head = lambda *a, **kw: calls.append((a, kw)) or head(*a, **kw)
    try:
        mtp_engine.add_request("stable2", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=4))
        while mtp_engine.has_unfinished_requests():
            mtp_engine.step()
    finally:
        del proposer._head
    args, kw = calls[-1]
    text = head.lower(*args, **kw).as_text()
    donated = len(jax.tree.leaves(proposer.kv)) + 2  # (the KV, the sampled ids, the (drafts | kept) buffer)
    assert text.count("tf.aliasing_output") == donated


def test_head_warmed_up_compiles_nothing_at_its_steps(mtp_engine):
    """A drafter's head warmed up with the engine (`warmup`, after the runner's) is never compiled at a step: a fresh
    head (its own jit, nothing cached) warmed, then a request's steps lower no head step."""
    from jinfer.sampling_params import SamplingParams
    from jinfer.spec.decoding import SpecDecoding
    from jinfer.spec.mtp import MtpProposer

    from ..unit.test_engine import lowerings

    own = mtp_engine.spec
    p = own.proposer
    fresh = MtpProposer(p.cfg, p.weights, p.k, runner=mtp_engine.runner, kv_manager=mtp_engine.kv,
                        max_model_len=p.max_model_len)
    fresh.warmup()
    mtp_engine.spec = SpecDecoding(fresh)
    try:
        with lowerings() as lowered:
            mtp_engine.add_request("warm", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=8,
                                                                               ignore_eos=True))
            while mtp_engine.has_unfinished_requests():
                mtp_engine.step()
        drafts = mtp_engine.spec.stats()["spec_decode_num_drafts"]
    finally:
        mtp_engine.spec = own
    assert drafts > 0
    assert not [name for name in lowered if "head_step" in name], lowered


def test_next_step_launched_before_the_read_back_with_states():
    """One draft a step on Qwen3.5 (k = 1): each step is launched before the one in flight is read back, its rows moved
    back on the device by what that verification rejects, its states read from the slot the verification wrote
    where the draft was kept, else from the one that kept the state after the row's first token. Batch 3: HF's greedy
    ids (the random layer's drafts mostly rejected). Forced outcomes (all kept; some), with a penalized request
    joining midway (steps read back first while it runs, then launched ahead again): every token the target sampled
    (each verification's last) is its greedy token after the tokens before it, rows without drafts at the end of
    max_tokens included; every state slot and page free after."""
    from jinfer.config.engine import EngineConfig
    from jinfer.engine.core import EngineCore
    from jinfer.sampling_params import SamplingParams
    from jinfer.spec.decoding import SpecDecoding
    from jinfer.spec.replay import ForcedAcceptance

    engine = EngineCore(EngineConfig(str(CKPT), **ENGINE, speculative_config={"method": "mtp",
                                                                              "num_speculative_tokens": 1}))
    gold = np.load(DATA / "golden" / "tiny-qwen3_5.npz")
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(engine, requests, join=None):
        got = {}
        for rid, p, params in requests:
            engine.add_request(rid, p, params)
        steps = 0
        while engine.has_unfinished_requests():
            if steps == 6 and join is not None:
                engine.add_request(*join)
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
            steps += 1
        return got

    got = run(engine, [(str(i), p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                       for i, p in enumerate(prompts)])
    assert [got[str(i)] for i in range(3)] == [g[:16] for g in GREEDY_IDS]
    assert engine.spec.num_overlapped_steps > 10
    own, checks = engine.spec, []
    try:
        for p in (1.0, 0.6):
            engine.spec = spec = SpecDecoding(ForcedAcceptance(own.proposer, p))
            kept, accept = {}, spec.accept
            spec.accept = lambda rid, d, t, kept=kept, accept=accept: (
                kept.setdefault(rid, []).append(accept(rid, d, t)) or kept[rid][-1])
            join = ("pen", prompts[0][:9], SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3))
            got = run(engine, [(f"{p}/{i}", q, greedy) for i, q in enumerate(prompts)], join)
            assert spec.num_overlapped_steps > 5 and spec.num_accepted_tokens > 0 and len(got["pen"]) == 8
            for i, q in enumerate(prompts):
                out, at = got[f"{p}/{i}"], 0
                assert len(out) == 20
                for accepted in kept[f"{p}/{i}"]:
                    at += len(accepted)
                    if at <= len(out):  # (the verification's sample: the target's own token)
                        checks.append((q + out[:at - 1], out[at - 1]))
    finally:
        engine.spec = own
    kv = engine.kv
    assert kv.num_free_state_slots == kv.num_state_slots - 1 and kv.num_free_pages == kv.num_usable_pages
    plain = EngineCore(EngineConfig(str(CKPT), **ENGINE | {"max_num_seqs": 8, "max_num_batched_tokens": 256}))
    want = run(plain, [(str(j), prefix, SamplingParams(temperature=0.0, max_tokens=1)) for j, (prefix, _) in
                       enumerate(checks)])
    assert len(checks) > 40 and [t for _, t in checks] == [want[str(j)][0] for j in range(len(checks))]
    # A 5-token budget: a row after a verification in flight now and then gets no drafts (the budget drops them), the
    # next one some: the same tokens as without drafts
    tight = EngineCore(EngineConfig(str(CKPT), **ENGINE | {"max_num_batched_tokens": 5},
                                    speculative_config={"method": "mtp", "num_speculative_tokens": 1}))
    requests = [(str(i), q[:4], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for i, (q, n) in enumerate(zip(prompts, (10, 24, 24)))]
    assert run(tight, requests) == run(plain, requests) and tight.spec.num_overlapped_steps > 10

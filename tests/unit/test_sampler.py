"""Sampler tests against NumPy references (float64) written here, independent of the JAX code."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jinfer.engine.sampler import (
    _candidates,
    _thresholds,
    _unpack_token_mask,
    apply_penalties,
    processed_logits,
    sample,
)
from jinfer.engine.sampling_tensors import GROUP_SIZE, NUM_GROUPS, SamplingTensors, num_logprobs_for, pack_token_mask

V = 64
jit_processed_logits = jax.jit(processed_logits)


def params(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, seed=0, logprobs=None)
    return SimpleNamespace(**(base | kw))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_penalties(x, out_ids, prompt_ids, presence, frequency, repetition):
    x = np.asarray(x, np.float64).copy()
    counts = np.bincount(np.asarray(out_ids, np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt_ids, np.int64)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - frequency * counts - presence * (counts > 0)


def ref_kept(x, temperature, top_k, top_p, min_p):
    """Boolean mask of the tokens a random row may draw (vLLM v1 order: min-p, top-k, top-p)."""
    x = np.asarray(x, np.float64) / temperature
    p = softmax(x)
    keep = p >= min_p * p.max()
    if 0 < top_k < len(x):
        kth = np.sort(x[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= x >= kth
    if top_p < 1:
        q = np.where(keep, softmax(np.where(keep, x, -np.inf)), 0.0)
        order = np.argsort(q)  # ascending, as vLLM: drop tokens whose ascending cumsum <= 1 - p
        drop = np.cumsum(q[order]) <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    return keep


def ref_distribution(x, temperature, top_k, top_p, min_p):
    keep = ref_kept(x, temperature, top_k, top_p, min_p)
    return np.where(keep, softmax(np.where(keep, np.asarray(x, np.float64) / temperature, -np.inf)), 0.0)


FILTER_CASES = [  # temperature, top_k, top_p, min_p
    (1.0, -1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.0, -1, 0.8, 0.0),
    (1.3, -1, 1.0, 0.1),
    (0.9, 10, 0.6, 0.0),
    (1.0, 20, 0.9, 0.02),
    (2.0, 1, 1.0, 0.0),
    (1.0, 64, 0.3, 0.5),
]


def test_filters_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (len(FILTER_CASES), V)).astype(np.float32)
    rows = [(params(temperature=T, top_k=k, top_p=p, min_p=m), [], None, 0) for T, k, p, m in FILTER_CASES]
    t = SamplingTensors.from_params(rows, V)
    out = np.asarray(jit_processed_logits(logits, t))
    for b, (T, k, p, m) in enumerate(FILTER_CASES):
        kept = ref_kept(logits[b], T, k, p, m)
        np.testing.assert_array_equal(np.isfinite(out[b]), kept, err_msg=f"case {FILTER_CASES[b]}")
        np.testing.assert_allclose(out[b][kept], logits[b][kept] / T, rtol=1e-6)
    assert not np.isfinite(out[6]).sum() - 1  # top_k=1 keeps exactly one token


def test_filter_rows_do_not_depend_on_batch():
    # An unfiltered row must come out bit-identical whether or not another row triggers the sort.
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (8, V)).astype(np.float32)
    rows = [(params(), [], None, 0)] * 8
    plain = SamplingTensors.from_params(rows, V)
    mixed = SamplingTensors.from_params(rows[:1] + [(params(top_p=0.5), [], None, 0)] + rows[2:], V)
    np.testing.assert_array_equal(np.asarray(jit_processed_logits(logits, plain))[0],
                                  np.asarray(jit_processed_logits(logits, mixed))[0])


LARGE_V = 2 * NUM_GROUPS * GROUP_SIZE  # so that the candidate path and its fallback both run
LARGE_CASES = [  # std of the logits, temperature, top_k, top_p, min_p
    (3.0, 1.0, -1, 0.9, 0.0),  # peaked (std 3 is spiked, like LM logits): the candidates suffice
    (0.3, 1.0, -1, 0.9, 0.0),  # flat: the nucleus needs the full sort
    (3.0, 0.8, 100, 0.8, 0.0),
    (0.3, 1.0, 200, 1.0, 0.0),
    (0.3, 1.0, 3000, 1.0, 0.0),  # more than the candidates
    (1.0, 1.0, -1, 0.95, 0.05),
    (1.0, 1.0, -1, 1.0, 0.0),
    (1.0, 1.0, 50, 0.99, 0.0),
]


def test_candidates_hold_every_token_above_cut():
    x = np.random.default_rng(10).normal(0, 1, (3, LARGE_V + 5)).astype(np.float32)  # ragged last group
    vals, ids, cut = (np.asarray(a) for a in _candidates(x))
    for b in range(3):
        assert (x[b][ids[b][ids[b] < x.shape[1]]] == vals[b][ids[b] < x.shape[1]]).all()
        above = set(np.flatnonzero(x[b] > cut[b, 0]))
        assert above <= set(ids[b]) and len(above) >= NUM_GROUPS


def test_large_vocab_filters_match_numpy_and_batch():
    rng = np.random.default_rng(11)
    logits = np.stack([rng.normal(0, c[0], LARGE_V) for c in LARGE_CASES]).astype(np.float32)
    for b in (0, 2):
        logits[b, rng.choice(LARGE_V, 20, replace=False)] += rng.uniform(10, 14, 20)
    rows = [(params(temperature=T, top_k=k, top_p=p, min_p=m), [], None, 0) for _, T, k, p, m in LARGE_CASES]
    out = np.asarray(jit_processed_logits(logits, SamplingTensors.from_params(rows, LARGE_V)))
    for b, (_, T, k, p, m) in enumerate(LARGE_CASES):
        kept = ref_kept(logits[b], T, k, p, m)
        np.testing.assert_array_equal(np.isfinite(out[b]), kept, err_msg=f"case {LARGE_CASES[b]}")
    assert np.isfinite(out[1]).sum() > NUM_GROUPS * GROUP_SIZE  # the flat row went past the candidates
    # The candidates settle the peaked row, not the flat one (T = 1 for both).
    x = jax.numpy.asarray(logits[:2])
    top = x.max(axis=1, keepdims=True)
    vals, _, cut = _candidates(x)
    _, ok = _thresholds(jax.numpy.sort(vals, axis=1, descending=True), cut, np.exp(x - top).sum(1, keepdims=True),
                        top, np.array([-1, -1]), np.array([0.9, 0.9], np.float32), LARGE_V)
    assert np.asarray(ok).tolist() == [True, False]
    # The peaked row alone never needs the full sort; beside the flat row the batch does.
    alone = jit_processed_logits(logits[[0] * 8], SamplingTensors.from_params(rows[:1], LARGE_V, num_seqs=8))
    np.testing.assert_array_equal(np.asarray(alone)[0], out[0])


def test_penalties_match_numpy():
    rng = np.random.default_rng(2)
    B = 5
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    logits[:, :4] = [0.0, 2.0, -2.0, 0.5]
    cases = [  # presence, frequency, repetition
        (0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.8), (-0.3, 0.4, 0.6)]
    rows = []
    for p, f, r in cases:
        out_ids = list(rng.integers(0, V, 9)) + [0, 1, 2, 1, 1]
        prompt = list(rng.integers(0, V, 12)) + [2, 3]
        rows.append((params(presence_penalty=p, frequency_penalty=f, repetition_penalty=r), out_ids, prompt,
                     None))
    t = SamplingTensors.from_params(rows, V)
    assert t.output_tokens.shape == (B, 16) and t.prompt_mask.shape == (B, 2)
    got = np.asarray(apply_penalties(logits, t))
    for b, ((p, f, r), (_, out_ids, prompt, _)) in enumerate(zip(cases, rows, strict=True)):
        np.testing.assert_allclose(got[b], ref_penalties(logits[b], out_ids, prompt, p, f, r), rtol=1e-6,
                                   atol=1e-6, err_msg=f"case {cases[b]}")


def test_penalties_without_prompt_mask_use_output_only():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (2, V)).astype(np.float32)
    rows = [(params(frequency_penalty=0.5, presence_penalty=0.2), [3, 3, 7], [1, 2], None),
            (params(), [], None, None)]
    t = SamplingTensors.from_params(rows, V)
    assert t.prompt_mask.shape == (2, 0)  # no repetition penalty: the prompt is not shipped
    got = np.asarray(apply_penalties(logits, t))
    np.testing.assert_allclose(got[0], ref_penalties(logits[0], [3, 3, 7], [], 0.2, 0.5, 1.0), rtol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])


def small_batch(rows):
    """B=8, M=16 tensors (with a prompt mask): the small-vocab `sample` tests share one compilation."""
    return SamplingTensors.from_params(rows, V, num_seqs=8, output_len=16)


def test_greedy_is_argmax_of_penalized_logits():
    rng = np.random.default_rng(4)
    B = 6
    logits = rng.normal(0, 1, (B, V)).astype(np.float32)
    rows = []
    for b in range(B):
        top = int(np.argmax(logits[b]))
        # Rows 0-2 penalize the raw argmax hard, so the greedy token must move.
        kw = dict(frequency_penalty=2.0, repetition_penalty=1.5) if b < 3 else {}
        rows.append((params(temperature=[0.0, 1e-6][b % 2], top_k=3, top_p=0.5, **kw), [top] * 3, [], 3))
    res = sample(np.pad(logits, ((0, 2), (0, 0))), small_batch(rows), num_logprobs=5)
    for b, (_, out_ids, _, _) in enumerate(rows):
        kw = (0.0, 2.0, 1.5) if b < 3 else (0.0, 0.0, 1.0)
        assert int(res.tokens[b]) == int(np.argmax(ref_penalties(logits[b], out_ids, [], *kw)))
    assert all(int(res.tokens[b]) != int(np.argmax(logits[b])) for b in range(3))


def test_sampling_frequencies_match_filtered_distribution():
    rng = np.random.default_rng(5)
    V8, n = 8, 3000
    logits = rng.normal(0, 1.0, V8).astype(np.float32)
    configs = [(1.5, -1, 1.0, 0.0), (0.8, 6, 0.9, 0.02), (1.0, -1, 0.85, 0.1)]
    rows = []
    for c, (T, k, p, m) in enumerate(configs):
        for i in range(n):
            # Config 2 varies the step under one seed: steps must give independent draws too.
            seed, step = (12345, i) if c == 2 else (i + c * n, 0)
            rows.append((params(temperature=T, top_k=k, top_p=p, min_p=m, seed=seed), [], None, step))
    t = SamplingTensors.from_params(rows, V8)
    tokens = np.asarray(sample(np.tile(logits, (len(rows), 1)), t).tokens).reshape(len(configs), n)
    for c, cfg in enumerate(configs):
        expected = ref_distribution(logits, *cfg)
        counts = np.bincount(tokens[c], minlength=V8)
        assert counts[expected == 0].sum() == 0, (cfg, counts, expected)
        assert (expected > 0).sum() >= 3, cfg  # the test is only meaningful with a few tokens left
        e = expected[expected > 0] * n
        chi2 = ((counts[expected > 0] - e) ** 2 / e).sum()
        assert chi2 < 40, (cfg, chi2, counts, e)  # df <= 7: p-value well below 1e-5


def test_seeded_row_is_independent_of_batch_and_position():
    rng = np.random.default_rng(6)
    Vb = 1000
    logits = rng.normal(0, 0.5, (8, Vb)).astype(np.float32)
    targets = [params(seed=s, top_k=[-1, 200][s % 2], top_p=[1.0, 0.95][s % 3 == 0]) for s in range(8)]
    steps = list(range(8))

    def alone(b):  # the row with greedy padding only, so nothing else in the batch samples or filters
        t = SamplingTensors.from_params([(targets[b], [], None, steps[b])], Vb, num_seqs=32, output_len=4)
        return int(sample(np.tile(logits[b], (32, 1)), t, num_logprobs=3).tokens[0])
    alone = [alone(b) for b in range(8)]
    # Same rows reversed, interleaved with greedy, penalized and heavily filtered strangers, padded.
    order = list(reversed(range(8)))
    rows, batch_logits, where = [], [], {}
    for b in order:
        rows.append((params(temperature=0.0, frequency_penalty=1.0), [1, 2, 3], None, 0))
        batch_logits.append(rng.normal(0, 1, Vb))
        where[b] = len(rows)
        rows.append((targets[b], [], None, steps[b]))
        batch_logits.append(logits[b])
        rows.append((params(top_p=0.2, min_p=0.3, seed=99), [], None, 0))
        batch_logits.append(rng.normal(0, 1, Vb))
    batch_logits = np.array(batch_logits + [np.zeros(Vb)] * 8, np.float32)
    t = SamplingTensors.from_params(rows, Vb, num_seqs=len(rows) + 8)
    mixed = np.asarray(sample(batch_logits, t, num_logprobs=3).tokens)
    assert [int(mixed[where[b]]) for b in range(8)] == alone
    assert len(set(alone)) >= 5  # different seeds (and steps) draw different tokens


def test_same_seed_same_token_and_different_seeds_differ():
    Vb = 1000
    logits = np.zeros((32, Vb), np.float32)  # uniform: every draw is pure noise
    draw = lambda rows: set(np.asarray(sample(logits, SamplingTensors.from_params(rows, Vb, output_len=4),
                                              num_logprobs=3).tokens).tolist())  # shapes as the test above
    assert len(draw([(params(seed=7), [], None, 5)] * 32)) == 1
    assert len(draw([(params(seed=s), [], None, 5) for s in range(32)])) > 20
    assert len(draw([(params(seed=None), [], None, 5)] * 32)) > 20


def test_logprobs_are_raw_log_softmax_and_top_n():
    rng = np.random.default_rng(7)
    B, N = 6, 5
    logits = rng.normal(0, 2, (B, V)).astype(np.float32)
    rows = [(params(temperature=[0.0, 0.5, 1.0][b % 3], repetition_penalty=1.3, presence_penalty=0.5,
                    seed=b, logprobs=[None, 2, N][b % 3]), [b, b + 1], [b + 2], None) for b in range(B)]
    assert num_logprobs_for([r[0] for r in rows]) == N
    res = sample(np.pad(logits, ((0, 2), (0, 0))), small_batch(rows), num_logprobs=N)
    res = jax.tree.map(lambda a: np.asarray(a)[:B], res)
    ref = log_softmax(logits)
    tokens = res.tokens
    np.testing.assert_allclose(np.asarray(res.logprobs), ref[np.arange(B), tokens], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(res.top_ids), np.argsort(-ref, axis=1)[:, :N])
    np.testing.assert_allclose(np.asarray(res.top_logprobs), np.sort(ref, axis=1)[:, ::-1][:, :N], rtol=1e-5,
                               atol=1e-5)
    none = sample(np.pad(logits, ((0, 2), (0, 0))), small_batch(rows), num_logprobs=-1)
    np.testing.assert_array_equal(np.asarray(none.tokens)[:B], tokens)
    assert none.top_ids.shape == (8, 0)
    assert num_logprobs_for([params()]) == -1


def test_padded_and_degenerate_rows_do_not_nan():
    rng = np.random.default_rng(8)
    rows = [(params(top_p=0.9, repetition_penalty=1.2, seed=1), [5, 6], [7], None)]
    t = small_batch(rows)
    logits = np.zeros((8, V), np.float32)
    logits[0] = rng.normal(0, 1, V)
    res = sample(logits, t, num_logprobs=5)
    for leaf in jax.tree.leaves(res):
        assert np.isfinite(np.asarray(leaf, np.float64)).all()
    assert np.asarray(res.tokens)[1:].tolist() == [0] * 7  # padding rows are greedy
    # All-zero parameters (as if someone padded with zeros): top_p 0, repetition 0 must still work.
    zeros = jax.tree.map(np.zeros_like, t)
    zeros.temperature[:] = 1.0
    logits = rng.normal(0, 1, (8, V)).astype(np.float32)  # no ties: top_p 0 keeps all tied values
    res = sample(logits, zeros, num_logprobs=5)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.argmax(logits, axis=1))  # top_p 0 keeps 1


def test_from_params_duck_typing_and_shapes():
    rows = [
        (dict(temperature=0.5, top_k=-1, seed=2**33 + 3, frequency_penalty=0.1), [1, 2, 3], [4], 9),
        (params(top_k=0, repetition_penalty=1.1, seed=None), [1] * 20, pack_token_mask([4, 63], V), None),
        (SimpleNamespace(temperature=0.0), [], None, None),  # missing attributes: vLLM defaults
    ]
    t = SamplingTensors.from_params(rows, V, num_seqs=4, rng=np.random.default_rng(0))
    assert t.temperature.tolist() == [0.5, 1.0, 0.0, 0.0]
    assert t.top_k.tolist() == [0, 0, 0, 0]
    assert t.seeds.dtype == np.uint32 and t.seeds[0] == 3
    assert t.steps.tolist() == [9, 20, 0, 0]
    assert t.output_tokens.shape == (4, 32)  # next power of two above the longest penalized output
    assert t.output_tokens[0, :4].tolist() == [1, 2, 3, -1] and (t.output_tokens[2:] == -1).all()
    assert t.prompt_mask.shape == (4, 2)
    bits = np.asarray(_unpack_token_mask(t.prompt_mask, V))
    assert np.flatnonzero(bits[1]).tolist() == [4, 63] and not bits[0].any()
    with pytest.raises(ValueError, match="output_len"):
        SamplingTensors.from_params(rows, V, output_len=8)


def test_pack_token_mask_roundtrip_odd_vocab():
    ids = [0, 31, 32, 33, 99, 100]
    mask = pack_token_mask(ids, 101)
    assert mask.dtype == np.uint32 and mask.shape == (4,)
    assert np.flatnonzero(np.asarray(_unpack_token_mask(mask[None], 101))[0]).tolist() == ids


def test_logit_bias_and_min_tokens_mask_match_numpy():
    """logit_bias adds to the logits and min_tokens masks its ids to -inf while step < min_tokens, before
    the penalties; greedy takes the argmax of the result; logprobs stay those of the raw logits."""
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 1, (8, V)).astype(np.float32)
    top = np.argmax(logits, axis=1)
    rows = [  # (params, masked ids, step)
        (params(temperature=0.0, logit_bias=((5, 100.0),)), (), 0),
        (params(temperature=0.0, logit_bias={7: 3.5, int(top[1]): -100.0}), (), 0),
        (params(temperature=0.0, min_tokens=2), (int(top[2]), 9), 1),  # masked: step 1 < 2
        (params(temperature=0.0, min_tokens=2), (int(top[3]),), 2),  # step 2: no longer masked
        (params(temperature=0.0, min_tokens=3, logit_bias=((int(top[4]), 50.0),), frequency_penalty=1.0),
         (int(top[4]),), 0),  # -inf wins over a bias
        (params(temperature=0.0), (), 0),
    ]
    t = SamplingTensors.from_params([(p, [1, 2], None, step) for p, _, step in rows], V, num_seqs=8,
                                    min_tokens_ids=[ids for _, ids, _ in rows])
    assert t.bias_ids.shape == (8, 2)
    res = sample(logits, t, num_logprobs=2)
    for b, (p, ids, step) in enumerate(rows):
        x = logits[b].astype(np.float64)
        for i, v in dict(getattr(p, "logit_bias", None) or ()).items():
            x[i] += v
        if step < getattr(p, "min_tokens", 0):
            x[list(ids)] = -np.inf
        x = ref_penalties(x, [1, 2], [], 0.0, p.frequency_penalty, 1.0)
        assert int(res.tokens[b]) == int(np.argmax(x)), b
        np.testing.assert_allclose(float(res.logprobs[b]), log_softmax(logits[b])[int(res.tokens[b])], rtol=1e-5)
    assert int(res.tokens[0]) == 5 and int(res.tokens[2]) != top[2] and int(res.tokens[3]) == top[3]
    assert int(res.tokens[4]) != top[4] and int(res.tokens[5]) == top[5]


def test_grammar_mask_restricts_every_row_and_leaves_others_bit_identical():
    """Structured outputs: rows sample only allowed tokens (greedy and random, logprobs renormalized over
    them); an all-ones row gives bit for bit what the variant without the grammar flag gives."""
    from jinfer.engine.sampling_tensors import SamplerFlags

    rng = np.random.default_rng(3)
    B, Vb = 4, 300
    logits = rng.normal(0, 3, (B, Vb)).astype(np.float32)
    rows = [(params(temperature=0.0 if b % 2 else 0.9, seed=b), [], None, 0) for b in range(B)]
    plain = SamplingTensors.from_params(rows, Vb)
    allowed = [rng.choice(Vb, size=5, replace=False) for _ in range(B - 1)]
    masked = SamplingTensors.from_params(rows, Vb)
    all_ones = np.full((Vb + 31) // 32, 0xFFFFFFFF, np.uint32)
    masked.token_mask = np.stack([pack_token_mask(a, Vb) for a in allowed] + [all_ones])
    flags = SamplerFlags.of(masked)
    assert flags.grammar and not SamplerFlags.of(plain).grammar
    r = sample(logits, masked, 3)
    for b in range(B - 1):
        assert int(r.tokens[b]) in allowed[b]
        assert set(np.asarray(r.top_ids[b]).tolist()) <= set(allowed[b].tolist())
        ref = log_softmax(logits[b, allowed[b]])
        np.testing.assert_allclose(np.sort(np.asarray(r.top_logprobs[b])), np.sort(ref)[-3:], atol=1e-5)
    free = sample(logits, plain, 3, SamplerFlags.of(plain))
    assert int(r.tokens[B - 1]) == int(free.tokens[B - 1])
    assert np.asarray(r.top_logprobs[B - 1]).tobytes() == np.asarray(free.top_logprobs[B - 1]).tobytes()


def test_allowed_token_mask_keeps_raw_logprobs_and_ranks_count_the_vocab():
    """allowed_token_ids' rows (mask_logprobs 0) sample only allowed tokens but report the raw logprobs, as vLLM
    (which applies the set after them); grammar rows (1) report the constrained ones. Every row's rank is 1 + the
    tokens more likely than its sampled one under the logprobs it reports."""
    rng = np.random.default_rng(4)
    B, Vb = 4, 300
    logits = rng.normal(0, 3, (B, Vb)).astype(np.float32)
    rows = [(params(temperature=0.0 if b % 2 else 0.9, seed=b), [], None, 0) for b in range(B)]
    t = SamplingTensors.from_params(rows, Vb)
    allowed = [rng.choice(Vb, size=5, replace=False) for _ in range(B)]
    t.token_mask = np.stack([pack_token_mask(a, Vb) for a in allowed])
    t.mask_logprobs = np.array([1, 0, 0, 1], np.int32)
    r = sample(logits, t, 3)
    for b in range(B):
        token = int(r.tokens[b])
        assert token in allowed[b]
        ref = log_softmax(logits[b, allowed[b]]) if t.mask_logprobs[b] else log_softmax(logits[b])
        np.testing.assert_allclose(np.sort(np.asarray(r.top_logprobs[b])), np.sort(ref)[-3:], atol=1e-5)
        scored = logits[b, allowed[b]] if t.mask_logprobs[b] else logits[b]
        assert int(r.ranks[b]) == int((scored >= logits[b, token]).sum())
    assert int(r.ranks[1]) > 1 or int(r.tokens[1]) == int(np.argmax(logits[1]))  # raw rank among all 300


def test_greedy_verify_rows_compile_to_an_argmax():
    """A step's sampler with only greedy rows and no logprobs (speculative verify steps: 1 + k rows a sequence) is an
    argmax over the vocabulary: its compiled HLO has no softmax (exp, log) and no sort. The variant with sampled rows
    has them (so the check can fail)."""
    import functools

    import jax.numpy as jnp

    from jinfer.engine.device_step import sample_step
    from jinfer.engine.sampling_tensors import GREEDY_FLAGS, SamplerFlags
    from jinfer.engine.step_inputs import sampling_size

    R, vocab = 8, 4096
    shapes = (jax.ShapeDtypeStruct((R, vocab), jnp.float32),
              jax.ShapeDtypeStruct((sampling_size(R, 0, 0, 0, 0),), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.int32),
              jax.ShapeDtypeStruct((R, 3), jnp.int32))

    def ops(flags) -> set[str]:
        step = functools.partial(sample_step, dims=(R, 0, 0, 0), num_logprobs=-1, flags=flags)
        text = jax.jit(step).lower(*shapes).compile().as_text()
        return {op for op in ("exponential(", " log(", " sort(") if op in text}

    assert ops(GREEDY_FLAGS) == set()
    assert {"exponential(", " sort("} <= ops(SamplerFlags(full_sort=False, penalties=False))

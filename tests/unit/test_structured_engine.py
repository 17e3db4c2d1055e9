"""Structured outputs in EngineCore, on the tiny random Llama with a byte-level tokenizer (vocab 256):
whatever the random weights prefer, every constrained output matches its constraint; async scheduling
(masks computed while the forward runs), preemption, n > 1, prefix caching and abort behave as without
a grammar; grammars compile once; bad grammars are ValueErrors naming the field."""

import json
import re

import jsonschema
import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.sampling_params import SamplingParams
from jinfer.structured_outputs import StructuredOutputsParams
from jinfer.tokenizer import Tokenizer, _byte_alphabet

from .test_engine import BASE, TINY, prompts, run_all

EOS = 255
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": -5, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-c]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[xyz]/'


def byte_tokenizer() -> Tokenizer:
    """Bytes 1..255 are ids 0..254, id 255 is the EOS (the tiny models' vocab is 256)."""
    alphabet = _byte_alphabet()
    backend = HFTokenizer(models.BPE({alphabet[b]: b - 1 for b in range(1, 256)}, [], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|eos|>", special=True, normalized=False)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[EOS])


def core(**kw) -> EngineCore:
    return EngineCore(EngineConfig(TINY, **{**BASE, **kw}), tokenizer=byte_tokenizer())


def constrained(so: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 64, **kw}, structured_outputs=so)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([xyz](,[xyz]){0,2}\)", text), text


KINDS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES},
         "grammar": {"grammar": GRAMMAR}}


def workload(n=12, seed=0):
    """Constrained requests of every kind, greedy and seeded sampling, mixed with unconstrained ones."""
    reqs = []
    for i, p in enumerate(prompts(n, seed)):
        kind = list(KINDS)[i % 4]
        if i % 3 == 2:
            reqs.append((f"free{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
        sp = constrained(KINDS[kind], temperature=0.0 if i % 2 else 1.0, seed=i)
        reqs.append((f"{kind}{i}", p, sp))
    return reqs


def texts(core_, out):
    return {k: core_.tokenizer.decode(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def reference():
    """Synchronous engine, one step at a time: the reference outputs."""
    c = core(async_scheduling=False)
    out, finish = run_all(c, workload())
    return out, finish


@pytest.fixture(scope="module")
def engine():
    """One async engine shared by the tests that do not need a special configuration (compiles once)."""
    return core()


def test_every_output_matches_its_constraint(reference, engine):
    out, finish = reference
    for key, text in texts(engine, out).items():
        kind = re.match(r"[a-z]+", key).group(0)
        if kind == "free":
            continue
        assert finish[key] == "stop", (key, text)  # the grammar completed: the request stopped there
        check(kind, text)
        if EOS in out[key]:  # a grammar that accepts lets EOS through; nothing comes after it
            assert out[key].index(EOS) == len(out[key]) - 1


def test_async_masks_overlap_the_forward_and_change_nothing(reference, engine, monkeypatch):
    """With async scheduling the forward of step N+1 is launched before step N is read back; the masks
    follow and the tokens are those of the synchronous engine."""
    c = engine
    splits = []
    launch = c.runner.launch  # masks computed once the forward is dispatched: token_mask is a function
    monkeypatch.setattr(c.runner, "launch", lambda *a, **kw: (splits.append(callable(kw.get("token_mask"))),
                                                              launch(*a, **kw))[1])
    out, finish = run_all(c, workload())
    assert (out, finish) == reference
    assert sum(splits) > 10
    assert not c._seqs and c.kv.num_free_pages == c.kv.num_usable_pages


def test_preemption_chunking_and_prefix_cache_are_invisible(reference):
    c = core(num_pages=30, max_num_batched_tokens=8)  # 29 usable pages of 4 tokens, 8-token chunks
    preempted = []
    orig = c.scheduler._preempt
    c.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))[1]
    out, finish = run_all(c, workload(), arrivals=[i // 3 for i in range(len(workload()))])
    assert preempted, "the pool was meant to be too small"
    assert (out, finish) == reference
    again, _ = run_all(c, workload())  # the prompts' pages are cached now
    assert again == reference[0] and c.kv.num_hit_tokens > 0


def test_n_samples_abort_and_no_leaked_matchers(engine):
    c = engine
    sp = constrained(KINDS["json"], n=3, temperature=1.0, seed=7, max_tokens=60)
    out, finish = run_all(c, [("r", prompts(1)[0], sp)])
    assert sorted(out) == ["r/0", "r/1", "r/2"] and set(finish.values()) == {"stop"}
    for text in texts(c, out).values():
        check("json", text)
    assert len({tuple(v) for v in out.values()}) > 1  # seeds 7, 8, 9: different samples
    compiled = c.grammar.num_compiled
    run_all(c, [("s", prompts(1, seed=3)[0], sp)])
    assert c.grammar.num_compiled == compiled  # compiled once per schema

    for i, p in enumerate(prompts(4)):
        c.add_request(f"a{i}", p, constrained(KINDS["grammar"], max_tokens=60, n=2))
    c.step()
    c.step()
    assert len(c._seqs) == 8
    for i in range(4):
        c.abort(f"a{i}")
    while c.has_unfinished_requests():
        c.step()
    c.step()
    assert not c._seqs and not c._children and c.kv.num_free_pages == c.kv.num_usable_pages


def test_grammar_that_completes_stops_even_with_ignore_eos(engine):
    c = engine
    out, finish = run_all(c, [("c", prompts(1)[0], constrained(KINDS["choice"], ignore_eos=True))])
    assert finish["c/0"] == "stop" and c.tokenizer.decode(out["c/0"]) in CHOICES


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
])
def test_bad_grammar_is_a_value_error_naming_the_field(so, field, engine):
    c = engine
    with pytest.raises(ValueError, match=re.escape(field)):
        c.add_request("x", [1, 2, 3], constrained(so))
    assert not c.has_unfinished_requests() and not c._seqs


def test_masked_logprobs_are_those_of_the_constrained_distribution(engine):
    c = engine
    out = {}
    c.add_request("x", prompts(1)[0], constrained(KINDS["choice"], logprobs=3))
    while c.has_unfinished_requests():
        for d in c.step():
            out.setdefault("lps", []).extend(d.new_logprobs or [])
            out.setdefault("ids", []).extend(d.new_token_ids)
    first = out["lps"][0]
    allowed = {ord(w[0]) - 1 for w in CHOICES}  # byte b is id b - 1
    assert set(first) <= allowed  # top-3 of the masked distribution: only the choices' first letters
    assert np.logaddexp.reduce([first[t] for t in first]) == pytest.approx(0.0, abs=1e-4)


def test_structured_outputs_params_round_trip_and_validation():
    sp = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert sp.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert SamplingParams(**sp.to_dict()) == sp
    for bad, field in [({}, "structured_outputs"), ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
                       ({"choice": []}, "structured_outputs.choice"), ({"json": "{"}, "structured_outputs.json"),
                       ({"regex": 5}, "structured_outputs.regex"), ({"bogus": 1}, "structured_outputs")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            SamplingParams(structured_outputs=bad)


def test_sequences_get_their_own_compiled_matchers():
    """A cheap grammar is compiled for every sequence (deep copies share llguidance's lexer behind a lock,
    which serialises the mask pool), the first compile's time not counting the tokenizer's set-up."""
    from jinfer.engine.grammar import GrammarEngine
    from jinfer.structured_outputs import StructuredOutputsParams
    from jinfer.tokenizer import Tokenizer
    from jinfer.weights.loader import default_model_path

    tok = Tokenizer.from_pretrained(default_model_path())
    grammar = GrammarEngine(tok, tok.vocab_size, tok.eos_token_ids)
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second, third = (grammar.matcher(params) for _ in range(3))
    assert grammar.num_compiled == 1
    ((_, fresh),) = grammar._compiled.values()
    assert fresh  # ~1 ms: the tokenizer's ~0.2 s set-up is outside the timed compile
    for t in tok.encode('{"a": 1'):
        assert second.consume_token(t)
    assert not third.is_stopped() and third.is_accepting() is False


def _printable(t: int) -> bool:
    return 33 <= t + 1 <= 126  # one ASCII character, not blank (byte b is id b - 1)


def test_bad_words_allowed_token_ids_and_stop_token_text(engine):
    """vLLM's token restrictions on the async engine: a one-token bad word never comes; a two-token one bans its
    second token right after its first (the step in flight is read back first: one step late it would come out);
    allowed_token_ids restricts every token; a stop token's text is dropped unless include_stop_str_in_output.
    One request at a time, on the prompt of the tests above: no new forward shape to compile."""
    c = engine
    p, greedy = prompts(1)[0], dict(temperature=0.0, max_tokens=32, ignore_eos=True)

    def run(**kw):
        c.add_request("r", p, SamplingParams(**greedy, **kw))
        text, ids = "", []
        while c.has_unfinished_requests():
            for d in c.step():
                text, ids = text + d.new_text, ids + d.new_token_ids
        return text, ids

    _, plain = run()
    j = next(i for i, t in enumerate(plain) if _printable(t))  # the first one-character token
    pair = next(i for i in range(len(plain) - 1) if _printable(plain[i]) and _printable(plain[i + 1]))
    one, two = chr(plain[j] + 1), chr(plain[pair] + 1) + chr(plain[pair + 1] + 1)
    _, got = run(bad_words=[one])
    assert plain[j] not in got and got[:j] == plain[:j]
    assert two not in c.tokenizer.decode(plain[:pair + 1])  # (its first occurrence is at `pair`)
    text, got = run(bad_words=[two])
    assert got[:pair + 1] == plain[:pair + 1] and got[pair + 1] != plain[pair + 1] and two not in text
    allowed = sorted(set(plain[3:6]) | {7})
    assert set(run(allowed_token_ids=allowed)[1]) <= set(allowed)
    stop_at = plain.index(plain[j])  # its first occurrence
    text, got = run(stop_token_ids=[plain[j]])
    kept, got_kept = run(stop_token_ids=[plain[j]], include_stop_str_in_output=True)
    assert text == c.tokenizer.decode(plain[:stop_at]) and kept == text + one
    assert got == got_kept == plain[:stop_at + 1]  # the stop token's id stays in the output
    with pytest.raises(ValueError, match="allowed_token_ids"):
        c.add_request("bad", p, SamplingParams(allowed_token_ids=[1, 256]))
    assert not c.has_unfinished_requests() and not c._seqs

"""The offline API and CLI on the embedded default model: real text, stop strings, chat."""

import subprocess
import sys
import time

import pytest

from jinfer import Logprob, SamplingParams
from jinfer.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=24)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(str(default_gguf), dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
               warmup=False)


def test_chat_answers_paris(llm):
    out = llm.chat(FRANCE, GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS (<|im_end|>), not a stop string
    assert out.token_ids[-1] == 2


def test_stop_string_spanning_tokens(llm):
    tok = llm.get_tokenizer()
    full = llm.chat(FRANCE, GREEDY, use_tqdm=False)[0].outputs[0]
    # "is Par" starts inside " is" and ends inside " Paris": it spans a token boundary
    pieces = [tok.decode([t]) for t in full.token_ids]
    assert not any("is Par" in p for p in pieces)
    out = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24, stop=["is Par"]), use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.text == "The capital of France " and o.finish_reason == "stop" and o.stop_reason == "is Par"
    keep = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24, stop=["is Par"],
                                           include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == "The capital of France is Par"


def test_streamed_text_equals_final_text(llm):
    """Deltas from the core never include a partial stop string and add up to the final text."""
    core = llm.engine
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    # (12 tokens: every delta after the first few is held back by a stop string's length less one)
    core.add_request("s", ids, SamplingParams(temperature=0, max_tokens=12, stop=["\n\n", "zzz"]))
    deltas = []
    while core.has_unfinished_requests():
        deltas += core.step()
    text = "".join(d.new_text for d in deltas)
    assert deltas[-1].finished and "\n\n" not in text
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert full.outputs[0].text.startswith(text)


def test_mixed_prompts_batch(llm):
    outs = llm.generate(["The quick brown fox", {"prompt_token_ids": [1, 504, 3575]}],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0), use_tqdm=False)
    assert outs[0].prompt == "The quick brown fox" and outs[1].prompt_token_ids == [1, 504, 3575]
    assert all(len(o.outputs[0].token_ids) <= 8 and o.outputs[0].text for o in outs)


def test_structured_outputs_offline(llm):
    """vLLM's offline shape: SamplingParams(structured_outputs=StructuredOutputsParams(...))."""
    import json

    from jinfer import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    sp = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
          SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": ["Paris", "Lyon"]})]
    outs = llm.chat([FRANCE, FRANCE], sp, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop", outs[0].outputs[0].text
    data = json.loads(outs[0].outputs[0].text)
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)
    assert outs[1].outputs[0].text in ("Paris", "Lyon") and outs[1].outputs[0].finish_reason == "stop"


def test_logprob_objects_and_request_metrics(llm):
    """vLLM's shapes: {token id: Logprob(logprob, rank, decoded_token)} per token, the chosen token first; and
    RequestOutput.metrics' wall-clock times in order."""
    tok = llm.get_tokenizer()
    t0 = time.time()
    out = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24, logprobs=2), use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.text == "The capital of France is Paris." and len(o.logprobs) == len(o.token_ids)
    for token, lps in zip(o.token_ids, o.logprobs, strict=True):
        assert next(iter(lps)) == token and all(isinstance(lp, Logprob) for lp in lps.values())
        assert lps[token].rank == 1  # greedy without penalties: the raw argmax
        assert sorted(lp.rank for lp in lps.values()) == [1, 2]
        assert all(lp.decoded_token == tok.decode([t], skip_special_tokens=False) for t, lp in lps.items())
    assert "".join(lps[t].decoded_token for t, lps in zip(o.token_ids[:-1], o.logprobs)) == o.text  # (EOS last)
    assert o.cumulative_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(o.token_ids, o.logprobs)))
    m = out.metrics
    assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
        <= m.finished_time <= time.time()
    assert m.time_in_queue >= 0 and m.first_token_latency > 0 and m.num_generation_tokens == len(o.token_ids)


def test_stop_token_ids_drop_their_text_and_bad_words(llm):
    """vLLM: a stop token's text is left out unless include_stop_str_in_output (its id stays); a bad word is never
    generated, with or without a leading space."""
    [paris] = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)
    sp = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[paris]),
          SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[paris], include_stop_str_in_output=True)]
    dropped, kept = (r.outputs[0] for r in llm.chat([FRANCE, FRANCE], sp, use_tqdm=False))
    assert dropped.text == "The capital of France is" and dropped.token_ids[-1] == paris
    assert dropped.finish_reason == "stop" and dropped.stop_reason == paris
    assert kept.text == "The capital of France is Paris" and kept.token_ids == dropped.token_ids
    banned = llm.chat([FRANCE, FRANCE], [SamplingParams(temperature=0, max_tokens=24, bad_words=["Paris"]),
                                         SamplingParams(temperature=0, max_tokens=24, bad_words=["capital"])],
                      use_tqdm=False)
    assert all(w not in r.outputs[0].text for r, w in zip(banned, ["Paris", "capital"]))
    assert banned[0].outputs[0].text.startswith("The capital of France is")


@pytest.mark.slow  # a process of its own: loads the model again
def test_cli_generate_chat(default_gguf, llm):
    """Last in the module: the `llm` fixture's engine limits, so the process loads the executables the chat tests
    compiled from the run's compilation cache instead of compiling them again."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--chat", "--dtype", "float32",
                           "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
                           "--prompt", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=600)
    log = "\n".join(line for line in proc.stderr.replace("\r", "\n").splitlines() if "loading " not in line)
    assert proc.returncode == 0, log[-2000:]  # (without the weight-loading progress bar)
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr

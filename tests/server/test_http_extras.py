"""The HTTP server on the fake engine core: /tokenize, /detokenize, /ping, and property-based fuzzing
(hypothesis) of every POST endpoint with arbitrary JSON, near-valid bodies (a valid request with fields
replaced by arbitrary values) and raw bytes. Every answer must be a 2xx, or a 4xx with an OpenAI error
body, never a 5xx; the server stays healthy. FUZZ_EXAMPLES=N runs N examples per endpoint (default 150)."""

import json
import os
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import FAKE_CORE, ROOT, metric, start_server, wait_for

GOLDEN = json.loads(Path(ROOT, "tests/data/golden/smollm2_tokenizer.json").read_text())  # HF tokenizer

ARGS = ["--core-factory", FAKE_CORE, "--max-model-len", "64", "--max-num-seqs", "8"]
C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Integers at and beyond every width the server or engine might store them in.
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), -(2**63) - 1, 10**300]
scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(EDGE_INTS)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.sampled_from(["", "user", "assistant", "system", "tool", "text", "fake-model", "\x00", "<|im_end|>"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=10) | st.sampled_from(["role", "content", "type",
                                                                                      "text", "0", "5"]),
                                             inner, max_size=5), max_leaves=25)

COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "stream",
          "stream_options", "logit_bias", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
          "best_of", "user", "response_format", "tool_choice", "prompt_logprobs"]
FIELDS = {
    C: COMMON + ["prompt", "echo", "suffix"],
    CHAT: COMMON + ["messages", "top_logprobs", "max_completion_tokens", "tools"],
    TOK: ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
          "return_token_strs"],
    DETOK: ["model", "tokens"],
}
BASE = {
    C: {"prompt": "hi", "max_tokens": 3},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    TOK: {"prompt": "hello world"},
    DETOK: {"tokens": [1, 2, 3]},
}


ids = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.text(max_size=20)}), min_size=1, max_size=3)
PLAUSIBLE = {  # in or near the valid range: these get past validation into the engine
    "max_tokens": st.integers(0, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 50),
    "min_p": st.floats(0, 1), "n": st.integers(0, 3), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=0, max_size=4), max_size=4) | st.text(max_size=4),
    "stop_token_ids": st.lists(st.integers(-1, 60000), max_size=4), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0, 2), "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 5) | st.booleans(), "top_logprobs": st.integers(0, 5), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "echo": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
    "prompt_logprobs": st.integers(0, 5), "prompt": st.text(max_size=30) | ids | st.lists(ids, max_size=3),
    "messages": messages, "tokens": ids, "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(), "return_token_strs": st.booleans(),
    "max_completion_tokens": st.integers(0, 8),
}


@st.composite
def near_valid(draw, path):
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=5, unique=True)):
        if draw(st.integers(0, 9)) == 0 and name in body:
            del body[name]
        elif name in PLAUSIBLE and draw(st.integers(0, 9)) < 7:
            body[name] = draw(PLAUSIBLE[name])
        else:
            body[name] = draw(json_values)
    return json.dumps(body).encode()


raw_bodies = (st.binary(max_size=200)
              | st.builds(lambda n, c: c * n, st.integers(1, 200_000), st.sampled_from([b"[", b"{", b'{"a":']))
              | json_values.map(lambda v: json.dumps(v).encode()))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # (the fuzzed prompts may hold the fake core's failure token: a real engine has none)
    srv = start_server(ARGS, tmp_path_factory.mktemp("fuzz"), env={"JINFER_FAKE_FAIL_TOKEN": "-1"}, timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def check(client, path: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, body[:500], r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"server_error"' not in r.text, r.text[-500:]
    else:
        r.json()


@pytest.mark.parametrize("path", [C, CHAT, TOK, DETOK])
def test_near_valid_bodies(server, client, path):
    @SETTINGS
    @given(body=near_valid(path))
    def run(body):
        check(client, path, body)

    run()


@pytest.mark.parametrize("path", [C, CHAT, TOK])
def test_arbitrary_bodies(server, client, path):
    @settings(SETTINGS, max_examples=60)
    @given(body=raw_bodies)
    def run(body):
        check(client, path, body)

    run()


def test_known_bad_inputs(server, client):
    """The inputs of issue 16 (each was a 500 or accepted): all 400s naming the field."""
    cases = [({"prompt": "hi", "seed": 2**70}, "seed"), ({"prompt": "hi", "stop": ["x"] * 100_000}, "stop"),
             ({"prompt": "hi", "stop": ["x" * 5000]}, "stop"), ({"prompt": "hi", "top_k": 2**40}, "top_k"),
             ({"prompt": "hi", "temperature": 10**400 // 10**100}, "temperature"),
             ({"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
             ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
             ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
             ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias")]
    for body, param in cases:
        r = client.post(C, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text[:300])
    r = client.post(C, content=b"[" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post(C, content=b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}")  # past Python's int digit limit
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post(C, json={"prompt": "hi", "seed": 2**63 - 1, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_healthy_after(server, client):
    assert client.get("/health").status_code == 200
    assert client.post(C, json={"prompt": "hi", "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3
    assert wait_for(lambda: metric(server.url, "jinfer_num_requests_running") == 0, 10)


# ---- /tokenize, /detokenize, /ping (the fake core serves the default model's tokenizer) ---------------


def test_tokenize_matches_hf(client):
    for t in GOLDEN["texts"]:
        r = client.post(TOK, json={"prompt": t["text"], "add_special_tokens": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body == {"count": len(t["ids_upstream"]), "max_model_len": 64, "tokens": t["ids_upstream"],
                        "token_strs": None}
        r = client.post(DETOK, json={"model": "fake-model", "tokens": t["ids_upstream"]})
        assert r.json() == {"prompt": t["decoded"]}
    r = client.post(TOK, json={"prompt": "Hello, world", "return_token_strs": True}).json()
    assert r["token_strs"] == ["Hello", ",", "Ġworld"] and r["count"] == 3


def test_tokenize_chat_matches_hf_template(client):
    for chat in GOLDEN["chats"]:
        rendered = chat["rendered"]
        r = client.post(TOK, json={"messages": chat["messages"],
                                   "add_generation_prompt": chat["add_generation_prompt"]}).json()
        expected = client.post(TOK, json={"prompt": rendered, "add_special_tokens": False}).json()["tokens"]
        assert r["tokens"] == expected and r["count"] == len(expected), rendered
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    r = client.post(TOK, json={"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    text = client.post(DETOK, json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe answer is"), text


def test_tokenize_errors(client):
    for path, body, param in [(TOK, {}, "prompt"), (TOK, {"prompt": "a", "messages": []}, "prompt"),
                              (TOK, {"prompt": 5}, "prompt"), (TOK, {"prompt": "a", "model": "x"}, "model"),
                              (TOK, {"messages": [{"role": "user"}]}, "messages[0].content"),
                              (TOK, {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
                              (DETOK, {}, "tokens"), (DETOK, {"tokens": [-1]}, "tokens"),
                              (DETOK, {"tokens": [10**9]}, "tokens"), (DETOK, {"tokens": "abc"}, "tokens")]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_tokenizer_info(client):
    info = client.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")  # SmolLM2-Instruct's
    assert info["model_max_length"] == 64 and "<|im_start|>" in info["chat_template"]


def test_ping(client):
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


# ---- /v1/completions echo + logprobs: the prompt tokens' logprobs (the fake core's: -j/1000) ----------


def test_echo_logprobs_with_max_tokens_0(client):
    """As lm-evaluation-harness scores a prompt: echo, logprobs 1, max_tokens 0 (and 1)."""
    ids = [19556, 28, 905, 17]  # "Hello, world!"
    for max_tokens in (0, 1):
        r = client.post(C, json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                                 "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = len(ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["tokens"][:4] == ["Hello", ",", " world", "!"]
        assert lp["token_logprobs"][:4] == [None, -0.001, -0.002, -0.003]
        assert lp["top_logprobs"][0] is None
        assert lp["top_logprobs"][1] == {",": -0.001, "-": -0.1}  # the prompt token and the top 1 (id 28 + 1)
        assert lp["text_offset"][:4] == [0, 5, 6, 12]
        assert choice["text"].startswith("Hello, world!")
        if max_tokens == 0:
            assert choice["text"] == "Hello, world!" and choice["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 0
        else:
            assert lp["token_logprobs"][4] == -0.5  # the generated token's
    # streamed: the first chunk carries the echoed prompt and its logprobs
    with client.stream("POST", C, json={"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0,
                                        "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == "Hello, world!" and first["logprobs"]["token_logprobs"] == [None, -0.001, -0.002, -0.003]
    assert len(first["logprobs"]["top_logprobs"][2]) == 3
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello, world!"
    # without echo, max_tokens 0 is still refused
    assert client.post(C, json={"prompt": ids, "max_tokens": 0}).status_code == 400

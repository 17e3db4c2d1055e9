"""The app in this process on a stub engine client that replays scripted text pieces (no engine process, no
model; the logs are caplog's): reasoning_content in responses and streams, tool calls read from the content,
ignored request fields, the API key check, and the access line of every request."""

import json
import logging
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from jinfer.outputs import EngineOutput
from server.app import build_app

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class StubTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
        return json.dumps({"messages": messages, **kwargs})

    def encode(self, text, add_special_tokens=True):
        return [1 + b % 100 for b in text.encode()[:8]]


class StubClient:
    """Each request's output: the pieces of `script`, one token each, then finished with "stop"."""

    def __init__(self, script):
        self.script = script
        self.info = SimpleNamespace(model_name="m", max_model_len=4096, vocab_size=1000, max_num_seqs=4,
                                    generation_defaults={})
        self.tokenizer, self.is_alive, self.replicas, self.dead_reason = StubTokenizer(), True, [self], None

    async def stream_batch(self, prompts, params, request_id):
        for i, piece in enumerate(self.script):
            last = i == len(self.script) - 1
            yield [(0, EngineOutput(request_id, 0, [7], piece, finished=last, finish_reason="stop" if last else None))]


def client(script, **kw):
    return TestClient(build_app(StubClient(script), **kw))


THINK = ["<th", "ink>\nAdd", " them.</", "think>\n\n", "<tool_call>", '{"name": "get_weather", ', '"arguments": {}}',
         "</tool_call>"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_tool_call_from_the_content(stream):
    c = client(THINK, reasoning_parser="qwen3", tool_parser="hermes")
    body = {"messages": MSG, "tools": TOOLS, "stream": stream}
    if not stream:
        msg = c.post(CHAT, json=body).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "\nAdd them." and msg["content"] is None  # (only whitespace before the call)
        assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
        return
    events = [json.loads(line[6:]) for line in c.post(CHAT, json=body).text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "\nAdd them." and content == "\n\n"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning first, then content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and "".join(c["function"]["arguments"] for c in calls) == "{}"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_deepseek_r1_output_starts_inside_reasoning_and_no_parser_means_no_field():
    c = client(["Hmm", ".</think>", "4"], reasoning_parser="deepseek_r1")
    msg = c.post(CHAT, json={"messages": MSG}).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "4")
    msg = client(["<think>a</think>b"]).post(CHAT, json={"messages": MSG}).json()["choices"][0]["message"]
    assert msg["content"] == "<think>a</think>b" and "reasoning_content" not in msg


def test_kimi_thinking_ends_at_a_tool_call_and_deepseek_v3_thinks_when_asked():
    """kimi_k2: reasoning up to the tool-call section (no </think>), which the kimi_k2 tool parser reads; off with
    `thinking: false`. deepseek_v3: all content unless `thinking: true`, then R1's split."""
    kimi = ["Weather?", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>']
    c = client(kimi, reasoning_parser="kimi_k2", tool_parser="kimi_k2")
    msg = c.post(CHAT, json={"messages": MSG, "tools": TOOLS}).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "Weather?" and msg["content"] is None
    assert msg["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    off = {"messages": MSG, "chat_template_kwargs": {"thinking": False}}
    assert "reasoning_content" not in client(["a</think>b"], reasoning_parser="kimi_k2").post(CHAT, json=off).json()[
        "choices"][0]["message"]
    c = client(["Hmm", ".</think>", "4"], reasoning_parser="deepseek_v3")
    assert c.post(CHAT, json={"messages": MSG}).json()["choices"][0]["message"]["content"] == "Hmm.</think>4"
    msg = c.post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"thinking": True}}).json()["choices"][0][
        "message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "4")


def test_chat_template_kwargs_reach_the_template():
    c = client(["x"])
    r = c.post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert c.post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}).status_code == 200
    c.app.state.jinfer.ctx.tokenizer.apply_chat_template = lambda *a, **kw: 1 + kw["n"]  # a template doing sums
    r = c.post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"n": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_unknown_fields_are_logged_once_with_typo_hints(caplog):
    c = client(["ok"])
    with caplog.at_level(logging.WARNING, logger="jinfer.server"):
        r = c.post(CHAT, json={"messages": MSG, "maxtokens": 5, "temprature": 0.1, "foo": 1, "user": "u1"})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert lines == ["The following fields were present in the request but ignored: maxtokens (did you mean "
                     "max_tokens?), temprature (did you mean temperature?), foo"]


class Reads(dict):
    """A request body that records which fields the parser looks at."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def test_every_field_the_parsers_read_is_a_known_field():
    """A field read by the parsers but missing from server/request_fields.py would be logged as ignored."""
    from server.request_fields import CHAT_FIELDS, COMPLETION_FIELDS
    from server.validation import ServingContext, parse_chat, parse_completion

    ctx = ServingContext(("m",), 4096, 1000, StubTokenizer(), tool_parser="hermes")
    for parse, body, known in [(parse_completion, Reads(prompt="hi", echo=True, logprobs=1), COMPLETION_FIELDS),
                               (parse_chat, Reads(messages=MSG, tools=TOOLS), CHAT_FIELDS)]:
        parse(body, ctx)
        assert body.read <= known, body.read - known


def test_api_key():
    c = client(["ok"], api_key="sekrit")
    for sent in [None, "Bearer sekri", "Bearer sekrit\xe9".encode("latin-1"), "Bearer sekrit"]:
        r = c.post(CHAT, json={"messages": MSG}, headers={"Authorization": sent} if sent else {})
        assert r.status_code == (200 if sent == "Bearer sekrit" else 401), sent


def test_one_access_line_per_request_rejected_ones_included(caplog):
    c = client(["a", "b"])
    with caplog.at_level(logging.INFO, logger="jinfer.access"):
        c.post(CHAT, json={"messages": MSG})
        c.post(CHAT, json={"messages": MSG, "max_tokens": "10"})
        c.get("/nope")
        with c.stream("POST", CHAT, json={"messages": MSG, "stream": True}) as r:
            r.read()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "jinfer.access"]
    assert len(lines) == 4, lines
    assert '"POST /v1/chat/completions" 200 ' in lines[0] and "id=chatcmpl-" in lines[0]
    assert "output_tokens=2" in lines[0] and "finish=stop" in lines[0]
    assert " 400 " in lines[1] and "error=\"'max_tokens' must be an integer" in lines[1]
    assert '"GET /nope" 404 ' in lines[2]
    assert " 200 " in lines[3] and "output_tokens=2" in lines[3]  # a stream: logged once it ended
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jinfer.access"):
        client(["a"], log_requests=False).post(CHAT, json={"messages": MSG})
    assert not [rec for rec in caplog.records if rec.name == "jinfer.access"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_events_are_the_chunks_json(chat, include_usage):
    """The streamed events built from templates (server/generation.py) are json.dumps of the chunk, byte for byte."""
    from server import schemas
    from server.generation import Generation

    req = SimpleNamespace(chat=chat, model='m"o\\é', include_usage=include_usage, prompts=[[1]],
                          params=SimpleNamespace(n=2))
    gen = Generation(SimpleNamespace(client=SimpleNamespace(stream_batch=lambda *a: None)), req, lambda: None)

    def reference(choices, usage=None):
        body = schemas.chunk(chat, gen.id, gen.created, req.model, choices, usage, include_usage)
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    for index in (0, 3):
        for text in ("", " hello", 'q"u\\o\n\x00\x7f\u2028é😀'):
            choice = (schemas.chat_delta(index, {"content": text}) if chat
                      else schemas.completion_choice(index, text, None, None))
            assert gen._text_event(index, text) == gen._event([choice]) == reference([choice])
    usage = schemas.usage(3, 4)
    assert gen._event([], usage) == reference([], usage)

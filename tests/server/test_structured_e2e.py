"""Structured outputs and tool calling end to end: `python -m server.launcher` on the default model
(SmolLM2-135M, float32, CPU) with `--enable-auto-tool-choice --tool-call-parser hermes`, driven by the
official `openai` client and raw HTTP. The schemas go out concurrently, so they share engine steps."""

import asyncio
import json
import re
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import SMOLLM2_ARGS, smollm2_env, start_server

MODEL = "SmolLM2-135M-Instruct"
S, I = {"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 100}


def obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


POINT = obj({"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9}})
SCHEMAS = {  # name: (what to ask for, schema)
    "person": ("a person", obj({"name": S, "age": I})),
    "color": ("a color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    "task": ("a task status", obj({"done": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 10}})),
    "tags": ("tags for a blog post", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                   "minItems": 1, "maxItems": 3}})),
    "nested": ("a user", obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": S})})),
    "any_of": ("a value", obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, S]}})),
    "nullable": ("a note", obj({"note": {"anyOf": [S, {"type": "null"}]}})),
    "optional": ("a name and maybe a nickname", obj({"name": S, "nick": S}, required=["name"])),
    "order": ("an order", obj({"items": {"type": "array", "maxItems": 2, "items": obj(
        {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}})),
    "pattern": ("an airport code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}})),
    "price": ("a price", obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}})),
    "refs": ("a line segment", {"$defs": {"pt": POINT}, **obj({"a": {"$ref": "#/$defs/pt"},
                                                                "b": {"$ref": "#/$defs/pt"}})}),
    "shape": ("a shape", obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
        obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}})]}})),
    "rating": ("a rating from 1 to 5", {"type": "integer", "minimum": 1, "maximum": 5}),
    "direction": ("a direction", {"enum": ["north", "south", "east", "west"]}),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    args = [*SMOLLM2_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = start_server(args, tmp, env=smollm2_env(), timeout=900)
    yield srv
    srv.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=600)


def test_json_schemas_all_parse_and_validate(server):
    async def one(aclient, name, what, schema):
        r = await aclient.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": f"Give me {what} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        return name, r.choices[0]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        return await asyncio.gather(*(one(aclient, n, w, s) for n, (w, s) in SCHEMAS.items()))

    results = asyncio.run(run())
    assert len(results) == len(SCHEMAS) >= 15
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][1])


def test_regex_choice_grammar_and_json_object(server):
    """Each kind of constraint once; the requests go out together (they share engine steps)."""
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    choices = ["Paris", "London", "Berlin"]
    # completions: vLLM's structured_outputs object, a Lark grammar and a GBNF one
    lark = 'start: "SELECT " col ("," col)? " FROM " tbl\ncol: "id" | "name"\ntbl: "users" | "orders"'
    gbnf = 'root ::= "The answer is " [0-9]+ "."'

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a phone number."}],
                                          temperature=0, max_tokens=30, extra_body={"guided_regex": phone}),
                c.chat.completions.create(model=MODEL, messages=ASK, temperature=0.8, n=3, seed=1, max_tokens=10,
                                          extra_body={"guided_choice": choices}),
                c.completions.create(model=MODEL, prompt="A SQL query:", temperature=0, max_tokens=30,
                                     extra_body={"structured_outputs": {"grammar": lark}}),
                c.completions.create(model=MODEL, prompt="2 + 2 =", temperature=0, max_tokens=12,
                                     extra_body={"guided_grammar": gbnf}),
                c.completions.create(model=MODEL, prompt="A JSON object with the key answer:", temperature=0,
                                     max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}),
                c.chat.completions.create(
                    model=MODEL, temperature=0, max_tokens=60, response_format={"type": "json_object"},
                    messages=[{"role": "user", "content": 'Reply with exactly {"capital": "Paris"}'}]))
        finally:
            await c.close()

    number, city, sql, answer, yes_no, obj_ = asyncio.run(run())
    assert re.fullmatch(phone, number.choices[0].message.content)
    assert len(city.choices) == 3
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in city.choices)
    assert re.fullmatch(r"SELECT (id|name)(,(id|name))? FROM (users|orders)", sql.choices[0].text)
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.choices[0].text), answer.choices[0].text
    assert yes_no.choices[0].text in ("yes", "no")
    assert isinstance(json.loads(obj_.choices[0].message.content), dict) and obj_.choices[0].finish_reason == "stop"


def test_streamed_structured_output_equals_the_whole(client):
    # (a short object: two requests of a few steps each)
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"][1]}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]
    assert "".join(pieces) == whole and len(pieces) > 3
    jsonschema.validate(json.loads(whole), SCHEMAS["person"][1])


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
        "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_constraints_are_400_naming_the_field(server, path, body, param):
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "hi"}
    r = post(server, path, {**base, **body, "max_tokens": 5})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_required_and_named_whole_and_streamed(client, tool_choice):
    """required: calls of the given tools with valid arguments; named (parallel calls off): that one call. Streamed,
    through the client's own assembly of delta.tool_calls: the same calls as the whole."""
    tools = [WEATHER, TIME]
    named = isinstance(tool_choice, dict)
    kw = dict(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=120,
              **({"parallel_tool_calls": False} if named else {}))
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    if named:
        assert [c.function.name for c in calls] == ["get_time"]
    else:
        assert whole.message.content is None
    for c in calls:
        tool = next(t for t in tools if t["function"]["name"] == c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])
    with client.beta.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in calls]
    assert final.finish_reason == "tool_calls"
    assert len({c.id for c in final.message.tool_calls}) == len(got)


def test_tool_conversation_round_trip(client):
    """A whole exchange: the forced call, its result as a `tool` message, then the model's answer (auto)."""
    tools = [WEATHER]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, temperature=0, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]

    async def answers():  # tool_choice auto and none, together (they share engine steps)
        c = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(
                c.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice=choice,
                                          temperature=0, max_tokens=n) for choice, n in (("auto", 30), ("none", 10))))
        finally:
            await c.close()

    second, none = asyncio.run(answers())
    msg = second.choices[0].message
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert msg.content or msg.tool_calls  # SmolLM2 has no tool format: whatever it says comes back parsed or as text
    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].message.content

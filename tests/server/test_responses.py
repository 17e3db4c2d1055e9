"""/v1/responses on the fake engine core, driven by the official openai client: plain and streamed responses,
function tools, previous_response_id, GET / DELETE, bad input (400 / 404 with OpenAI's error body). The fake
writes " <id> <id+1> ..." after the prompt's last token, so the same input gives the same text. The last tests
need no server: tool-call text read into function_call items, whole and streamed."""

import json

import httpx
import openai
import pytest

from server.responses import input_messages, output_items
from server.responses_stream import _Events
from server.tools import ToolPlan, ToolStream
from tests.server.helpers import FAKE_CORE, start_server

ARGS = ["--core-factory", FAKE_CORE, "--max-model-len", "64", "--max-num-seqs", "4"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(ARGS, tmp_path_factory.mktemp("responses"), timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_tokens(server, messages) -> int:
    """Tokens of the chat prompt these messages make (the server's own template, through /tokenize)."""
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=10).json()["count"]


def test_plain_and_streamed(server, client):
    r = client.responses.create(model="fake-model", input="hi", instructions="Be brief.", max_output_tokens=4)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake-model"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.output_text == msg.content[0].text and len(r.output_text.split()) == 4
    system_and_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert r.usage.input_tokens == prompt_tokens(server, system_and_user)
    assert r.usage.output_tokens == 4 and r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.instructions == "Be brief." and r.max_output_tokens == 4 and r.store

    events = list(client.responses.create(model="fake-model", input="hi", instructions="Be brief.",
                                          max_output_tokens=4, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    done = events[-1].response
    assert done.output_text == r.output_text and done.usage.output_tokens == 4 and done.status == "incomplete"
    assert events[2].item.id == events[-2].item.id == done.output[0].id

    with client.responses.stream(model="fake-model", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}]}], max_output_tokens=3) as stream:  # the client's own assembly
        final = stream.get_final_response()
    assert r.output_text.startswith(final.output_text) and len(final.output_text.split()) == 3


def test_function_tool(client):
    kw = dict(model="fake-model", input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED, max_output_tokens=3)
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.arguments and r.output_text == "" and r.tools[0].name == "get_weather"
    with client.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    (streamed,) = final.output
    assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", "get_weather", call.arguments)


def test_previous_response_id(server, client):
    first = client.responses.create(model="fake-model", input="hi", instructions="Be brief.", max_output_tokens=3)
    second = client.responses.create(model="fake-model", input="more", previous_response_id=first.id,
                                     max_output_tokens=3)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "more"}]  # the earlier instructions are not carried over (OpenAI)
    assert second.usage.input_tokens == prompt_tokens(server, history)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text

    call = client.responses.create(model="fake-model", input="Weather?", tools=[WEATHER], tool_choice=NAMED,
                                   max_output_tokens=3)
    (item,) = call.output
    result = client.responses.create(model="fake-model", previous_response_id=call.id, input=[
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}], max_output_tokens=3)
    tool_turn = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": item.call_id, "type": "function", "function": {"name": "get_weather", "arguments": item.arguments}}]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "sunny"}]
    assert result.usage.input_tokens == prompt_tokens(server, tool_turn) and result.output_text

    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model="fake-model", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="fake-model", input="hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


USER = [{"role": "user", "content": "hi"}]
BAD = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": "4"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 60}, "max_output_tokens"),  # the engine's refusal, in this API's name
    ({"input": "hello " * 70}, "input"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "instructions": 5}, "instructions"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"},
     "tools[0].name"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     "text.format.schema"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
    ({"input": USER, "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_bad_input_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fake-model", input=[{"role": "user", "content": 5}], stream=True)
    assert e.value.body["param"] == "input[0].content"
    r = httpx.post(f"{server.url}/v1/responses", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{server.url}/v1/responses/resp_nope", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- no server -----------------------------------------------------------------------------------------------

HERMES_TEXT = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "sys"}, {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"}]
    msgs = input_messages(items)
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool"]
    assert msgs[1]["content"] == "ab" and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_parsed_tool_calls_whole_and_streamed_alike():
    plan = ToolPlan("auto", parser="hermes")
    content, calls = plan.message(HERMES_TEXT)
    whole = output_items({"message": {"content": content, "tool_calls": calls}, "finish_reason": "stop"})
    ev, tools, lines = _Events(), ToolStream(plan), []
    for end in range(3, len(HERMES_TEXT) + 3, 3):  # three characters a step
        text, pieces = tools.update(HERMES_TEXT[:end], end >= len(HERMES_TEXT))
        lines += (ev.text_delta(text) if text else []) + [e for p in pieces for e in ev.call_piece(p)]
    lines += ev.close_text("completed") + ev.close_call()
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events if e["type"].endswith(("added", "done"))] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        *["response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"] * 2]
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(ev.output) == strip(whole)
    assert [(i["type"], i.get("name")) for i in whole] == [("message", None), ("function_call", "get_weather"),
                                                           ("function_call", "get_time")]
    assert json.loads(whole[1]["arguments"]) == {"city": "Paris"} and whole[0]["content"][0]["text"] == "Let me check."

"""Tool-call parsing on fixed model outputs (Hermes / Qwen, Llama 3 JSON, Mistral, pythonic, Kimi-K2, DeepSeek-V3 /
V3.1, the forced formats): the
non-streaming message, and streaming fed in every possible piece size, whose assembled result (the
way the openai client assembles `delta.tool_calls`) must equal it."""

import json

import pytest

from server.errors import InvalidRequest
from server.tool_parsers import partial_suffix
from server.tools import ToolPlan, ToolStream, parse_tools

HERMES = ToolPlan("auto", parser="hermes")
LLAMA = ToolPlan("auto", parser="llama3_json")
MISTRAL = ToolPlan("auto", parser="mistral")
PYTHONIC = ToolPlan("auto", parser="pythonic")
KIMI = ToolPlan("auto", parser="kimi_k2")
DSV3, DSV31 = ToolPlan("auto", parser="deepseek_v3"), ToolPlan("auto", parser="deepseek_v31")
KIMI_TEXT = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
             '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|> functions.ns.find:1 '
             '<|tool_call_argument_begin|> {"q": "}<|tool_call_end|>"}<|tool_call_end|><|tool_calls_section_end|>')
# brackets and quotes inside strings, a triple-quoted string, a tuple, Llama 4's tags
TRICKY = "<|python_start|>[f(a=[1, {'k': (2, 'x)]')}], b='''q\"), ''', c=-1.5, d=True)]<|python_end|>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CASES = [  # plan, model output, expected content, expected [(name, arguments)]
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", '{"city": "Paris"}')]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n<tool_call>\n'
             '{"arguments": {}, "name": "b"}\n</tool_call>',
     None, [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")]),
    (HERMES, 'No tools needed: 2 < 3 and "<tool" is just text.', 'No tools needed: 2 < 3 and "<tool" is just text.',
     []),
    (HERMES, '<tool_call>\n{"name": "esc\\"aped", "arguments": {"q": "a\\\\b \\"c\\" \\u00e9"}}</tool_call>',
     None, [('esc"aped', '{"q": "a\\\\b \\"c\\" \\u00e9"}')]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {"n": -2.5e3}}',
     None, [("a", '{"n": 1}'), ("b", '{"n": -2.5e3}')]),
    (LLAMA, 'The weather is fine.', "The weather is fine.", []),
    (LLAMA, '{"answer": 42}', '{"answer": 42}', []),
    (ToolPlan("required"), '[{"name": "a", "parameters": {"k": "v"}}, {"name": "b", "parameters": {}}]', None,
     [("a", '{"k": "v"}'), ("b", "{}")]),
    (ToolPlan("required", parallel=False), '[{"name": "a", "parameters": {"k": "v"}}]', None, [("a", '{"k": "v"}')]),
    (ToolPlan("named", function="get_weather"), '{"city": "Rome"}', None, [("get_weather", '{"city": "Rome"}')]),
    (MISTRAL, 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "b", '
              '"arguments": {}}]', "Checking.", [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]{}', None,
     [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    (MISTRAL, "Just text with [brackets].", "Just text with [brackets].", []),
    (PYTHONIC, '[get_weather(city="San Francisco", days=3, units=None), ping()]', None,
     [("get_weather", '{"city": "San Francisco", "days": 3, "units": null}'), ("ping", "{}")]),
    (PYTHONIC, TRICKY, None, [("f", json.dumps({"a": [1, {"k": [2, "x)]"]}], "b": 'q"), ', "c": -1.5, "d": True}))]),
    (PYTHONIC, "[1] is a citation.", "[1] is a citation.", []),
    (PYTHONIC, "[f(1)]", "[f(1)]", []),  # positional arguments: not vLLM's format
    (PYTHONIC, "[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # literals only, never evaluated
    (PYTHONIC, "[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set has no JSON form
    (KIMI, KIMI_TEXT, "Let me check.",
     [("get_weather", '{"city": "Beijing"}'), ("ns.find", '{"q": "}<|tool_call_end|>"}')]),
    (KIMI, "Text with <|tool_call_begin|> alone.", "Text with <|tool_call_begin|> alone.", []),
    (DSV3, 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
           '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```'
           '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    (DSV31, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
            '<｜tool▁calls▁end｜>', None, [("get_weather", '{"city": "Paris"}')]),
]


def assemble(plan, text, piece):
    """Feed `text` in pieces of `piece` chars; assemble deltas like openai's ChatCompletionStreamState."""
    stream, content, calls = ToolStream(plan), "", {}
    for end in list(range(piece, len(text), piece)) + [len(text)]:
        delta, pieces = stream.update(text[:end], end == len(text))
        content += delta
        for p in pieces:
            call = calls.setdefault(p["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in p:
                assert call["id"] is None, "a call's header is sent once"
                call["id"], call["name"] = p["id"], p["function"]["name"]
            call["arguments"] += p["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("plan, text, content, calls", CASES)
def test_message_and_every_streaming_split_agree(plan, text, content, calls):
    got_content, tool_calls = plan.message(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") or plan in (MISTRAL, KIMI) for c in tool_calls)
    assert all(c["type"] == "function" for c in tool_calls)
    for call in tool_calls:
        json.loads(call["function"]["arguments"])
    for piece in range(1, len(text) + 1):
        streamed_content, streamed_calls = assemble(plan, text, piece)
        assert streamed_calls == calls, piece
        assert streamed_content == (content or "") if calls else streamed_content == text


def test_streaming_holds_back_a_partial_tag_and_sends_headers_before_arguments():
    stream = ToolStream(HERMES)
    assert stream.update("Sure <tool", False) == ("Sure ", [])
    assert stream.update('Sure <tool_call>{"name": "get_w', False) == ("", [])
    delta, pieces = stream.update('Sure <tool_call>{"name": "get_weather", "arguments": {"ci', False)
    assert delta == "" and pieces[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert set(pieces[0]) == {"index", "id", "type", "function"}
    delta, pieces = stream.update('Sure <tool_call>{"name": "get_weather", "arguments": {"city": "X"}}', False)
    assert pieces == [{"index": 0, "function": {"arguments": 'ty": "X"}'}}]
    assert partial_suffix("abc<tool_ca", "<tool_call>") == 8 and partial_suffix("abc", "<tool_call>") == 0


def test_mistral_ids_fit_its_template_and_pythonic_calls_come_whole():
    _, calls = MISTRAL.message('[TOOL_CALLS]f[ARGS]{"x": 1}')
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # Mistral's templates check the id's form
    stream = ToolStream(PYTHONIC)
    assert stream.update("[get_weather(city='Os", False) == ("", [])  # a call comes whole, once it parses
    delta, pieces = stream.update("[get_weather(city='Oslo'), ", False)
    assert delta == "" and pieces[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # not a list of calls after all: text, as in vLLM (a stream has sent the calls read before that showed)
    assert PYTHONIC.message("[f(x=1), g(") == ("[f(x=1), g(", [])
    assert PYTHONIC.message("[f(x=1)] and then text") == ("[f(x=1)] and then text", [])
    assert PYTHONIC.message("  ") == ("  ", [])


def test_kimi_call_ids_are_the_models():
    """Kimi's template writes each call's id back into the history (`<|tool_call_begin|>{{ id }}...`): the id is the
    one the model wrote, in the message and in the stream's headers."""
    _, calls = KIMI.message(KIMI_TEXT)
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.ns.find:1"]
    stream = ToolStream(KIMI)
    ids = [p["id"] for end in range(1, len(KIMI_TEXT) + 1) for p in stream.update(KIMI_TEXT[:end], False)[1]
           if "id" in p]
    assert ids == ["functions.get_weather:0", "functions.ns.find:1"]


def test_truncated_call_keeps_what_was_written():
    content, calls = ToolPlan("named", function="f").message('{"city": "Ro')
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Ro'


def test_parse_tools_modes_and_errors():
    body = {"tools": [WEATHER]}
    with pytest.raises(InvalidRequest, match="enable-auto-tool-choice") as e:
        parse_tools(body, None)  # tool_choice defaults to auto when tools are given
    assert e.value.param == "tool_choice"
    tools, plan, forced = parse_tools(body, "qwen")
    assert tools == [WEATHER] and plan == ToolPlan("auto", parser="hermes") and forced is None
    assert parse_tools({**body, "tool_choice": "none"}, None) == ([WEATHER], None, None)
    _, plan, forced = parse_tools({**body, "tool_choice": "required", "parallel_tool_calls": False}, None)
    assert plan.mode == "required" and forced.json["maxItems"] == 1
    _, plan, forced = parse_tools({**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                                  None)
    assert plan.function == "get_weather" and forced.json == WEATHER["function"]["parameters"]
    for bad, param in [({"tools": [{"type": "function"}]}, "tools[0].function"),
                       ({"tools": [{"function": {"name": "bad name"}}]}, "tools[0].function.name"),
                       ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "tool_choice"),
                       ({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": "yes"},
                        "parallel_tool_calls"),
                       ({"tools": [{"function": {"name": "f", "parameters": {"type": "nope"}}}],
                         "tool_choice": "required"}, "tools")]:
        with pytest.raises(InvalidRequest) as e:
            parse_tools(bad, None)
        assert e.value.param == param, bad


HERMES_TEMPLATE = (  # the shape of Qwen 2.5's tool template, cut down
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")


def test_tools_and_tool_history_reach_the_chat_template(default_gguf):
    from jinfer.tokenizer import Tokenizer
    from server.validation import ServingContext, parse_chat

    tok = Tokenizer.from_pretrained(default_gguf)
    tok.chat_template = HERMES_TEMPLATE
    ctx = ServingContext(("m",), 2048, tok.vocab_size, tok, tool_parser="hermes")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    req = parse_chat({"messages": messages, "tools": [WEATHER]}, ctx)
    text = req.prompt_texts[0]
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    # arguments reach the template as an object (tojson'd once), not as a JSON string inside a string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<tool_response id="call_1">21 C</tool_response>' in text
    assert req.tools == ToolPlan("auto", parser="hermes") and req.params.structured_outputs is None
    forced = parse_chat({"messages": messages[:1], "tools": [WEATHER], "tool_choice": "required"}, ctx)
    assert forced.tools.mode == "required" and forced.params.structured_outputs.json["type"] == "array"

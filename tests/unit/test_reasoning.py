"""--reasoning-parser on fixed model outputs: the plain split, and streaming fed in every piece size, whose
assembled reasoning and content must equal it (think tags split across deltas included)."""

import pytest

from server.reasoning import ReasoningStream, split

CASES = [  # parser, model output, expected (reasoning_content, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\n2 + 2 = 4.", ("\nLet me add.\n", "\n\n2 + 2 = 4.")),
    ("qwen3", "2 + 2 = 4.", (None, "2 + 2 = 4.")),  # enable_thinking=False: no think block, all content
    ("qwen3", "<thinking is fun>", (None, "<thinking is fun>")),
    ("qwen3", "<think>still thinking when max_tokens hit", ("still thinking when max_tokens hit", None)),
    ("qwen3", "<think>a</think>", ("a", None)),
    ("qwen3", "The tag </think> alone is text.", (None, "The tag </think> alone is text.")),
    ("deepseek_r1", "Let me add.\n</think>\n\n4.", ("Let me add.\n", "\n\n4.")),  # the template opened <think>
    ("deepseek_r1", "<think>Hmm.</think>4.", ("Hmm.", "4.")),
    ("deepseek_r1", "no end tag: all reasoning", ("no end tag: all reasoning", None)),
    ("deepseek_r1", "a </th b </think> c", ("a </th b ", " c")),
    ("kimi_k2", "<think>Plan.</think>Done.", ("Plan.", "Done.")),
    # a tool call ends the reasoning, the section stays in the content (for the tool parser)
    ("kimi_k2", "Need the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0",
     ("Need the weather.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0")),
    ("kimi_k2", "a <|tool_calls b</think>c", ("a <|tool_calls b", "c")),
]


def assemble(parser, text, piece):
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for end in list(range(piece, len(text), piece)) + [len(text)]:
        r, c, so_far = stream.update(text[:end], end == len(text))
        reasoning, content = reasoning + r, content + c
        assert so_far == content
    return reasoning, content


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_split_and_every_streaming_split_agree(parser, text, expected):
    assert split(parser, text) == expected
    for piece in range(1, len(text) + 1):
        assert assemble(parser, text, piece) == tuple(x or "" for x in expected), piece


def test_streaming_holds_back_partial_tags():
    stream = ReasoningStream("qwen3")
    assert stream.update("<thi", False) == ("", "", "")  # may be <think>: neither reasoning nor content yet
    assert stream.update("<think>abc</th", False) == ("abc", "", "")
    assert stream.update("<think>abc</think>Hi", False) == ("", "Hi", "Hi")
    assert ReasoningStream("qwen3").update("Hello", False) == ("", "Hello", "Hello")
    assert ReasoningStream("deepseek_r1").update("  <th", False) == ("", "", "")
    assert ReasoningStream("deepseek_r1").update("  <ta", False) == ("  <ta", "", "")


def test_thinking_by_the_requests_template_kwargs():
    """kimi_k2 thinks unless `{"thinking": false}`; deepseek_v3 only with `{"thinking": true}` (then R1's split)."""
    from server.reasoning import reasoning_parser

    assert reasoning_parser("kimi_k2", {}) == "kimi_k2" and reasoning_parser("kimi_k2", {"thinking": False}) is None
    assert reasoning_parser("deepseek_v3", {}) is None
    assert reasoning_parser("deepseek_v3", {"thinking": True}) == "deepseek_r1"
    assert reasoning_parser("qwen3", {"enable_thinking": False}) == "qwen3"  # (its template leaves no tags)
    assert ReasoningStream("kimi_k2").update("x<|tool_calls_sec", False) == ("x", "", "")  # held back: may end it

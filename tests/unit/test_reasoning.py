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

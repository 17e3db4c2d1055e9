"""`--reasoning-parser`: a reasoning model's `<think>...</think>` becomes `reasoning_content`, the rest `content`
(vLLM's parsers, on the text), in chat responses (`message.reasoning_content`) and streams
(`delta.reasoning_content` while inside the think block, then `delta.content`).

- qwen3: the output opens its own `<think>` (Qwen3 with thinking on). Without it everything is content:
  with `enable_thinking: false` Qwen3's template pre-fills an empty think block and the output has no tags.
- deepseek_r1: the chat template already opened `<think>` (DeepSeek-R1, QwQ, Qwen3-*-Thinking-2507), so the
  output starts inside the reasoning: everything before `</think>` is reasoning (a leading `<think>` is
  dropped), and an output that never closes it is all reasoning.

A think block still open at the end (max_tokens reached while thinking) is reasoning for both parsers, streamed
or not, so that a stream and a plain response always agree (vLLM's qwen3 returns it as content when not
streaming). Tool calls are read from the content only (server/generation.py). Tags are matched as text:
`<think>` and `</think>` are added tokens that detokenize to themselves, special-token skipping or not.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split(parser: str, text: str, final: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of the output `text`; None where there is none. While not `final`, what may
    still become a tag (an opening `<thi`, a closing `</th` at the end) is held back from both."""
    lead = len(text) - len(text.lstrip())
    if text.startswith(START, lead):
        body = text[lead + len(START):]
    elif not final and START.startswith(text[lead:]):  # nothing, or the start of "<think>", yet
        return (None, None) if parser == "qwen3" else ("", None)
    elif parser == "qwen3":
        return None, text  # no think block: all content
    else:
        body = text  # deepseek_r1: the template opened the block
    end = body.find(END)
    if end < 0:
        return body[:len(body) - (0 if final else _partial_suffix(body, END))], None
    return body[:end], body[end + len(END):] or None


class ReasoningStream:
    """Streaming: one choice's growing text -> the new reasoning and content pieces (both only ever grow)."""

    def __init__(self, parser: str):
        self.parser = parser
        self.reasoning_sent = 0
        self.content_sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str, str]:
        """(reasoning delta, content delta, the content so far) for the text so far."""
        reasoning, content = split(self.parser, text, final)
        reasoning, content = reasoning or "", content or ""
        deltas = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return *deltas, content

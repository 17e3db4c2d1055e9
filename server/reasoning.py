"""`--reasoning-parser`: a reasoning model's `<think>...</think>` becomes `reasoning_content`, the rest `content`
(vLLM's parsers, on the text), in chat responses (`message.reasoning_content`) and streams
(`delta.reasoning_content` while inside the think block, then `delta.content`).

- qwen3: the output opens its own `<think>` (Qwen3 with thinking on). Without it everything is content:
  with `enable_thinking: false` Qwen3's template pre-fills an empty think block and the output has no tags.
- deepseek_r1: the chat template already opened `<think>` (DeepSeek-R1, QwQ, Qwen3-*-Thinking-2507), so the
  output starts inside the reasoning: everything before `</think>` is reasoning (a leading `<think>` is
  dropped), and an output that never closes it is all reasoning.
- kimi_k2: deepseek_r1's split, and a tool-call section (`<|tool_calls_section_begin|>`) also ends the reasoning
  (Kimi-K2-Thinking may call a tool without closing it; the section stays in the content for the tool parser).
  Off (all content) with `chat_template_kwargs` `{"thinking": false}`.
- deepseek_v3: off unless the request's `chat_template_kwargs` turn thinking on (`{"thinking": true}`: DeepSeek-V3.1
  and later), then deepseek_r1's split.
  (`reasoning_parser` says which split a request takes.)

A think block still open at the end (max_tokens reached while thinking) is reasoning for both parsers, streamed
or not, so that a stream and a plain response always agree (vLLM's qwen3 returns it as content when not
streaming). Tool calls are read from the content only (server/generation.py). Tags are matched as text:
`<think>` and `</think>` are added tokens that detokenize to themselves, special-token skipping or not.
"""

from __future__ import annotations

from server.tool_parsers import KIMI_SECTIONS, partial_suffix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "kimi_k2", "qwen3")
# what else ends the reasoning, kept in the content: Kimi's tool-call section
_TOOL_SECTIONS = {"kimi_k2": KIMI_SECTIONS}


def reasoning_parser(parser: str | None, template_kwargs: dict) -> str | None:
    """The split a request takes under `--reasoning-parser parser`: None (all content) where its chat template
    kwargs turn thinking off (kimi_k2, on by default) or leave it off (deepseek_v3, off by default)."""
    if parser not in ("kimi_k2", "deepseek_v3"):
        return parser
    thinking = template_kwargs.get("thinking", template_kwargs.get("enable_thinking", parser == "kimi_k2"))
    return ("kimi_k2" if parser == "kimi_k2" else "deepseek_r1") if thinking else None


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
        body = text  # deepseek_r1, kimi_k2: the template opened the block
    ends = [(i, len(END)) for i in [body.find(END)] if i >= 0]
    ends += [(i, 0) for i in (body.find(t) for t in _TOOL_SECTIONS.get(parser, ())) if i >= 0]
    if not ends:
        hold = 0 if final else max(partial_suffix(body, t) for t in (END, *_TOOL_SECTIONS.get(parser, ())))
        return body[:len(body) - hold], None
    end, skip = min(ends)
    return body[:end], body[end + skip:] or None


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

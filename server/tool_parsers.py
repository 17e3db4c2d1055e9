"""How each `--tool-call-parser` reads tool calls out of a model's text, incrementally (server/tools.py says how
the calls reach the response). Every parser takes the text so far and `final` (the text is complete) and returns
(content, calls): the content before the calls, and each call's name once it is complete and its arguments as
raw JSON text so far, which only ever grows. A parser never executes anything it reads: JSON is scanned, and
pythonic calls go through `ast` with literal values only.

- hermes (alias qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional text.
- llama3_json: `{"name": ..., "parameters": {...}}` objects, `;`-separated, after an optional `<|python_tag|>`.
- mistral: text, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}` objects (tokenizers before v11),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later: Mistral Small 3.2, Magistral, Devstral).
- pythonic: the whole output is a Python list of calls with keyword arguments, `[f(a=1, b="x"), g()]` (Llama
  3.2 / 4's pythonic template, ToolACE), optionally inside `<|python_start|>...<|python_end|>`.
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>` (Kimi-K2); the model's `functions.NAME:IDX` is the call's id, which
  Kimi's template writes back into the history.
- deepseek_v3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (DeepSeek-V3, R1); deepseek_v31:
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` in the same section (DeepSeek-V3.1 and later).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

_WS = " \t\r\n"
_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG, _ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_PY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Call:
    name: str | None  # None until the name's string is complete
    arguments: str | None  # raw JSON text of the arguments so far (None: not started)
    complete: bool = False
    id: str | None = None  # the call's id where the model writes one (kimi_k2), else the server makes one


# ---- incremental JSON scanning -------------------------------------------------------------------------


class _Malformed(ValueError):
    pass


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the string starting at text[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if it is not complete yet."""
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends where the next token starts
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) or final else None


def _scan_object(text: str, i: int, final: bool) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Fields (key -> value span; end None: still open) of the object at text[i] == '{', and its end."""
    fields: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return fields, j + 1
    while j < len(text):
        if text[j] != '"':
            raise _Malformed(text[j])
        end = _scan_string(text, j)
        if end is None:
            return fields, None
        try:
            key = json.loads(text[j:end])
        except json.JSONDecodeError as e:
            raise _Malformed(str(e)) from None
        j = skip_ws(text, end)
        if j >= len(text):
            return fields, None
        if text[j] != ":":
            raise _Malformed(text[j])
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return fields, None
        end = scan_value(text, j, final)
        fields[key] = (j, end)
        if end is None:
            return fields, None
        j = skip_ws(text, end)
        if j >= len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise _Malformed(text[j])
        j = skip_ws(text, j + 1)
    return fields, None


def _call(text: str, fields: dict[str, tuple[int, int | None]]) -> Call:
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, end = fields["name"]
        value = json.loads(text[start:end]) if text[start] == '"' else None
        name = value if isinstance(value, str) else None
    for key in ("arguments", "parameters"):
        if key in fields:
            start, end = fields[key]
            return Call(name, text[start:end] if end is not None else text[start:], end is not None)
    return Call(name, None)


def _objects(text: str, j: int, final: bool, sep: str | None) -> tuple[list[Call], int | None]:
    """Calls from consecutive objects starting at text[j], separated by `sep` (None: one object); stops at
    anything else. Also the end of the last complete object (None if none is)."""
    calls, last_end = [], None
    while j < len(text) and text[j] == "{":
        try:
            fields, end = _scan_object(text, j, final)
        except _Malformed:
            break
        calls.append(_call(text, fields))
        if end is None:
            break
        last_end = end
        j = skip_ws(text, end)
        if sep is not None and j < len(text) and text[j] == sep:
            j = skip_ws(text, j + 1)
        else:
            break
    return calls, last_end


def parse_array(text: str, final: bool) -> list[Call]:
    j = skip_ws(text, 0)
    if j >= len(text) or text[j] != "[":
        return []
    return _objects(text, skip_ws(text, j + 1), final, ",")[0]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_hermes(text: str, final: bool) -> tuple[str, list[Call]]:
    start = text.find(_TAG)
    if start < 0:
        return text[:len(text) - (0 if final else partial_suffix(text, _TAG))], []
    calls, pos = [], start
    while pos >= 0:
        found, end = _objects(text, skip_ws(text, pos + len(_TAG)), final, None)  # one object per block
        calls += found
        if end is None:
            break
        pos = text.find(_TAG, end)
    return text[:start], calls


def parse_llama3(text: str, final: bool) -> tuple[str, list[Call]]:
    j = skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, j):
        j = skip_ws(text, j + len(_PYTHON_TAG))
    if j >= len(text) or (not final and _PYTHON_TAG.startswith(text[j:])):
        return (text if final else ""), []  # nothing but whitespace (or part of the tag) yet: it may become a call
    if text[j] != "{":
        return text, []
    calls = _objects(text, j, final, ";")[0]
    if not calls or (calls[0].name is None and (final or calls[0].complete)):
        return (text if final or (calls and calls[0].complete) else ""), []  # a JSON object, not a call
    return "", calls


def parse_mistral(text: str, final: bool) -> tuple[str, list[Call]]:
    start = text.find(_MISTRAL_TAG)
    if start < 0:
        return text[:len(text) - (0 if final else partial_suffix(text, _MISTRAL_TAG))], []
    j = skip_ws(text, start + len(_MISTRAL_TAG))
    if j < len(text) and text[j] in "[{":  # before v11: one JSON array of calls (or a lone object)
        sep = "," if text[j] == "[" else None
        return text[:start], _objects(text, skip_ws(text, j + 1) if sep else j, final, sep)[0]
    calls, pos = [], start
    while pos >= 0:  # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated per call
        k = pos + len(_MISTRAL_TAG)
        m = _MISTRAL_NAME.match(text, k)
        name_end = m.end() if m else k
        if not m or not text.startswith(_ARGS_TAG, name_end):
            break  # the name is not complete yet (or not a name: what was read stays)
        a = skip_ws(text, name_end + len(_ARGS_TAG))
        end = scan_value(text, a, final) if a < len(text) else None
        calls.append(Call(m.group(), text[a:end] if end is not None else text[a:] or None, end is not None))
        if end is None:
            break
        pos = text.find(_MISTRAL_TAG, end)
    return text[:start], calls


# ---- pythonic ------------------------------------------------------------------------------------------


def _scan_py_string(text: str, i: int) -> int | None:
    """End (exclusive) of the Python string literal whose quote is at text[i] (triple quotes too), or None."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    j = i + len(quote)
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith(quote, j):
            return j + len(quote)
        else:
            j += 1
    return None


def _py_call(source: str) -> Call:
    """One complete `name(key=literal, ...)` element -> a Call with JSON arguments; _Malformed otherwise.
    `ast.literal_eval` accepts literals only (numbers, strings, lists, dicts, True/False/None...)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(kw.arg is not None for kw in node.keywords)):
            raise _Malformed(source[:100])
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return Call(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False), True)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # also sets, bytes, NaN: not JSON
        raise _Malformed(source[:100]) from None


def _py_list(text: str, i: int, final: bool) -> tuple[list[Call], int | None]:
    """Calls of the Python list whose items start at text[i] (after its '['), and the end of the list (None:
    not closed yet). _Malformed if it is not a list of calls."""
    calls: list[Call] = []
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return calls, None
        if text[i] == "]" and not calls:
            raise _Malformed("[]")  # no calls: plain text
        m = _PY_NAME.match(text, i)
        if not m:
            raise _Malformed(text[i])
        k = skip_ws(text, m.end())
        if k >= len(text):  # the name may go on
            return calls, None
        if text[k] != "(":
            raise _Malformed(text[k])
        depth, j = 0, k
        while j < len(text):
            c = text[j]
            if c in "'\"":
                end = _scan_py_string(text, j)
                if end is None:
                    break
                j = end
                continue
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if j >= len(text) or text[j] != ")" or depth != 0:  # still open: reported once it parses (a stream
            return calls, None  # cannot take back a call header whose arguments turn out not to be literals)
        calls.append(_py_call(text[i:j + 1]))
        i = skip_ws(text, j + 1)
        if i >= len(text):
            return calls, None
        if text[i] == "]":
            return calls, i + 1
        if text[i] != ",":
            raise _Malformed(text[i])
        i += 1


def parse_pythonic(text: str, final: bool) -> tuple[str, list[Call]]:
    j = skip_ws(text, 0)
    if text.startswith(_PY_START, j):
        j = skip_ws(text, j + len(_PY_START))
    if j >= len(text) or (not final and _PY_START.startswith(text[j:])):
        return (text if final else ""), []  # nothing but whitespace (or part of the tag) yet: it may become calls
    if text[j] != "[":
        return text, []
    try:
        calls, end = _py_list(text, j + 1, final)
    except _Malformed:
        return text, []
    if end is None:
        return (text, []) if final else ("", calls)  # a truncated list is text, as in vLLM
    tail = text[end:].strip()
    if tail and tail != _PY_END and (final or not _PY_END.startswith(tail)):
        return text, []  # text after the list: the whole output is not a list of calls
    return "", calls


# ---- marked sections (Kimi-K2, DeepSeek) ---------------------------------------------------------------


@dataclass(frozen=True)
class _Markers:
    sections: tuple[str, ...]  # what opens the calls' section (content is the text before it)
    begin: str  # what opens a call
    header_end: str  # what ends the call's header (its name, or id), before the arguments
    name: Callable[[str], tuple[str, str | None]]  # header -> (name, the model's id or None)


def _marked(m: _Markers, text: str, final: bool) -> tuple[str, list[Call]]:
    found = [i for i in (text.find(t) for t in m.sections) if i >= 0]
    if not found:
        hold = 0 if final else max(partial_suffix(text, t) for t in m.sections)
        return text[:len(text) - hold], []
    start = min(found)
    calls, pos = [], text.find(m.begin, start)
    while pos >= 0:
        k = pos + len(m.begin)
        h = text.find(m.header_end, k)
        if h < 0:
            break  # the header is not complete yet
        name, call_id = m.name(text[k:h])
        j = skip_ws(text, h + len(m.header_end))
        end = scan_value(text, j, final) if j < len(text) else None
        calls.append(Call(name, text[j:end] if end is not None else text[j:] or None, end is not None, call_id))
        if end is None:
            break
        pos = text.find(m.begin, end)
    return text[:start], calls


def _kimi_name(header: str) -> tuple[str, str]:
    call_id = header.strip()  # functions.get_weather:0
    return call_id.rsplit(":", 1)[0].split(".", 1)[-1], call_id


_DS_SECTION, _DS_BEGIN, _DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
KIMI_SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # (both of Kimi's spellings)
_KIMI = _Markers(KIMI_SECTIONS, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", _kimi_name)
_DEEPSEEK_V3 = _Markers((_DS_SECTION,), _DS_BEGIN, "```json", lambda h: (h.split(_DS_SEP)[-1].strip(), None))
_DEEPSEEK_V31 = _Markers((_DS_SECTION,), _DS_BEGIN, _DS_SEP, lambda h: (h.strip(), None))


def parse_kimi_k2(text: str, final: bool) -> tuple[str, list[Call]]:
    return _marked(_KIMI, text, final)


def parse_deepseek_v3(text: str, final: bool) -> tuple[str, list[Call]]:
    return _marked(_DEEPSEEK_V3, text, final)


def parse_deepseek_v31(text: str, final: bool) -> tuple[str, list[Call]]:
    return _marked(_DEEPSEEK_V31, text, final)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3, "mistral": parse_mistral,
           "pythonic": parse_pythonic, "kimi_k2": parse_kimi_k2, "deepseek_v3": parse_deepseek_v3,
           "deepseek_v31": parse_deepseek_v31}

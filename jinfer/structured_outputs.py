"""Structured outputs: what a request's output must match (vLLM's `StructuredOutputsParams`).

Exactly one constraint per request: a JSON schema (`json`), any JSON object (`json_object`), a regular
expression (`regex`), one of a list of strings (`choice`), or a context-free grammar (`grammar`: Lark
or GBNF/EBNF). `to_grammar()` turns it into an llguidance grammar (a string); the engine compiles that
once per distinct grammar against the model's tokenizer (jinfer/engine/grammar.py) and masks the logits
of every step with it, so the output always matches.

JSON is generated in `json.dumps` style by default (", " and ": " separators, no other whitespace):
the grammar then leaves a model no room to pad with whitespace. `disable_any_whitespace` (vLLM's) gives
"," and ":"; `whitespace_pattern` (a regex) allows the whitespace it matches between tokens instead.
A schema's own "x-guidance" options override both.

No engine code here: the server validates (`check_grammar`) with this module alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema / regex / grammar larger than this is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one of json / json_object / regex / choice / grammar)."""

    json: str | dict | None = None  # a JSON schema: a dict or its JSON text
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF / EBNF (llama.cpp's)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs={self.to_dict()!r} must set exactly one of {', '.join(KINDS)}"[:400])
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            set_("json", schema)
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema (an object)"[:300])
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string"[:300])
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of "
                                 "non-empty strings"[:300])
            set_("choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a bool")
        if len(self.source()) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is larger than {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def source(self) -> str:
        """The constraint's own text (schema JSON, regex, grammar, choices JSON)."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value if self.kind != "choice" else list(value))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["choice"] is not None:
            d["choice"] = list(d["choice"])
        return {k: v for k, v in d.items() if v not in (None, False)}

    def to_wire(self) -> str:
        """One JSON string (the engine protocol carries scalars only)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """From itself, a dict of its fields or `to_wire()`'s string; ValueError naming the field."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs={value!r} must be a StructuredOutputsParams or a dict"[:300])
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)

    def json_options(self) -> dict[str, Any]:
        if self.whitespace_pattern is not None:
            return {"whitespace_pattern": self.whitespace_pattern}
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def to_grammar(self) -> str:
        """The llguidance grammar (a string); ValueError if the constraint cannot be expressed."""
        return _to_grammar(self.kind, self.source(), json.dumps(self.json_options()))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@lru_cache(maxsize=256)
def _to_grammar(kind: str, source: str, options: str) -> str:
    import llguidance

    opts = json.loads(options)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=opts)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=opts)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(source))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", source)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None


@lru_cache(maxsize=256)
def _check(grammar: str) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError naming the field if the constraint does not compile (no tokenizer needed; cached)."""
    error = _check(params.to_grammar())
    if error:
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {error.strip()}"[:2000])

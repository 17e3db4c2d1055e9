"""vLLM's config arguments (`--speculative-config`, `--kv-events-config`): a dict of a dataclass's fields or its JSON
text, checked once for both."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def config_fields(cls: type, name: str, value: dict[str, Any] | str) -> dict[str, Any]:
    """`value` (a dict or its JSON text) as a copy of the dict of `cls`'s fields; ValueError naming `name` for bad
    JSON, a non-object or an unknown field."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a JSON object of its fields")
    known = {f.name for f in fields(cls)}
    if unknown := sorted(set(value) - known):
        raise ValueError(f"{name}: unknown fields {unknown}; known: {sorted(known)}")
    return dict(value)

"""Per-request sampling parameters, field-compatible with vLLM's `SamplingParams` (the subset we serve).

Frozen and validated once in `__post_init__`: every bad value raises `ValueError` naming the field, so
the server can turn it into a 400 without knowing the rules. Normalization done here:
- `stop` (str | list[str] | None) -> tuple[str, ...]; `stop_token_ids` -> tuple[int, ...];
- `top_k` 0 -> -1 (both mean "off"); ints given for float fields become floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20
# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. `max_tokens=None` means "up to the model's context length"."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: off (normalized to -1)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always returned)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
            set_(name, float(value))
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name}={value!r} must be an integer")
        for name in ("seed", "max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name}={value!r} must be an integer or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a bool")

        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 or 0 (off) or >= 1")
        if self.top_k == 0:
            set_("top_k", -1)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]")

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop={stop!r} must be a string, a list of strings or None")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} must contain only non-empty strings")
        set_("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, list | tuple):
            ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids={ids!r} must be a list of integers or None")
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must contain only integers >= 0")
        set_("stop_token_ids", ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the (normalized) fields, e.g. for msgpack; `SamplingParams(**d)` round-trips."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

"""Per-request sampling parameters, field-compatible with vLLM's `SamplingParams` (the subset we serve).

Frozen and validated once in `__post_init__`: every bad value raises `InvalidParam` (a ValueError, jinfer/errors.py)
naming the field, so the server can turn it into a 400 without knowing the rules. Normalization done here:
- `stop` (str | list[str] | None) -> tuple[str, ...]; `stop_token_ids` -> tuple[int, ...];
- `top_k` 0 -> -1 (both mean "off"); ints given for float fields become floats;
- `logit_bias` ({token id (int or decimal string): bias} or [[id, bias], ...]) -> tuple of (id, bias) pairs;
- `allowed_token_ids` -> tuple[int, ...] (None stays None: no restriction); `bad_words` -> tuple[str, ...].

Bounds (every field is checked into a range, so nothing downstream overflows: a request is never a 500):
integers fit their device types (`seed` in int64 as vLLM, the others in int32), floats are finite in float32,
`n` <= MAX_N, at most MAX_STOP_STRINGS stop strings of at most MAX_STOP_STRING_CHARS characters each,
at most MAX_STOP_TOKEN_IDS stop token ids, at most MAX_LOGIT_BIAS logit_bias entries in [-100, 100], at most
MAX_ALLOWED_TOKEN_IDS allowed token ids, at most MAX_BAD_WORDS bad words of at most MAX_STOP_STRING_CHARS characters.
Token ids are checked against the model's vocabulary by the engine (jinfer/engine/input_processor.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from jinfer.errors import InvalidParam
from jinfer.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary: a bound on what a request can make us allocate
MAX_BAD_WORDS = 256
LOGIT_BIAS_RANGE = 100.0
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _show(x: Any) -> str:
    """A short repr for error messages (a 4000-digit integer from a request must not become the message)."""
    if _is_int(x) and abs(x) > 10**20:
        return f"<{x.bit_length()}-bit integer>"
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _finite32(x: Any) -> bool:
    """A number whose float value is finite in float32 (huge ints would overflow float() or the device)."""
    try:
        return _is_number(x) and math.isfinite(float(x)) and abs(float(x)) <= FLOAT32_MAX
    except OverflowError:
        return False


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
    # ---- issue 16 part B: prompt logprobs and logit bias ----
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (and the token's own); first is None
    logit_bias: Any = None  # {token id: bias in [-100, 100]} added to the logits before sampling
    # What the output must match (JSON schema, regex, choice, grammar): a StructuredOutputsParams, a dict
    # of its fields, or its `to_wire()` string (normalized to StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | dict | str | None = None
    # ---- vLLM's token restrictions (applied after the raw logprobs, like logit_bias) ----
    allowed_token_ids: list[int] | tuple[int, ...] | None = None  # sample only among these ids
    # Words never to generate: each is tokenized with and without a leading space; a one-token word is always
    # banned, a longer one bans its last token when the output ends with the rest (jinfer/engine/bad_words.py).
    bad_words: list[str] | tuple[str, ...] | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _finite32(value):
                raise InvalidParam(name, f"{name}={_show(value)} must be a finite number")
            set_(name, float(value))
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise InvalidParam(name, f"{name}={_show(value)} must be an integer")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidParam(name, f"{name}={_show(value)} must be an integer or None")
        for name in ("n", "top_k", "min_tokens", "max_tokens"):  # int32 on the device
            value = getattr(self, name)
            if value is not None and abs(value) > INT32_MAX:
                raise InvalidParam(name, f"{name}={_show(value)} must be at most {INT32_MAX} in magnitude")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise InvalidParam("seed",
                               f"seed={_show(self.seed)} must be a 64-bit signed integer [{INT64_MIN}, {INT64_MAX}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidParam(name, f"{name}={_show(value)} must be a bool")

        if not 1 <= self.n <= MAX_N:
            raise InvalidParam("n", f"n={self.n} must be in [1, {MAX_N}]")
        if self.temperature < 0:
            raise InvalidParam("temperature", f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise InvalidParam("top_k", f"top_k={self.top_k} must be -1 or 0 (off) or >= 1")
        if self.top_k == 0:
            set_("top_k", -1)
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p={self.min_p} must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam("presence_penalty", f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam("frequency_penalty", f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise InvalidParam("repetition_penalty", f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens={self.max_tokens} must be >= 1")
        if self.min_tokens < 0:
            raise InvalidParam("min_tokens", f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"logprobs={_show(self.logprobs)} must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidParam("prompt_logprobs",
                               f"prompt_logprobs={_show(self.prompt_logprobs)} must be in [0, {MAX_LOGPROBS}]")

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple):
            stop = tuple(stop)
        else:
            raise InvalidParam("stop", f"stop={_show(stop)} must be a string, a list of strings or None")
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidParam("stop", f"stop={_show(self.stop)} must contain only non-empty strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"stop= has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise InvalidParam("stop", f"stop= strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        set_("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, list | tuple):
            ids = tuple(ids)
        else:
            raise InvalidParam("stop_token_ids", f"stop_token_ids={_show(ids)} must be a list of integers or None")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise InvalidParam("stop_token_ids",
                               f"stop_token_ids={_show(self.stop_token_ids)} must contain only integers in "
                             f"[0, {INT32_MAX}]")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam("stop_token_ids",
                               f"stop_token_ids= has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        set_("stop_token_ids", ids)
        set_("logit_bias", _logit_bias(self.logit_bias))
        set_("allowed_token_ids", _allowed_token_ids(self.allowed_token_ids))
        set_("bad_words", _bad_words(self.bad_words))
        try:
            set_("structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        except InvalidParam:
            raise
        except ValueError as e:
            raise InvalidParam("structured_outputs", str(e)) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the (normalized) fields, e.g. for msgpack; `SamplingParams(**d)` round-trips."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = None if self.logit_bias is None else [list(p) for p in self.logit_bias]
        d["allowed_token_ids"] = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        d["bad_words"] = list(self.bad_words)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_wire()
        return d


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...] | None:
    """{id: bias} (ids as ints or decimal strings, as JSON gives them) or [[id, bias], ...] -> sorted pairs."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in bias):
        items = [tuple(p) for p in bias]
    else:
        raise InvalidParam("logit_bias", "logit_bias= must be a map of token id to bias")
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidParam("logit_bias", f"logit_bias= has {len(items)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for key, value in items:
        if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10:
            key = int(key)
        if not _is_int(key) or not 0 <= key <= INT32_MAX:
            raise InvalidParam("logit_bias", f"logit_bias= keys must be token ids (integers >= 0), got {_show(key)}")
        if not _finite32(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise InvalidParam("logit_bias", f"logit_bias= values must be numbers in [-100, 100], got {_show(value)}")
        out[key] = float(value)
    return tuple(sorted(out.items())) or None


def _allowed_token_ids(ids: Any) -> tuple[int, ...] | None:
    """None (no restriction) or a non-empty list of token ids -> tuple (vLLM refuses an empty list too)."""
    if ids is None:
        return None
    if not isinstance(ids, list | tuple):
        raise InvalidParam("allowed_token_ids", f"allowed_token_ids={_show(ids)} must be a list of token ids or None")
    if not ids:
        raise InvalidParam("allowed_token_ids", "allowed_token_ids= must not be empty (None: no restriction)")
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidParam("allowed_token_ids",
                           f"allowed_token_ids= has {len(ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS} are allowed")
    if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise InvalidParam("allowed_token_ids",
                           f"allowed_token_ids={_show(ids)} must contain only token ids (integers >= 0)")
    return tuple(ids)


def _bad_words(words: Any) -> tuple[str, ...]:
    if words is None:
        return ()
    if isinstance(words, str) or not isinstance(words, list | tuple):
        raise InvalidParam("bad_words", f"bad_words={_show(words)} must be a list of strings or None")
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise InvalidParam("bad_words", f"bad_words={_show(words)} must contain only non-blank strings")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidParam("bad_words", f"bad_words= has {len(words)} words; at most {MAX_BAD_WORDS} are allowed")
    if any(len(w) > MAX_STOP_STRING_CHARS for w in words):
        raise InvalidParam("bad_words", f"bad_words= words must be at most {MAX_STOP_STRING_CHARS} characters long")
    return tuple(words)

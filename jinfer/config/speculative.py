"""Speculative decoding's options, in vLLM's form: `--speculative-config '{"method": "ngram", ...}'` on the command
line, `LLM(model, speculative_config={...})` offline. JAX-free, frozen, validated in `__post_init__` (ValueError
naming the field).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

Methods: "ngram" (prompt lookup: drafts copied from an earlier occurrence of the sequence's last tokens;
jinfer/spec/ngram.py), "eagle3" (with "model", the draft head's directory: jinfer/spec/eagle.py), "mtp" (the MTP layer
a Qwen3.5 checkpoint ships: jinfer/spec/mtp.py). A model drafter takes "quantization": "fp8" (vLLM's field for the
draft's weights): its linear weights and its lm_head quantized to block FP8 at load (MTP: an FP8 copy of the target's
lm_head for the drafts), read by the FP8 kernels; the verification stays the target's, so the output is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinfer.config.json_fields import config_fields

METHODS = ("ngram", "eagle3", "mtp")
# vLLM's defaults for prompt lookup when neither bound is given (both 5; one given sets the other).
DEFAULT_PROMPT_LOOKUP = 5
QUANTIZATIONS = ("fp8",)  # a model drafter's weights
MAX_SPECULATIVE_TOKENS = 64  # a verifying row is 1 + k tokens of one step's budget


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None  # drafts per step and sequence (k)
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix that may match
    prompt_lookup_max: int | None = None  # ngram: the longest suffix tried
    model: str | None = None  # eagle3: the draft model; mtp: None (the target's own layers)
    quantization: str | None = None  # eagle3 / mtp: "fp8" quantizes the draft's weights at load

    def __post_init__(self):
        method = self.method
        if method in ("[ngram]",):  # vLLM's older spelling
            object.__setattr__(self, "method", method := "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if k is None and method in ("ngram", "eagle3"):
            raise ValueError(f"speculative_config.num_speculative_tokens is required for method {method!r}")
        if k is not None and (not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method == "ngram":
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(v) or v < 1:
                    raise ValueError(f"speculative_config.{name}={v!r} must be an integer >= 1")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif lo is not None or hi is not None:
            raise ValueError(f"speculative_config.prompt_lookup_min / prompt_lookup_max are for method 'ngram', "
                             f"not {method!r}")
        if method == "eagle3" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model (the EAGLE-3 draft checkpoint) is required for method "
                             "'eagle3'")
        if self.quantization is not None and (self.quantization not in QUANTIZATIONS or method == "ngram"):
            raise ValueError(f"speculative_config.quantization={self.quantization!r} must be one of "
                             f"{list(QUANTIZATIONS)} (for a model drafter: 'eagle3' or 'mtp')")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or name")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a dict of the fields, its JSON text, or a config (None: no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        value = config_fields(cls, "speculative_config", value)
        if "method" not in value:  # vLLM: {"model": "ngram", ...} names the method as the model
            if value.get("model") in ("ngram", "[ngram]"):
                value["method"] = value.pop("model")
            else:
                raise ValueError("speculative_config.method is required (one of " f"{list(METHODS)})")
        return cls(**value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

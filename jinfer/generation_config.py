"""Default sampling parameters from a model's `generation_config.json` (`--generation-config`, vLLM's semantics).

    "auto" (default)  the model directory's generation_config.json (beside a .gguf file), if there is one
    "vllm"            none: SamplingParams' own defaults
    <dir>             that directory's generation_config.json (it must exist)

The fields vLLM takes are taken: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens
(as max_tokens). A request's own value wins over a default, except max_tokens, which the default caps (as
vLLM does). Read by the engine process (no JAX here) and sent to the server in `EngineReady`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_setting(setting: Any) -> None:
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"generation_config={setting!r} must be 'auto', 'vllm' or a directory")
    if setting not in ("auto", "vllm") and not (Path(setting) / FILE).is_file():
        raise ValueError(f"generation_config={setting!r}: no {FILE} in that directory")


def load_generation_defaults(setting: str, model_path: str | Path | None) -> dict[str, float]:
    """The default sampling parameters the setting gives for a model at `model_path` (dir or file)."""
    check_setting(setting)
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_path is None:
            return {}
        d = Path(model_path)
        d = d if d.is_dir() else d.parent
    else:
        d = Path(setting)
    path = d / FILE
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    out = {dst: cfg[src] for src, dst in FIELDS.items()
           if isinstance(cfg, dict) and isinstance(cfg.get(src), int | float) and not isinstance(cfg[src], bool)}
    from jinfer.sampling_params import SamplingParams

    try:  # the same checks as a request's, naming the field
        SamplingParams(**{k: v for k, v in out.items() if k != "max_tokens"}, max_tokens=out.get("max_tokens", 16))
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    if out:
        log.info("default sampling parameters from %s: %s (a request's own values win)", path, out)
    return out

"""Which runner a model gets: text generation or pooling (embeddings). JAX-free: the engine's start-up reads it
(jinfer/engine/builder.py) once the model is resolved.

`runner` is vLLM's option: "generate", "pooling", or "auto", which picks pooling for a base model without an LM
head (`Qwen3Model`: `ModelConfig.pooling` is already set from config.json) and for a sentence-transformers
checkpoint (a modules.json naming a Pooling module: Qwen3-Embedding's config.json says "Qwen3ForCausalLM", its
sentence-transformers files say what it is). vLLM's older `--task` names map onto it (`TASK_RUNNERS`).

Pooling is the last token's final normed hidden state, L2-normalised (what Qwen3-Embedding and vLLM's default for
decoder embedding models do): the engine's prefill path already computes that row for every finished prompt. A
checkpoint whose Pooling module asks for another mode (mean, CLS...) is refused rather than served wrong.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jinfer.config.model import ModelConfig

log = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
# vLLM's --task values (before --runner) -> the runner
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
                "pooling": "pooling"}
_ST_POOLING = "sentence_transformers.models.Pooling"
# 1_Pooling/config.json's switches -> the mode's name
_ST_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_weightedmean_tokens": "weightedmean"}


def sentence_transformers_pooling(path: Path | None) -> str | None:
    """The pooling mode a sentence-transformers checkpoint's metadata names (modules.json's Pooling module and its
    config.json): "lasttoken", "mean", ...; None when the directory has no such module."""
    if path is None or not path.is_dir() or not (path / "modules.json").is_file():
        return None
    try:
        modules = json.loads((path / "modules.json").read_text())
        module = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
        if module is None:
            return None
        cfg = json.loads((path / module.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: sentence-transformers metadata (modules.json, its Pooling module's config.json) "
                         f"could not be read: {e}") from None
    return "+".join(name for key, name in _ST_MODES.items() if cfg.get(key)) or "none"


def resolve_runner(runner: str, cfg: ModelConfig, path: Path | None) -> ModelConfig:
    """`cfg` with `pooling` set for `runner` ("auto" | "generate" | "pooling"); ValueError naming `runner` where the
    checkpoint cannot be run that way."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r} must be one of {RUNNERS}")
    mode = sentence_transformers_pooling(path)
    if runner == "generate" and cfg.pooling:
        raise ValueError("runner='generate': this checkpoint is a base model without an LM head (an embedding "
                         "model); serve it with runner='pooling'")
    pooling = runner == "pooling" or (runner == "auto" and (cfg.pooling or mode is not None))
    if pooling and mode not in (None, "lasttoken"):
        raise ValueError(f"runner={runner!r}: the checkpoint's sentence-transformers Pooling module asks for "
                         f"{mode!r} pooling; jinfer pools the last token only")
    if pooling and not cfg.pooling:
        log.info("runner: pooling (embeddings, last-token pooling)%s",
                 " from the checkpoint's sentence-transformers metadata" if runner == "auto" else "")
    return cfg.replace(pooling=pooling)

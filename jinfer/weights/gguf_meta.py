"""Reading GGUF key/value metadata into plain Python values (shared by the config, weight and
tokenizer loaders)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf


@lru_cache(maxsize=4)
def open_gguf(path: str) -> gguf.GGUFReader:
    """Memory-map a GGUF file once (cached: config, weights and tokenizer all read the same file)."""
    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises bare ValueError/struct errors on garbage
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of a GGUF file as Python values (str, int, float, bool, lists)."""
    reader = open_gguf(str(path))
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = fld.contents()
    return meta


def tensor_names(path: str | Path) -> set[str]:
    return {t.name for t in open_gguf(str(path)).tensors}

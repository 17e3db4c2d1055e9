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


# GGUF value types -> struct formats (little-endian); 8 = string, 9 = array (gguf.GGUFValueType)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _parse_header(data: memoryview) -> dict[str, Any]:
    """The key/value section of a GGUF (v2/v3) file, parsed straight from the bytes. The gguf package's
    reader builds a numpy view per array element: ~5 s for a 49k-token vocabulary and its merges, on every
    server and engine start; this takes ~0.1 s."""
    import struct

    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, _, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    off = 24

    def string(o: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, o)
        return bytes(data[o + 8:o + 8 + n]).decode("utf-8", errors="replace"), o + 8 + n

    def value(kind: int, o: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(o)
        if kind == _ARRAY:
            sub, count = struct.unpack_from("<IQ", data, o)
            o += 12
            if sub in _SCALARS:
                fmt = _SCALARS[sub]
                size = struct.calcsize(fmt)
                return list(struct.unpack_from(f"<{count}{fmt}", data, o)), o + count * size
            items = []
            for _ in range(count):
                item, o = value(sub, o)
                items.append(item)
            return items, o
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        fmt = _SCALARS[kind]
        return struct.unpack_from("<" + fmt, data, o)[0], o + struct.calcsize(fmt)

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = string(off)
        (kind,) = struct.unpack_from("<I", data, off)
        meta[key], off = value(kind, off + 4)
    return meta


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of a GGUF file as Python values (str, int, float, bool, lists)."""
    import mmap

    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return _parse_header(view)
            finally:
                view.release()
    except (ValueError, OSError, IndexError, __import__("struct").error) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def tensor_names(path: str | Path) -> set[str]:
    return {t.name for t in open_gguf(str(path)).tensors}

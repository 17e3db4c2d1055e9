"""Reading GGUF files straight from their bytes: the key/value metadata as plain Python values, and the
tensor infos with a zero-copy view of each tensor's data (shared by the config, weight and tokenizer
loaders).

The gguf package's `GGUFReader` builds a numpy view per array element of the key/value section: ~2.4 s
for a 49k-token vocabulary and its merges, on every engine start. Here the section is walked with
`struct` (~0.02 s to skip it, ~0.07 s to decode it) and the package serves only its type tables and
dequantizers.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, n_tensors u64, n_kv u64; n_kv key/values
(key string, value type u32, value); n_tensors tensor infos (name string, n_dims u32, dims u64 x n_dims
innermost first, ggml type u32, offset u64); then the data section, at the end of the infos aligned up to
`general.alignment` (default 32), each tensor at data_start + offset. A string is a u64 length + bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: the HTTP server reads metadata and needs neither
    import numpy as np
    from gguf import GGMLQuantizationType

# GGUF value types -> struct formats (little-endian); 8 = string, 9 = array (gguf.GGUFValueType)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


def _parse_kv(data, decode: bool = True, want: tuple[str, ...] = ()) -> tuple[dict[str, Any], int, int, int]:
    """The header and key/value section of a GGUF (v2/v3) file in `data` (a buffer: mmap, bytes,
    memoryview). Returns (metadata, version, n_tensors, offset of the first tensor info). With
    `decode=False` only the keys in `want` are decoded, the other values skipped (a string array still
    needs a walk: one length read per item)."""
    size = len(data)
    if size < 24 or bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic or shorter than its header)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    u64 = _U64.unpack_from

    def past_end(o: int, what: str) -> ValueError:
        return ValueError(f"{what} at byte {o} runs past the end of the file ({size} bytes)")

    def strings(o: int, count: int, keep: bool) -> tuple[list[str] | None, int]:
        if o + 8 * count > size:
            raise past_end(o, f"an array of {count} strings")
        items: list[str] | None = [] if keep else None
        for _ in range(count):
            end = o + 8 + u64(data, o)[0]
            if end > size:
                raise past_end(o, "a string")
            if keep:
                items.append(bytes(data[o + 8:end]).decode("utf-8", errors="replace"))
            o = end
        return items, o

    def value(kind: int, o: int, keep: bool) -> tuple[Any, int]:
        if kind == _STRING:
            items, o = strings(o, 1, keep)
            return (items[0] if keep else None), o
        if kind == _ARRAY:
            sub, count = struct.unpack_from("<IQ", data, o)
            o += 12
            if sub == _STRING:
                return strings(o, count, keep)
            if sub in _SCALARS:
                fmt = _SCALARS[sub]
                end = o + count * struct.calcsize(fmt)
                if end > size:
                    raise past_end(o, f"an array of {count} values")
                return (list(struct.unpack_from(f"<{count}{fmt}", data, o)) if keep else None), end
            if sub != _ARRAY:
                raise ValueError(f"unknown GGUF value type {sub}")
            if o + 12 * count > size:
                raise past_end(o, f"an array of {count} arrays")
            items = []
            for _ in range(count):
                item, o = value(sub, o, keep)
                items.append(item)
            return (items if keep else None), o
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        fmt = _SCALARS[kind]
        return struct.unpack_from("<" + fmt, data, o)[0], o + struct.calcsize(fmt)

    meta: dict[str, Any] = {}
    off = 24
    for _ in range(n_kv):
        (key,), off = strings(off, 1, True)
        (kind,) = _U32.unpack_from(data, off)
        keep = decode or key in want
        v, off = value(kind, off + 4, keep)
        if keep:
            meta[key] = v
    if off > size:
        raise past_end(24, "the key/value section")
    return meta, version, n_tensors, off


def _parse_header(data) -> dict[str, Any]:
    """The key/value section of a GGUF (v2/v3) file, parsed straight from the bytes."""
    return _parse_kv(data)[0]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of a GGUF file as Python values (str, int, float, bool, lists)."""
    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse_header(m)
    except (ValueError, OSError, IndexError, OverflowError, MemoryError, RecursionError, struct.error) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of a GGUF file (the fields of the gguf package's ReaderTensor that jinfer uses)."""
    name: str
    shape: tuple[int, ...]  # dims as written: innermost first
    tensor_type: GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    # Read-only uint8 view of the mapped bytes, shaped [*outer dims, bytes per innermost row] (the byte
    # shape GGUFReader gives quantized tensors); gguf.quants.dequantize takes it for every type.
    data: np.ndarray


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: str
    version: int
    alignment: int
    data_start: int
    tensors: tuple[GGUFTensor, ...]  # in file order


def _read_tensors(path: str, buf: np.ndarray, data) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(data)
    meta, version, n_tensors, off = _parse_kv(data, decode=False, want=("general.alignment",))
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise ValueError(f"general.alignment={alignment!r} is not a positive integer")
    if n_tensors * 24 > size - off:  # each info is at least 8 + 4 + 4 + 8 bytes
        raise ValueError(f"{n_tensors} tensor infos cannot fit in the file")
    infos = []
    for _ in range(n_tensors):
        (n,) = _U64.unpack_from(data, off)
        if off + 8 + n > size:
            raise ValueError(f"a tensor name at byte {off} runs past the end of the file")
        name = bytes(data[off + 8:off + 8 + n]).decode("utf-8")
        off += 8 + n
        (n_dims,) = _U32.unpack_from(data, off)
        if off + 4 + 8 * n_dims + 12 > size:
            raise ValueError(f"tensor {name!r}: its info runs past the end of the file")
        dims = struct.unpack_from(f"<{n_dims}Q", data, off + 4)
        raw_type, offset = struct.unpack_from("<IQ", data, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, raw_type, offset))
    data_start = -(-off // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
        n_elements = 1
        for d in dims:
            n_elements *= d
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name!r}: row size {dims[0]} is not a multiple of {qtype.name}'s "
                             f"block size {block}")
        n_bytes = n_elements // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at byte {start}) runs past the end of the file")
        byte_shape = (*reversed(dims[1:]), dims[0] // block * type_size) if dims else (n_bytes,)
        view = buf[start:start + n_bytes].reshape(byte_shape)
        tensors.append(GGUFTensor(name, tuple(dims), qtype, n_elements, n_bytes, start, view))
    return GGUFFile(path, version, alignment, data_start, tuple(tensors))


@lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    """Memory-map a GGUF file once and read its tensor infos (cached: config, weights and tokenizer all
    read the same file; `open_gguf.cache_clear()` drops the mapping once no tensor view is left)."""
    import numpy as np

    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # The array holds the mapping; it is unmapped when the last view of it goes (never closed by
        # hand: a live view would make mmap.close() raise).
        buf = np.frombuffer(m, dtype=np.uint8)
        return _read_tensors(path, buf, m)
    except (ValueError, OSError, IndexError, OverflowError, MemoryError, RecursionError, struct.error) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def tensor_names(path: str | Path) -> set[str]:
    return {t.name for t in open_gguf(str(path)).tensors}

"""HF safetensors checkpoints: a single model.safetensors, or shards listed in model.safetensors.index.json.

Block-FP8 checkpoints (jinfer/config/quantization.py) keep a quantized weight as `<name>` in float8_e4m3fn beside
`<name>_scale_inv`: `get_fp8` reads the pair as stored, `get` the float values (dequantized on the host, for a
weight jinfer keeps unquantized). safetensors' numpy reader has no FP8 dtype, so those tensors are read from the
file's header and bytes directly (memory-mapped).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jinfer.models.fp8 import dequantize_np
from jinfer.models.spec import EXPERT, ArrayInfo

FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
SCALE_SUFFIX = "_scale_inv"


def _read_fp8(path: Path, name: str) -> np.ndarray:
    """A float8 tensor straight from a .safetensors file: an 8-byte header length, the JSON header, the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
    begin, end = info["data_offsets"]
    data = np.memmap(path, np.uint8, "r", offset=8 + n + begin, shape=(end - begin,))
    return np.asarray(data).view(FP8_DTYPES[info["dtype"]]).reshape(info["shape"])


class SafetensorsSource:
    def __init__(self, directory: Path, fp8_block: tuple[int, int] | None = None):
        """`fp8_block`: the checkpoint's (out, in) `weight_block_size`, for its FP8 tensors."""
        self.directory, self.fp8_block = Path(directory), fp8_block
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors files in {self.directory}")
        self._handles = {f: safe_open(str(self.directory / f), framework="numpy") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def names(self) -> set[str]:
        """The names of every tensor in the checkpoint."""
        return set(self._where)

    def _find(self, name: str) -> str | None:
        """The name the checkpoint stores `name` under, or None. Multimodal checkpoints
        (Qwen3_5ForConditionalGeneration) keep the text model under model.language_model. (the vision tower and the
        MTP head are simply never read); a base model's (Qwen3Model: the embedding models) has its tensors without
        the prefix."""
        bare = name.removeprefix("model.")
        candidates = (name, "model.language_model." + bare, bare) if name.startswith("model.") else (name,)
        return next((n for n in candidates if n in self._where), None)

    def _tensor(self, name: str) -> np.ndarray:
        found = self._find(name)
        if found is None:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        handle = self._handles[self._where[found]]
        if handle.get_slice(found).get_dtype() in FP8_DTYPES:
            return _read_fp8(self.directory / self._where[found], found)
        return handle.get_tensor(found)

    def optional(self, name: str) -> np.ndarray | None:
        """A tensor's float values, or None where the checkpoint has no such tensor."""
        return self._float(name) if self._has(name) else None

    def _has(self, name: str) -> bool:
        bare = name.removeprefix("model.")
        return any(n in self._where for n in (name, "model.language_model." + bare, bare))

    def _float(self, name: str) -> np.ndarray:
        """A tensor's values; an FP8 one (with its scales beside it) dequantized."""
        t = self._tensor(name)
        if t.dtype not in FP8_DTYPES.values():
            return t
        if self.fp8_block is None or not self._has(name + SCALE_SUFFIX):
            raise ValueError(f"tensor {name!r} is FP8 but the checkpoint in {self.directory} gives no "
                             f"weight_block_size or no {name + SCALE_SUFFIX!r}")
        return dequantize_np(t, self._tensor(name + SCALE_SUFFIX), self.fp8_block)

    def stored_fp8(self, spec: ArrayInfo) -> bool:
        """Whether the checkpoint keeps this weight in FP8 with block scales (its first expert's, for stacked ones)."""
        name = spec.hf_name.replace(EXPERT, "0")
        return self._has(name + SCALE_SUFFIX) and self._has(name)

    def get_fp8(self, spec: ArrayInfo) -> tuple[np.ndarray, np.ndarray]:
        """(float8 values, float32 scales) as the checkpoint stores them ([.., out, in] and [.., out / bn, in / bk])."""
        values = self._stacked(spec, lambda n: self._tensor(n))
        scale = self._stacked(spec, lambda n: self._tensor(n + SCALE_SUFFIX), SCALE_SUFFIX)
        return values, np.asarray(scale, np.float32)

    def get(self, spec: ArrayInfo) -> np.ndarray:
        return self._stacked(spec, self._float)

    def _stacked(self, spec: ArrayInfo, read, suffix: str = "") -> np.ndarray:
        if EXPERT not in spec.hf_name:
            return read(spec.hf_name)
        # Stacked experts: one tensor per expert (published checkpoints, transformers' save_pretrained),
        # else transformers' fused in-memory layout [E, parts * out, in].
        names = [spec.hf_name.replace(EXPERT, str(e)) for e in range(spec.shape[0])]
        if self._find(names[0]) is None and spec.hf_fused is not None and self._find(spec.hf_fused[0] + suffix):
            name, part, parts = spec.hf_fused
            fused = read(name)
            if fused.ndim != 3 or fused.shape[1] % parts:
                raise ValueError(f"tensor {name!r} has shape {fused.shape}, expected [experts, {parts} x out, in]")
            rows = fused.shape[1] // parts
            return fused[:, part * rows:(part + 1) * rows]
        return np.stack([read(n) for n in names])

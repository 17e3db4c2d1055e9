"""HF safetensors checkpoints: a single model.safetensors, or shards listed in model.safetensors.index.json.

FP8 checkpoints (jinfer/config/quantization.py) keep a quantized weight as `<name>` in float8_e4m3fn beside its
scales, `<name>` + the config's `scale_suffix` (block-FP8's `_scale_inv`, compressed-tensors' `_scale`): `get_fp8`
reads the pair (the scales spread over the config's blocks: `block_scales`), `get` the float values (dequantized on
the host, for a weight jinfer keeps unquantized). safetensors' numpy reader has no FP8 dtype, so those tensors are
read from the file's header and bytes directly (memory-mapped).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jinfer.config.quantization import Fp8Config
from jinfer.models.fp8 import dequantize_np
from jinfer.models.spec import EXPERT, ArrayInfo

FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


def _read_fp8(path: Path, name: str) -> np.ndarray:
    """A float8 tensor straight from a .safetensors file: an 8-byte header length, the JSON header, the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
    begin, end = info["data_offsets"]
    data = np.memmap(path, np.uint8, "r", offset=8 + n + begin, shape=(end - begin,))
    return np.asarray(data).view(FP8_DTYPES[info["dtype"]]).reshape(info["shape"])


def block_scales(name: str, scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """The scales `name` of a weight [..., out, in] as one float32 per `block` (out, in): [..., ceil(out / bo),
    ceil(in / bi)]. Scales stored so already pass; one scale (a per-tensor [1] or []) fills every block; per-channel
    ones [..., out, 1] (or [..., out]) are repeated along `in` where blocks are one row high. Exact: each block gets
    the scale its values had."""
    *lead, out, inp = shape
    want = (*lead, -(-out // block[0]), -(-inp // block[1]))
    scale = np.asarray(scale, np.float32)
    if scale.shape == want:
        return scale
    if scale.size == 1:
        return np.full(want, scale.reshape(()), np.float32)
    if block[0] == 1 and scale.shape in ((*lead, out, 1), (*lead, out)):
        return np.repeat(scale.reshape(*lead, out, 1), want[-1], axis=-1)
    raise ValueError(f"tensor {name!r} has shape {scale.shape}, expected {want} (blocks of {block} of the "
                     f"[out, in] weight{' or one per output channel' if block[0] == 1 else ''}) or one scale")


class SafetensorsSource:
    def __init__(self, directory: Path, quant: Fp8Config | None = None):
        """`quant`: the checkpoint's FP8 format (its blocks and where its scales are), for its FP8 tensors."""
        self.directory, self.quant = Path(directory), quant
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
        suffix = self.quant.scale_suffix if self.quant is not None else None
        if suffix is None or not self._has(name + suffix):
            raise ValueError(f"tensor {name!r} is FP8 but the checkpoint in {self.directory} gives no FP8 "
                             f"quantization_config or no {name + (suffix or '_scale_inv')!r}")
        return dequantize_np(t, self._scale(name), self.quant.block)

    def _scale(self, name: str) -> np.ndarray:
        """Weight `name`'s scales, one per block of the config (`block_scales`)."""
        found = self._find(name)
        shape = tuple(self._handles[self._where[found]].get_slice(found).get_shape())
        scale_name = name + self.quant.scale_suffix
        return block_scales(scale_name, self._tensor(scale_name), shape, self.quant.block)

    def stored_fp8(self, spec: ArrayInfo) -> bool:
        """Whether the checkpoint keeps this weight in FP8 with its scales (its first expert's, for stacked ones)."""
        name = spec.hf_name.replace(EXPERT, "0")
        return self.quant is not None and self._has(name + self.quant.scale_suffix) and self._has(name)

    def get_fp8(self, spec: ArrayInfo) -> tuple[np.ndarray, np.ndarray]:
        """(float8 values, float32 scales) as the checkpoint stores them, the scales one per block of the config:
        [.., out, in] and [.., out / bn, in / bk]."""
        values = self._stacked(spec, self._fp8_values)
        return values, self._stacked(spec, self._scale, self.quant.scale_suffix)

    def _fp8_values(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        if t.dtype not in FP8_DTYPES.values():
            raise ValueError(f"tensor {name!r} has dtype {t.dtype} beside its {self.quant.scale_suffix!r} scales, "
                             "expected float8_e4m3fn")
        return t

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

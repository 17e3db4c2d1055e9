"""GGUF checkpoints, read by gguf_meta (memory-mapped, no copy) and dequantized to float32 at load time
by the `gguf` package's numpy dequantizers.

llama.cpp's converter permutes the rows of Q and K for llama-architecture files (to interleave
RoPE pairs; `Architecture.gguf_permuted_qk`); we undo it so the same rotate-half forward serves every
source. qwen2/qwen3 GGUFs are not permuted, nor are deepseek2's (HF's DeepSeek RoPE is already interleaved).
DeepSeek's `attn_kv_b`, split by recent converters into `attn_k_b` / `attn_v_b`, is joined back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from jinfer.config.model import ModelConfig
from jinfer.models.architectures import ARCHITECTURES
from jinfer.models.spec import ArrayInfo
from jinfer.weights.gguf_meta import GGUFTensor, open_gguf

SUPPORTED_TYPES = {t.name for t in (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_K)}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` (rows [n, 2, D/2] -> [n, D/2, 2]) on a [n*D, ...] weight or bias."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_CHUNK_BLOCKS = 4096  # quant blocks dequantized per numpy pass (~130k values: cache-sized, few passes)


def dequantize_tensor(t: GGUFTensor) -> np.ndarray:
    """A tensor's values as a flat float32 array. Quantized data goes through gguf.quants in flat chunks
    of whole blocks (every block decodes on its own): ~1.5x faster than its 16-rows-at-a-time grouping on
    narrow rows, and the temporaries stay small for any tensor size."""
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    flat, out = t.data.reshape(-1), np.empty(t.n_elements, np.float32)
    step = _CHUNK_BLOCKS * type_size
    for i in range(0, flat.size, step):
        chunk = flat[i:i + step]
        out[i // type_size * block:(i + chunk.size) // type_size * block] = dequantize(chunk, t.tensor_type)
    return out


class GGUFTensorSource:
    def __init__(self, path: Path, cfg: ModelConfig):
        self.path, self.cfg = Path(path), cfg
        self._tensors = {t.name: t for t in open_gguf(str(path)).tensors}

    def get(self, spec: ArrayInfo) -> np.ndarray:
        if spec.gguf_name not in self._tensors and spec.gguf_name.endswith(".attn_kv_b.weight"):
            return self._join_kv_b(spec.gguf_name)
        w = self._read(spec.gguf_name)
        if ARCHITECTURES[self.cfg.architecture].gguf_permuted_qk:
            name = spec.gguf_name.rsplit(".", 2)
            if name[-2] == "attn_q":
                w = unpermute_qk(w, self.cfg.num_heads)
            elif name[-2] == "attn_k":
                w = unpermute_qk(w, self.cfg.num_kv_heads)
        return w

    def _read(self, name: str) -> np.ndarray:
        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"tensor {name!r} is missing from {self.path}")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {name!r} has unsupported GGML type {t.tensor_type.name}; "
                             f"supported: {sorted(SUPPORTED_TYPES)}")
        # GGUF lists dims innermost first; the data is row-major [out, in], like HF.
        return dequantize_tensor(t).reshape(tuple(reversed(t.shape)))

    def _join_kv_b(self, name: str) -> np.ndarray:
        """DeepSeek's `kv_b_proj` [H * (nope + v), kv_lora_rank] from the halves recent llama.cpp writes instead
        for MLA's absorbed form: `attn_k_b` (W_UK transposed per head, [H, kv_lora_rank, nope]) and `attn_v_b`
        ([H, v, kv_lora_rank])."""
        k_name, v_name = name.replace("attn_kv_b", "attn_k_b"), name.replace("attn_kv_b", "attn_v_b")
        if k_name not in self._tensors or v_name not in self._tensors:
            raise ValueError(f"tensor {name!r} is missing from {self.path}, and so is its split form "
                             f"{k_name if k_name not in self._tensors else v_name!r}")
        k_b, v_b = self._read(k_name), self._read(v_name)
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            raise ValueError(f"tensors {k_name!r} {k_b.shape} and {v_name!r} {v_b.shape} must be [heads, "
                             f"kv_lora_rank, nope] and [heads, v, kv_lora_rank]")
        return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])

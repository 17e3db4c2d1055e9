"""HF safetensors checkpoints: a single model.safetensors, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jinfer.models.spec import EXPERT, ArrayInfo


class SafetensorsSource:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
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
        return self._handles[self._where[found]].get_tensor(found)

    def get(self, spec: ArrayInfo) -> np.ndarray:
        if EXPERT not in spec.hf_name:
            return self._tensor(spec.hf_name)
        # Stacked experts: one tensor per expert (published checkpoints, transformers' save_pretrained),
        # else transformers' fused in-memory layout [E, parts * out, in].
        names = [spec.hf_name.replace(EXPERT, str(e)) for e in range(spec.shape[0])]
        if self._find(names[0]) is None and spec.hf_fused is not None and self._find(spec.hf_fused[0]):
            name, part, parts = spec.hf_fused
            fused = self._tensor(name)
            if fused.ndim != 3 or fused.shape[1] % parts:
                raise ValueError(f"tensor {name!r} has shape {fused.shape}, expected [experts, {parts} x out, in]")
            rows = fused.shape[1] // parts
            return fused[:, part * rows:(part + 1) * rows]
        return np.stack([self._tensor(n) for n in names])

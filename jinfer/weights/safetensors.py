"""HF safetensors checkpoints: a single model.safetensors, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jinfer.models.llama import ArrayInfo


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

    def get(self, spec: ArrayInfo) -> np.ndarray:
        f = self._where.get(spec.hf_name)
        if f is None:
            raise ValueError(f"tensor {spec.hf_name!r} is missing from the checkpoint in {self.directory}")
        return self._handles[f].get_tensor(spec.hf_name)

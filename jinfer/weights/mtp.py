"""Load the MTP layer a Qwen3.5 checkpoint ships under `mtp.*` (jinfer/models/qwen3_5_mtp.py), replicated over the
mesh, with the target's embedding, lm_head and final norm; random ones for a dummy target (`dummy:qwen3.5-4b`)."""

from __future__ import annotations

import os
from pathlib import Path

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config.model import ModelConfig
from jinfer.models.base import Weights
from jinfer.models.qwen3_5_mtp import MtpWeights, assemble_weights, weight_specs
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import DTYPES, place
from jinfer.weights.safetensors import SafetensorsSource


def load_mtp(path: str | os.PathLike | None, target: ModelConfig, target_weights: Weights, dtype: str = "bfloat16",
             mesh: Mesh | None = None, seed: int = 0) -> MtpWeights:
    """The MTP layer in the checkpoint directory `path` of a target of config `target`; ValueError where it has none.
    `path` None (a dummy target): random weights at the layer's shapes (`weights.dummy`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    if target.architecture != "qwen3_5":
        raise ValueError(f"an MTP layer is read from Qwen3.5 checkpoints, not {target.architecture!r}")
    specs = weight_specs(target)
    if path is None:
        from jinfer.weights.dummy import dummy_weights

        mesh = mesh or make_mesh(1)
        replicated = NamedSharding(mesh, PartitionSpec())
        arrays = dummy_weights(specs, DTYPES[dtype], {name: replicated for name in specs}, seed)
        return assemble_weights(target, arrays, target_weights)
    reader = SafetensorsSource(Path(path))
    missing = sorted(s.hf_name for s in specs.values() if s.hf_name not in reader.names())
    if missing:
        raise ValueError(f"the checkpoint in {path} has no MTP layer ({len(missing)} tensors missing, e.g. "
                         f"{missing[0]!r})")
    mesh, jdtype = mesh or make_mesh(1), DTYPES[dtype]
    arrays = {k: place(reader.get(spec), spec, jdtype, mesh) for k, spec in specs.items()}
    return assemble_weights(target, arrays, target_weights)

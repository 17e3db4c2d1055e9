"""Device mesh and logical-axis -> mesh-axis sharding rules.

Weights and the KV cache are always placed with a `NamedSharding` on a mesh (one device by
default), so tensor parallelism is a change of mesh shape, not of code. Logical axis names come from
the weight specs (`jinfer/models/llama.py`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"

# Which logical axes are split across the tensor-parallel mesh axis. Column-parallel q/k/v/gate/up,
# row-parallel o/down, vocab-parallel embedding and lm_head: the standard Megatron layout.
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": TP_AXIS,
    "embed": None,
    "q_heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "head_dim": None,
    "mlp": TP_AXIS,
    "pages": None,
    "page_slot": None,
}


def make_mesh(tp: int = 1, devices: list | None = None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} must be between 1 and the {len(devices)} available devices")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def logical_sharding(mesh: Mesh, logical_axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
    """NamedSharding for an array with the given logical axes; an axis not divisible by the mesh stays whole."""
    spec = []
    for name, dim in zip(logical_axes, shape, strict=True):
        axis = LOGICAL_RULES.get(name) if name else None
        if axis is not None and dim % mesh.shape[axis]:
            axis = None
        spec.append(axis)
    return NamedSharding(mesh, PartitionSpec(*spec))

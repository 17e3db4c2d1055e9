"""Load an EAGLE-3 draft head (config.json + safetensors; jinfer/models/eagle3.py describes it) for a target.

Published heads name the decoder layer `midlayer.` (SpecForge, SGLang) or `layers.0.` (vLLM / speculators
exports), some under a `model.` prefix. Optional tensors, as vLLM and SGLang treat them: no `embed_tokens` shares
the target's embedding; no `lm_head` (only with a full draft vocabulary) shares the target's head; no `d2t` is
the identity. `t2d` (which target ids the draft vocabulary holds) is not needed to draft and is not read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config.model import ModelConfig
from jinfer.models.base import Weights
from jinfer.models.eagle3 import Eagle3Config, Eagle3Weights, assemble_weights, eagle3_config, weight_specs
from jinfer.models.spec import ArrayInfo
from jinfer.parallel.mesh import logical_sharding, make_mesh, put
from jinfer.weights.loader import DTYPES, place
from jinfer.weights.safetensors import SafetensorsSource

LAYER_PREFIXES = ("midlayer.", "layers.0.")


def _candidates(name: str) -> list[str]:
    """The names a tensor goes by in published heads, SpecForge's first."""
    names = [name]
    if name.startswith("midlayer."):
        names += [p + name.removeprefix("midlayer.") for p in LAYER_PREFIXES[1:]]
    return names + ["model." + n for n in names]


def load_eagle3(path: str | os.PathLike, target: ModelConfig, target_weights: Weights | None = None,
                dtype: str = "bfloat16", mesh: Mesh | None = None) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head in directory `path` for a target of config `target`, its arrays replicated over `mesh`.
    `target_weights`: the target's, for what the head shares (its embedding, a full-vocabulary head's lm_head)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    path = Path(path)
    cfg = eagle3_config(path, target)
    mesh, jdtype = mesh or make_mesh(1), DTYPES[dtype]
    reader = SafetensorsSource(path)
    present = reader.names()
    arrays = {}
    for key, spec in weight_specs(cfg).items():
        name = next((n for n in _candidates(spec.hf_name) if n in present), None)
        if name is None:
            arrays[key] = _shared(key, spec, cfg, target_weights, path)
        elif key == "d2t":  # integer offsets: not cast to the weights' dtype
            host = np.asarray(reader.get(dataclasses.replace(spec, hf_name=name)))
            if host.shape != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {host.shape}, expected {spec.shape}")
            arrays[key] = put(host.astype(np.int32), logical_sharding(mesh, spec.axes, spec.shape))
        else:
            arrays[key] = place(reader.get(dataclasses.replace(spec, hf_name=name)), spec, jdtype, mesh)
    if arrays["embed"] is not None and arrays["embed"].dtype != jdtype:
        arrays["embed"] = arrays["embed"].astype(jdtype)
    if arrays["d2t"] is None:
        del arrays["d2t"]
    return cfg, assemble_weights(cfg, arrays)


def dummy_eagle3(target: ModelConfig, target_weights: Weights, dtype: str = "bfloat16", mesh: Mesh | None = None,
                 seed: int = 0) -> tuple[Eagle3Config, Eagle3Weights]:
    """A random head for a target (benchmarks: speculative_config.model "dummy"): SpecForge's layout at the target's
    layer shapes (its Qwen3-8B head's: hidden 4096, 32 / 8 heads of 128, MLP 12288) with a 32000-token draft
    vocabulary (d2t: its first ids), the target's embedding shared."""
    from jinfer.weights.dummy import dummy_weights

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    t = target
    cfg = eagle3_config({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t.hidden_size,
                         "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
                         "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps,
                         "rope_theta": t.rope_theta, "vocab_size": t.vocab_size,
                         "draft_vocab_size": min(32000, t.vocab_size)}
                        | ({} if t.num_layers >= 6 else  # (a tiny target: no default layers to read)
                           {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, t.num_layers // 2,
                                                                                   t.num_layers - 1]}}), t)
    mesh = mesh or make_mesh(1)
    specs = {k: v for k, v in weight_specs(cfg).items() if k not in ("embed", "d2t")}
    replicated = NamedSharding(mesh, PartitionSpec())
    arrays = dummy_weights(specs, DTYPES[dtype], {name: replicated for name in specs}, seed)
    arrays["embed"] = _shared("embed", weight_specs(cfg)["embed"], cfg, target_weights, Path("dummy"))
    if arrays["embed"].dtype != DTYPES[dtype]:
        arrays["embed"] = arrays["embed"].astype(DTYPES[dtype])
    arrays["d2t"] = put(np.zeros(cfg.draft_vocab_size, np.int32), replicated)
    return cfg, assemble_weights(cfg, arrays)


def _shared(key: str, spec: ArrayInfo, cfg: Eagle3Config, target: Weights | None, path: Path) -> jax.Array | None:
    """What a head without tensor `key` uses instead (None: `d2t`'s identity)."""
    full_vocab = cfg.draft_vocab_size == cfg.layer.vocab_size
    if key == "d2t" and full_vocab:
        return None
    if key in ("embed", "lm_head") and (key == "embed" or full_vocab):
        if target is None:
            raise ValueError(f"the head in {path} has no {spec.hf_name!r}: load it with the target's weights")
        shared = target.embed if key == "embed" else (target.lm_head if target.lm_head is not None
                                                      else jnp.asarray(target.embed).T)
        if tuple(shared.shape) != spec.shape:
            raise ValueError(f"the head in {path} has no {spec.hf_name!r} and the target's {key} has shape "
                             f"{tuple(shared.shape)}, not the head's {spec.shape}")
        return shared
    raise ValueError(f"tensor {spec.hf_name!r} is missing from the EAGLE-3 head in {path}")

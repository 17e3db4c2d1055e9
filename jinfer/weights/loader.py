"""Resolve a model argument to a config plus a weight source, and load the `Weights` pytree.

Three sources give the same pytree: an HF safetensors directory, a GGUF file (dequantized at load
time) and `dummy` random weights at any config. Every tensor is checked against its spec and
placed on the mesh with the sharding its logical axes ask for.

Block FP8 (`ModelConfig.quantization`; jinfer/models/fp8.py): a weight its spec marks FP8 is read as the checkpoint
stores it (values and scales, transposed to jinfer's layout) or, stored as floats, quantized on the device after
placing it (online quantization: `quantization="fp8"`, and dummy weights). In a published FP8 checkpoint a weight
stored unquantized (`modules_to_not_convert` the config did not list) stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jinfer.config.model import NAMED_SHAPES, ModelConfig
from jinfer.config.quantization import Fp8Config
from jinfer.models.base import Weights
from jinfer.models.fp8 import Fp8Weight, in_kernel_layout, quantize, transposed_sharding
from jinfer.models.registry import assemble_weights, weight_specs
from jinfer.models.spec import ArrayInfo
from jinfer.parallel.mesh import fp8_shardings, logical_sharding, make_mesh, put
from jinfer.weights.gguf_meta import open_gguf, read_metadata, tensor_names
from jinfer.weights.hub import resolve_path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def models_dir() -> Path:
    """Where model directories live: $JINFER_MODELS_DIR, else the repository's models/."""
    env = os.environ.get("JINFER_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME / DEFAULT_MODEL_FILE


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "dummy"
    path: Path | None  # directory (hf), file (gguf), or None / config dir (dummy)
    config: ModelConfig


def resolve_model(model: str | os.PathLike | None = None, load_format: str = "auto", *, revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    """Turn a model argument into a ModelSource.

    `None` is the embedded default model; "dummy:<shape>" (shapes: NAMED_SHAPES) is random weights
    at a real shape, "dummy:<shape>,num_layers=47" the same with integer fields overridden; a `.gguf`
    file, a directory holding one, an HF directory with config.json, or a Hugging Face model ID
    (jinfer/weights/hub.py: `revision`, `download_dir`).
    `load_format="dummy"` gives random weights for an HF directory's config.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} must be 'auto' or 'dummy'")
    if model is None:
        path = default_model_path()
        if not path.is_file():
            raise ValueError(f"the default model is not installed at {path}; run `make install` first")
        model = path
    name = str(model)
    if name.startswith("dummy:"):
        return ModelSource("dummy", None, dummy_config(name))
    path = resolve_path(name, revision=revision, download_dir=download_dir)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"model={name!r}: a directory needs a config.json or exactly one .gguf file "
                             f"(found {len(ggufs)} .gguf files)")
        path = ggufs[0]
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={name!r}: a model file must be .gguf")
        cfg = ModelConfig.from_gguf_metadata(read_metadata(path), tensor_names(path))
        return ModelSource("dummy" if load_format == "dummy" else "gguf", path, cfg)
    cfg = ModelConfig.from_hf_config(path)
    return ModelSource("dummy" if load_format == "dummy" else "hf", path, cfg)


def dummy_config(name: str) -> ModelConfig:
    """"dummy:<shape>[,field=int...]" -> the named shape's config with those integer fields replaced
    (e.g. `dummy:qwen3-235b-a22b,num_layers=47`: half the depth, every layer's shapes the real ones).
    "<shape>-fp8" (`dummy:qwen3-8b-fp8`): the same with block-FP8 linear weights (128 x 128 blocks), as the
    published FP8 checkpoints."""
    shape, *overrides = name.removeprefix("dummy:").split(",")
    fp8 = shape.endswith("-fp8") and shape.removesuffix("-fp8") in NAMED_SHAPES
    shape = shape.removesuffix("-fp8") if fp8 else shape
    if shape not in NAMED_SHAPES:
        raise ValueError(f"model={name!r}: unknown shape {shape!r}; known: {sorted(NAMED_SHAPES)} "
                         "(each also as <shape>-fp8)")
    cfg, kw = NAMED_SHAPES[shape], {}
    if fp8:
        kw["quantization"] = Fp8Config(online=True)
    for item in overrides:
        key, _, value = item.partition("=")
        if not isinstance(getattr(cfg, key, None), int) or isinstance(getattr(cfg, key), bool) \
                or not value.lstrip("-").isdecimal():
            raise ValueError(f"model={name!r}: {item!r} must be <integer field>=<integer>")
        kw[key] = int(value)
    return cfg.replace(**kw) if kw else cfg


def with_online_fp8(source: ModelSource) -> ModelSource:
    """`quantization="fp8"`: the source's linear weights quantized at load to block FP8 (128 x 128). A checkpoint that
    is block-FP8 already keeps its own format."""
    if source.config.quantization is not None:
        return source
    return dataclasses.replace(source, config=source.config.replace(quantization=Fp8Config(online=True)))


def load_weights(source: ModelSource, dtype: str = "bfloat16", mesh: Mesh | None = None,
                 seed: int = 0, progress: bool = True, expert_parallel: bool = False) -> Weights:
    """The model's weights, each placed on `mesh` by its logical axes (`expert_parallel`: MoE experts
    split whole over the mesh, see jinfer/parallel/mesh.py); FP8 where `source.config.quantization` asks."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    t0 = time.perf_counter()
    mesh = mesh or make_mesh(1)
    cfg, jdtype = source.config, DTYPES[dtype]
    specs = weight_specs(cfg)
    if source.kind == "dummy":
        from jinfer.weights.dummy import dummy_weights
        shardings = {name: logical_sharding(mesh, spec.axes, spec.shape, expert_parallel)
                     for name, spec in specs.items()}
        arrays = dummy_weights(specs, jdtype, shardings, seed,
                               finish=lambda name, a: _to_fp8(a, specs[name], mesh, expert_parallel))
    else:
        arrays = _load_checkpoint(source, specs, jdtype, mesh, progress, expert_parallel)
    jax.block_until_ready(arrays)
    log.info("weights loaded in %.1f s: %s %s%s, %.2f GB", time.perf_counter() - t0, source.kind, dtype,
             " + FP8" if cfg.quantization else "", sum(a.nbytes for a in arrays.values()) / 1e9)
    return assemble_weights(cfg, arrays)


# Where checkpoints keep an FP8 KV cache's scales (vLLM's names; `{kv}`: k or v)
KV_SCALE_NAMES = ("model.layers.{i}.self_attn.{kv}_scale", "model.layers.{i}.self_attn.attn.{kv}_scale")


def load_kv_scales(source: ModelSource) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """An FP8 KV cache's scales from a safetensors checkpoint (`KV_SCALE_NAMES`): {layer: (k_scale, v_scale)}, each
    float32 [num_kv_heads] (a per-tensor scale broadcast; a missing one 1.0), for the layers that have any. {} for
    other sources (dummy weights, GGUF): every scale is then 1.0."""
    if source.kind != "hf":
        return {}
    from jinfer.weights.safetensors import SafetensorsSource

    cfg = source.config
    reader = SafetensorsSource(source.path, cfg.quantization)
    scales = {}
    for i in range(cfg.num_layers):
        k, v = (_kv_scale(reader, i, kv, cfg.num_kv_heads) for kv in "kv")
        if k is not None or v is not None:
            ones = np.ones((cfg.num_kv_heads,), np.float32)
            scales[i] = (ones if k is None else k, ones if v is None else v)
    return scales


def _kv_scale(reader, layer: int, kv: str, heads: int) -> np.ndarray | None:
    """Layer `layer`'s K (kv="k") or V scale as float32 [heads], or None where the checkpoint has none."""
    for pattern in KV_SCALE_NAMES:
        name = pattern.format(i=layer, kv=kv)
        t = reader.optional(name)
        if t is None:
            continue
        t = np.asarray(t, np.float32).reshape(-1)
        if t.size not in (1, heads) or not np.all(np.isfinite(t) & (t > 0)):
            raise ValueError(f"kv_cache_dtype='fp8': the checkpoint's {name!r} must be one positive scale or one "
                             f"per kv head ({heads}), got {t.tolist()}")
        return np.broadcast_to(t, (heads,)).copy()
    return None


def _load_checkpoint(source: ModelSource, specs: dict[str, ArrayInfo], dtype, mesh: Mesh,
                     progress: bool, expert_parallel: bool = False) -> dict[str, jax.Array]:
    if source.kind == "gguf":
        from jinfer.weights.gguf import GGUFTensorSource
        reader = GGUFTensorSource(source.path, source.config)
    else:
        from jinfer.weights.safetensors import SafetensorsSource
        reader = SafetensorsSource(source.path, source.config.quantization)
    arrays, kept = {}, []
    bar = tqdm(specs.items(), desc=f"loading {source.path.name}", unit="tensor", disable=not progress, leave=False)
    for name, spec in bar:
        if spec.fp8_block is not None and getattr(reader, "stored_fp8", lambda s: False)(spec):
            # (the weights the decode kernels read [out, in] stay as the checkpoint stores them: fp8.kernel_layout)
            out_in = in_kernel_layout(name.rsplit(".", 1)[-1], len(spec.shape)) and spec.transpose
            arrays[name] = place_fp8(*reader.get_fp8(spec), spec, mesh, expert_parallel, out_in)
            continue
        online = spec.fp8_block is not None and source.config.quantization.online
        # (quantized from float32, not from the model's dtype: one rounding, not two)
        arrays[name] = place(reader.get(spec), spec, jnp.float32 if online else dtype, mesh, expert_parallel)
        if online:
            arrays[name] = _to_fp8(arrays[name], spec, mesh, expert_parallel)
        elif spec.fp8_block is not None:
            kept.append(spec.hf_name)
    if kept:  # the checkpoint's own choice (its modules_to_not_convert may not list every such module)
        log.info("FP8 checkpoint: %d linear weights stored unquantized are kept so, e.g. %s", len(kept), kept[0])
    if source.kind == "gguf":
        # Everything is on the device now: unmap the file and drop its parsed metadata (for a 49k-token
        # vocabulary ~150 MB of host memory kept for nothing); a later read opens it again.
        del reader
        open_gguf.cache_clear()
    return arrays


def _to_fp8(a: jax.Array, spec: ArrayInfo, mesh: Mesh, expert_parallel: bool) -> jax.Array | Fp8Weight:
    """A placed float weight quantized to block FP8 on its devices where its spec asks (else returned as it is)."""
    if spec.fp8_block is None:
        return a
    shardings = fp8_shardings(mesh, spec.axes, spec.shape, spec.fp8_block, expert_parallel, spec.hf_name)
    return quantize(a, spec.fp8_block, shardings)


def place_fp8(values: np.ndarray, scale: np.ndarray, spec: ArrayInfo, mesh: Mesh,
              expert_parallel: bool = False, out_in: bool = False) -> Fp8Weight:
    """A checkpoint's FP8 weight [.., out, in] and its block scales [.., out / bn, in / bk] -> an Fp8Weight in
    jinfer's [in, out] layout, values and scales sharded alike; `out_in`: the values kept [out, in]
    (`Fp8Weight.transposed`, their sharding transposed), no host transpose."""
    expected = spec.checkpoint_shape()
    if tuple(values.shape) != expected:
        raise ValueError(f"tensor {spec.hf_name!r} has shape {tuple(values.shape)}, expected {expected}")
    want = spec.scale_shape()
    want = (*want[:-2], want[-1], want[-2]) if spec.transpose else want
    if tuple(scale.shape) != want:
        raise ValueError(f"the scales of tensor {spec.hf_name!r} have shape {tuple(scale.shape)}, expected {want} "
                         f"(blocks of {spec.fp8_block[::-1]} of the [out, in] weight)")
    if spec.transpose:
        values = values if out_in else np.swapaxes(values, -1, -2)
        scale = np.swapaxes(scale, -1, -2)
    vs, ss = fp8_shardings(mesh, spec.axes, spec.shape, spec.fp8_block, expert_parallel, spec.hf_name)
    if out_in:
        vs = transposed_sharding(vs, values.ndim)
    return Fp8Weight(put(np.ascontiguousarray(values), vs), put(np.ascontiguousarray(scale), ss), spec.fp8_block,
                     out_in)


def place(host: np.ndarray, spec: ArrayInfo, dtype, mesh: Mesh, expert_parallel: bool = False) -> jax.Array:
    """Check a checkpoint tensor against its spec, transpose to jinfer's layout, cast and shard it."""
    expected = spec.checkpoint_shape()
    if tuple(host.shape) != expected:
        raise ValueError(f"tensor {spec.hf_name!r} has shape {tuple(host.shape)}, expected {expected}")
    if spec.transpose:
        host = np.swapaxes(host, -1, -2)
    host = np.ascontiguousarray(host.astype(spec.dtype or dtype))
    return put(host, logical_sharding(mesh, spec.axes, spec.shape, expert_parallel))

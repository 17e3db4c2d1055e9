"""Device mesh, logical-axis -> mesh-axis sharding rules, and the sharded forward.

Weights and the KV cache are always placed with a `NamedSharding` on a mesh (one device by default),
so tensor parallelism is a change of mesh shape, not of model code. Logical axis names come from the
weight descriptions (`ArrayInfo.axes`), so a model family states nothing new to be sharded.

Several devices run the forward under `jax.shard_map` (`shard_forward`): each device runs the family's
own forward on its shards, with the Pallas kernels, and `ModelOps` issues the collectives
(`ModelOps.axis`). GSPMD cannot partition a `pallas_call` (it gathered around every kernel: 12x slower
on two GPUs than on one), hence explicit per-device code. The layout is Megatron's:
- attention: q heads and kv heads split (column-parallel q/k/v, the KV cache split by kv heads),
  row-parallel o, then one psum; with more devices than kv heads each kv head is replicated so every
  device holds the one its q heads read (`kv_heads_total`);
- dense MLP: gate/up column-parallel, down row-parallel, one psum;
- multi-head latent attention (DeepSeek): q, the latent's up-projection and o split by head; the latent projection
  and the latent cache replicated (every head reads every row);
- MoE: the experts' intermediate axis split like a dense MLP (tensor parallel), or with
  `expert_parallel` whole experts split over the devices. The activations are replicated after the
  attention's psum, so each device routes every token, runs only its own experts' pairs and the psum
  that ends the block combines them: no dispatch all_to_all is needed;
- embedding and lm_head: vocab-parallel (masked lookup + psum; logits all-gathered for the sampler).
The sharded axis of every array is `TP_AXIS`; a mesh is one-dimensional (data-parallel replicas are
separate meshes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.models.fp8 import Fp8Weight, check_shardable, map_columns

TP_AXIS = "tp"

# Which logical axes are split across the mesh axis: the standard Megatron layout.
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": TP_AXIS,
    "embed": None,
    "q_heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "linear_heads": TP_AXIS,  # a linear-attention layer's key / value heads (and their channels, states)
    "head_dim": None,
    "mlp": TP_AXIS,
    "moe_mlp": TP_AXIS,  # experts' intermediate axis: tensor parallel MoE
    "experts": None,
    "pages": None,
    "page_slot": None,
}
EXPERT_PARALLEL_RULES = LOGICAL_RULES | {"experts": TP_AXIS, "moe_mlp": None}
KV_AXES = ("pages", "page_slot", "kv_heads", "head_dim")


def make_mesh(tp: int = 1, devices: list | None = None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} must be between 1 and the {len(devices)} available devices")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def put(host, sharding):
    """Host array(s) -> device array(s) with `sharding`. Over several processes each one puts its own copy
    of the (identical) host data on its own devices: `jax.device_put` would first check that the copies
    are equal with a collective that gathers the whole array from every process, on each call."""
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    if isinstance(host, tuple | list):
        return type(host)(put(h, sharding) for h in host)
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class RecycledBuffers:
    """int32 device buffers by shape for an executable's small outputs: each is donated to the call that writes it and
    given back once read (or never to be read). A new small array alive across a step's launch can sit where the
    forward's temp buffer was and move it (its command buffer re-recorded: docs/ARCHITECTURE.md); these keep their
    addresses. At most `keep` of a shape wait."""

    def __init__(self, sharding, keep: int = 4):
        self.sharding, self.keep = sharding, keep
        self._free: dict[tuple[int, ...], list[jax.Array]] = {}

    def take(self, shape: tuple[int, ...]) -> jax.Array:
        """One given back of this shape, else a new one (zeros)."""
        free = self._free.get(tuple(shape))
        return free.pop() if free else put(np.zeros(shape, np.int32), self.sharding)

    def give_back(self, buffer: jax.Array) -> None:
        free = self._free.setdefault(buffer.shape, [])
        if len(free) < self.keep:
            free.append(buffer)


def rules(expert_parallel: bool = False) -> dict[str, str | None]:
    return EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_RULES


def logical_spec(mesh: Mesh, logical_axes: tuple[str | None, ...], shape: tuple[int, ...],
                 expert_parallel: bool = False) -> PartitionSpec:
    """PartitionSpec for an array with the given logical axes; an axis not divisible by the mesh stays whole."""
    table, spec = rules(expert_parallel), []
    for name, dim in zip(logical_axes, shape, strict=True):
        axis = table.get(name) if name else None
        if axis is not None and dim % mesh.shape[axis]:
            axis = None
        spec.append(axis)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, logical_axes: tuple[str | None, ...], shape: tuple[int, ...],
                     expert_parallel: bool = False) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(mesh, logical_axes, shape, expert_parallel))


def fp8_shardings(mesh: Mesh, logical_axes: tuple[str | None, ...], shape: tuple[int, ...], block: tuple[int, int],
                  expert_parallel: bool = False, name: str = "") -> tuple[NamedSharding, NamedSharding]:
    """(values', scales') shardings of an FP8 weight: the scales split on the weight's axes, so each device holds its
    blocks' scales; ValueError (`check_shardable`) where a shard would cut a block."""
    spec = logical_spec(mesh, logical_axes, shape, expert_parallel)
    parts = tuple(1 if a is None else mesh.shape[a] for a in tuple(spec)[-2:])
    check_shardable(name, shape, block, parts)
    *lead, k, n = shape
    scale_shape = (*lead, -(-k // block[0]), -(-n // block[1]))
    return NamedSharding(mesh, spec), NamedSharding(mesh, logical_spec(mesh, logical_axes, scale_shape,
                                                                       expert_parallel))


# ---- what a model needs to be split n ways ------------------------------------------------------

def check_parallel(cfg, tp: int, expert_parallel: bool = False) -> None:
    """ValueError, naming the field, when the model cannot be split `tp` ways."""
    if "linear_attention" in cfg.layer_types:  # their key and value heads split as the attention's
        if tp > 1 and cfg.quantization:  # (refused before the weights load; their small b / a split below a block)
            raise ValueError(f"tensor_parallel_size={tp}: FP8 linear-attention layers ({cfg.architecture}) run on one "
                             "device only for now")
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(cfg, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the linear-attention layers' "
                                 f"{name}={getattr(cfg, name)}")
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_heads={cfg.num_heads}")
    kvh = cfg.num_kv_heads
    if kvh % tp and tp % kvh:
        raise ValueError(f"tensor_parallel_size={tp} must divide, or be a multiple of, num_kv_heads={kvh}")
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size={cfg.intermediate_size}")
    if not cfg.num_experts:
        if expert_parallel and tp > 1:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
        return
    if expert_parallel and cfg.num_experts % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_experts={cfg.num_experts} "
                         "with enable_expert_parallel")
    if cfg.shared_expert_intermediate_size % tp:  # (Qwen3.5-MoE's shared expert, split like a dense MLP)
        raise ValueError(f"tensor_parallel_size={tp} must divide shared_expert_intermediate_size="
                         f"{cfg.shared_expert_intermediate_size}")
    if cfg.num_shared_experts * cfg.moe_intermediate_size % tp:  # split like a dense MLP, ep or not
        raise ValueError(f"tensor_parallel_size={tp} must divide the shared experts' width "
                         f"{cfg.num_shared_experts} x {cfg.moe_intermediate_size}")
    if not expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide moe_intermediate_size="
                         f"{cfg.moe_intermediate_size} (or set enable_expert_parallel)")


def kv_heads_total(cfg, tp: int) -> int:
    """KV heads over all devices: the model's, or one per device when there are more devices than heads
    (each head then stored tp / num_kv_heads times, as vLLM does)."""
    return max(cfg.num_kv_heads, tp)


def local_config(cfg, tp: int):
    """The config one device's forward sees: its share of the q and kv heads. Everything else the
    forward derives from its arrays' (local) shapes."""
    if tp == 1:
        return cfg
    linear = {}
    if "linear_attention" in (cfg.layer_types or ()):
        linear = dict(linear_num_key_heads=cfg.linear_num_key_heads // tp,
                      linear_num_value_heads=cfg.linear_num_value_heads // tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=kv_heads_total(cfg, tp) // tp,
                               **linear)


def shard_attention_weights(cfg, weights, mesh: Mesh, fuse_qkv: bool = True, expert_parallel: bool = False):
    """Lay out the attention weights for the mesh: kv heads repeated when the devices outnumber them,
    then (`fuse_qkv`) one q|k|v projection per layer whose shard on device d is [wq_d | wk_d | wv_d], so
    the per-device forward splits its local columns exactly as one device splits the whole matrix."""
    tp, kvh, d = mesh.size, cfg.num_kv_heads, cfg.head_dim
    if tp == 1:  # nothing to repeat or split (one device fuses the family's own way: `registry.shard_weights`)
        return weights
    repeat = kv_heads_total(cfg, tp) // kvh

    def repeat_heads(w, unit):  # [..., kvh * unit] -> [..., kvh * repeat * unit], each head `repeat` times in a row
        w = w.reshape(*w.shape[:-1], kvh, unit)
        return jnp.repeat(w, repeat, axis=-2).reshape(*w.shape[:-2], kvh * repeat * unit)

    def heads(w):  # an FP8 weight's scales repeat with their heads (a head must be whole blocks)
        if w is None or repeat == 1:
            return w
        out = map_columns(w, repeat_heads, d)
        if out is None:
            raise ValueError(f"tensor_parallel_size={tp} repeats the kv heads, but head_dim={d} is not a whole "
                             f"number of FP8 blocks of {w.block[1]} columns")
        return out

    def place(w, axes):
        if isinstance(w, Fp8Weight):
            vs, ss = fp8_shardings(mesh, axes, w.shape, w.block, expert_parallel, "q|k|v")
            return Fp8Weight(jax.device_put(w.w, vs), jax.device_put(w.scale, ss), w.block)
        return None if w is None else jax.device_put(w, logical_sharding(mesh, axes, w.shape, expert_parallel))

    col = ("embed", "kv_heads")
    layers = []
    for layer in weights.layers:
        if getattr(layer, "lin_qkv", None) is not None:  # a linear-attention layer (Qwen3.5): no q/k/v heads
            layers.append(_linear_channels_per_shard(cfg, layer, mesh, expert_parallel))
            continue
        if getattr(layer, "wqkv", None) is not None or getattr(layer, "wk", None) is None:  # fused, or MLA (no k/v)
            layers.append(layer)
            continue
        wk, wv = place(heads(layer.wk), col), place(heads(layer.wv), col)
        new = dict(wk=wk, wv=wv)
        if hasattr(layer, "bk"):  # (q/k/v biases: Qwen2)
            new |= dict(bk=place(heads(layer.bk), col[1:]), bv=place(heads(layer.bv), col[1:]))
        parts = (layer.wq, wk, wv)
        fp8 = [isinstance(w, Fp8Weight) for w in parts]
        if fuse_qkv and (not any(fp8) or all(fp8) and all(w.shape[1] // tp % w.block[1] == 0 for w in parts)):
            # (biases stay apart, added after the split; FP8 parts fuse with their scales when shards are whole
            # blocks, which `place` checked for each already)
            if all(fp8):
                wqkv = Fp8Weight(per_shard([w.w for w in parts], tp, 1), per_shard([w.scale for w in parts], tp, 1),
                                 parts[0].block)
            else:
                wqkv = per_shard(parts, tp, 1)
            new |= dict(wq=None, wk=None, wv=None, wqkv=place(wqkv, ("embed", "q_heads")))
        layers.append(dataclasses.replace(layer, **new))
    return dataclasses.replace(weights, layers=layers)


def per_shard(parts: list, tp: int, axis: int) -> jax.Array:
    """Arrays joined on `axis` so that the result's shard d of `tp` is [part_0's shard d | part_1's | ...]."""
    parts = [p.reshape(*p.shape[:axis], tp, p.shape[axis] // tp, *p.shape[axis + 1:]) for p in parts]
    w = jnp.concatenate(parts, axis=axis + 1)
    return w.reshape(*w.shape[:axis], -1, *w.shape[axis + 2:])


def _linear_channels_per_shard(cfg, layer, mesh: Mesh, expert_parallel: bool):
    """A linear-attention layer's q | k | v channels (the input projection's columns, the conv's channels), loaded
    whole, reordered so device d's shard is [q_d | k_d | v_d] (its key and value heads' channels) and split: each
    device's conv and delta rule then read their channels as one device reads them all. Its input projections are
    then one, [qkv_d | z_d | b_d | a_d] per shard (`lin_in`, as one device fuses them). The layer's other weights and
    its states split by heads as loaded (`linear_heads`)."""
    if isinstance(layer.lin_qkv, Fp8Weight) or isinstance(layer.conv_w, Fp8Weight):
        raise ValueError(f"tensor_parallel_size={mesh.size}: FP8 linear-attention projections are not split yet")
    tp, keys = mesh.size, cfg.linear_key_size

    def qkv(w, axis):
        return jnp.split(w, [keys, 2 * keys], axis=axis)

    def place(w, axes):
        return jax.device_put(w, logical_sharding(mesh, axes, w.shape, expert_parallel))

    lin_in = per_shard([*qkv(layer.lin_qkv, 1), layer.lin_z, layer.lin_b, layer.lin_a], tp, 1)
    return dataclasses.replace(layer, lin_in=place(lin_in, ("embed", "linear_heads")), lin_qkv=None, lin_z=None,
                               lin_b=None, lin_a=None,
                               conv_w=place(per_shard(qkv(layer.conv_w, 0), tp, 0), ("linear_heads", None, None)))


# ---- the sharded forward ------------------------------------------------------------------------

def array_specs(tree):
    """The PartitionSpec of every (NamedSharding-placed) array of a pytree."""
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def all_reduce_table(mesh: Mesh, ops) -> tuple:
    """(the one-shot all-reduce workspace's table,) where a sharded forward on `mesh` reduces with that kernel: GPUs,
    the Pallas kernels compiled for them, and the policy's `one_shot_all_reduce_bytes` or `one_shot_all_gather_bytes`
    set; () otherwise (XLA's collectives). GPUs of one process share a workspace of JAX arrays; a mesh over several
    processes, one GPU each, one over CUDA IPC (`peer_memory`; all of the group or none of it)."""
    devices = list(mesh.devices.flat)
    policy = ops.policy
    if mesh.size == 1 or ops.backend != "pallas" or ops.interpret \
            or not (policy.all_reduce_limit(jax.local_device_count()) or policy.one_shot_all_gather_bytes) \
            or devices[0].platform != "gpu":
        return ()
    if any(d.process_index != jax.process_index() for d in devices):
        from jinfer.parallel.peer_memory import ipc_table

        table = ipc_table(mesh)
        return () if table is None else (table,)
    from pallas_kernels import all_reduce

    return (all_reduce.workspace(mesh).table,)


def mesh_forward(forward, cfg, ops, mesh: Mesh, weight_specs, kv_specs, aux_layers: tuple[int, ...] = (),
                 all_reduce_table: bool = False, expert_load: bool = False):
    """`forward(weights, batch, kv_cache, cfg, ops)` (a family's, or the registry's) as a function of
    (weights, batch, kv_cache) for the mesh: itself on one device; on several, each device runs it on its
    shards under `jax.shard_map` with its `local_config` and the collectives on (`ModelOps.axis`). The
    batch goes to every device whole, the logits come back whole (the forward gathers them), the cache
    stays in its shards (`weight_specs`, `kv_specs`: `array_specs` of the placed arrays). `aux_layers`: the forward
    also returns the hidden states at those layer boundaries, whole (replicated after the layers' psums).
    `all_reduce_table`: the function takes a fourth argument, the table of a `pallas_kernels.all_reduce.Workspace`
    for the mesh, and the collectives the policy sends there (`one_shot_all_*_bytes`) run on its kernels.
    `expert_load`: the forward also returns the MoE layers' expert counts, last, whole (every device routes every
    token, so each holds the same counts)."""
    extra = ({"aux_layers": aux_layers} if aux_layers else {}) | ({"expert_load": True} if expert_load else {})
    if mesh.size == 1:
        return functools.partial(forward, cfg=cfg, ops=ops, **extra)
    body = functools.partial(forward, cfg=local_config(cfg, mesh.size), ops=dataclasses.replace(ops, axis=TP_AXIS),
                             **extra)
    out_specs = (PartitionSpec(), kv_specs) + ((PartitionSpec(),) if aux_layers else ()) \
        + ((PartitionSpec(),) if expert_load else ())
    in_specs = (weight_specs, PartitionSpec(), kv_specs)
    if all_reduce_table:
        from pallas_kernels import all_reduce

        def body_with_table(weights, batch, kv_cache, table, forward=body):
            with all_reduce.use(table):
                return forward(weights, batch, kv_cache)

        body, in_specs = body_with_table, (*in_specs, PartitionSpec())
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

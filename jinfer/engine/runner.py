"""Turns a scheduled batch into padded device arrays and launches one jitted forward + sampling step.

Shapes come from a small fixed set of buckets so serving never stalls on a compile:
- T (tokens in the step): 1 (GPU only), then powers of two from `MIN_TOKENS` up to `max_num_batched_tokens`;
- B (sequences): min(T, the max_num_seqs bucket): a step never has more sequences than tokens;
- P (pages per sequence in the page table): powers of two up to the longest sequence allowed.
With the Pallas kernels, a bucket with B = T (T > 1) has a second forward for decode-only steps
(every sequence one new token), whose attention is the paged decode kernel instead of the ragged
one (`ModelOps.decode_step`). `warmup()` compiles (or loads, in parallel) every (T, P) forward, the
decode forwards, and the sampler variants of `SamplerFlags.warm()` for every B ahead of time.
The KV cache is donated to the step, so it is updated in place.

A step is two executables (forward, then sampler) fed by two host-to-device copies: the whole batch
description packed into one int32 buffer, the sampling parameters into another (`pack_batch`,
`pack_sampling`; unpacked by static slices inside the jitted functions). `launch` returns at once
with device arrays (JAX dispatch is asynchronous) and starts the copy of the results to the host;
`fetch` waits for them. The sampled tokens also stay on the device in a fixed-size buffer, from
which the next step takes the inputs of its decodes (`ScheduledRequest.input_from_device`), so the
engine can launch step N+1 before it reads step N's tokens.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, field, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.cache.host_tier import KVTransfers
from jinfer.cache.manager import NULL_PAGE, cdiv
from jinfer.cache.transfer import HostKVPool
from jinfer.config.model import ModelConfig
from jinfer.engine.executables import ExecutableCache
from jinfer.engine.sampler import (
    SamplerFlags,
    SamplingTensors,
    mask_words,
    sample_traced,
    token_logprobs,
    uses_penalties,
)
from jinfer.engine.scheduler import SchedulerOutput
from jinfer.models.base import Weights
from jinfer.models.batch import Batch
from jinfer.models.ops import REFERENCE_OPS, ModelOps
from jinfer.models.registry import forward, state_specs
from jinfer.parallel.mesh import KV_AXES, array_specs, kv_heads_total, logical_sharding, mesh_forward, put
from jinfer.parallel.multihost import StepInputs

log = logging.getLogger(__name__)

MIN_TOKENS = 8
WARMUP_THREADS = 8  # forward executables loaded / compiled at once during warm-up
MIN_PAGES = 4
# XLA command buffers (CUDA graphs) only for steps of at most this many tokens. They save the
# per-kernel launch cost that dominates small decode steps, but recording a graph costs ~16 ms for a
# 1k-token prefill executable (it was re-recorded in front of the first prefill after warm-up, on
# the TTFT path), and large steps hide their launches behind device time anyway.
COMMAND_BUFFER_MAX_TOKENS = 32
# An unloaded bucket (ModelRunner.unload_idle) is loaded again once this many steps wanted it: sustained demand, not
# one request's few prefill chunks (a lone 1k-token prompt after an idle minute ran 0.15-0.2 s slower while the
# 512-2048 buckets its first chunk asked for loaded beside it; it needs none of them).
RELOAD_AFTER_STEPS = 16
# Large (prefill) steps: no command buffers (above), and no "dot merger". That XLA pass merges two dots of
# one operand into one over the concatenation of the other operands: it merged the MLP's x @ w_gate and
# x @ w_up, concatenating the two weights (94 MB for Qwen3.5-4B) anew in every layer of every prefill step:
# 60 us a layer on an H100, more than the merged dot saved (`benchmarks/hlo_ops.py` names such kernels).
# JINFER_XLA_DOT_MERGER=1 keeps XLA's default (A/B runs).
NO_COMMAND_BUFFER = {"xla_gpu_enable_command_buffer": ""} | (
    {} if os.environ.get("JINFER_XLA_DOT_MERGER") == "1" else {"xla_gpu_dot_merger_threshold_mb": 0})


def _trim_host_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc only; a no-op elsewhere). Warm-up frees a lot
    (executable payloads read from disk, lowering and compile temporaries), spread over the arenas of
    its threads; glibc keeps such memory mapped, and it counted as the idle engine's RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... and finally hi itself (so the largest bucket is exactly the limit)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def pick(buckets: Sequence[int], n: int) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype, tp: int = 1) -> int:
    """Bytes one page takes on each device of a `tp`-way mesh (its share of the kv heads), over the layers
    that keep paged KV."""
    heads = kv_heads_total(cfg, tp) // tp
    num_layers = cfg.num_layers - len(state_specs(cfg))
    return 2 * num_layers * page_size * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def state_bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    """Bytes one sequence's state slot takes over all layers with a per-sequence state (0 for most models)."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype or dtype).itemsize
               for specs in state_specs(cfg).values() for s in specs)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh, num_state_slots: int = 0):
    """Per layer: its (k, v) pages, or (a layer with a per-sequence state, `registry.state_specs`) one pool
    of `num_state_slots` slots per state array, replicated over the mesh."""
    shape = (num_pages, page_size, kv_heads_total(cfg, mesh.size), cfg.head_dim)
    sharding = logical_sharding(mesh, KV_AXES, shape)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    states = state_specs(cfg)
    if states and num_state_slots < 2:
        raise ValueError(f"num_state_slots={num_state_slots}: this model keeps a state per sequence in "
                         f"{len(states)} layers and needs >= 2 slots (slot 0 is reserved)")

    def pool(spec):
        full = (num_state_slots, *spec.shape)
        return jax.jit(lambda: jnp.zeros(full, spec.dtype or dtype),
                       out_shardings=NamedSharding(mesh, PartitionSpec()))()

    return tuple(tuple(pool(spec) for spec in states[i]) if i in states else (zeros(), zeros())
                 for i in range(cfg.num_layers))


@dataclass
class StepRow:
    """Sampling inputs of one scheduled sequence that needs a token."""

    params: object  # SamplingParams-like
    output_ids: list[int]  # generated ids known on the host (penalties read them)
    prompt: object  # packed prompt token set (repetition penalty) or None
    seed: int
    step: int  # index of the token being sampled among the request's outputs (keys the noise)
    min_tokens_ids: tuple[int, ...] = ()  # masked while step < min_tokens (EOS, stop ids)


@dataclass
class StepResult:
    """Host copies of a step's samples; row b = scheduled sequence b."""

    tokens: np.ndarray  # [B] i32
    logprobs: np.ndarray  # [B] f32, raw logprob of the sampled token
    top_ids: np.ndarray  # [B, N] i32
    top_logprobs: np.ndarray  # [B, N] f32


@dataclass
class Launched:
    """A step dispatched to the device whose results have not been read yet."""

    out: SchedulerOutput
    packed: jax.Array  # i32[B, 2 + 2N]: token, logprob bits, top ids, top logprob bits
    tokens: jax.Array  # i32[max_seqs_bucket]: sampled ids, for the next step's inputs
    row_of: dict[str, int]  # request id -> batch row, for rows that sample
    # Prompt logprobs: i32[T, 1 + 2k] (target logprob bits, top ids, top logprob bits), and for each of its
    # rows (request id, prompt position whose token it scores).
    prompt_packed: jax.Array | None = None
    prompt_rows: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """Host copies of a step's prompt logprobs: row i scores prompt position `Launched.prompt_rows[i]`."""

    logprobs: np.ndarray  # [R] f32, of the prompt token itself
    top_ids: np.ndarray  # [R, k] i32
    top_logprobs: np.ndarray  # [R, k] f32


@dataclass
class ForwardLaunched:
    """A step whose forward is dispatched and whose sampler is not (`ModelRunner.launch_forward`)."""

    out: SchedulerOutput
    logits: jax.Array  # [B, V]
    B: int


def _i32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32).ravel()


def pack_batch(batch: Batch, prev_index: np.ndarray) -> np.ndarray:
    """One int32 buffer for the batch description (see `unpack_batch`)."""
    return np.concatenate([batch.input_ids, batch.positions, batch.slot_mapping, prev_index, batch.query_start,
                           batch.seq_lens, batch.logits_indices, batch.state_slots,
                           batch.page_table.ravel()]).astype(np.int32)


def _batch_sizes(T: int, B: int, P: int, L: int | None = None) -> tuple[int, ...]:
    """Lengths of the packed batch's parts, in `pack_batch` order. L: logits rows (B, or B + T in steps with
    prompt logprobs: each sequence's last token, then the prompt positions whose logprobs are wanted)."""
    return (T, T, T, T, B + 1, B, B if L is None else L, B, B * P)


def unpack_batch(buf: jax.Array, dims: tuple[int, ...]) -> tuple[Batch, jax.Array]:
    T, B, P = dims[:3]
    parts, o = [], 0
    for n in _batch_sizes(*dims):
        parts.append(buf[o:o + n])
        o += n
    ids, pos, slots, prev, qs, lens, logits_idx, state_slots, table = parts
    return Batch(ids, pos, slots, qs, lens, table.reshape(B, P), logits_idx, state_slots), prev


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("top_k", "seeds", "steps")


def pack_sampling(t: SamplingTensors) -> np.ndarray:
    """One int32 buffer for the sampling parameters (floats and u32 by bit pattern)."""
    parts = [_i32(np.asarray(getattr(t, f), np.float32)) for f in _FLOAT_FIELDS]
    parts += [_i32(getattr(t, f)) for f in _INT_FIELDS] + [_i32(t.output_tokens), _i32(t.prompt_mask)]
    parts += [_i32(t.bias_ids), _i32(np.asarray(t.bias_values, np.float32))]
    if t.token_mask is not None and t.token_mask.size:
        parts.append(_i32(t.token_mask))
    return np.concatenate(parts)


def unpack_sampling(buf: jax.Array, dims: tuple[int, int, int, int], mask_words: int = 0) -> SamplingTensors:
    """`mask_words`: G of the grammar token mask that ends the buffer (0: none)."""
    B, M, W, K = dims
    o, out = 0, {}
    for f in _FLOAT_FIELDS + _INT_FIELDS:
        out[f] = buf[o:o + B]
        o += B
    for f in _FLOAT_FIELDS:
        out[f] = jax.lax.bitcast_convert_type(out[f], jnp.float32)
    out["seeds"] = jax.lax.bitcast_convert_type(out["seeds"], jnp.uint32)
    out["output_tokens"] = buf[o:o + B * M].reshape(B, M)
    o += B * M
    out["prompt_mask"] = jax.lax.bitcast_convert_type(buf[o:o + B * W], jnp.uint32).reshape(B, W)
    o += B * W
    out["bias_ids"] = buf[o:o + B * K].reshape(B, K)
    out["bias_values"] = jax.lax.bitcast_convert_type(buf[o + B * K:o + 2 * B * K], jnp.float32).reshape(B, K)
    o += 2 * B * K
    G = mask_words
    out["token_mask"] = jax.lax.bitcast_convert_type(buf[o:o + B * G], jnp.uint32).reshape(B, G)
    return SamplingTensors(**out)


def _forward_step(weights, buf, kv_cache, prev_tokens, *, dims, cfg, ops, mesh, specs):
    """Unpack the batch and run the model's forward on the mesh (`parallel.mesh_forward`; `specs`: the
    weights' and the cache's PartitionSpecs). Only values with a stable repr are bound here: they key
    the executable cache."""
    batch, prev = unpack_batch(buf, dims)
    # Decodes of tokens sampled by the previous step read them from its on-device buffer.
    batch.input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], batch.input_ids)
    return mesh_forward(forward, cfg, ops, mesh, *specs)(weights, batch, kv_cache)


# Forked samples' copies go to the device in calls of at most this many (page, slot) pairs, padded to a power of
# two (no-op copies of the null page and the reserved slot onto themselves): FORK_CHUNK.bit_length() executables.
FORK_CHUNK = 16


def _fork_step(kv_cache, pairs, *, state_layers: frozenset[int]):
    """pairs i32[4, N]: (source, destination) pages, then (source, destination) state slots. Each attention
    layer's destination pages get the source pages' K and V, each state layer's destination slots the source
    slots' states."""
    out = []
    for i, layer in enumerate(kv_cache):
        src, dst = (pairs[2], pairs[3]) if i in state_layers else (pairs[0], pairs[1])
        out.append(tuple(a.at[dst].set(a[src]) for a in layer))
    return tuple(out)


def _sample_step(logits, buf, prev_tokens, *, dims, num_logprobs, flags, max_seqs):
    B, V = logits.shape
    t = unpack_sampling(buf, dims, mask_words(V) if flags.grammar else 0)
    if dims[1]:  # penalties: an output token still pending on the host is -2 - (its row in prev_tokens)
        ids = t.output_tokens
        t.output_tokens = jnp.where(ids <= -2, prev_tokens[jnp.clip(-2 - ids, 0, max_seqs - 1)], ids)
    r = sample_traced(logits, t, num_logprobs, flags)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    packed = jnp.concatenate([r.tokens[:, None], bits(r.logprobs)[:, None], r.top_ids, bits(r.top_logprobs)], axis=1)
    return packed, jnp.zeros(max_seqs, jnp.int32).at[:B].set(r.tokens)


def _prompt_logprobs_step(logits, targets, *, num_seqs, k):
    """Split the logits of a step with prompt logprobs: the sampler's [B, V], and the packed logprobs of the
    prompt positions [T, 1 + 2k] (see `Launched.prompt_packed`)."""
    lp, top_ids, top_lps = token_logprobs(logits[num_seqs:], targets, k)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    return logits[:num_seqs], jnp.concatenate([bits(lp)[:, None], top_ids, bits(top_lps)], axis=1)


def unpack_prompt_logprobs(packed: np.ndarray, num_rows: int) -> PromptLogprobs:
    packed = packed[:num_rows]
    k = (packed.shape[1] - 1) // 2
    f32 = lambda x: np.ascontiguousarray(x).view(np.float32)
    return PromptLogprobs(f32(packed[:, :1])[:, 0], packed[:, 1:1 + k], f32(packed[:, 1 + k:]))


def unpack_result(packed: np.ndarray) -> StepResult:
    n = (packed.shape[1] - 2) // 2
    f32 = lambda x: np.ascontiguousarray(x).view(np.float32)
    return StepResult(packed[:, 0], f32(packed[:, 1]), packed[:, 2:2 + n], f32(packed[:, 2 + n:]))


def _sampler_key(B: int, M: int, W: int, K: int, num_logprobs: int, flags: SamplerFlags) -> tuple:
    return ("sample", B, M, W, K, num_logprobs, flags)


def _with_pending_output(row: StepRow | None, s, prev: Launched | None) -> StepRow | None:
    """A penalized row whose last output token is still being sampled by `prev` (async scheduling): its
    output ids end with the marker -2 - (that token's row in prev's samples), which the sampler resolves on
    the device, so penalties never make the host wait for the previous step."""
    if row is None or not s.input_from_device or not uses_penalties(row.params):
        return row
    return replace(row, output_ids=[*row.output_ids, -2 - prev.row_of[s.request_id]])


def _sample_rows(out: SchedulerOutput) -> dict[str, int]:
    """request id -> its row of the step's samples, for the sequences that sample."""
    return {s.request_id: b for b, s in enumerate(out.scheduled) if s.needs_sample}


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, mesh: Mesh, *, num_pages: int, page_size: int,
                 kv_dtype, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 ops: ModelOps = REFERENCE_OPS, executable_dir: str | None = None, num_state_slots: int = 0,
                 num_host_pages: int = 0, keep_alive: float = 0.0):
        self.cfg, self.weights, self.mesh = cfg, weights, mesh
        self.page_size = page_size
        self.kv_cache = init_kv_cache(cfg, num_pages, page_size, kv_dtype, mesh, num_state_slots)
        # The host tier's pages (kv_transfer.py): `transfer` launches a schedule's copies before its step.
        self.host_pool = HostKVPool(self.kv_cache, num_host_pages) if num_host_pages else None
        # On GPU, T=1 is its own bucket: batch-1 decode is the latency-critical case and has its own
        # kernels. Not on CPU: there XLA copies the whole KV cache when a one-token update is followed
        # by a read of the cache in the same executable (step time grew with the pool: 4 s at 4096 pages).
        one = (1,) if jax.default_backend() == "gpu" else ()
        self.token_buckets = one + pow2_buckets(MIN_TOKENS, max(max_num_batched_tokens, MIN_TOKENS))
        self.max_seqs_bucket = pick(pow2_buckets(1, 1 << (max_num_seqs - 1).bit_length()), max_num_seqs)
        max_pages = cdiv(max_model_len, page_size)
        # The reference attention gathers all P pages of every token, so P is bucketed; the Pallas
        # kernels stop at each sequence's length, so one full-width page table costs nothing there.
        self.page_buckets = ((max_pages,) if ops.backend == "pallas"
                             else pow2_buckets(min(MIN_PAGES, max_pages), max_pages))
        self.ops = ops
        # Every output's sharding is pinned to the very object its next consumer was first called
        # with (the KV pool's own shardings, one replicated sharding for logits and tokens). JAX keys
        # its C++ dispatch cache on argument shardings by equality, and shardings XLA infers (e.g.
        # replicated) differ from the pool's logical ones even on one device: each new combination
        # took the Python path once more (~30 ms, measured as a slow first prefill after warm-up).
        self._replicated = NamedSharding(mesh, PartitionSpec())
        # Buckets whose decode-only steps get their own executable (see the module doc).
        self.decode_buckets = (frozenset(T for T in self.token_buckets if T > 1 and self.seqs_bucket(T) == T)
                               if ops.backend == "pallas" else frozenset())
        self._state_layers = frozenset(state_specs(cfg))
        self._fork_sizes = [1 << b for b in range(FORK_CHUNK.bit_length())] if self._state_layers else []
        self._make_jits()
        self._no_prev = put(np.zeros(self.max_seqs_bucket, np.int32), self._replicated)
        # Compiled executables per shape, loaded from / stored to disk when `executable_dir` is set: a
        # warm start then neither traces nor lowers (see executable_cache.py).
        self.executables = ExecutableCache(executable_dir, namespace=repr((cfg, ops, mesh.shape, self.max_seqs_bucket)))
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        self.warmed_up = False
        # Buckets steps may use now: all of them (compiled on first use) unless a staged warm-up
        # (`warmup(first_tokens=...)`) is still compiling the rest in the background.
        self.ready_tokens: tuple[int, ...] = self.token_buckets
        self.ready_decode: frozenset[int] = self.decode_buckets
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self._ready_lock = threading.Lock()
        self.background_seconds = 0.0  # start-up to the last background compile
        # Idle unloading (`unload_idle`): a bucket beyond the staged warm-up's first ones whose forward executables
        # no step used for `keep_alive` seconds is dropped (its host memory, ~1 MB per GPU code image, goes back),
        # and loaded again from the executable cache in the background when a step wants it (`_want`).
        self.keep_alive = float(keep_alive) if executable_dir else 0.0
        self._pinned: frozenset[tuple[int, bool]] = frozenset()  # (T, decode) buckets never unloaded
        self._last_used: dict[tuple[int, bool], float] = {}
        self._unloaded: set[tuple[int, bool]] = set()
        self._loading: set[tuple[int, bool]] = set()
        self._demand: dict[tuple[int, bool], int] = {}  # unloaded bucket -> steps that wanted it since
        self._loader: ThreadPoolExecutor | None = None
        self.unloads = self.reloads = 0  # buckets dropped as idle / loaded again
        self.compiles_after_warmup = 0  # shapes first needed after warm-up (each one stalls a step)
        # The forward's `prev_tokens` argument is always the latest sampler output (even when no row
        # reads it), so every call of an executable sees arguments of identical type and sharding and
        # stays on JAX's C++ fast path (see above).
        self._last_tokens = self._no_prev
        # Host inputs go to the devices uncommitted (the executable places them) in one process; over
        # several processes each one puts its (identical) copy on its own devices of the mesh.
        self._input_sharding = self._replicated if jax.process_count() > 1 else None
        self.on_launch = None  # process 0 of a group: called with each step's StepInputs before launching

    def _make_jits(self) -> None:
        """The jitted step functions that executables are lowered from. Made anew (`_drop_traces`) once a cold
        start's compiles are done: JAX caches each jit's traces and lowerings for as long as its function lives
        (a cold-started Qwen3-4B server idled at 1.83 GB, against 854 MB after a warm start)."""
        kv_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)
        specs = (array_specs(self.weights), array_specs(self.kv_cache))
        forward_jit = lambda ops, **kw: jax.jit(  # noqa: E731
            partial(_forward_step, cfg=self.cfg, ops=ops, mesh=self.mesh, specs=specs), static_argnames=("dims",),
            donate_argnames=("kv_cache",),
            out_shardings=(self._replicated, kv_shardings), **kw)
        # Indexed by "decode step": small steps run with command buffers (XLA's default), large without.
        self._forward = {d: (forward_jit(o), forward_jit(o, compiler_options=NO_COMMAND_BUFFER))
                         for d, o in ((False, self.ops), (True, replace(self.ops, decode_step=True)))}
        self._sample = jax.jit(partial(_sample_step, max_seqs=self.max_seqs_bucket),
                               static_argnames=("dims", "num_logprobs", "flags"),
                               out_shardings=(self._replicated, self._replicated))
        self._prompt_logprobs = jax.jit(_prompt_logprobs_step, static_argnames=("num_seqs", "k"),
                                        out_shardings=(self._replicated, self._replicated))
        self._fork = jax.jit(partial(_fork_step, state_layers=self._state_layers), donate_argnames=("kv_cache",),
                             out_shardings=kv_shardings)

    def _drop_traces(self) -> None:
        """After compiles whose executables went to the executable cache (so none is the plain jit's own): new jit
        objects, so JAX frees the old ones' traces and lowerings. Later misses trace again, as they would anyway."""
        if self.executables.directory is not None and self.executables.misses:
            self._make_jits()

    def _put(self, x):
        return put(x, self._input_sharding)

    def transfer(self, transfers: KVTransfers) -> list[int]:
        """Launch one schedule's copies between the HBM and host tiers; call it before launching the step
        (the device runs them first: offloads read pages before the step overwrites them, restores fill
        pages before the step reads them). Returns the host slots whose bytes were dropped (the tier
        forgets them)."""
        self.kv_cache, dropped = self.host_pool.apply(self.kv_cache, transfers)
        return dropped

    def fork_executable(self, N: int) -> jax.stages.Compiled:
        key = ("fork", N)
        if (hit := self._compiled.get(key)) is None:
            hit = self._add_executable(key, self._fork, (self.kv_cache, jax.ShapeDtypeStruct((4, N), jnp.int32)))
        return hit

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """Launch a schedule's fork copies (scheduler.py: a forked sample's partial page and state slot); call
        it before launching the step, which reads them."""
        for c in range(0, max(len(pages), len(slots)), FORK_CHUNK):
            p, sl = pages[c:c + FORK_CHUNK], slots[c:c + FORK_CHUNK]
            pairs = np.zeros((4, 1 << (max(len(p), len(sl)) - 1).bit_length()), np.int32)  # padding: 0 -> 0
            pairs[:2, :len(p)] = np.asarray(p, np.int32).reshape(-1, 2).T
            pairs[2:, :len(sl)] = np.asarray(sl, np.int32).reshape(-1, 2).T
            self.kv_cache = self.fork_executable(pairs.shape[1])(self.kv_cache, self._put(pairs))

    def batch_rows(self, out: SchedulerOutput) -> int:
        """B, the padded number of sequences of the step `out` (build_batch's)."""
        return self.seqs_bucket(pick(self.ready_tokens, out.num_scheduled_tokens))

    def seqs_bucket(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_seqs_bucket)

    # ---- host-side batch building ---------------------------------------------------------------

    def build_batch(self, out: SchedulerOutput, prev: Launched | None = None) -> tuple[Batch, np.ndarray]:
        """Pad the scheduled sequences into one Batch (numpy) and the [T] rows of `prev`'s samples to
        take as input ids (-1: the id in the batch)."""
        T = pick(self.ready_tokens, out.num_scheduled_tokens)
        B = self.seqs_bucket(T)
        if len(out.scheduled) > B:
            raise ValueError(f"{len(out.scheduled)} sequences exceed the bucket of {B}")
        P = pick(self.page_buckets, max(len(s.page_ids) for s in out.scheduled))
        ps, n_seqs = self.page_size, len(out.scheduled)
        counts = np.fromiter((s.num_new_tokens for s in out.scheduled), np.int32, n_seqs)
        starts = np.fromiter((s.start for s in out.scheduled), np.int32, n_seqs)
        total = int(counts.sum())
        query_start = np.full(B + 1, total, np.int32)
        query_start[0] = 0
        np.cumsum(counts, out=query_start[1:n_seqs + 1])
        page_table = np.full((B, P), NULL_PAGE, np.int32)
        for b, s in enumerate(out.scheduled):
            page_table[b, :len(s.page_ids)] = s.page_ids
        seq_of_token = np.repeat(np.arange(n_seqs, dtype=np.int32), counts)  # [total]
        pos = starts[seq_of_token] + np.arange(total, dtype=np.int32) - query_start[seq_of_token]
        input_ids = np.zeros(T, np.int32)
        prev_index = np.full(T, -1, np.int32)
        ids = []
        for b, s in enumerate(out.scheduled):
            if s.input_from_device:  # a one-token decode of the token `prev` is sampling
                prev_index[query_start[b]] = prev.row_of[s.request_id]
                ids.append(0)
            elif s.num_new_tokens == 1:
                ids.append(s.request.all_token_ids[s.start])
            else:
                ids.extend(s.token_ids)
        input_ids[:total] = ids
        positions = np.zeros(T, np.int32)
        positions[:total] = pos
        slots = np.full(T, -1, np.int32)
        slots[:total] = page_table[seq_of_token, pos // ps] * ps + pos % ps
        seq_lens = np.zeros(B, np.int32)
        seq_lens[:n_seqs] = starts + counts
        logits_idx = np.zeros(B, np.int32)
        logits_idx[:n_seqs] = query_start[1:n_seqs + 1] - 1
        state_slots = np.zeros(B, np.int32)  # padding sequences: the reserved slot 0
        state_slots[:n_seqs] = [s.request.state_slot for s in out.scheduled]
        return (Batch(input_ids, positions, slots, query_start, seq_lens, page_table, logits_idx, state_slots),
                prev_index)

    def sampling_tensors(self, rows: list[StepRow | None], B: int, token_mask: np.ndarray | None = None
                         ) -> SamplingTensors:
        """Rows align with the batch's sequences; None (a prefill chunk that samples nothing) is padding.
        `token_mask`: [<= B, ceil(V/32)] 32-bit grammar masks (structured outputs), or None when no row has one."""
        dense = [(r.params, r.output_ids, r.prompt, r.step) if r else ({"temperature": 0.0}, [], None, None)
                 for r in rows]
        st = SamplingTensors.from_params(dense, self.cfg.vocab_size, num_seqs=B,
                                         min_tokens_ids=[r.min_tokens_ids if r else () for r in rows])
        for b, r in enumerate(rows):
            if r is not None:
                st.seeds[b] = r.seed % 2**32
        if token_mask is not None:  # rows past the scheduled ones (padding) allow everything
            G = mask_words(self.cfg.vocab_size)
            if token_mask.shape[1] != G:
                raise ValueError(f"token_mask of shape {token_mask.shape} for {B} rows of {self.cfg.vocab_size} tokens")
            # Sized by `batch_rows` before the step's batch was built: a bucket loaded in between (background
            # warm-up or reload) can make B smaller; the rows past len(rows) <= B are padding either way.
            token_mask = token_mask[:B]
            if token_mask.shape[0] < B:
                token_mask = np.concatenate([token_mask, np.full((B - len(token_mask), G), -1, token_mask.dtype)])
            st.token_mask = token_mask.view(np.uint32)
        return st

    # ---- executables ------------------------------------------------------------------------------

    def _add_executable(self, key: tuple, jitted, args: tuple, background: bool = False,
                        **static) -> jax.stages.Compiled:
        """A shape seen for the first time: load it from the executable cache or compile it (with no
        cache directory and not `background`, the plain jit, which compiles on its first call); kept under
        `key`. `background`: the staged warm-up's thread, whose compiles are not stalls."""
        if self.warmed_up and not background:
            self.compiles_after_warmup += 1
            log.warning("compiling %s after warm-up", key)
        self._compiled[key] = (partial(jitted, **static) if self.executables.directory is None and not background
                               else self.executables.compile(key[0], jitted, *args, **static))
        return self._compiled[key]

    def forward_executable(self, T: int, B: int, P: int, decode: bool = False,
                           prompt_logits: bool = False, background: bool = False) -> jax.stages.Compiled:
        """`prompt_logits`: the variant that also returns the logits of every token (B + T rows), for steps
        with prompt logprobs; compiled on first use, not at warm-up."""
        key = ("forward_decode" if decode else "forward_prompt_logits" if prompt_logits else "forward", T, B, P)
        if (hit := self._compiled.get(key)) is not None:  # the per-step path
            return hit
        if decode and T not in self.decode_buckets:
            raise ValueError(f"no decode-only executable for T={T} (decode buckets: {sorted(self.decode_buckets)})")
        # XLA command buffers only for small steps (see COMMAND_BUFFER_MAX_TOKENS).
        jitted = self._forward[decode][T > COMMAND_BUFFER_MAX_TOKENS]
        dims = (T, B, P, B + T) if prompt_logits else (T, B, P)
        buf = jax.ShapeDtypeStruct((sum(_batch_sizes(*dims)),), jnp.int32)
        return self._add_executable(key, jitted, (self.weights, buf, self.kv_cache, self._no_prev), background,
                                    dims=dims)

    def prompt_logprobs_executable(self, T: int, B: int, k: int) -> jax.stages.Compiled:
        if (hit := self._compiled.get(("prompt_logprobs", T, B, k))) is not None:
            return hit
        logits = jax.ShapeDtypeStruct((B + T, self.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        targets = jax.ShapeDtypeStruct((T,), jnp.int32)
        return self._add_executable(("prompt_logprobs", T, B, k), self._prompt_logprobs, (logits, targets),
                                    num_seqs=B, k=k)

    def sampler_executable(self, B: int, M: int, W: int, num_logprobs: int, flags: SamplerFlags,
                           K: int = 0, background: bool = False) -> jax.stages.Compiled:
        key = _sampler_key(B, M, W, K, num_logprobs, flags)
        if (hit := self._compiled.get(key)) is not None:
            return hit
        logits = jax.ShapeDtypeStruct((B, self.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        G = mask_words(self.cfg.vocab_size) if flags.grammar else 0
        buf = jax.ShapeDtypeStruct((B * (len(_FLOAT_FIELDS) + len(_INT_FIELDS) + M + W + 2 * K + G),), jnp.int32)
        return self._add_executable(key, self._sample,
                                    (logits, buf, self._no_prev), background, dims=(B, M, W, K),
                                    num_logprobs=num_logprobs, flags=flags)

    # ---- device step ------------------------------------------------------------------------------

    def launch(self, out: SchedulerOutput, rows: list[StepRow | None], num_logprobs: int,
               prev: Launched | None = None, prompt_logprobs: tuple[int, list[bool]] | None = None,
               token_mask: np.ndarray | None = None, pending_outputs: bool = True) -> Launched:
        """Dispatch the step (forward + sampler) and return without waiting for the device. `prev`: the
        step launched before, still in flight, whose samples feed this step's `input_from_device` rows.
        `prompt_logprobs` = (k, wants): the scheduled sequences (wants[b]) whose prompt positions in this
        step get their prompt token's logprob and top k (`Launched.prompt_rows`). `token_mask`: the rows'
        grammar masks (`sampling_tensors`). `pending_outputs` False: `prev` was read back already, so the
        rows' output ids hold its tokens (no device-side markers for penalties)."""
        batch, prev_index, decode = self._step_batch(out, prev)
        T, B, P = batch.num_tokens, batch.num_seqs, batch.page_table.shape[1]
        plp_k, targets, prompt_rows = -1, None, []
        if prompt_logprobs is not None:
            indices, targets, prompt_rows = self._prompt_positions(out, batch, prompt_logprobs[1])
            if prompt_rows:
                plp_k = prompt_logprobs[0]
                batch.logits_indices = np.concatenate([batch.logits_indices, indices])
        if pending_outputs:
            rows = [_with_pending_output(r, s, prev) for r, s in zip(rows, out.scheduled, strict=True)]
        packed_batch = pack_batch(batch, prev_index)
        plp_targets = targets if plp_k >= 0 else None
        # One process: the forward goes first, and the host builds the sampler's inputs while the device runs
        # it (a lone step's first token waited for both: 0.3-0.5 ms at batch 1). A group sends whole steps.
        forward = None if self.on_launch is not None else self.run_forward(T, B, P, decode, packed_batch, plp_k,
                                                                          plp_targets)
        st = self.sampling_tensors(rows, B, token_mask)
        step = StepInputs(T, B, P, decode, st.output_tokens.shape[1], st.prompt_mask.shape[1], num_logprobs,
                          astuple(SamplerFlags.of(st)), packed_batch, pack_sampling(st),
                          K=st.bias_ids.shape[1], plp_k=plp_k, plp_targets=plp_targets)
        if self.on_launch is not None:  # the other processes of a multi-process group launch it too
            self.on_launch(step)
        packed, tokens, prompt_packed = self.run_step(step, forward)
        packed.copy_to_host_async()
        if prompt_packed is not None:
            prompt_packed.copy_to_host_async()
        return Launched(out, packed, tokens, _sample_rows(out), prompt_packed, prompt_rows)

    def _step_batch(self, out: SchedulerOutput, prev: Launched | None) -> tuple[Batch, np.ndarray, bool]:
        """The step's batch (`build_batch`) and whether it is decode-only (every sequence one new token:
        the decode executables, where that bucket has them)."""
        if prev is None and any(s.input_from_device for s in out.scheduled):
            raise ValueError("decodes of pending tokens need the previous step")
        batch, prev_index = self.build_batch(out, prev)
        T, n = batch.num_tokens, out.num_scheduled_tokens
        decode_only = n == len(out.scheduled)
        decode = T in self.ready_decode and decode_only
        if self.keep_alive:  # (idle unloading's bookkeeping)
            if self._unloaded:
                self._want_unloaded(n, decode_only)
            self._last_used[(T, decode)] = time.monotonic()
        return batch, prev_index, decode

    def _want_unloaded(self, n: int, decode_only: bool) -> None:
        """Load again the unloaded buckets a step of n tokens wanted: its own, and every larger one when the step
        filled the scheduler's budget (the budget is the largest ready bucket: the scheduler wanted more)."""
        T = pick(self.token_buckets, n)
        self._want(T, False)
        if decode_only and T in self.decode_buckets:
            self._want(T, True)
        if n >= self.ready_limits()[0]:
            for U in self.token_buckets:
                if U > T:
                    self._want(U, False)

    @staticmethod
    def _prompt_positions(out: SchedulerOutput, batch: Batch, wants: list[bool]
                          ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]]]:
        """For the wanted sequences, the tokens of this step at prompt positions p < prompt length - 1 (their
        logits score prompt token p + 1): flat token indices and target ids, each padded to T, and the rows'
        (request id, p + 1)."""
        T = batch.num_tokens
        indices, targets = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        rows = []
        for b, s in enumerate(out.scheduled):
            if not wants[b]:
                continue
            r = s.request
            end = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
            for p in range(s.start, end):
                indices[len(rows)] = batch.query_start[b] + p - s.start
                targets[len(rows)] = r.prompt_token_ids[p + 1]
                rows.append((s.request_id, p + 1))
        return indices, targets, rows

    # ---- structured outputs: the forward first, the sampler once the host has the grammar masks ----------

    def launch_forward(self, out: SchedulerOutput, prev: Launched | None) -> ForwardLaunched:
        """Dispatch the step's forward only (one process: a group's other processes replay whole steps).
        The host then reads `prev` back, advances the grammars and computes this step's masks while the
        device runs the forward; `launch_sample` queues the sampler behind it (prompt logprobs: `launch`)."""
        if self.on_launch is not None:
            raise RuntimeError("a multi-process group launches whole steps (launch)")
        batch, prev_index, decode = self._step_batch(out, prev)
        T, B, P = batch.num_tokens, batch.num_seqs, batch.page_table.shape[1]
        logits, _ = self.run_forward(T, B, P, decode, pack_batch(batch, prev_index))
        return ForwardLaunched(out, logits, B)

    def launch_sample(self, fwd: ForwardLaunched, rows: list[StepRow | None], num_logprobs: int,
                      token_mask: np.ndarray | None) -> Launched:
        """Dispatch the sampler of a step whose forward `launch_forward` dispatched. The step before it has
        been read back, so the rows' output ids are complete."""
        st = self.sampling_tensors(rows, fwd.B, token_mask)
        sample = self.sampler_executable(fwd.B, st.output_tokens.shape[1], st.prompt_mask.shape[1], num_logprobs,
                                         SamplerFlags.of(st), st.bias_ids.shape[1])
        packed, tokens = sample(fwd.logits, self._put(pack_sampling(st)), self._last_tokens)
        self._last_tokens = tokens
        packed.copy_to_host_async()
        return Launched(fwd.out, packed, tokens, _sample_rows(fwd.out))

    def run_step(self, step: StepInputs, forward: tuple[jax.Array, jax.Array | None] | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Launch one step's executables on its packed inputs: (packed samples, sampled ids, packed prompt
        logprobs or None). The decodes of pending tokens read the latest sampler output, the step launched
        just before this one. `forward`: what `run_forward` returned for this step, if it was launched already."""
        if forward is None:
            forward = self.run_forward(step.T, step.B, step.P, step.decode, step.batch, step.plp_k, step.plp_targets)
        logits, prompt_packed = forward
        sample = self.sampler_executable(step.B, step.M, step.W, step.num_logprobs, SamplerFlags(*step.flags),
                                         step.K)
        packed, tokens = sample(logits, self._put(step.sampling), self._last_tokens)
        self._last_tokens = tokens
        return packed, tokens, prompt_packed

    def run_forward(self, T: int, B: int, P: int, decode: bool, batch: np.ndarray, plp_k: int = -1,
                    plp_targets: np.ndarray | None = None) -> tuple[jax.Array, jax.Array | None]:
        """Launch a step's forward (and its prompt logprobs, plp_k >= 0) on the packed batch: (the logits the
        sampler takes, the packed prompt logprobs or None)."""
        prompt_logits = plp_k >= 0
        forward = self.forward_executable(T, B, P, decode and not prompt_logits, prompt_logits)
        logits, self.kv_cache = forward(self.weights, self._put(batch), self.kv_cache, self._last_tokens)
        prompt_packed = None
        if prompt_logits:  # the logits of the prompt positions: their logprobs, before the sampler
            split = self.prompt_logprobs_executable(T, B, plp_k)
            logits, prompt_packed = split(logits, self._put(plp_targets))
        return logits, prompt_packed

    def fetch(self, launched: Launched) -> StepResult:
        """Wait for a launched step and return its samples on the host."""
        return unpack_result(np.asarray(launched.packed))

    def fetch_prompt_logprobs(self, launched: Launched) -> PromptLogprobs | None:
        if launched.prompt_packed is None:
            return None
        return unpack_prompt_logprobs(np.asarray(launched.prompt_packed), len(launched.prompt_rows))

    def warmup(self, first_tokens: int | None = None, background: bool = True) -> float:
        """Compile (or load) every forward bucket, and the warm sampler variants per sequence bucket.

        `first_tokens` (a staged warm-up, for a server to be ready sooner): only T = 1 and the bucket of
        `first_tokens` tokens now; the other buckets, smallest first, then the decode-only variants, in a
        background thread (`background`; else `start_background()` later). Until a bucket is ready a step
        is padded into a larger ready one (`ready_tokens`) and the scheduler stays within the largest
        (`ready_limits`), so no step waits for a compile.
        """
        t0 = time.perf_counter()
        run = self.executables.directory is None  # plain jit compiles on its first call: make that call
        now = self.token_buckets
        if first_tokens is not None:
            cut = pick(self.token_buckets, min(max(first_tokens, 1), self.token_buckets[-1]))
            now = tuple(T for T in self.token_buckets if T in (1, cut))
        shapes = [(T, self.seqs_bucket(T), P, decode) for T in now for P in self.page_buckets
                  for decode in ((False, True) if T in self.decode_buckets and first_tokens is None else (False,))]
        if not run:  # load (or trace + compile) everything in parallel: loads and XLA compiles release the GIL
            jobs = [partial(self.forward_executable, *shape) for shape in shapes]
            jobs += [partial(self.sampler_executable, B, 0, 0, -1, flags)
                     for B in sorted({shape[1] for shape in shapes}) for flags in SamplerFlags.warm()]
            jobs += [partial(self.fork_executable, N) for N in self._fork_sizes]
            with ThreadPoolExecutor(max_workers=WARMUP_THREADS) as pool:
                for _ in pool.map(lambda job: job(), jobs):  # re-raises a job's exception
                    pass
        for T in now:
            B = self.seqs_bucket(T)
            for _, _, P, decode in (shape for shape in shapes if shape[0] == T):
                forward = self.forward_executable(T, B, P, decode)
                if run:
                    buf = np.zeros(sum(_batch_sizes(T, B, P)), np.int32)
                    buf[2 * T:4 * T] = -1  # slots and prev rows (parts 3, 4): no KV writes, no previous step
                    logits, self.kv_cache = forward(self.weights, self._put(buf), self.kv_cache, self._last_tokens)
            for flags in SamplerFlags.warm():
                sample = self.sampler_executable(B, 0, 0, -1, flags)
                if run:
                    jax.block_until_ready(sample(logits, self._put(pack_sampling(self.sampling_tensors([None] * B,
                                                                                                       B))),
                                                 self._last_tokens))
        if self.host_pool is not None:  # the host tier's gathers and scatters, every chunk size
            self.kv_cache = self.host_pool.warmup(self.kv_cache)
        for N in self._fork_sizes:  # forked samples' copies (n > 1 on models with states), every chunk size
            self.kv_cache = self.fork_executable(N)(self.kv_cache, self._put(np.zeros((4, N), np.int32)))
        # A first sampler output, so the very first step passes the same kind of array as all others.
        B = self.seqs_bucket(now[0])
        sample = self.sampler_executable(B, 0, 0, -1, SamplerFlags.warm()[0])
        logits = put(np.zeros((B, self.cfg.vocab_size), np.float32), self._replicated)
        self._last_tokens = sample(logits, self._put(pack_sampling(self.sampling_tensors([None] * B, B))),
                                   self._last_tokens)[1]
        self.warmed_up = True
        if first_tokens is None:  # (a staged warm-up does this once its background compiles are done)
            self._drop_traces()
        _trim_host_heap()
        self.compile_seconds = time.perf_counter() - t0
        log.info("warm-up: %d forward shapes ready in %.1f s (executable cache: %d loaded, %d compiled)",
                 len(shapes), self.compile_seconds, self.executables.hits,
                 self.executables.misses)
        if first_tokens is not None:
            self._pinned = frozenset((T, False) for T in now)
            self.ready_tokens, self.ready_decode = now, frozenset()
            self._rest = [(T, False) for T in self.token_buckets if T not in now] \
                + [(T, True) for T in sorted(self.decode_buckets)]
            self._t0 = t0
            if background:
                self.start_background()
        return self.compile_seconds

    def start_background(self) -> None:
        """Compile the buckets a staged warm-up left, one at a time in a daemon thread; each becomes usable
        as soon as it is compiled (loads and XLA compiles release the GIL, so steps go on meanwhile)."""
        if self._background is not None or not getattr(self, "_rest", None):
            return

        def bucket(T: int, decode: bool) -> None:
            if self._stop_background.is_set():
                return
            B = self.seqs_bucket(T)
            for P in self.page_buckets:
                if self._stop_background.is_set():  # a bucket is several compiles: stop between them
                    return
                self.forward_executable(T, B, P, decode, background=True)
            if not decode:
                for flags in SamplerFlags.warm():
                    self.sampler_executable(B, 0, 0, -1, flags, background=True)
            self._make_ready(T, decode)

        def work():
            try:  # smallest buckets first, WARMUP_THREADS at a time (compiles release the GIL)
                if self.executables.misses == 0 and self.executables.directory is not None:
                    # A warm start (the first buckets all loaded from disk): the rest are loads too, one at a time
                    # in this thread. Loaded in 8 threads, their memory, once dropped as idle, stayed in those
                    # threads' malloc arenas: 120-140 MB of the idle engine's RSS (`executable_memory
                    # --engine-cycle`); this way ~10 MB, for full speed 5.4 s after launch instead of 3.7-4.5
                    # (Qwen3-4B on an H100; startup_qwen3-4b_h100.json). (Fewer arenas for the whole process,
                    # MALLOC_ARENA_MAX=2, did as well for memory but doubled a cold start's compile times.)
                    for job in self._rest:
                        bucket(*job)
                else:
                    with ThreadPoolExecutor(max_workers=WARMUP_THREADS, thread_name_prefix="jinfer-warmup") as pool:
                        for _ in pool.map(lambda job: bucket(*job), self._rest):
                            pass
                if self._stop_background.is_set():
                    return
                with self._ready_lock:  # the buckets loaded here count as used now: they unload together
                    done = time.monotonic()
                    for b in self._rest:
                        self._last_used[b] = max(self._last_used.get(b, done), done)
                self._drop_traces()
                _trim_host_heap()  # compile-time host memory back to the OS, as after a full warm-up
                self.background_seconds = time.perf_counter() - self._t0
                log.info("warm-up: all %d token buckets ready %.1f s after start-up began",
                         len(self.token_buckets), self.background_seconds)
            except Exception:  # the buckets compiled so far stay usable; the rest compile on first use
                log.exception("background warm-up failed")
                self.ready_tokens, self.ready_decode = self.token_buckets, self.decode_buckets

        self._background = threading.Thread(target=work, name="jinfer-warmup", daemon=True)
        self._background.start()

    def _make_ready(self, T: int, decode: bool) -> None:
        with self._ready_lock:
            self._unloaded.discard((T, decode))
            if decode:
                self.ready_decode = self.ready_decode | {T}
            else:
                self.ready_tokens = tuple(sorted({*self.ready_tokens, T}))
            self._last_used[(T, decode)] = time.monotonic()  # an unused bucket unloads keep_alive after this

    def warmup_pending(self) -> int:
        """Buckets a staged warm-up has not made ready yet (unloaded ones not counted)."""
        with self._ready_lock:
            return (len(self.token_buckets) - len(self.ready_tokens) + len(self.decode_buckets)
                    - len(self.ready_decode) - len(self._unloaded))

    def _warming(self) -> bool:
        return self._background is not None and self._background.is_alive()

    def unload_idle(self, now: float | None = None) -> int:
        """Drop the forward executables of every bucket (but the warm-up's first ones) that no step used for
        `keep_alive` seconds; returns how many buckets. Call it from the thread that launches steps, between
        steps (the engine loop does, while idle): a step picks its bucket from the ready ones."""
        if not self.keep_alive or not self._pinned or self._warming():  # (only after a staged warm-up)
            return 0
        now = time.monotonic() if now is None else now
        with self._ready_lock:
            idle = [b for b, t in self._last_used.items()
                    if b not in self._pinned and b not in self._unloaded and b not in self._loading
                    and now - t >= self.keep_alive]
            if not idle:
                return 0
            drop_tokens = {T for T, decode in idle if not decode}
            drop_decode = {T for T, decode in idle if decode}
            self.ready_tokens = tuple(T for T in self.ready_tokens if T not in drop_tokens)
            self.ready_decode = self.ready_decode - drop_decode
            self._unloaded.update(idle)
            for b in idle:
                self._demand.pop(b, None)
            # ... and the warm sampler variants of every sequence bucket no loaded bucket has any more
            kept = {self.seqs_bucket(T) for T in (*self.ready_tokens, *self.ready_decode)}
            kept |= {self.seqs_bucket(T) for T, _ in self._loading}
            samplers = {_sampler_key(self.seqs_bucket(T), 0, 0, 0, -1, flags) for T, _ in idle
                        for flags in SamplerFlags.warm()} - {_sampler_key(B, 0, 0, 0, -1, flags) for B in kept
                                                             for flags in SamplerFlags.warm()}
            for key in [k for k in list(self._compiled)  # (a snapshot: a reload may be adding keys)
                        if (k[0] in ("forward", "forward_decode") and (k[1], k[0] == "forward_decode") in idle)
                        or k in samplers]:
                del self._compiled[key]
        self.unloads += len(idle)
        _trim_host_heap()
        log.info("unloaded the executables of %d bucket(s) idle for %.0f s: %s", len(idle), self.keep_alive,
                 ", ".join(f"{T}{' decode' if d else ''}" for T, d in sorted(idle)))
        return len(idle)

    def _want(self, T: int, decode: bool) -> None:
        """A step wanted bucket T (decode-only or not) and it is unloaded: the RELOAD_AFTER_STEPS-th such step loads
        it again in the background (steps run padded into a ready bucket meanwhile)."""
        b = (T, decode)
        with self._ready_lock:
            if b not in self._unloaded or b in self._loading:
                return
            self._demand[b] = self._demand.get(b, 0) + 1
            if self._demand[b] < RELOAD_AFTER_STEPS:
                return
            del self._demand[b]
            self._loading.add(b)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jinfer-reload")  # one arena

        def load():
            try:
                B = self.seqs_bucket(T)
                for P in self.page_buckets:
                    self.forward_executable(T, B, P, decode, background=True)
                for flags in SamplerFlags.warm():  # (unloaded with the last bucket of B)
                    self.sampler_executable(B, 0, 0, -1, flags, background=True)
                self._make_ready(T, decode)
                self.reloads += 1
                log.info("loaded the executables of bucket %d%s again", T, " decode" if decode else "")
            except Exception:  # the step path goes on padded; a later step asks again
                log.exception("loading bucket %s again failed", b)
            finally:
                with self._ready_lock:
                    self._loading.discard(b)

        self._loader.submit(load)

    def wait_warmup(self, timeout: float | None = None) -> bool:
        """Wait for a staged warm-up's background compiles; True once every bucket is ready."""
        if self._background is not None:
            self._background.join(timeout)
        return self.ready_tokens == self.token_buckets and self.ready_decode == self.decode_buckets

    def stop_background(self) -> None:
        self._stop_background.set()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def ready_limits(self) -> tuple[int, int]:
        """(tokens, sequences) a step may hold now: the largest ready bucket and its sequence bucket."""
        T = self.ready_tokens[-1]
        return T, self.seqs_bucket(T)

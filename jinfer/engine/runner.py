"""Turns a scheduled batch into padded device arrays and launches one jitted forward + sampling step.

A step is two executables (forward, then sampler; `executables.py` holds them, one per shape bucket) fed by two
host-to-device copies: the batch description packed into one int32 buffer, the sampling parameters into another
(`step_inputs.py`; the batch is built by `batch_builder.py`). There is one launch path: `launch` builds the
step's `StepInputs` and `run_step` runs them, which is also what the other processes of a multi-process group do
with the inputs process 0 sends them. `launch` returns at once with device arrays (JAX dispatch is asynchronous)
and starts the copy of the results to the host; `fetch` waits for them. The sampled tokens also stay on the device
in a fixed-size buffer, from which the next step takes the inputs of its decodes
(`ScheduledRequest.input_from_device`), so the engine can launch step N+1 before it reads step N's tokens.
A sequence may return several logits rows (its last positions: the drafts it verifies); the sampler samples
each, and `StepResult.rows` says which rows are whose.

`warmup()` compiles (or loads, in parallel) every (T, P) forward, the decode forwards, and the sampler variants
of `SamplerFlags.warm()` for every B ahead of time. The KV cache is donated to every step: it is updated in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.cache.host_tier import KVTransfers
from jinfer.cache.layout import init_kv_cache, slot_layers
from jinfer.cache.manager import cdiv
from jinfer.cache.transfer import HostKVPool
from jinfer.config.model import ModelConfig
from jinfer.engine.batch_builder import BuiltBatch, StepRow, build_batch, prompt_positions, sampling_tensors
from jinfer.engine.device_step import FORK_CHUNK
from jinfer.engine.executable_cache import ExecutableCache
from jinfer.engine.executables import COMMAND_BUFFER_MAX_TOKENS, NO_COMMAND_BUFFER, StepExecutables, pick
from jinfer.engine.idle_unload import trim_host_heap
from jinfer.engine.sampling_inputs import SamplingInputs
from jinfer.engine.sampling_tensors import SamplerFlags
from jinfer.engine.scheduler import SchedulerOutput
from jinfer.engine.step_inputs import (
    PromptLogprobs,
    StepInputs,
    StepResult,
    batch_sizes,
    pack_batch,
    pack_sampling,
    packed_shape,
    pooled_result,
    unpack_prompt_logprobs,
    unpack_result,
)
from jinfer.models.base import Weights
from jinfer.models.batch import Batch
from jinfer.models.registry import cache_spec
from jinfer.ops import REFERENCE_OPS, ModelOps
from jinfer.parallel.mesh import RecycledBuffers, all_reduce_table, put

log = logging.getLogger(__name__)

__all__ = ["Launched", "ModelRunner", "PromptLogprobs", "StepResult", "StepRow"]


@dataclass
class Launched:
    """A step dispatched to the device whose results have not been read yet."""

    out: SchedulerOutput
    packed: jax.Array  # i32[R, 3 + 2N]: token, logprob bits, rank, top ids, top logprob bits
    tokens: jax.Array  # i32[ids_rows]: sampled ids, for the next step's inputs (a drafter's head donates it)
    rows: dict[str, tuple[int, int]]  # request id -> (first logits row, count), for sequences that sample
    # Prompt logprobs: i32[T, 2 + 2k] (target logprob bits, rank, top ids, top logprob bits), and for each of its
    # rows (request id, prompt position whose token it scores).
    prompt_packed: jax.Array | None = None
    prompt_rows: list[tuple[str, int]] = field(default_factory=list)
    batch: Batch | None = None  # the step's padded batch (numpy), for a drafter that runs after it (EAGLE-3)
    aux: jax.Array | None = None  # [T, n*H] the hidden states at the runner's `aux_layers` (None without)
    expert_load: jax.Array | None = None  # i32[MoE layers, E]: expert counts (`expert_load` runners; copy started)
    row_of: dict[str, int] = field(init=False)  # request id -> the row of its last sample (its next decode's input)

    def __post_init__(self):
        self.row_of = {rid: first + count - 1 for rid, (first, count) in self.rows.items()}


class ModelRunner(StepExecutables):
    def __init__(self, cfg: ModelConfig, weights: Weights, mesh: Mesh, *, num_pages: int, page_size: int,
                 kv_dtype, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 ops: ModelOps = REFERENCE_OPS, executable_dir: str | None = None, num_state_slots: int = 0,
                 num_host_pages: int = 0, keep_alive: float = 0.0, aux_layers: tuple[int, ...] = (), dtype=None,
                 kv_scales: dict | None = None, verify_query_len: int = 0, expert_load: bool = False):
        """`kv_dtype`: the KV pages'; `dtype` (default kv_dtype): the model's (state pools, a draft head's KV);
        `kv_scales`: an FP8 cache's checkpoint scales (`layout.init_kv_cache`). `aux_layers`: the forward also
        returns the hidden states at these layer boundaries (an EAGLE-3 head's: `Launched.aux`); part of the
        executables' key. `verify_query_len`: 1 + the drafts a drafter verifies per sequence and step (0: none), for
        the verify steps' executables (`executables.py`). `expert_load`: the forward also returns the MoE layers'
        expert counts (`Launched.expert_load`, read back with the step: jinfer/engine/expert_load.py)."""
        self.cfg, self.weights, self.mesh, self.ops = cfg, weights, mesh, ops
        # the forward takes the weights as flat leaves (device_step.forward_step's `weights_tree`)
        self.weight_leaves, self._weights_tree = jax.tree.flatten(weights)
        self.weight_leaves = tuple(self.weight_leaves)
        self.aux_layers, self._aux = tuple(aux_layers), None
        self.expert_load, self._load = bool(expert_load), None
        self.page_size = page_size
        self.dtype = kv_dtype if dtype is None else dtype
        self.kv_cache = init_kv_cache(cfg, num_pages, page_size, self.dtype, mesh, num_state_slots, kv_dtype,
                                      kv_scales)
        # The host tier's pages (cache/transfer.py): `transfer` launches a schedule's copies before its step.
        self.host_pool = HostKVPool(self.kv_cache, num_host_pages) if num_host_pages else None
        self._init_registry(max_num_batched_tokens, max_num_seqs, cdiv(max_model_len, page_size),
                            keep_alive if executable_dir else 0.0, verify_query_len)
        # Every output's sharding is pinned to the very object its next consumer was first called
        # with (the KV pool's own shardings, one replicated sharding for logits and tokens). JAX keys
        # its C++ dispatch cache on argument shardings by equality, and shardings XLA infers (e.g.
        # replicated) differ from the pool's logical ones even on one device: each new combination
        # took the Python path once more (~30 ms, measured as a slow first prefill after warm-up).
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._slot_layers = slot_layers(cache_spec(cfg))
        self._fork_sizes = [1 << b for b in range(FORK_CHUNK.bit_length())] if self._slot_layers else []
        self._all_reduce_table = all_reduce_table(mesh, ops)
        # with a drafter, the forward moves rows that follow a verification in flight (device_step.shift_rows)
        self.shift_page_size = page_size if verify_query_len > 1 else 0
        # what a sharded step reduces with: our one-shot kernels (over CUDA IPC across processes) or XLA's collectives
        self.collectives = None if mesh.size == 1 else "xla" if not self._all_reduce_table else (
            "one_shot_ipc" if jax.process_count() > 1 else "one_shot")
        self._make_jits()
        self._prev_spec = jax.ShapeDtypeStruct((self.ids_rows,), jnp.int32, sharding=self._replicated)
        # Stable step buffers. A small step's executable runs as one XLA command buffer (a CUDA graph), which XLA
        # updates (every kernel node again: ~1.1 ms of host a step for Qwen3-8B on an H200, as long as its launch)
        # whenever one of its buffers moved since the last call. So every buffer a small step reads or writes keeps
        # its address: the KV cache and the sampled tokens are donated and written in place, the logits are written
        # into the buffer of the previous logits of their shape (donated), and the packed inputs are copied into a
        # staging buffer per size (`_stage`, donated) before the forward reads them.
        self._logits_out: dict[int, jax.Array] = {}
        self._aux_out: dict[int, jax.Array] = {}  # (the hidden states of `aux_layers` by T, as the logits by rows)
        # The sampler's packed samples are written into a donated buffer of their shape, one a fetched step gave back
        # (`fetch`): a new small array each step, alive until its read-back, had landed where the forward's temp
        # buffer had been, moving the next temp (the CUDA pool) and re-recording the forward's command buffer.
        self._packed = RecycledBuffers(self._replicated)
        self._placeholder = put(np.zeros(1, np.float32), self._replicated)  # large steps' logits_out (not donated)
        self._staged: dict[int, jax.Array] = {}
        self._staged_sampling: dict[int, jax.Array] = {}  # the sampler's inputs, by size (`run_step`, `launch`)
        # (no command buffer: its upload moves every call, and re-recording one took ~0.35 ms of host a call)
        self._stage = jax.jit(lambda dst, src: jax.lax.dynamic_update_slice(dst, src, (0,)), donate_argnums=0,
                              out_shardings=self._replicated, compiler_options=NO_COMMAND_BUFFER)
        # Compiled executables per shape, loaded from / stored to disk when `executable_dir` is set: a
        # warm start then neither traces nor lowers (see executable_cache.py).
        self.executables = ExecutableCache(executable_dir, namespace=repr(
            (cfg, ops, mesh.shape, self.max_seqs_bucket) + ((self.aux_layers,) if self.aux_layers else ())
            + (("expert_load",) if self.expert_load else ()) + (("shift",) if self.shift_page_size else ())))
        # The forward's `prev_tokens` argument is always the latest sampler output (even when no row
        # reads it), so every call of an executable sees arguments of identical type and sharding and
        # stays on JAX's C++ fast path (see above).
        self._last_tokens = put(np.zeros(self.ids_rows, np.int32), self._replicated)
        # Host inputs go to the devices uncommitted (the executable places them) in one process; over
        # several processes each one puts its (identical) copy on its own devices of the mesh.
        self._input_sharding = self._replicated if jax.process_count() > 1 else None
        self.on_launch = None  # process 0 of a group: called with each step's StepInputs before launching
        self.sampling = SamplingInputs(cfg.vocab_size)  # each step's sampler inputs (rows kept across steps)
        self.forward_at = 0.0  # perf_counter() when the last step's forward was dispatched (EngineCore's host timing)

    def _put(self, x):
        # One process: the host array goes to the executable as it is, which copies it over in its C++ dispatch path
        # (jax.device_put first took ~0.1 ms of Python per buffer, twice per step)
        return x if self._input_sharding is None else put(x, self._input_sharding)

    # ---- copies ahead of a step: the host tier, forks ---------------------------------------------------------

    def transfer(self, transfers: KVTransfers) -> list[int]:
        """Launch one schedule's copies between the HBM and host tiers; call it before launching the step
        (the device runs them first: offloads read pages before the step overwrites them, restores fill
        pages before the step reads them). Returns the host slots whose bytes were dropped (the tier
        forgets them)."""
        self.kv_cache, dropped = self.host_pool.apply(self.kv_cache, transfers)
        return dropped

    @property
    def host_page_bytes(self) -> int:
        """Bytes of one page in the host tier (over all devices); 0 without one."""
        return self.host_pool.page_bytes if self.host_pool is not None else 0

    def host_tier_hold(self) -> None:
        """The engine runs requests: the host tier's copies to host memory wait for their turn after read-backs."""
        if self.host_pool is not None:
            self.host_pool.hold()

    def host_tier_read_back(self) -> None:
        """A step was read back: host-tier copies may go out until the next read-back is due."""
        if self.host_pool is not None:
            self.host_pool.read_back()

    def host_tier_release(self) -> None:
        """The engine is idle: the host tier copies everything waiting."""
        if self.host_pool is not None:
            self.host_pool.release()

    def host_tier_join(self) -> None:
        """Wait for the host tier's threads (they hold XLA buffers) before the interpreter exits."""
        if self.host_pool is not None:
            self.host_pool.join()

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """Launch a schedule's fork copies (scheduler.py: a forked sample's partial page and state slot); call
        it before launching the step, which reads them."""
        for c in range(0, max(len(pages), len(slots)), FORK_CHUNK):
            p, sl = pages[c:c + FORK_CHUNK], slots[c:c + FORK_CHUNK]
            pairs = np.zeros((4, 1 << (max(len(p), len(sl)) - 1).bit_length()), np.int32)  # padding: 0 -> 0
            pairs[:2, :len(p)] = np.asarray(p, np.int32).reshape(-1, 2).T
            pairs[2:, :len(sl)] = np.asarray(sl, np.int32).reshape(-1, 2).T
            self.kv_cache = self.fork_executable(pairs.shape[1])(self.kv_cache, self._put(pairs))

    # ---- the step -----------------------------------------------------------------------------------------------

    def batch_rows(self, out: SchedulerOutput) -> int:
        """B, the padded number of sequences of the step `out` (grammar masks are sized by it, one per sequence)."""
        return self.seqs_bucket(pick(self.ready_tokens, out.num_scheduled_tokens))

    def build_batch(self, out: SchedulerOutput, prev: Launched | None = None) -> BuiltBatch:
        """Pad the scheduled sequences into the smallest ready buckets (`batch_builder.build_batch`)."""
        T = pick(self.ready_tokens, out.num_scheduled_tokens)
        P = pick(self.page_buckets, max(len(s.page_ids) for s in out.scheduled))
        return build_batch(out, prev.row_of if prev is not None else None, T, self.seqs_bucket(T), P, self.page_size)

    def launch(self, out: SchedulerOutput, rows: list[StepRow | None], num_logprobs: int,
               prev: Launched | None = None, prompt_logprobs: tuple[int, list[bool]] | None = None,
               token_mask: np.ndarray | Callable[[], np.ndarray] | None = None,
               pending_outputs: bool = True, prepare: Callable | None = None) -> Launched:
        """Dispatch the step (forward + sampler) and return without waiting for the device.

        `rows`: each scheduled sequence's sampling inputs (None: it samples nothing). `prev`: the step launched
        before, still in flight, whose samples feed this step's `input_from_device` rows. `prompt_logprobs` =
        (k, wants): the scheduled sequences (wants[b]) whose prompt positions in this step get their prompt
        token's logprob and top k (`Launched.prompt_rows`). `token_mask`: the sequences' grammar masks
        (`batch_builder.sampling_tensors`), or a function returning them that is called once the forward is
        dispatched (one process; a group calls it first), so the host computes them (and may read `prev` back)
        while the device runs the forward. `pending_outputs` False: the rows' output ids hold `prev`'s tokens by
        the time the sampler's inputs are built (no device-side markers for penalties). `prepare(out, built)`
        (speculative decoding): called once the batch is built, before anything of the step is dispatched; what it
        returns, if not None, is called with the `Launched` step (a model drafter launches its head behind the step:
        jinfer/spec/eagle.py).

        The sampler's inputs are staged as the batch (`stage`), and in speculative decoding's steps before the forward:
        uploaded after it, they stayed alive until the sampler ran and were freed late, where the next step's first
        inputs could not take their place, and the next forward's temp buffer moved every other step (its command
        buffer re-recorded: ~1.7 ms a Qwen3-8B verify step)."""
        # One process: the forward goes first, and the host builds the sampler's inputs while the device runs it
        # (a lone step's first token waited for both: 0.3-0.5 ms at batch 1). A group sends whole steps.
        group = self.on_launch is not None
        if group and callable(token_mask):
            token_mask = token_mask()
        if prev is None and any(s.input_from_device for s in out.scheduled):
            raise ValueError("decodes of pending tokens need the previous step")
        built = self.build_batch(out, prev)
        then = prepare(out, built) if prepare is not None else None
        batch = built.batch
        T, B, P, R = batch.num_tokens, batch.num_seqs, batch.page_table.shape[1], built.R
        # The forward's kind: decode-only steps take the paged decode kernel, and so do verify steps (every sequence at
        # most Q new tokens: 1 + its drafts, or a short prompt) where the engine verifies drafts
        Q = self.verify_len
        kind = 1 if out.num_scheduled_tokens == len(out.scheduled) else Q if Q and built.max_query_len <= Q else 0
        decode = kind if kind and T in self.ready_kind(kind) else 0
        self._note_use(T, decode, out.num_scheduled_tokens, kind)
        plp_k, plp_targets, prompt_rows = -1, None, []
        if prompt_logprobs is not None:
            indices, targets, prompt_rows = prompt_positions(out, batch, prompt_logprobs[1])
            if prompt_rows:
                plp_k, plp_targets = prompt_logprobs[0], targets
                batch.logits_indices = np.concatenate([batch.logits_indices, indices])
        packed_batch = built.packed  # (small steps come packed; prompt logprobs' rows change the batch)
        if packed_batch is None or prompt_rows:
            packed_batch = pack_batch(batch, built.prev_index, built.shift_from)

        def sampler_inputs():
            mask = token_mask() if callable(token_mask) else token_mask
            return self.sampling.build(rows, out, built.counts, R, mask,
                                       prev.row_of if pending_outputs and prev is not None else None, built.shift_from)

        sampling = staged = None
        if prepare is not None and not group and not callable(token_mask) and not self.cfg.pooling:
            sampling = sampler_inputs()
            staged = self.stage(self._staged_sampling, sampling.buffer)
        self.forward_at = time.perf_counter()
        forward = None if group else self.run_forward(T, B, P, decode, packed_batch, plp_k, plp_targets, R)
        if self.cfg.pooling:  # an embedding model: the forward's rows are the pooled vectors, nothing is sampled
            for a in (forward[0], self._load):
                if a is not None:
                    a.copy_to_host_async()
            return Launched(out, forward[0], self._last_tokens, built.rows, batch=batch, expert_load=self._load)
        if sampling is None:
            sampling = sampler_inputs()
        step = StepInputs(T, B, P, decode, sampling.M, sampling.W, num_logprobs, sampling.flags, packed_batch,
                          sampling.buffer, K=sampling.K, plp_k=plp_k, plp_targets=plp_targets, R=R)
        if group:  # the other processes of a multi-process group launch it too
            self.on_launch(step)
        packed, tokens, prompt_packed = self.run_step(step, forward, staged)
        packed.copy_to_host_async()
        for extra in (prompt_packed, self._load):
            if extra is not None:
                extra.copy_to_host_async()
        launched = Launched(out, packed, tokens, built.rows, prompt_packed, prompt_rows, batch, self._aux, self._load)
        if then is not None:
            then(launched)
        return launched

    def run_step(self, step: StepInputs, forward: tuple[jax.Array, jax.Array | None] | None = None,
                 sampling: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Launch one step's executables on its packed inputs: (packed samples, sampled ids, packed prompt
        logprobs or None). The decodes of pending tokens read the latest sampler output, the step launched
        just before this one. `forward`: what `run_forward` returned for this step, if it was launched already;
        `sampling`: the step's sampling inputs staged on the devices already (`launch`)."""
        if forward is None:
            forward = self.run_forward(step.T, step.B, step.P, step.decode, step.batch, step.plp_k, step.plp_targets,
                                       step.R)
        logits, prompt_packed = forward
        sample = self.sampler_executable(step.R, step.M, step.W, step.num_logprobs, SamplerFlags(*step.flags),
                                         step.K)
        if sampling is None:  # (staged as the batch: the sampler's inputs keep their address)
            sampling = self.stage(self._staged_sampling, step.sampling)
        packed, tokens = sample(logits, sampling, self._last_tokens,
                                self._packed_out(step.R, step.num_logprobs))
        self._last_tokens = tokens
        return packed, tokens, prompt_packed

    def run_forward(self, T: int, B: int, P: int, decode: int, batch: np.ndarray, plp_k: int = -1,
                    plp_targets: np.ndarray | None = None, R: int | None = None
                    ) -> tuple[jax.Array, jax.Array | None]:
        """Launch a step's forward of kind `decode` (0 any step, 1 decode-only, Q verify) (and its prompt logprobs,
        plp_k >= 0) on the packed batch: (the logits the sampler takes, [R, V], the packed prompt logprobs or None)."""
        R = B if R is None else R
        prompt_logits = plp_k >= 0
        forward = self.forward_executable(T, B, P, 0 if prompt_logits else decode, R, prompt_logits)
        logits = self._call_forward(forward, self._forward_input(batch, T), R + T if prompt_logits else R, T)
        prompt_packed = None
        if prompt_logits:  # the logits of the prompt positions: their logprobs, before the sampler
            split = self.prompt_logprobs_executable(T, R, plp_k)
            logits, prompt_packed = split(logits, self._put(plp_targets))
        return logits, prompt_packed

    def _warm_stage(self, size: int, sampling: bool = False) -> None:
        """The staging copy of a small step's packed batch (the sampler's inputs) of this size, compiled (with the
        forward or the sampler, maybe in a warm-up thread: it never takes a staging buffer out of the table, which a
        step may be about to read)."""
        table = self._staged_sampling if sampling else self._staged
        if size not in table:
            zeros = np.zeros(size, np.int32)
            table.setdefault(size, self._stage(put(zeros, self._replicated), self._put(zeros)))

    def _forward_input(self, batch: np.ndarray, T: int):
        """A step's packed batch as its forward takes it: for a small step (T tokens, one command buffer), in this
        size's staging buffer on the devices (`stage`); else as it is (`_put`)."""
        if T > COMMAND_BUFFER_MAX_TOKENS:
            return self._put(batch)
        return self.stage(self._staged, batch)

    def stage(self, table: dict[int, jax.Array], buf: np.ndarray) -> jax.Array:
        """int32 `buf` on the devices, copied into `table`'s staging buffer of its size (donated: its address never
        changes; the staging's own upload is freed as soon as the copy ran)."""
        dst = table.pop(buf.size, None)
        if dst is None:
            dst = put(np.zeros(buf.size, np.int32), self._replicated)
        table[buf.size] = staged = self._stage(dst, self._put(buf))
        return staged

    def _call_forward(self, forward, buf: jax.Array, rows: int, T: int) -> jax.Array:
        """Run a forward executable of T tokens on a packed batch: the cache is updated, the hidden states kept
        (`aux_layers`); returns the logits ([rows, V]), for a small step written into the previous logits' buffer of
        their shape, the hidden states into the previous ones' (`outputs_kept`)."""
        keep, specs = self.keeps_logits(T), self.outputs_kept(rows, T)
        kept = ((self._logits_out.pop(rows, None), self._aux_out.pop(T, None))[:len(specs)] if keep
                else (self._placeholder,) * len(specs))
        outs = tuple(put(np.zeros(shape, dtype), self._replicated) if out is None else out
                     for out, (shape, dtype) in zip(kept, specs))
        logits, self.kv_cache, *extra = forward(self.weight_leaves, buf, self.kv_cache, self._last_tokens, outs,
                                                *self._all_reduce_table)
        if keep:
            self._logits_out[rows] = logits
            if self.aux_layers:
                self._aux_out[T] = extra[0]
        self._aux = extra[0] if self.aux_layers else None
        self._load = extra[-1] if self.expert_load else None
        return logits

    def fetch(self, launched: Launched) -> StepResult:
        """Wait for a launched step and return its samples (an embedding model: its pooled rows) on the host; the
        samples' buffer goes back to the sampler's (`_packed_out`)."""
        if self.cfg.pooling:
            return pooled_result(np.asarray(launched.packed), launched.rows)
        packed = np.asarray(launched.packed)
        self.give_back_packed(launched.packed)
        return unpack_result(packed, launched.rows)

    def give_back_packed(self, packed: jax.Array) -> None:
        """A step's packed samples, read (or never to be read), become a buffer for a later sampler (`_packed_out`)."""
        self._packed.give_back(packed)

    def _packed_out(self, rows: int, num_logprobs: int) -> jax.Array:
        """A buffer for a sampler's packed samples (donated to it): one a fetched step gave back, else a new one."""
        return self._packed.take(packed_shape(rows, num_logprobs))

    def fetch_prompt_logprobs(self, launched: Launched) -> PromptLogprobs | None:
        if launched.prompt_packed is None:
            return None
        return unpack_prompt_logprobs(np.asarray(launched.prompt_packed), len(launched.prompt_rows))

    # ---- warm-up ------------------------------------------------------------------------------------------------

    def _sampling_buffer(self, B: int) -> jax.Array:
        return self.stage(self._staged_sampling, pack_sampling(sampling_tensors([None] * B, B, self.cfg.vocab_size)))

    def warmup(self, first_tokens: int | None = None, background: bool = True, compile_turn=None) -> float:
        """Compile (or load) every forward bucket (with a drafter, for as many logits rows as tokens too), and the warm
        sampler variants per sequence bucket (and per token bucket with a drafter).

        `first_tokens` (a staged warm-up, for a server to be ready sooner): only T = 1 and the bucket of
        `first_tokens` tokens now; the other buckets, smallest first, then the decode-only variants, in a
        background thread (`background`; else `start_background()` later). Until a bucket is ready a step
        is padded into a larger ready one (`ready_tokens`) and the scheduler stays within the largest
        (`ready_limits`), so no step waits for a compile.

        `compile_turn`: a multi-process group's member (jinfer/parallel/multihost.py), a context manager around its
        compiles ahead (`_precompile_all`): process 0 compiles first, the others after it (`GROUP_XLA_OPTIONS`).
        """
        t0 = time.perf_counter()
        run = not self.compiles_ahead  # plain jit compiles on its first call: make that call
        now = self.token_buckets
        if first_tokens is not None:
            cut = pick(self.token_buckets, min(max(first_tokens, 1), self.token_buckets[-1]))
            now = tuple(T for T in self.token_buckets if T in (1, cut))
        shapes = [(T, self.seqs_bucket(T), P, decode) for T in now for P in self.page_buckets
                  for decode in (self.kinds(T) if first_tokens is None else (0,))]
        if not run:
            self._load_all(shapes, self._fork_sizes)
        elif compile_turn is not None:
            with compile_turn:
                self._precompile_all(shapes, self._fork_sizes)
        for T in now:
            B = self.seqs_bucket(T)
            for _, _, P, decode in (shape for shape in shapes if shape[0] == T):
                for R in self.row_buckets(T, decode):
                    forward = self.forward_executable(T, B, P, decode, R)
                    if run:
                        buf = np.zeros(sum(batch_sizes(T, B, P, R)), np.int32)
                        buf[2 * T:4 * T] = -1  # slots and prev rows (parts 3, 4): no KV writes, no previous step
                        buf[4 * T + 5 * B + 1 + R:4 * T + 6 * B + 1 + R] = -1  # (shifts: no row moves)
                        self._call_forward(forward, self._forward_input(buf, T), R, T)
            for R in self.sampler_rows(T):
                logits = put(np.zeros((R, self.cfg.vocab_size), np.float32), self._replicated)
                for flags in self.warm_sampler_flags:
                    sample = self.sampler_executable(R, 0, 0, -1, flags)
                    if run:
                        self._last_tokens = sample(logits, self._sampling_buffer(R), self._last_tokens,
                                                   self._packed_out(R, -1))[1]
                        jax.block_until_ready(self._last_tokens)
        if self.host_pool is not None:  # the host tier's gathers and scatters, every chunk size
            self.kv_cache = self.host_pool.warmup(self.kv_cache)
        for N in self._fork_sizes:  # forked samples' copies (n > 1 on models with states), every chunk size
            self.kv_cache = self.fork_executable(N)(self.kv_cache, self._put(np.zeros((4, N), np.int32)))
        # A first sampler output, so the very first step passes the same kind of array as all others.
        if self.warm_sampler_flags:
            B = self.seqs_bucket(now[0])
            sample = self.sampler_executable(B, 0, 0, -1, SamplerFlags.warm()[0])
            logits = put(np.zeros((B, self.cfg.vocab_size), np.float32), self._replicated)
            self._last_tokens = sample(logits, self._sampling_buffer(B), self._last_tokens, self._packed_out(B, -1))[1]
        self.warmed_up = True
        if first_tokens is None:  # (a staged warm-up does this once its background compiles are done)
            self._drop_traces()
        trim_host_heap()
        self.compile_seconds = time.perf_counter() - t0
        log.info("warm-up: %d forward shapes ready in %.1f s (executable cache: %d loaded, %d compiled)",
                 len(shapes), self.compile_seconds, self.executables.hits, self.executables.misses)
        if first_tokens is not None:
            # Never unloaded: what the staged warm-up made ready first, and the smallest bucket above T = 1 (and its
            # decode-only variant): after an idle unload, small batches' decode steps would otherwise run padded into
            # the large first bucket until reloaded (on CPU the first request after idle decoded at 553 ms a token
            # against 78, SmolLM2).
            small = min((T for T in self.token_buckets if T > 1), default=now[0])
            self._pinned = frozenset([(T, 0) for T in now] + [(small, kind) for kind in self.kinds(small)])
            self.ready_tokens, self.ready_decode, self.ready_verify = now, frozenset(), frozenset()
            self._rest = [(T, 0) for T in self.token_buckets if T not in now]
            self._rest += [(T, 1) for T in sorted(self.decode_buckets)]
            self._rest += [(T, self.verify_len) for T in sorted(self.verify_buckets)]
            self._t0 = t0
            if background:
                self.start_background()
        return self.compile_seconds

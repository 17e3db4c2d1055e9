"""The step's compiled executables: one per shape bucket, loaded from the on-disk cache (`executable_cache.py`) or
compiled, made ready in the background during a staged warm-up, dropped when idle and loaded again on demand
(idle_unload.py).

Shapes come from a small fixed set of buckets so serving never stalls on a compile:
- T (tokens in the step): 1 (GPU only), then powers of two from `MIN_TOKENS` up to `max_num_batched_tokens`;
- B (sequences): min(T, the max_num_seqs bucket): a step never has more sequences than tokens;
- P (pages per sequence in the page table): powers of two up to the longest sequence allowed;
- R (logits rows the sampler takes): B, or T in steps whose sequences return more rows than B (drafts);
  for T up to the max_num_seqs bucket the two are the same.
With the Pallas kernels, a bucket with B = T (T > 1) has a second forward for decode-only steps (every
sequence one new token), whose attention is the paged decode kernel instead of the ragged one
(`ModelOps.decode_step`). An engine with a drafter (speculative decoding, k drafts) also has, for the buckets a
verify step can fill (T up to Q x the max_num_seqs bucket), a forward for steps whose sequences have at most Q = 1 + k
new tokens each: the paged decode kernel with Q query rows per sequence (`ModelOps.verify_query_len`; Q up to
`KernelPolicy.verify_max_query_len`). A forward's kind: 0 any step, 1 decode-only, Q verify.

`StepExecutables` is the registry part of `ModelRunner` (a base class: the engine, tests and benchmarks reach the
buckets, the ready sets and the executables through the runner).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp

from jinfer.engine.device_step import fork_step, forward_step, prompt_logprobs_step, sample_step
from jinfer.engine.idle_unload import IdleUnloading, trim_host_heap
from jinfer.engine.sampling_tensors import SamplerFlags, mask_words
from jinfer.engine.step_inputs import batch_sizes, packed_shape, sampling_size
from jinfer.parallel.mesh import array_specs

log = logging.getLogger(__name__)

MIN_TOKENS = 8
MIN_PAGES = 4
WARMUP_THREADS = 8  # forward executables loaded / compiled at once during warm-up
# XLA command buffers (CUDA graphs) only for steps of at most this many tokens. They save the
# per-kernel launch cost that dominates small decode steps, but recording a graph costs ~16 ms for a
# 1k-token prefill executable (it was re-recorded in front of the first prefill after warm-up, on
# the TTFT path), and large steps hide their launches behind device time anyway.
COMMAND_BUFFER_MAX_TOKENS = 32
# Large (prefill) steps: no command buffers (above), and no "dot merger". That XLA pass merges two dots of
# one operand into one over the concatenation of the other operands: it merged the MLP's x @ w_gate and
# x @ w_up, concatenating the two weights (94 MB for Qwen3.5-4B) anew in every layer of every prefill step:
# 60 us a layer on an H100, more than the merged dot saved (`benchmarks/hlo_ops.py` names such kernels).
# That choice is the KernelPolicy's (`large_step_xla_options`; xla_dot_merger=True keeps XLA's default, for A/B runs).
NO_COMMAND_BUFFER = {"xla_gpu_enable_command_buffer": ""}
# The executables of a multi-process group's warm-up (`_precompile_all`): each process autotunes XLA's GEMM fusions
# itself. By default XLA splits a module's autotuning among the processes compiling it and waits for the others'
# parts, keyed by the set of fusions not yet tuned in that process; with compiles in parallel threads, that set
# differed between processes and a two-process `jinfer serve -tp 2` hung in its warm-up (two H200s). The processes
# still tune the same choices: process 0 compiles first and the others then read its results (`warmup`'s
# `compile_turn`; JAX's persistent cache keeps them, process 0 writing, the others reading). A group without a warm-up
# compiles each shape at its first call, every process at once, and keeps XLA's split autotuning.
GROUP_XLA_OPTIONS = {"xla_gpu_shard_autotuning": False}


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


def sampler_key(R: int, M: int, W: int, K: int, num_logprobs: int, flags: SamplerFlags) -> tuple:
    return ("sample", R, M, W, K, num_logprobs, flags)


class StepExecutables(IdleUnloading):
    """Buckets and the executables compiled for them (the registry half of `ModelRunner`). Needs of its subclass:
    cfg, mesh, ops, weights, kv_cache, `_replicated` (the sharding of logits and tokens), `_prev_spec` (a tokens
    buffer), `executables` (the on-disk cache), `_slot_layers` (the cache's layers indexed by state slot) and
    `aux_layers` (the layer boundaries whose hidden states the forward also returns: an EAGLE-3 head's, else ()) and
    `expert_load` (the forward also returns the MoE layers' expert counts: `--expert-load-stats`)."""

    def _init_registry(self, max_num_batched_tokens: int, max_num_seqs: int, max_pages: int,
                       keep_alive: float, verify_query_len: int = 0) -> None:
        # On GPU, T=1 is its own bucket: batch-1 decode is the latency-critical case and has its own
        # kernels. Not on CPU: there XLA copies the whole KV cache when a one-token update is followed
        # by a read of the cache in the same executable (step time grew with the pool: 4 s at 4096 pages).
        one = (1,) if jax.default_backend() == "gpu" else ()
        self.token_buckets = one + pow2_buckets(MIN_TOKENS, max(max_num_batched_tokens, MIN_TOKENS))
        self.max_seqs_bucket = pick(pow2_buckets(1, 1 << (max_num_seqs - 1).bit_length()), max_num_seqs)
        self.max_rows = self.token_buckets[-1]  # the sampled-token buffer: a row per logits row of any step, and with
        # a drafter (Q = 1 + its drafts) the drafter's rows after them: a rejected count and Q - 1 drafts per sequence
        self.ids_rows = self.max_rows + (self.max_seqs_bucket * verify_query_len if verify_query_len > 1 else 0)
        # The reference attention gathers all P pages of every token, so P is bucketed; the Pallas
        # kernels stop at each sequence's length, so one full-width page table costs nothing there.
        self.page_buckets = ((max_pages,) if self.ops.backend == "pallas"
                             else pow2_buckets(min(MIN_PAGES, max_pages), max_pages))
        # Buckets whose decode-only steps get their own executable (see the module doc).
        self.decode_buckets = (frozenset(T for T in self.token_buckets if T > 1 and self.seqs_bucket(T) == T)
                               if self.ops.backend == "pallas" else frozenset())
        # ... and verify steps (`verify_query_len` Q = 1 + the drafts per sequence; 0: no drafter): the kind Q forward
        Q = verify_query_len
        self.verifies = Q > 1  # a drafter's steps return more logits rows than sequences (`row_buckets`)
        self.verify_len = Q if self.ops.backend == "pallas" and 1 < Q <= self.ops.policy.verify_max_query_len else 0
        top = pick(self.token_buckets, min(Q * self.max_seqs_bucket, self.token_buckets[-1])) if self.verify_len else 0
        self.verify_buckets = frozenset(T for T in self.token_buckets if 1 < T <= top)
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._precompiling = False  # `_precompile_all` at work
        self.compile_seconds = 0.0
        self.warmed_up = False
        # Buckets steps may use now: all of them (compiled on first use) unless a staged warm-up
        # (`warmup(first_tokens=...)`) is still compiling the rest in the background.
        self.ready_tokens: tuple[int, ...] = self.token_buckets
        self.ready_decode: frozenset[int] = self.decode_buckets
        self.ready_verify: frozenset[int] = self.verify_buckets
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self._ready_lock = threading.Lock()
        self.background_seconds = 0.0  # start-up to the last background compile
        self._init_idle(keep_alive)  # idle_unload.py
        self._rest: list[tuple[int, int]] = []  # buckets a staged warm-up left to the background
        self.compiles_after_warmup = 0  # shapes first needed after warm-up (each one stalls a step)

    @property
    def warm_sampler_flags(self) -> tuple[SamplerFlags, ...]:
        """The sampler variants warm-up compiles for each sequence bucket; none for an embedding model (no sampler)."""
        return () if self.cfg.pooling else SamplerFlags.warm()

    def _warm_sampler_keys(self, B: int) -> set[tuple]:
        """The keys of the warm sampler variants of sequence bucket B (unloaded with the last bucket of B sequences)."""
        return {sampler_key(B, 0, 0, 0, -1, flags) for flags in self.warm_sampler_flags}

    def seqs_bucket(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_seqs_bucket)

    def kinds(self, T: int) -> tuple[int, ...]:
        """The forward kinds bucket T has: 0 (any step), 1 (decode-only), the verify steps' Q."""
        return (0,) + ((1,) if T in self.decode_buckets else ()) + ((self.verify_len,) if T in self.verify_buckets
                                                                   else ())

    def ready_kind(self, kind: int) -> frozenset[int] | tuple[int, ...]:
        """The buckets whose forward of `kind` steps may use now."""
        return self.ready_tokens if kind == 0 else self.ready_decode if kind == 1 else self.ready_verify

    def warm_rows(self, T: int, kind: int) -> int:
        """R, the logits rows a bucket's forward is made ready for: B, or T for verify steps (a row per token)."""
        return T if kind > 1 else self.seqs_bucket(T)

    def row_buckets(self, T: int, kind: int) -> tuple[int, ...]:
        """The logits rows R a bucket's forwards of `kind` are made ready for: `warm_rows`, and with a drafter also T
        for any step (a prefill chunk beside rows of drafts returns a row per token)."""
        R = self.warm_rows(T, kind)
        return (R, T) if self.verifies and kind == 0 and T != R else (R,)

    def sampler_rows(self, T: int) -> tuple[int, ...]:
        """The logits rows R bucket T's warm sampler variants are made ready for: B, and with a drafter T."""
        B = self.seqs_bucket(T)
        return (B, T) if self.verifies and T != B else (B,)

    def ready_limits(self) -> tuple[int, int]:
        """(tokens, sequences) a step may hold now: the largest ready bucket and its sequence bucket."""
        T = self.ready_tokens[-1]
        return T, self.seqs_bucket(T)

    # ---- the jitted functions and their executables -------------------------------------------------------------

    def _make_jits(self, own_autotuning: bool = False) -> None:
        """The jitted step functions that executables are lowered from. Made anew (`_drop_traces`) once a cold
        start's compiles are done: JAX caches each jit's traces and lowerings for as long as its function lives
        (a cold-started Qwen3-4B server idled at 1.83 GB, against 854 MB after a warm start)."""
        kv_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)
        specs = (array_specs(self.weights), array_specs(self.kv_cache))
        group = GROUP_XLA_OPTIONS if own_autotuning else {}  # (`_precompile_all`)
        load = {"expert_load": True} if self.expert_load else {}  # (off: the step's program and key are unchanged)
        if self.shift_page_size:  # (a drafter: rows after a verification in flight move on the device)
            load["page_size"] = self.shift_page_size
        extra_outputs = (self._replicated,) * (bool(self.aux_layers) + self.expert_load)
        forward_jit = lambda ops, small, compiler_options={}, **kw: jax.jit(  # noqa: E731
            partial(forward_step, cfg=self.cfg, ops=ops, mesh=self.mesh, specs=specs, aux_layers=self.aux_layers,
                    weights_tree=self._weights_tree, **load),
            static_argnames=("dims",), keep_unused=True,  # (logits_out is donated, not read)
            donate_argnames=("kv_cache", "logits_out") if small and not self.cfg.pooling else ("kv_cache",),
            out_shardings=(self._replicated, kv_shardings) + extra_outputs,
            compiler_options={**group, **compiler_options} or None, **kw)
        # Indexed by "decode step": small steps run with command buffers (XLA's default), large without.
        large = NO_COMMAND_BUFFER | self.ops.policy.large_step_xla_options()
        kinds = [(0, self.ops), (1, replace(self.ops, decode_step=True))]
        if self.verify_len:
            kinds.append((self.verify_len, replace(self.ops, verify_query_len=self.verify_len)))
        self._forward = {d: (forward_jit(o, True),
                             forward_jit(o, False, compiler_options=large)) for d, o in kinds}
        self._sample = jax.jit(sample_step,
                               donate_argnames=("prev_tokens", "packed_out"),
                               keep_unused=True,  # (a donated argument the step does not read still gives its buffer)
                               static_argnames=("dims", "num_logprobs", "flags"),
                               out_shardings=(self._replicated, self._replicated), compiler_options=group or None)
        self._prompt_logprobs = jax.jit(prompt_logprobs_step, static_argnames=("num_rows", "k"),
                                        out_shardings=(self._replicated, self._replicated),
                                        compiler_options=group or None)
        self._fork = jax.jit(partial(fork_step, slot_layers=self._slot_layers), donate_argnames=("kv_cache",),
                             out_shardings=kv_shardings, compiler_options=group or None)

    def _drop_traces(self) -> None:
        """After compiles ahead of use (so no executable is the plain jit's own): new jit objects, so JAX frees the
        old ones' traces and lowerings. Later misses trace again, as they would anyway."""
        if self.compiles_ahead and self.executables.misses:
            self._make_jits()

    def _add_executable(self, key: tuple, jitted, args: tuple, background: bool = False,
                        **static) -> jax.stages.Compiled:
        """A shape seen for the first time: load it from the executable cache or compile it (with no
        cache directory and not `background`, the plain jit, which compiles on its first call); kept under
        `key`. `background`: the staged warm-up's thread, whose compiles are not stalls."""
        if self.warmed_up and not background:
            self.compiles_after_warmup += 1
            log.warning("compiling %s after warm-up", key)
        if self._precompiling:  # a group's warm-up (`_precompile_all`): JAX's caches hold it for the plain jit's call
            jitted.lower(*args, **static).compile()
        self._compiled[key] = (partial(jitted, **static) if not self.compiles_ahead and not background
                               else self.executables.compile(key[0], jitted, *args, **static))
        return self._compiled[key]

    @property
    def compiles_ahead(self) -> bool:
        """Whether shapes compile (or load) ahead of their first call, several at once during warm-up, into
        executables of their own: with an executable cache, in one process. (A multi-process group calls its plain
        jits, after `_precompile_all`: called by the processes of a group, an executable compiled ahead failed,
        'compiled for 405 inputs but called with 403', two H200s.)"""
        return self.executables.directory is not None

    def forward_executable(self, T: int, B: int, P: int, decode: int = 0, R: int | None = None,
                           prompt_logits: bool = False, background: bool = False) -> jax.stages.Compiled:
        """`decode`: the forward's kind (0 any step, 1 decode-only, the verify Q). R: the sampler's logits rows (None:
        `warm_rows`). `prompt_logits`: the variant that also returns the logits of every token (R + T rows), for steps
        with prompt logprobs; compiled on first use, not at warm-up."""
        R = self.warm_rows(T, decode) if R is None else R
        key = (_KIND_NAMES.get(decode, f"forward_q{decode}") if decode else
               "forward_prompt_logits" if prompt_logits else "forward", T, B, P)
        key = key if R == B else (*key, R)
        if (hit := self._compiled.get(key)) is not None:  # the per-step path
            return hit
        if decode and decode not in self.kinds(T):
            raise ValueError(f"no executable of kind {decode} for T={T} (decode buckets: {sorted(self.decode_buckets)}"
                             f", verify: {sorted(self.verify_buckets)})")
        # XLA command buffers only for small steps (see COMMAND_BUFFER_MAX_TOKENS).
        jitted = self._forward[decode][T > COMMAND_BUFFER_MAX_TOKENS]
        dims = (T, B, P, R + T if prompt_logits else R)
        buf = jax.ShapeDtypeStruct((sum(batch_sizes(*dims)),), jnp.int32, sharding=self._replicated)
        outs = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)
                     for shape, dtype in self.outputs_kept(dims[3], T))
        compiled = self._add_executable(key, jitted, (self.weight_leaves, buf, self.kv_cache, self._prev_spec, outs,
                                                      *self._all_reduce_table), background,
                                        dims=dims)
        if T <= COMMAND_BUFFER_MAX_TOKENS:
            self._warm_stage(buf.shape[0])
        return compiled

    def outputs_kept(self, rows: int, T: int) -> tuple[tuple[tuple[int, ...], object], ...]:
        """The (shape, dtype) of the forward's `logits_out` buffers: for a small step (T tokens, one command buffer),
        the previous logits of its `rows` rows, and with `aux_layers` the previous hidden states [T, n*H], donated
        (runner.py: stable step buffers); for a large step (no command buffer: kept buffers would buy nothing and
        hold up to [T + B, V] floats) or an embedding model (pooled rows), placeholders."""
        keep = self.keeps_logits(T)
        outs = (((rows, self.cfg.vocab_size) if keep else (1,), jnp.float32),)
        if self.aux_layers:
            hidden = (T, len(self.aux_layers) * self.cfg.hidden_size)
            outs += ((hidden, self.weights.embed.dtype) if keep else ((1,), jnp.float32),)
        return outs

    def keeps_logits(self, T: int) -> bool:
        return T <= COMMAND_BUFFER_MAX_TOKENS and not self.cfg.pooling

    def prompt_logprobs_executable(self, T: int, R: int, k: int) -> jax.stages.Compiled:
        if (hit := self._compiled.get(("prompt_logprobs", T, R, k))) is not None:
            return hit
        logits = jax.ShapeDtypeStruct((R + T, self.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        targets = jax.ShapeDtypeStruct((T,), jnp.int32)
        return self._add_executable(("prompt_logprobs", T, R, k), self._prompt_logprobs, (logits, targets),
                                    num_rows=R, k=k)

    def sampler_executable(self, R: int, M: int, W: int, num_logprobs: int, flags: SamplerFlags,
                           K: int = 0, background: bool = False) -> jax.stages.Compiled:
        key = sampler_key(R, M, W, K, num_logprobs, flags)
        if (hit := self._compiled.get(key)) is not None:
            return hit
        logits = jax.ShapeDtypeStruct((R, self.cfg.vocab_size), jnp.float32, sharding=self._replicated)
        G = mask_words(self.cfg.vocab_size) if flags.grammar else 0
        buf = jax.ShapeDtypeStruct((sampling_size(R, M, W, K, G),), jnp.int32, sharding=self._replicated)
        packed = jax.ShapeDtypeStruct(packed_shape(R, num_logprobs), jnp.int32, sharding=self._replicated)
        compiled = self._add_executable(key, self._sample, (logits, buf, self._prev_spec, packed), background,
                                        dims=(R, M, W, K), num_logprobs=num_logprobs, flags=flags)
        self._warm_stage(buf.shape[0], sampling=True)  # (steps with none in flight stage their inputs: runner.py)
        return compiled

    def fork_executable(self, N: int) -> jax.stages.Compiled:
        key = ("fork", N)
        if (hit := self._compiled.get(key)) is None:
            hit = self._add_executable(key, self._fork, (self.kv_cache, jax.ShapeDtypeStruct((4, N), jnp.int32)))
        return hit

    def _precompile_all(self, shapes: list[tuple[int, int, int, bool]], fork_sizes: list[int]) -> None:
        """A multi-process group's warm-up: `_load_all`'s compiles, into JAX's caches (the plain jits' first calls
        then find them). One by one at their first calls, a two-process group's 16 Qwen3-8B shapes took 158 s on two
        H200s; one process compiling them in parallel ran at full speed 57 s after its launch."""
        self._make_jits(own_autotuning=True)
        self._precompiling = True
        try:
            self._load_all(shapes, fork_sizes)
        finally:
            self._precompiling = False
            self._compiled.clear()  # (the plain jits again, as warm-up calls them)

    def _load_all(self, shapes: list[tuple[int, int, int, bool]], fork_sizes: list[int]) -> None:
        """Load (or trace + compile) the forwards of `shapes` ((T, B, P, decode) each), the warm samplers of their
        sequence buckets and the fork copies of `fork_sizes`, in parallel: loads and XLA compiles release the GIL."""
        jobs = [partial(self.forward_executable, *shape, R) for shape in shapes for R in self.row_buckets(T=shape[0],
                                                                                                          kind=shape[3])]
        jobs += [partial(self.sampler_executable, R, 0, 0, -1, flags)
                 for R in sorted({R for shape in shapes for R in self.sampler_rows(shape[0])})
                 for flags in self.warm_sampler_flags]
        jobs += [partial(self.fork_executable, N) for N in fork_sizes]
        with ThreadPoolExecutor(max_workers=WARMUP_THREADS) as pool:
            for _ in pool.map(lambda job: job(), jobs):  # re-raises a job's exception
                pass

    def _bucket_executables(self, T: int, decode: int, background: bool = False) -> None:
        """Every executable of one bucket: its forwards (every P), and its sampler's warm variants."""
        B = self.seqs_bucket(T)
        for P in self.page_buckets:
            for R in self.row_buckets(T, decode):
                if self._stop_background.is_set() and background:  # a bucket is several compiles: stop between them
                    return
                self.forward_executable(T, B, P, decode, R, background=background)
        for R in self.sampler_rows(T):
            for flags in self.warm_sampler_flags:
                self.sampler_executable(R, 0, 0, -1, flags, background=background)

    # ---- staged warm-up: the rest in the background -----------------------------------------------------------

    def start_background(self) -> None:
        """Compile the buckets a staged warm-up left, one at a time in a daemon thread; each becomes usable
        as soon as it is compiled (loads and XLA compiles release the GIL, so steps go on meanwhile)."""
        if self._background is not None or not self._rest:
            return

        def bucket(T: int, decode: int) -> None:
            if self._stop_background.is_set():
                return
            self._bucket_executables(T, decode, background=True)
            if not self._stop_background.is_set():
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
                trim_host_heap()  # compile-time host memory back to the OS, as after a full warm-up
                self.background_seconds = time.perf_counter() - self._t0
                log.info("warm-up: all %d token buckets ready %.1f s after start-up began",
                         len(self.token_buckets), self.background_seconds)
            except Exception:  # the buckets compiled so far stay usable; the rest compile on first use
                log.exception("background warm-up failed")
                self.ready_tokens, self.ready_decode = self.token_buckets, self.decode_buckets
                self.ready_verify = self.verify_buckets

        self._background = threading.Thread(target=work, name="jinfer-warmup", daemon=True)
        self._background.start()

    def _make_ready(self, T: int, decode: int) -> None:
        with self._ready_lock:
            self._unloaded.discard((T, decode))
            if decode == 1:
                self.ready_decode = self.ready_decode | {T}
            elif decode:
                self.ready_verify = self.ready_verify | {T}
            else:
                self.ready_tokens = tuple(sorted({*self.ready_tokens, T}))
            self._last_used[(T, decode)] = time.monotonic()  # an unused bucket unloads keep_alive after this

    def warmup_pending(self) -> int:
        """Buckets a staged warm-up has not made ready yet (unloaded ones not counted)."""
        with self._ready_lock:
            return (len(self.token_buckets) - len(self.ready_tokens) + len(self.decode_buckets)
                    - len(self.ready_decode) + len(self.verify_buckets) - len(self.ready_verify) - len(self._unloaded))

    def wait_warmup(self, timeout: float | None = None) -> bool:
        """Wait for a staged warm-up's background compiles; True once every bucket is ready."""
        if self._background is not None:
            self._background.join(timeout)
        return (self.ready_tokens == self.token_buckets and self.ready_decode == self.decode_buckets
                and self.ready_verify == self.verify_buckets)

    def stop_background(self) -> None:
        self._stop_background.set()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)


_KIND_NAMES = {1: "forward_decode"}  # forward kind -> its executables' name (verify Q: "forward_q{Q}")

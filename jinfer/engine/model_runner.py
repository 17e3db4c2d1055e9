"""Turns a scheduled batch into padded device arrays and runs one jitted forward + sampling step.

Shapes come from a small fixed set of buckets so serving never stalls on a compile:
- T (tokens in the step): 1 (GPU only), then powers of two from `MIN_TOKENS` up to `max_num_batched_tokens`;
- B (sequences): min(T, the max_num_seqs bucket): a step never has more sequences than tokens;
- P (pages per sequence in the page table): powers of two up to the longest sequence allowed.
`warmup()` compiles every (T, P) forward and the plain sampler for every B ahead of time. The KV
cache is donated to the step, so it is updated in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jinfer.config import ModelConfig
from jinfer.engine.kv_cache_manager import NULL_PAGE, cdiv
from jinfer.engine.sampler import SampleResult, SamplingTensors, sample
from jinfer.engine.scheduler import SchedulerOutput
from jinfer.models.batch import Batch
from jinfer.models.llama import Weights, forward
from jinfer.models.ops import REFERENCE_OPS, ModelOps
from jinfer.parallel import logical_sharding

log = logging.getLogger(__name__)

MIN_TOKENS = 8
MIN_PAGES = 4
KV_AXES = ("pages", "page_slot", "kv_heads", "head_dim")


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


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh):
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    sharding = logical_sharding(mesh, KV_AXES, shape)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return tuple((zeros(), zeros()) for _ in range(cfg.num_layers))


@dataclass
class StepRow:
    """Sampling inputs of one scheduled sequence that needs a token: (params, output ids, prompt, step)."""

    params: object
    output_ids: list[int]
    prompt: object
    seed: int


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, mesh: Mesh, *, num_pages: int, page_size: int,
                 kv_dtype, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 ops: ModelOps = REFERENCE_OPS):
        self.cfg, self.weights, self.mesh = cfg, weights, mesh
        self.page_size = page_size
        self.kv_cache = init_kv_cache(cfg, num_pages, page_size, kv_dtype, mesh)
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
        self._forward = jax.jit(partial(forward, cfg=cfg, ops=ops), donate_argnames=("kv_cache",))
        self._sample = jax.jit(sample, static_argnames=("num_logprobs",))
        self.compile_seconds = 0.0

    def seqs_bucket(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_seqs_bucket)

    # ---- host-side batch building ---------------------------------------------------------------

    def build_batch(self, out: SchedulerOutput) -> Batch:
        """Pad the scheduled sequences into one Batch (numpy, moved to device in one call)."""
        T = pick(self.token_buckets, out.num_scheduled_tokens)
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
        input_ids[:total] = [t for s in out.scheduled for t in s.token_ids] if total > n_seqs else \
            [s.request.all_token_ids[s.start] for s in out.scheduled]
        positions = np.zeros(T, np.int32)
        positions[:total] = pos
        slots = np.full(T, -1, np.int32)
        slots[:total] = page_table[seq_of_token, pos // ps] * ps + pos % ps
        seq_lens = np.zeros(B, np.int32)
        seq_lens[:n_seqs] = starts + counts
        logits_idx = np.zeros(B, np.int32)
        logits_idx[:n_seqs] = query_start[1:n_seqs + 1] - 1
        return Batch(input_ids, positions, slots, query_start, seq_lens, page_table, logits_idx)

    def sampling_tensors(self, rows: list[StepRow | None], B: int) -> SamplingTensors:
        """Rows align with the batch's sequences; None (a prefill chunk that samples nothing) is padding."""
        dense = [(r.params, r.output_ids, r.prompt, None) if r else ({"temperature": 0.0}, [], None, None)
                 for r in rows]
        st = SamplingTensors.from_params(dense, self.cfg.vocab_size, num_seqs=B)
        for b, r in enumerate(rows):
            if r is not None:
                st.seeds[b] = r.seed % 2**32
        return st

    # ---- device step ------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, rows: list[StepRow | None], num_logprobs: int) -> SampleResult:
        """Run the step; returns device arrays (row b = scheduled sequence b)."""
        batch = self.build_batch(out)
        st = self.sampling_tensors(rows, batch.num_seqs)
        batch, st = jax.device_put((batch, st))
        logits, self.kv_cache = self._forward(self.weights, batch, self.kv_cache)
        return self._sample(logits, st, num_logprobs=num_logprobs)

    def warmup(self) -> float:
        """Compile every forward bucket and the plain sampler per sequence bucket; returns seconds."""
        t0 = time.perf_counter()
        for T in self.token_buckets:
            B = self.seqs_bucket(T)
            for P in self.page_buckets:
                batch = Batch(np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32),
                              np.zeros(B + 1, np.int32), np.zeros(B, np.int32), np.zeros((B, P), np.int32),
                              np.zeros(B, np.int32))
                logits, self.kv_cache = self._forward(self.weights, batch, self.kv_cache)
            st = self.sampling_tensors([None] * B, B)
            jax.block_until_ready(self._sample(logits, st, num_logprobs=-1))
        self.compile_seconds = time.perf_counter() - t0
        log.info("warm-up: %d forward shapes compiled in %.1f s", len(self.token_buckets) * len(self.page_buckets),
                 self.compile_seconds)
        return self.compile_seconds

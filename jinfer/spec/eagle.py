"""EAGLE-3 drafts in the engine (speculative_config {"method": "eagle3", "model": DIR, "num_speculative_tokens": k}):
the draft head of jinfer/models/eagle3.py run on the device after each step, its drafts handed to the requests
through the `Proposer` interface.

Start-up (engine/builder.py): `load_head` loads the head after the target; the KV pool's pages grow by the head's
one attention layer (`head_page_bytes`: its K and V, replicated over a mesh), kept here as its own
`[num_pages, page_size, kv_heads, head_dim]` pair on the target's page ids; the target's executables return the
hidden states at the head's `aux_layers` (`Launched.aux`, kept on the device).

The head is launched with each step, right after the target's forward and sampler (`after_launch`, one jitted call
on the step's own shapes, on the step's device arrays and one int32 upload of the host's part, built while the
device runs the step); the engine reads the step's tokens back, and the head's drafts stay on the device. On the
device:
- which drafts each verification keeps (`accepted_drafts`: the samples equal to the drafts, the host's exact rule);
- the head's first pass over *every* row of the step (prefill chunks too, so a preempted and recomputed sequence's
  head KV is rewritten): row at position q takes the token at q + 1 (a prompt token mid-prefill, a sampled id at a
  sequence's sampled rows). The rows past the kept drafts write nothing (`head_rows`);
- then k - 1 one-token steps (`eagle3.propose`) for the sequences that sample, from their last accepted row. The
  chain writes the head's KV up to that row's position + k - 1: those pages are allocated at the launch
  (`allocate_slots` for k - 1 more tokens; the next step needs them for its verification row anyway); where the
  pool is short, the chain's write into a page-table entry not allocated (the reserved page 0) is dropped.
The step writes the drafts into rows past any step's samples of the runner's sampled-ids buffer (donated: the next
step's forward and sampler read their inputs there; `ModelRunner.ids_rows`), and (drafts | kept counts) into a
recycled buffer (`_out_free`, `parallel.mesh.RecycledBuffers`: a new one alive during the next step's launch could
move its forward's temp buffer). `propose` hands a request its drafts where the host's verification kept as many as
the head's step started from (the kept count it read back says so), cut to the room left in the context (the scheduler's
`_fit_drafts` drops what does not fit the budget or max_tokens): as the device holds them (`request.device_input`
markers: the next step reads them there, so the host schedules it while the head still runs) where no host work needs
their ids first (SpecDecoding.propose: grammars, multi-token bad words), else read back. Once that step is
dispatched, `after_launch` reads the drafts and puts their ids in its rows (`_resolve`): its verification compares them
with the samples. A Qwen3.5 sequence rolled back over a rejected draft gets its drafts too: its recompute row verifies
them.

Prefix cache: the head's KV at position p depends on the token at p + 1, so a hit's last page may hold KV computed
with another next token: with a head, a prefix hit is one page shorter (`KVCacheManager(hit_drop_last_page=True)`),
that page is recomputed. Drafts only ever cost acceptance, never correctness: pages restored from the host tier
and the last rows of a finished sequence's cached pages carry no (or stale) head KV.

The next step may be launched before this one is read back (EngineCore): a request still in flight gets the head's
drafts after its row's tokens as if every draft is kept (`in_flight`, `propose`); the head's step writes each
sequence's rejected drafts into row `max_rows + b` of the sampled-ids buffer, from which that next step's forward,
sampler and head move its rows back (`ScheduledRequest.shift_from`, engine/device_step.py `shift_rows`). The host
checks a chain's start by the kept counts of the verifications it reads back (`accepted`), not by positions.
Not built: tensor-parallel shards of the head (it runs replicated, on the reference ops), multi-process groups.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jinfer.config.model import ModelConfig
from jinfer.config.speculative import SpeculativeConfig
from jinfer.engine.request import DEVICE_DRAFT, DEVICE_TOKEN, device_input
from jinfer.models import eagle3
from jinfer.models.batch import Batch
from jinfer.ops import REFERENCE_OPS
from jinfer.parallel.mesh import RecycledBuffers, put
from jinfer.weights.eagle3 import dummy_eagle3, load_eagle3

log = logging.getLogger(__name__)


def load_head(config: SpeculativeConfig, target: ModelConfig, target_weights, dtype: str, mesh
              ) -> tuple[eagle3.Eagle3Config, eagle3.Eagle3Weights]:
    """The head `config.model` names, for this target ("dummy": a random one, benchmarks); ValueError naming the field
    where it cannot serve it."""
    if config.model == "dummy":
        return dummy_eagle3(target, target_weights, dtype, mesh)
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model={config.model!r}: no EAGLE-3 head there (a directory with its "
                         "config.json and safetensors)")
    try:
        cfg = eagle3.eagle3_config(path, target)
        if cfg.target_hidden_size != target.hidden_size:
            raise ValueError(f"target_hidden_size={cfg.target_hidden_size}: the head reads a target of that hidden "
                             f"size, this model's is {target.hidden_size}")
        return load_eagle3(path, target, target_weights, dtype, mesh)
    except ValueError as e:
        raise ValueError(f"speculative_config.model={config.model!r}: {e}") from None


def head_page_bytes(cfg: eagle3.Eagle3Config, page_size: int, dtype) -> int:
    """Bytes the head's layer adds to a page on each device (its KV is replicated)."""
    return eagle3.cache_spec(cfg).page_bytes(page_size, dtype, 1)


def aux_layers(cfg: eagle3.Eagle3Config) -> tuple[int, ...]:
    """The target's layer boundaries the head reads."""
    return cfg.aux_layers


def _chain(weights, kv, batch, aux, live, *, cfg, num_steps, ops):
    return eagle3.propose(weights, cfg, batch, aux, kv, num_steps, ops, live=live)


class Eagle3Proposer:
    """The engine's `Proposer` for an EAGLE-3 head (module doc). `runner`: the model runner (its page size, page
    buckets, mesh, ops, model dtype); `kv_manager`: the page allocator (lookahead pages)."""

    def __init__(self, cfg: eagle3.Eagle3Config, weights: eagle3.Eagle3Weights, k: int, *, runner, kv_manager,
                 max_model_len: int):
        self.cfg, self.weights, self.k = cfg, weights, k
        if runner.ids_rows < runner.max_rows + runner.max_seqs_bucket * (1 + max(k, 1)):
            raise ValueError(f"the runner's sampled-ids buffer ({runner.ids_rows} rows) has no room for {k} drafts a "
                             "sequence: build it with verify_query_len = 1 + k")
        self.kv_manager, self.max_model_len = kv_manager, max_model_len
        self.page_size, self.page_buckets = runner.page_size, runner.page_buckets
        target_kv = next(layer[0] for layer in runner.kv_cache if layer[0].ndim == 4)  # a paged layer's K
        spec = self.cache_spec(cfg)
        shape = (target_kv.shape[0], self.page_size, spec.num_kv_heads, spec.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, runner.dtype),  # the model's dtype (the target's KV may be FP8)
                        out_shardings=NamedSharding(runner.mesh, PartitionSpec()))
        self.kv = (zeros(), zeros())
        ops = runner.ops if runner.mesh.size == 1 else REFERENCE_OPS  # (replicated: no sharded kernels)
        self._head = jax.jit(functools.partial(head_step, chain=self.chain, cfg=cfg, num_steps=k, ops=ops,
                                               first_row=runner.max_rows, page_size=runner.page_size),
                             donate_argnames=("kv", "tokens", "out"), static_argnames=("dims",),
                             keep_unused=True,  # (`out` is not read: without this its donation is dropped)
                             out_shardings=NamedSharding(runner.mesh, PartitionSpec()))  # (as the step's inputs)
        self.runner = runner
        # The last launch: its (drafts | accepted) [B, k + 1] on the device, its sequences' request id -> (row, sampled
        # rows), the row where its drafts start in the sampled-ids buffer (its rejected counts the B rows before), and
        # the host copy once read. Its buffer comes from (and once read goes back to) `_out_free`
        self._launched: tuple[jax.Array | None, dict[str, tuple[int, int]], int] | None = None
        self._read: np.ndarray | None = None
        self._kept: dict[str, int] = {}  # request id -> the drafts its last verification read back kept (`accepted`)
        self.shift_rows: dict[str, int] = {}  # request id -> ScheduledRequest.shift_from, of requests in flight drafted
        self._handed: list = []  # requests given markers since the last launch (`_resolve` drops those no step took)
        self._out_free = RecycledBuffers(NamedSharding(runner.mesh, PartitionSpec()))
        self._mismatched = False  # (logged once)

    cache_spec = staticmethod(eagle3.cache_spec)  # the head's one layer of KV
    chain = staticmethod(_chain)  # (weights, kv, batch, aux, live, *, cfg, num_steps, ops) -> (drafts, kv)

    device_drafts = True  # `propose` may hand drafts over as the device's (SpecDecoding.propose)

    def in_flight(self, request) -> bool:
        """Whether the last launch verified this request's row and it is not read back yet: its next row may be
        scheduled now, from the head's drafts there, and moved back on the device by what that verification rejects
        (`propose`; EngineCore launches the next step first where every such request allows)."""
        return (self._launched is not None and request.request_id in self._launched[1]
                and request.num_sampling_tokens == 1 and request.pending_token_ids[-1] == DEVICE_TOKEN)

    def propose(self, requests: Sequence, on_device: Sequence[bool] | None = None) -> list[list[int]]:
        """The drafts the last launch's chain made for these requests, where the verification the host accepted is
        the one the chain started from (none for a request that moved on since). Where `on_device[i]`, request i's are
        handed over as the device holds them (`request.device_input` markers: the next step reads them there, the host
        waits for nothing; `after_launch` puts their ids in once that step is dispatched, and only then compares the
        head's kept count with the host's: a mismatch costs acceptance); the others are read back. A request whose
        verification is still in flight (`in_flight`) gets them as the device's, after its tokens as if every draft
        is kept: `shift_rows` says where the head writes how many were not."""
        self.shift_rows = {}
        if self._launched is None:
            return [[] for _ in requests]
        _, rows, tail = self._launched
        on_device = [False] * len(requests) if on_device is None else on_device
        if not all(d for r, d in zip(requests, on_device) if r.request_id in rows):
            self._fetch()
        out = []
        for r, device in zip(requests, on_device, strict=True):
            b, m = rows.get(r.request_id, (-1, 0))
            if b >= 0 and device and self.in_flight(r):
                room = min(self.k, self.max_model_len - r.num_tokens - r.num_inflight_tokens)
                self.shift_rows[r.request_id] = self.runner.max_rows + b if m > 1 else -1  # (`head_step`)
                out.append([device_input(tail + b * self.k + j) for j in range(room)])
                self._handed.append(r)
                continue
            room = min(self.k, self.max_model_len - r.num_tokens)
            kept = self._kept.get(r.request_id, -1)  # (the launch's verification of it, read back: its chain's start)
            if b < 0 or room <= 0 or not 0 <= kept < m:
                out.append([])
            elif device:
                out.append([device_input(tail + b * self.k + j) for j in range(room)])
                self._handed.append(r)
            elif self._agrees(r.request_id, b, kept):
                out.append(self._read[b, :room].tolist())
            else:
                out.append([])
        return out

    def accepted(self, request_id: str, kept: int) -> None:
        """A verification read back kept `kept` drafts: the head's chain for that row started after as many
        (`propose` and `_resolve` check it against the device's count)."""
        self._kept[request_id] = kept

    def _fetch(self) -> np.ndarray:
        """The last launch's (drafts | accepted) on the host; its device buffer goes back to `_out_free`."""
        if self._read is None:
            result, rows, tail = self._launched
            self._read = np.asarray(result)
            self._out_free.give_back(result)
            self._launched = None, rows, tail
        return self._read

    def _agrees(self, request_id: str, b: int, kept: int) -> bool:
        """Whether the head's step kept as many drafts as the host's verification (else its chain started elsewhere:
        a bug, logged once; its drafts cost only acceptance)."""
        device = int(self._read[b, self.k])
        if device != kept and not self._mismatched:
            self._mismatched = True
            log.warning("request %s: the head's step kept %d drafts, the host's verification %d: its chain started "
                        "elsewhere (drafts read back are dropped, those on the device only cost acceptance)",
                        request_id, device, kept)
        return device == kept

    def _resolve(self, scheduled) -> None:
        """The ids of the drafts handed over as the device's (`propose`) into the scheduled rows and their requests'
        pending tokens, from the last launch's copy (read now: the step that reads them on the device is dispatched);
        those handed to requests this step did not take are dropped."""
        marked = [s for s in scheduled if s.device_drafts]
        for r in self._handed:  # markers no step took: once this step has run their rows hold other drafts
            if r.num_draft_tokens and r.pending_token_ids[-1] <= DEVICE_DRAFT:
                r.drop_draft_tokens()
        self._handed = []
        if not marked:
            return
        read, (_, rows, tail) = self._fetch(), self._launched
        ids = lambda tokens: [int(read[divmod(DEVICE_DRAFT - t - tail, self.k)]) if t <= DEVICE_DRAFT else t
                              for t in tokens]
        for s in marked:
            b, _ = rows[s.request_id]
            if not s.input_from_device and s.request_id in self._kept:  # (else in flight: not known here yet)
                self._agrees(s.request_id, b, self._kept[s.request_id])  # (else only acceptance suffers)
            pending = s.request.pending_token_ids
            pending[:] = ids(pending)
            s.draft_token_ids[:] = ids(s.draft_token_ids)

    def warmup(self) -> None:
        """Compile the head's step for the buckets the runner made ready (each token bucket with its sequence bucket,
        every page bucket; the engine calls this after the runner's warm-up), so no step waits for it."""
        r, K = self.runner, max(self.k, 1)
        for T in r.ready_tokens:
            B = r.seqs_bucket(T)
            aux = put(np.zeros((T, len(r.aux_layers) * r.cfg.hidden_size), r.weights.embed.dtype), r._replicated)
            for P in self.page_buckets:
                packed = np.zeros(sum(head_sizes((T, B, P, K))), np.int32)
                packed[T:2 * T] = -1  # (slots: nothing written)
                packed[-B:] = -1  # (no row moves)
                out, _ = self._call(packed, aux, (T, B, P, K))
                jax.block_until_ready(out)
                self._out_free.give_back(out)

    def prepare(self, out, built, forced: dict[str, int] | None = None):
        """A step's batch is built, nothing of it dispatched yet (`ModelRunner.launch`): returns what launches the head
        behind it (`after_launch`). `forced` (benchmarks: `ForcedAcceptance`): request id -> the drafts its
        verification keeps, instead of the exact rule."""
        return functools.partial(self.after_launch, forced=forced)

    def after_launch(self, launched, forced: dict[str, int] | None = None) -> None:
        """Launch the head behind a step just dispatched (`Launched`: its scheduler output, padded batch, hidden states
        and sampled ids, all still on the device), its inputs built while the device runs the step and uploaded as
        one int32 buffer (`head_inputs`); the next `propose` reads its drafts. First the step's drafts handed over as
        the device's get their ids (`_resolve`)."""
        built, scheduled = launched.batch, launched.out.scheduled
        if self._launched is not None:
            self._resolve(scheduled)
            if (result := self._launched[0]) is not None:  # (not read: its buffer serves a later head step as is)
                self._out_free.give_back(result)
        self._launched, self._read, self._kept = None, None, {}  # (kept counts of older launches: not needed again)
        if built is None or launched.aux is None or not scheduled:
            return
        T, B, K = built.input_ids.shape[0], built.seq_lens.shape[0], max(self.k, 1)
        ids, slots = np.zeros(T, np.int32), built.slot_mapping.astype(np.int32)  # (a copy)
        at, first, count = np.full(B, T, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        drafts, force, live = np.full((B, K), -1, np.int32), np.full(B, -1, np.int32), np.zeros(B, np.int32)
        shift = np.full(B, -1, np.int32)
        rows, tables = {}, {}
        for b, s in enumerate(scheduled):
            r, lo, n = s.request, int(built.query_start[b]), s.num_new_tokens
            shift[b] = s.shift_from
            if r.is_finished:  # (aborted since it was scheduled: its rows write nothing)
                slots[lo:lo + n] = -1
                continue
            m = s.num_logits  # its sampled rows, the last m: the row's last token and its drafts
            known = r.all_token_ids[s.start + 1:s.start + n - m + 1]  # the next tokens of the rows before them
            ids[lo:lo + len(known)] = known
            slots[lo + len(known):lo + n - m] = -1
            at[b] = lo + n - m
            if not m:
                continue
            first[b], count[b] = launched.rows[s.request_id][0], m
            drafts[b, :m - 1] = s.draft_token_ids
            if forced is not None:
                force[b] = min(forced.get(s.request_id, 0), m - 1)
            rows[s.request_id] = (b, m)
            live[b] = 1
            ahead = min(self.k - 1, self.max_model_len - r.num_computed_tokens)
            if ahead > 0:  # the chain's KV positions (module doc); where the pool is short, writes are dropped
                self.kv_manager.allocate_slots(r, ahead)
            tables[b] = r.page_ids
        if not rows and not (slots >= 0).any():
            return
        P = built.page_table.shape[1]
        width = max([P] + [len(p) for p in tables.values()])
        P2 = next((p for p in self.page_buckets if p >= width), width)
        page_table = np.zeros((B, P2), np.int32)
        page_table[:, :P] = built.page_table
        for b, pages in tables.items():
            page_table[b, :len(pages)] = pages
        packed = np.concatenate([ids, slots, built.positions, built.query_start, built.seq_lens, page_table.ravel(),
                                 at, live, first, count, drafts.ravel(), force, shift]).astype(np.int32)
        out, tail = self._call(packed, launched.aux, (T, B, P2, K))
        out.copy_to_host_async()
        self._launched = out, rows, tail

    def _call(self, packed: np.ndarray, aux: jax.Array, dims: tuple[int, int, int, int]) -> tuple[jax.Array, int]:
        """Run the head's step on the runner's latest sampled ids: ((drafts | accepted) [B, K + 1] in a recycled
        buffer, the row where its drafts sit in the next step's input ids). The ids' buffer, donated, becomes the
        runner's with the rejected counts and the drafts in its rows past any step's samples (`head_step`)."""
        B, K = dims[1], dims[3]
        out = self._out_free.take((B, K + 1))
        out, self.kv, self.runner._last_tokens = self._head(self.weights, self.kv, packed, aux,
                                                            self.runner._last_tokens, out, dims=dims)
        return out, self.runner.max_rows + B


def head_sizes(dims: tuple[int, int, int, int]) -> list[int]:
    """The parts of `after_launch`'s int32 buffer for dims (T, B, pages, K), in `head_inputs`' order."""
    T, B, P, K = dims
    return [T, T, T, B + 1, B, B * P, B, B, B, B, B * K, B, B]


def head_inputs(packed: jax.Array, dims: tuple[int, int, int, int]):
    """`after_launch`'s int32 buffer: (the head's Batch, its `logits_indices` each sequence's first sampled row, live,
    first, count, drafts, forced, shift_from)."""
    T, B, P, K = dims
    ids, slots, positions, qs, seq_lens, pages, at, live, first, count, drafts, forced, shift = jnp.split(
        packed, np.cumsum(head_sizes(dims))[:-1])
    batch = Batch(ids, positions, slots, qs, seq_lens, pages.reshape(B, P), at)
    return batch, live > 0, first, count, drafts.reshape(B, K), forced, shift


def accepted_drafts(tokens: jax.Array, first: jax.Array, count: jax.Array, drafts: jax.Array,
                    forced: jax.Array) -> jax.Array:
    """i32[B]: the drafts each sequence's verification keeps by the exact rule (while its samples equal them; the
    host's `accept_draft_tokens`), or `forced[b]` where >= 0. `tokens` the step's sampled ids by logits row; sequence
    b samples rows first[b]..first[b] + count[b] - 1 and verifies drafts[b, :count[b] - 1]."""
    j = jnp.arange(drafts.shape[1])
    sampled = tokens[jnp.clip(first[:, None] + j, 0, tokens.shape[0] - 1)]
    match = (j < count[:, None] - 1) & (sampled == drafts)
    kept = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return jnp.where(forced >= 0, forced, kept).astype(jnp.int32)


def head_rows(batch: Batch, tokens: jax.Array, first: jax.Array, count: jax.Array, drafts: jax.Array,
              accepted: jax.Array) -> Batch:
    """The head's first pass over a verified step (module doc): `batch` holds the host's next ids and slots, and in
    `logits_indices` each sequence's first sampled row (count[b] of them). Those rows take the kept drafts, then the
    sampled id after them (the row at position q the token at q + 1: by the exact rule a kept draft is the sample;
    forced outcomes keep drafts that are not), the rows past them write nothing, and each sequence's last row
    (`logits_indices`, where its chain starts) is its last accepted one."""
    from jinfer.engine.device_step import token_seqs

    T, at = batch.input_ids.shape[0], batch.logits_indices
    seq = token_seqs(batch)
    rel = jnp.arange(T) - at[seq]
    sampled = (rel >= 0) & (rel < count[seq])
    kept = drafts[seq, jnp.clip(rel, 0, drafts.shape[1] - 1)]
    ids = jnp.where(sampled, jnp.where(rel < accepted[seq], kept, tokens[jnp.clip(first[seq] + rel, 0,
                                                                                  tokens.shape[0] - 1)]),
                    batch.input_ids)
    slots = jnp.where(sampled & (rel > accepted[seq]), -1, batch.slot_mapping)
    last = jnp.clip(jnp.where(count > 0, at + accepted, at - 1), 0, T - 1)
    return dataclasses.replace(batch, input_ids=ids.astype(jnp.int32), slot_mapping=slots.astype(jnp.int32),
                               logits_indices=last.astype(jnp.int32))


def head_step(weights, kv, packed, aux, tokens, out, *, dims, chain, cfg, num_steps, ops, first_row, page_size):
    """The head's device step after a verification (one jitted call): acceptance, its rows, the chain, on the inputs
    `after_launch` packed (`head_inputs`) and the step's sampled ids `tokens` [rows]. Returns ((drafts [B, num_steps] |
    accepted [B]) [B, num_steps + 1], written into the donated `out` of that shape; kv; `tokens` (donated) with, past
    any step's samples (`first_row`: `ModelRunner.max_rows`), each sequence's rejected drafts in rows first_row + b
    (the next step's rows launched before this one is read back move back by as many: `device_step.shift_rows`), then
    the drafts, row-major, where the next step's rows read them (`request.device_input`). Rows of this step that were
    launched so move back first, as its forward's did (their rejected counts are the previous head step's)."""
    from jinfer.engine.device_step import shift_rows

    del out
    batch, live, first, count, drafts, forced, shift = head_inputs(packed, dims)
    batch, _ = shift_rows(batch, jnp.full_like(batch.input_ids, -1), shift, tokens, page_size)
    accepted = accepted_drafts(tokens, first, count, drafts, forced)
    new, kv = chain(weights, kv, head_rows(batch, tokens, first, count, drafts, accepted), aux, live, cfg=cfg,
                    num_steps=num_steps, ops=ops)
    rejected = jnp.maximum(count - 1 - accepted, 0)
    written = jnp.concatenate([rejected, new.reshape(-1)]).astype(tokens.dtype)
    tokens = jax.lax.dynamic_update_slice(tokens, written, (first_row,))
    return jnp.concatenate([new, accepted[:, None]], axis=1).astype(jnp.int32), kv, tokens

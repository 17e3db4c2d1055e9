"""EAGLE-3 drafts in the engine (speculative_config {"method": "eagle3", "model": DIR, "num_speculative_tokens": k}):
the draft head of jinfer/models/eagle3.py run on the device after each step, its drafts handed to the requests
through the `Proposer` interface.

Start-up (engine/builder.py): `load_head` loads the head after the target; the KV pool's pages grow by the head's
one attention layer (`head_page_bytes`: its K and V, replicated over a mesh), kept here as its own
`[num_pages, page_size, kv_heads, head_dim]` pair on the target's page ids; the target's executables return the
hidden states at the head's `aux_layers` (`Launched.aux`, kept on the device).

After a step is read back and the scheduler updated (`after_step`; with speculation the engine is synchronous, so
the host knows every sequence's accepted tokens), one jitted call per step runs on the step's own shapes:
- the head's first pass over *every* row of the step (prefill chunks too, so a preempted and recomputed sequence's
  head KV is rewritten): row at position q takes the token at q + 1 (a prompt token mid-prefill, the token just
  sampled at a sequence's last accepted row). Rows whose next token is not known (rejected drafts' rows) and the
  rows of sequences that finished write nothing;
- then k - 1 one-token steps (`eagle3.propose`) for the sequences that sampled and go on ("live"), from their last
  accepted row. The chain writes the head's KV up to that row's position + k - 1: those pages are allocated here
  (`allocate_slots` for k - 1 more tokens; the next step needs them for its verification row anyway); where the
  pool is short, the chain's write into a page-table entry not allocated (the reserved page 0) is dropped.
The drafts [B, k] are read back, cut to the room left in the context, and returned by `propose` before the next
schedule (the scheduler's `_fit_drafts` drops what does not fit the budget or max_tokens).

Prefix cache: the head's KV at position p depends on the token at p + 1, so a hit's last page may hold KV computed
with another next token: with a head, a prefix hit is one page shorter (`KVCacheManager(hit_drop_last_page=True)`),
that page is recomputed. Drafts only ever cost acceptance, never correctness: pages restored from the host tier
and the last rows of a finished sequence's cached pages carry no (or stale) head KV.
Not built: drafting inside the step's own launch (drafts kept on the device), tensor-parallel shards of the head
(it runs replicated, on the reference ops), multi-process groups.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jinfer.config.model import ModelConfig
from jinfer.config.speculative import SpeculativeConfig
from jinfer.models import eagle3
from jinfer.models.batch import Batch
from jinfer.ops import REFERENCE_OPS
from jinfer.weights.eagle3 import load_eagle3


def load_head(config: SpeculativeConfig, target: ModelConfig, target_weights, dtype: str, mesh
              ) -> tuple[eagle3.Eagle3Config, eagle3.Eagle3Weights]:
    """The head `config.model` names, for this target; ValueError naming the field where it cannot serve it."""
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
        self.kv_manager, self.max_model_len = kv_manager, max_model_len
        self.page_size, self.page_buckets = runner.page_size, runner.page_buckets
        target_kv = next(layer[0] for layer in runner.kv_cache if layer[0].ndim == 4)  # a paged layer's K
        spec = self.cache_spec(cfg)
        shape = (target_kv.shape[0], self.page_size, spec.num_kv_heads, spec.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, runner.dtype),  # the model's dtype (the target's KV may be FP8)
                        out_shardings=NamedSharding(runner.mesh, PartitionSpec()))
        self.kv = (zeros(), zeros())
        ops = runner.ops if runner.mesh.size == 1 else REFERENCE_OPS  # (replicated: no sharded kernels)
        self._chain = jax.jit(functools.partial(self.chain, cfg=cfg, num_steps=k, ops=ops), donate_argnames=("kv",))
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (its num_tokens, draft)

    cache_spec = staticmethod(eagle3.cache_spec)  # the head's one layer of KV
    chain = staticmethod(_chain)  # (weights, kv, batch, aux, live, *, cfg, num_steps, ops) -> (drafts, kv)

    def propose(self, requests: Sequence) -> list[list[int]]:
        """The drafts the last step's chain made for these requests (none for a request that moved on since)."""
        out = []
        for r in requests:
            entry = self._drafts.get(r.request_id)
            out.append(entry[1] if entry is not None and entry[0] == r.num_tokens else [])
        return out

    def after_step(self, launched) -> None:
        """Run the head over a step read back (`Launched`: its scheduler output, padded batch and hidden states) and
        keep each live sequence's drafts for `propose`."""
        self._drafts = {}
        built, scheduled = launched.batch, launched.out.scheduled
        if built is None or launched.aux is None or not scheduled:
            return
        T, B = built.input_ids.shape[0], built.seq_lens.shape[0]
        ids, slots = np.zeros(T, np.int32), built.slot_mapping.astype(np.int32)  # (a copy)
        last, live, room = np.zeros(B, np.int32), np.zeros(B, bool), {}
        tables = {}
        for b, s in enumerate(scheduled):
            r, lo, n = s.request, int(built.query_start[b]), s.num_new_tokens
            nxt = [] if r.is_finished else r.all_token_ids[s.start + 1:s.start + n + 1]  # rows whose next is known
            v = len(nxt)
            ids[lo:lo + v] = nxt
            slots[lo + v:lo + n] = -1
            last[b] = lo + max(v, 1) - 1
            k = min(self.k, self.max_model_len - r.num_tokens)
            if not (s.needs_sample and v and k > 0 and r.num_computed_tokens == r.num_tokens - 1):
                continue
            live[b], room[b] = True, k
            ahead = min(self.k - 1, self.max_model_len - r.num_computed_tokens)
            if ahead > 0:  # the chain's KV positions (module doc); where the pool is short, writes are dropped
                self.kv_manager.allocate_slots(r, ahead)
            tables[b] = r.page_ids
        if not (slots[:T] >= 0).any():
            return
        P = built.page_table.shape[1]
        width = max([P] + [len(p) for p in tables.values()])
        P2 = next((p for p in self.page_buckets if p >= width), width)
        page_table = np.zeros((B, P2), np.int32)
        page_table[:, :P] = built.page_table
        for b, pages in tables.items():
            page_table[b, :len(pages)] = pages
        batch = Batch(ids, built.positions, slots, built.query_start, built.seq_lens, page_table, last,
                      built.state_slots)
        drafts, self.kv = self._chain(self.weights, self.kv, batch, launched.aux, live)
        if room:
            drafts = np.asarray(drafts)
            self._drafts = {scheduled[b].request_id: (scheduled[b].request.num_tokens, drafts[b, :k].tolist())
                            for b, k in room.items()}

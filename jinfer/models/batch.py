"""The model's input: a flattened batch of new tokens from several sequences over a paged KV cache.

Prefill, chunked prefill and decode are the same thing here: sequence b contributes the tokens
`input_ids[query_start[b]:query_start[b+1]]` at positions `positions[...]`, and after the step its
context holds `seq_lens[b]` tokens (cached ones plus the new ones). Everything is padded to static
bucket sizes (T tokens, B sequences, P pages per sequence) so a handful of shapes are compiled.

KV cache: a tuple with one entry per layer (cache/spec.py): a `(k, v)` pair, each `[num_pages, page_size,
num_kv_heads, head_dim]`, or a latent `(rows,)` `[num_pages, page_size, dim]` (DeepSeek's MLA). Token t of the
batch is written to flat slot `slot_mapping[t]` (= page * page_size + offset); a negative slot means padding.
Page 0 is reserved: it never holds a sequence's tokens (padding writes and padding page-table entries point at
it), so real pages are 1..num_pages-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class Batch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, flat KV slot to write; -1 for padding tokens
    query_start: jax.Array  # [B+1] int32, cumulative new-token counts; padding seqs repeat the last value
    seq_lens: jax.Array  # [B] int32, context length after this step; 0 for padding seqs
    page_table: jax.Array  # [B, P] int32, page ids of each sequence (unused entries: any valid id, e.g. 0)
    # [N] int32, rows of the flattened tokens whose logits are returned: in the engine, each sequence's last token, or
    # its last few (the drafts it verifies), then padding
    logits_indices: jax.Array
    # [B] int32, each sequence's slot in the per-sequence state pools of linear-attention layers (slot 0:
    # reserved, padding sequences); unused by models without such layers
    state_slots: jax.Array | None = None
    # [B] int32, the slot each sequence's state is written to after the step (None: `state_slots`): a row verifying
    # drafts writes the other slot of its pair (jinfer/engine/scheduler.py)
    state_write_slots: jax.Array | None = None
    # [B] int32 (None: zeros): where > 0, the slot read takes the state after the sequence's first state_keep[b] rows:
    # a row verifying drafts keeps there the state after its known tokens, from which a rejection goes on
    state_keep: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def make_batch(
    seqs: list[tuple[list[int], int, list[int]]],
    page_size: int,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    all_logits: bool = False,
    state_slots: list[int] | None = None,
) -> Batch:
    """Host-side helper: build a padded Batch from (new_token_ids, num_cached_tokens, page_ids) per seq.
    `state_slots`: each sequence's state slot (default b + 1: slot 0 is reserved).

    Returns numpy arrays inside the Batch (jit converts them). With `all_logits`, logits of every
    real token are returned (golden tests); otherwise those of each sequence's last new token.
    """
    total = sum(len(toks) for toks, _, _ in seqs)
    T = num_tokens or total
    B = num_seqs or len(seqs)
    P = pages_per_seq or max(len(p) for _, _, p in seqs)
    if total > T or len(seqs) > B:
        raise ValueError(f"batch of {total} tokens / {len(seqs)} seqs exceeds buckets T={T}, B={B}")
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, -1, np.int32)
    qstart = np.zeros(B + 1, np.int32)
    seq_lens = np.zeros(B, np.int32)
    table = np.zeros((B, P), np.int32)
    last = []
    t = 0
    for b, (toks, cached, pages) in enumerate(seqs):
        n = len(toks)
        if 0 in pages:
            raise ValueError(f"sequence {b}: page 0 is reserved and cannot hold tokens")
        if (cached + n + page_size - 1) // page_size > len(pages):
            raise ValueError(f"sequence {b}: {cached + n} tokens need more than {len(pages)} pages")
        pos = np.arange(cached, cached + n)
        input_ids[t:t + n] = toks
        positions[t:t + n] = pos
        slots[t:t + n] = np.asarray(pages)[pos // page_size] * page_size + pos % page_size
        table[b, :len(pages)] = pages
        seq_lens[b] = cached + n
        t += n
        qstart[b + 1] = t
        last.append(t - 1)
    qstart[len(seqs) + 1:] = t
    logits_idx = np.arange(total, dtype=np.int32) if all_logits else np.asarray(last + [0] * (B - len(seqs)), np.int32)
    state = np.zeros(B, np.int32)
    state[:len(seqs)] = state_slots if state_slots is not None else np.arange(1, len(seqs) + 1)
    return Batch(input_ids, positions, slots, qstart, seq_lens, table, logits_idx, state)

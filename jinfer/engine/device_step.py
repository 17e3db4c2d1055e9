"""The pure functions a step's executables are compiled from (`executables.py` jits them): the forward on the
packed batch, the sampler on the packed sampling parameters, the split of prompt logprobs, and forks' copies.

Only values with a stable repr are bound to them (`functools.partial`): those key the executable cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jinfer.engine.sampler import sample_traced, token_logprobs
from jinfer.engine.sampling_tensors import mask_words
from jinfer.engine.step_inputs import pack_samples, unpack_batch, unpack_sampling
from jinfer.models.registry import forward
from jinfer.parallel.mesh import mesh_forward

# Forked samples' copies go to the device in calls of at most this many (page, slot) pairs, padded to a power of
# two (no-op copies of the null page and the reserved slot onto themselves): FORK_CHUNK.bit_length() executables.
FORK_CHUNK = 16


def token_seqs(batch) -> jax.Array:
    """i32[T]: the sequence of each token of the batch (padding tokens: the last sequence's)."""
    from pallas_kernels.common import search_right

    T, B = batch.input_ids.shape[0], batch.seq_lens.shape[0]
    return jnp.clip(search_right(batch.query_start, jnp.arange(T)) - 1, 0, B - 1)


def shift_rows(batch, prev, shift_from, prev_tokens, page_size: int):
    """A step launched before the step in flight is read back (speculative decoding): the host built each row that
    follows a verification in flight as if it kept every draft; `shift_from[b] >= 0` is the row of `prev_tokens` where
    the drafter's device step wrote how many drafts that verification rejected (jinfer/spec/eagle.py). Sequence b's
    row moves back by as many: positions, KV slots (from its page table), context length, its first input (the
    sample after the kept drafts: `prev`), and with state pairs the slots (all kept: the request's state is in the slot
    the verification wrote, so the two swap). (batch, prev); the same batch where nothing was rejected."""
    T, B = batch.input_ids.shape[0], batch.seq_lens.shape[0]
    shifted = shift_from >= 0
    rejected = jnp.where(shifted, prev_tokens[jnp.clip(shift_from, 0, prev_tokens.shape[0] - 1)], 0)
    seq = token_seqs(batch)
    d = jnp.where(jnp.arange(T) < batch.query_start[B], rejected[seq], 0)
    pos = batch.positions - d
    page = batch.page_table[seq, jnp.clip(pos // page_size, 0, batch.page_table.shape[1] - 1)]
    slots = jnp.where((d > 0) & (batch.slot_mapping >= 0), page * page_size + pos % page_size, batch.slot_mapping)
    first = (jnp.arange(T) == batch.query_start[seq]) & (prev >= 0)
    swap = shifted & (rejected == 0)
    read, write = batch.state_slots, batch.state_write_slots
    if read is not None and write is not None:
        read, write = jnp.where(swap, write, read), jnp.where(swap, read, write)
    batch = dataclasses.replace(batch, positions=pos, slot_mapping=slots, seq_lens=batch.seq_lens - rejected,
                                state_slots=read, state_write_slots=write)
    return batch, jnp.where(first, prev - d, prev)


def forward_step(weights, buf, kv_cache, prev_tokens, logits_out, *table, dims, cfg, ops, mesh, specs,
                 aux_layers=(), expert_load=False, weights_tree=None, page_size=0):
    """Unpack the batch (dims = (T, B, P, L)) and run the model's forward on the mesh (`parallel.mesh_forward`;
    `specs`: the weights' and the cache's PartitionSpecs): (logits [L, V], the cache), and with `aux_layers` (an
    EAGLE-3 head's) the hidden states at those boundaries [T, n*H] too. `logits_out` (donated, unread): the
    previous logits of this shape (and with `aux_layers` the previous hidden states), whose buffers the outputs are
    written to, so that every output of a step stays at the same address from step to step (runner.py: stable step
    buffers). `table`: the one-shot all-reduce's
    workspace table, where the runner uses that kernel (`all_reduce_table`). `expert_load` (`--expert-load-stats`):
    the MoE layers' expert counts i32[MoE layers, E] come last (`base.decoder_forward`). `weights_tree`: `weights`
    come as their flat leaves, this the tree's structure (the runner flattens them once, not at every step's call:
    a Qwen3-8B FP8 tree's custom nodes cost ~0.15 ms of dispatch a call on a 2-core CPU, `bench_dispatch`).
    `page_size` > 0 (an engine with a model drafter): rows after a verification in flight move on the device
    (`shift_rows`)."""
    del logits_out
    if weights_tree is not None:
        weights = jax.tree.unflatten(weights_tree, weights)
    batch, prev, shift_from = unpack_batch(buf, dims)
    if page_size:
        batch, prev = shift_rows(batch, prev, shift_from, prev_tokens, page_size)
    # Tokens sampled by the previous step (the first token of its sequences' decodes) are read from its buffer.
    batch.input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], batch.input_ids)
    return mesh_forward(forward, cfg, ops, mesh, *specs, aux_layers, all_reduce_table=bool(table),
                        expert_load=expert_load)(weights, batch, kv_cache, *table)


def fork_step(kv_cache, pairs, *, slot_layers: frozenset[int]):
    """pairs i32[4, N]: (source, destination) pages, then (source, destination) state slots. Each paged layer's
    destination pages get the source pages' entries, each slot layer's destination slots the source slots' (an FP8
    layer's scales, 1-D, are the layer's and stay)."""
    out = []
    for i, layer in enumerate(kv_cache):
        src, dst = (pairs[2], pairs[3]) if i in slot_layers else (pairs[0], pairs[1])
        out.append(tuple(a.at[dst].set(a[src]) if a.ndim > 1 else a for a in layer))
    return tuple(out)


def sample_step(logits, buf, prev_tokens, packed_out, *, dims, num_logprobs, flags):
    """Sample every logits row (dims = (R, M, W, K)): (packed samples i32[R, 3 + 2N], written into the donated
    `packed_out` of that shape, whose values are not read; the sampled ids in the first R rows of `prev_tokens`
    (donated), from which the next step takes the inputs of its decodes)."""
    R, V = logits.shape
    max_rows = prev_tokens.shape[0]
    t = unpack_sampling(buf, dims, mask_words(V) if flags.grammar else 0)
    if dims[1]:  # penalties: an output token still pending on the host is -2 - (its row in prev_tokens)
        ids = t.output_tokens
        t.output_tokens = jnp.where(ids <= -2, prev_tokens[jnp.clip(-2 - ids, 0, max_rows - 1)], ids)
    # rows after a verification in flight: their outputs' index moves back by the drafts it rejected (`shift_rows`)
    t.steps = t.steps - jnp.where(t.shifts >= 0, prev_tokens[jnp.clip(t.shifts, 0, max_rows - 1)], 0)
    r = sample_traced(logits, t, num_logprobs, flags)
    packed = pack_samples(r.tokens, r.logprobs, r.ranks, r.top_ids, r.top_logprobs)
    return packed, prev_tokens.at[:R].set(r.tokens)  # (rows past R: a drafter's, `ModelRunner.ids_rows`)


def prompt_logprobs_step(logits, targets, *, num_rows, k):
    """Split the logits of a step with prompt logprobs: the sampler's [R, V], and the packed logprobs of the
    prompt positions [T, 2 + 2k] (see `Launched.prompt_packed`)."""
    lp, ranks, top_ids, top_lps = token_logprobs(logits[num_rows:], targets, k)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    return logits[:num_rows], jnp.concatenate([bits(lp)[:, None], ranks[:, None], top_ids, bits(top_lps)], axis=1)

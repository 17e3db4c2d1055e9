"""Host-side batch building: a schedule's sequences padded into one `Batch` of bucketed shapes, and the sampler's
parameters per logits row (numpy; `step_inputs.py` packs both for the device).

A sequence contributes its new tokens (ragged: a prefill chunk, a one-token decode, or a decode of its last token
and the drafts it verifies) and `max(1, ScheduledRequest.num_logits)` logits rows, its last positions, in batch
order: one row per sequence in plain steps (row b = sequence b). The sampler gets one parameter row per logits
row: a sequence's rows share its parameters, each with its own step (the noise key, min_tokens) and the drafts
before it counted as outputs (penalties). It reads only the `ScheduledRequest` interface, never a `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jinfer.cache.manager import NULL_PAGE
from jinfer.engine.bad_words import banned_tokens
from jinfer.engine.request import DEVICE_DRAFT
from jinfer.engine.sampling_tensors import SamplingTensors, mask_words, uses_penalties
from jinfer.engine.scheduler import SchedulerOutput
from jinfer.models.batch import Batch


@dataclass
class StepRow:
    """Sampling inputs of one scheduled sequence that needs a token."""

    params: object  # SamplingParams-like
    output_ids: list[int]  # generated ids known on the host (penalties read them)
    prompt: object  # packed prompt token set (repetition penalty) or None
    seed: int
    step: int  # index of the token being sampled among the request's outputs (keys the noise); the last row's
    min_tokens_ids: tuple[int, ...] = ()  # masked while step < min_tokens (EOS, stop ids)
    allowed: object = None  # allowed_token_ids as a packed token set, or None
    bad_words: tuple[tuple[int, ...], ...] = ()  # bad_words' token ids (banned per step from output_ids)
    guided: bool = False  # a grammar constrains it: its token mask also masks its logprobs


@dataclass
class BuiltBatch:
    batch: Batch  # numpy arrays, padded to (T, B, P) and R logits rows
    prev_index: np.ndarray  # [T] the row of the previous step's samples a token takes as input (-1: its own id)
    R: int  # logits rows the sampler takes: B, or T when the sequences return more than B rows
    counts: np.ndarray  # [len(scheduled)] logits rows per sequence (>= 1: a sequence that samples nothing has a
    #                     padding row)
    rows: dict[str, tuple[int, int]]  # request id -> (first logits row, count), the sequences that sample
    max_query_len: int = 0  # the most new tokens of one sequence (a verify step's executable takes up to its Q)
    packed: np.ndarray | None = None  # `step_inputs.pack_batch(batch, prev_index, shift_from)` when built so (small)
    shift_from: np.ndarray | None = None  # [B] each sequence's `ScheduledRequest.shift_from` (-1: padding)


def build_batch(out: SchedulerOutput, prev_rows: dict[str, int] | None, T: int, B: int, P: int,
                page_size: int) -> BuiltBatch:
    """Pad the scheduled sequences into one Batch. `prev_rows`: request id -> the row of the previous (in-flight)
    step's samples holding its sampled token, for the rows whose first input is that token."""
    n_seqs = len(out.scheduled)
    if n_seqs > B:
        raise ValueError(f"{n_seqs} sequences exceed the bucket of {B}")
    if out.num_scheduled_tokens <= SMALL_STEP:
        return _build_small(out, prev_rows, T, B, P, page_size)
    ps = page_size
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
        tokens = s.token_ids
        if s.input_from_device:  # its first token is the one `prev` is sampling
            prev_index[query_start[b]] = prev_rows[s.request_id]
            tokens = [0, *tokens[1:]]
        ids.extend(tokens)
    input_ids[:total] = ids
    device = input_ids <= DEVICE_DRAFT  # drafts the device holds (request.device_input)
    prev_index[device] = DEVICE_DRAFT - input_ids[device]
    input_ids[device] = 0
    if (input_ids[:total] < 0).any():
        raise ValueError("a pending token past a row's first one comes from the device: one step in flight at most")
    positions = np.zeros(T, np.int32)
    positions[:total] = pos
    slots = np.full(T, -1, np.int32)
    slots[:total] = page_table[seq_of_token, pos // ps] * ps + pos % ps
    seq_lens = np.zeros(B, np.int32)
    seq_lens[:n_seqs] = starts + counts
    logit_counts = np.fromiter((max(1, s.num_logits) for s in out.scheduled), np.int32, n_seqs)
    num_rows = int(logit_counts.sum())
    R = B if num_rows <= B else T  # (every row is a token: num_rows <= T)
    first_row = np.zeros(n_seqs, np.int32)
    np.cumsum(logit_counts[:-1], out=first_row[1:])
    logits_idx = np.zeros(R, np.int32)
    if num_rows == n_seqs:  # one row per sequence: its last token
        logits_idx[:n_seqs] = query_start[1:n_seqs + 1] - 1
    else:  # each sequence's last logit_counts[b] tokens
        row_seq = np.repeat(np.arange(n_seqs), logit_counts)
        logits_idx[:num_rows] = (query_start[1:n_seqs + 1][row_seq] - logit_counts[row_seq]
                                 + np.arange(num_rows) - first_row[row_seq])
    state_slots = np.zeros((3, B), np.int32)  # read, written, rows kept; padding sequences: the reserved slot 0
    state_slots[:, :n_seqs] = [[s.state_slot for s in out.scheduled], [s.state_write_slot for s in out.scheduled],
                               [s.state_keep for s in out.scheduled]]
    rows = {s.request_id: (int(first_row[b]), int(logit_counts[b]))
            for b, s in enumerate(out.scheduled) if s.needs_sample}
    shift_from = np.full(B, -1, np.int32)
    shift_from[:n_seqs] = [s.shift_from for s in out.scheduled]
    return BuiltBatch(Batch(input_ids, positions, slots, query_start, seq_lens, page_table, logits_idx, *state_slots),
                      prev_index, R, logit_counts, rows, int(counts.max()), shift_from=shift_from)


SMALL_STEP = 256  # steps of at most this many tokens (decodes, drafts verified) are built per token in Python


def _build_small(out: SchedulerOutput, prev_rows: dict[str, int] | None, T: int, B: int, P: int,
                 ps: int) -> BuiltBatch:
    """`build_batch` for a few tokens: lists per token, written straight into the packed buffer the forward takes
    (`BuiltBatch.packed`; the batch's arrays are views of it). A step's numpy calls cost more than its tokens' Python
    here (~40 calls: 0.2 ms of the host's time in series with the device at batch 1)."""
    ids, pos, slots, prev, qs, lens, logits_idx, counts = [], [], [], [], [0], [], [], []
    state_slots, writes, keep, shifts = [], [], [], []
    rows, row, longest = {}, 0, 0
    tables = []
    for s in out.scheduled:
        n, start, pages = s.num_new_tokens, s.start, s.page_ids
        longest = n if n > longest else longest
        tables.append(pages)
        tokens = s.token_ids
        if s.input_from_device:  # its first token is the one `prev` is sampling
            row_prev = [prev_rows[s.request_id]] + [-1] * (n - 1)
            tokens = [0, *tokens[1:]]
        else:
            row_prev = [-1] * n
        if s.device_drafts:  # read from the device's rows (request.device_input)
            row_prev = [DEVICE_DRAFT - t if t <= DEVICE_DRAFT else p for t, p in zip(tokens, row_prev)]
            tokens = [0 if t <= DEVICE_DRAFT else t for t in tokens]
        prev += row_prev
        ids += tokens
        positions = range(start, start + n)
        pos += positions
        slots += [(pages[p // ps] if p // ps < len(pages) else NULL_PAGE) * ps + p % ps for p in positions]
        q = qs[-1] + n
        qs.append(q)
        lens.append(start + n)
        c = max(1, s.num_logits)
        counts.append(c)
        logits_idx += range(q - c, q)
        if s.needs_sample:
            rows[s.request_id] = (row, c)
        row += c
        state_slots.append(s.state_slot)
        writes.append(s.state_write_slot)
        keep.append(s.state_keep)
        shifts.append(s.shift_from)
    total = qs[-1]
    if min(ids, default=0) < 0:
        raise ValueError("a pending token past a row's first one comes from the device: one step in flight at most")
    R = B if row <= B else T
    # the packed layout (`step_inputs.pack_batch`): ids, positions, slots, prev rows [T each], query starts [B + 1],
    # lengths [B], logits rows [R], state slots read and written, rows kept, shifts [B each], page table [B, P]
    o_qs = 4 * T
    o_table = o_qs + 6 * B + 1 + R
    packed = np.zeros(o_table + B * P, np.int32)  # (NULL_PAGE, padding ids / positions / lengths / slots: 0)
    n = len(ids)
    packed[:n] = ids
    packed[T:T + n] = pos
    packed[2 * T:4 * T] = -1
    packed[2 * T:2 * T + n] = slots
    packed[3 * T:3 * T + n] = prev
    packed[o_qs:o_qs + len(qs)] = qs
    packed[o_qs + len(qs):o_qs + B + 1] = total
    o = o_qs + B + 1
    packed[o:o + len(lens)] = lens
    packed[o + B:o + B + len(logits_idx)] = logits_idx
    packed[o + B + R:o + B + R + len(state_slots)] = state_slots
    packed[o + 2 * B + R:o + 2 * B + R + len(writes)] = writes
    packed[o + 3 * B + R:o + 3 * B + R + len(keep)] = keep
    packed[o + 4 * B + R:o_table] = -1
    packed[o + 4 * B + R:o + 4 * B + R + len(shifts)] = shifts
    table = packed[o_table:].reshape(B, P)
    for b, pages in enumerate(tables):
        table[b, :len(pages)] = pages
    batch = Batch(packed[:T], packed[T:2 * T], packed[2 * T:3 * T], packed[o_qs:o], packed[o:o + B], table,
                  packed[o + B:o + B + R], packed[o + B + R:o + 2 * B + R], packed[o + 2 * B + R:o + 3 * B + R],
                  packed[o + 3 * B + R:o + 4 * B + R])
    return BuiltBatch(batch, packed[3 * T:4 * T], R, np.asarray(counts, np.int32), rows, longest, packed,
                      packed[o + 4 * B + R:o_table])


def with_pending_output(row: StepRow | None, s, prev_rows: dict[str, int]) -> StepRow | None:
    """A penalized row whose last output token is still being sampled by the previous step (async scheduling): its
    output ids end with the marker -2 - (that token's row in the previous step's samples), which the sampler
    resolves on the device, so penalties never make the host wait for the previous step."""
    if row is None or not s.input_from_device or not uses_penalties(row.params):
        return row
    return replace(row, output_ids=[*row.output_ids, -2 - prev_rows[s.request_id]])


def logits_rows(rows: list[StepRow | None], out: SchedulerOutput, counts: np.ndarray) -> list[StepRow | None]:
    """The sampler's row per logits row from one per sequence: sequence b's counts[b] rows sample its positions
    step - counts[b] + 1 ... step, the drafts before each counted as its outputs (penalties)."""
    if len(counts) == int(counts.sum()):
        return rows
    out_rows = []
    for row, s, n in zip(rows, out.scheduled, counts.tolist(), strict=True):
        if row is None or n == 1:
            out_rows += [row] * n
            continue
        drafts = s.draft_token_ids
        out_rows += [replace(row, step=row.step - (n - 1) + i, output_ids=[*row.output_ids, *drafts[:i]])
                     for i in range(n)]
    return out_rows


def sampling_tensors(rows: list[StepRow | None], R: int, vocab_size: int, token_mask: np.ndarray | None = None,
                     counts: np.ndarray | None = None) -> SamplingTensors:
    """Rows align with the logits rows; None (a sequence that samples nothing) is padding. `token_mask`:
    [>= the logits rows, ceil(V/32)] 32-bit grammar masks per logits row (structured outputs: a verifying sequence's
    rows hold its grammar's mask after each prefix of its drafts), or None when no row has one. Rows with
    allowed_token_ids get their set ANDed in (after the raw logprobs, unlike a grammar's: vLLM's order); bad_words
    become -inf biases."""
    dense = [(r.params, r.output_ids, r.prompt, r.step) if r else ({"temperature": 0.0}, [], None, None)
             for r in rows]
    st = SamplingTensors.from_params(dense, vocab_size, num_seqs=R,
                                     min_tokens_ids=[r.min_tokens_ids if r else () for r in rows],
                                     banned_ids=[banned_tokens(r.bad_words, r.output_ids) if r and r.bad_words
                                                 else () for r in rows])
    for b, r in enumerate(rows):
        if r is not None:
            st.seeds[b] = r.seed % 2**32
    G = mask_words(vocab_size)
    allowed = [(b, r.allowed) for b, r in enumerate(rows) if r is not None and r.allowed is not None]
    if token_mask is None and allowed:
        token_mask = np.full((R, G), -1, np.int32)
    if token_mask is not None:  # rows past the scheduled ones (padding) allow everything
        if token_mask.shape[1] != G:
            raise ValueError(f"token_mask of shape {token_mask.shape} for {R} rows of {vocab_size} tokens")
        # Sized by `batch_rows` before the step's batch was built: a bucket loaded in between (background warm-up
        # or reload) can make R smaller; the rows past len(rows) <= R are padding either way.
        token_mask = token_mask[:R]
        if token_mask.shape[0] < R:
            token_mask = np.concatenate([token_mask, np.full((R - len(token_mask), G), -1, token_mask.dtype)])
        token_mask = token_mask.view(np.uint32)
        for b, mask in allowed:
            token_mask[b] &= mask
        st.token_mask = token_mask
        st.mask_logprobs = np.zeros(R, np.int32)
        st.mask_logprobs[:len(rows)] = [r is not None and r.guided for r in rows]
    return st


def prompt_positions(out: SchedulerOutput, batch: Batch, wants: list[bool]
                     ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]]]:
    """For the wanted sequences, the tokens of this step at prompt positions p < prompt length - 1 (their logits
    score prompt token p + 1): flat token indices and target ids, each padded to T, and the rows' (request id,
    p + 1)."""
    T = batch.num_tokens
    indices, targets = np.zeros(T, np.int32), np.full(T, -1, np.int32)
    rows = []
    for b, s in enumerate(out.scheduled):
        if not wants[b]:
            continue
        prompt = s.prompt_token_ids
        end = min(s.start + s.num_new_tokens, len(prompt) - 1)
        for p in range(s.start, end):
            indices[len(rows)] = batch.query_start[b] + p - s.start
            targets[len(rows)] = prompt[p + 1]
            rows.append((s.request_id, p + 1))
    return indices, targets, rows

"""A step's packed sampling buffer and sampler flags, from per-sequence rows kept across steps.

Most steps sample rows whose sampler inputs are their parameters, their seed and their step only: greedy or plain
sampling (temperature, top-k, top-p, min-p), no penalties, no logit biases, no bad words, no allowed ids, no grammar,
no min_tokens still due. Their part of the packed buffer (`step_inputs.pack_sampling`) is the same every step but for
the step (the key of the row's noise), so `SamplingInputs` keeps each (parameters, seed)'s eight words and flags and
builds a step's buffer with a few numpy calls, whatever the batch's composition and its sequences' logits rows (1 +
drafts, which vary per step). Building it row by row (`batch_builder.sampling_tensors`) took ~0.4 ms of the host per
step at batch 1 with 4 drafts and ~2.8 ms at batch 32 (CPU); steps with any other row still take that path. Rows that
sample nothing are greedy padding with seed 0 here (drawn at random there): nobody reads their samples.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import NamedTuple

import numpy as np

from jinfer.engine.batch_builder import StepRow, logits_rows, sampling_tensors, with_pending_output
from jinfer.engine.sampling_tensors import SamplerFlags, _row_params, sort_flags
from jinfer.engine.step_inputs import pack_sampling

MAX_KEPT = 4096  # (parameters, seed) entries kept; the table starts again past this


class StepSampling(NamedTuple):
    """What a step's `StepInputs` takes from its sampler rows."""

    buffer: np.ndarray  # int32, `pack_sampling`'s layout
    M: int  # output ids per row (penalties)
    W: int  # words of the packed prompt set per row
    K: int  # sparse biases per row
    flags: tuple[bool, ...]  # SamplerFlags fields, in order


class _Kept(NamedTuple):
    params: object  # held, so that no other object takes its id while it is a key
    words: tuple[int, ...]  # the row's 6 float fields' bits, top_k, seed: `pack_sampling`'s first 8 parts
    static: bool  # no penalties, no logit_bias (else the row takes the row-by-row path)
    sampled: bool  # not greedy (SamplerFlags.sampling)
    full_sort: bool  # SamplerFlags.full_sort
    min_tokens: int


def _kept(row: StepRow) -> _Kept:
    """A row's words and flags, as `SamplingTensors.from_params` and `SamplerFlags.of` compute them."""
    values, top_k, _, penalized, logit_bias, min_tokens = _row_params(row.params)
    floats = np.array(values, np.float32)
    seed = np.array([row.seed % 2**32], np.uint32).view(np.int32)
    words = (*floats.view(np.int32).tolist(), top_k, int(seed[0]))
    sampled, full_sort = (bool(f) for f in sort_flags(floats[0], top_k, floats[1]))
    return _Kept(row.params, words, not penalized and not logit_bias, sampled, full_sort, min_tokens)


_PADDING = _kept(StepRow({"temperature": 0.0}, [], None, 0, 0)).words  # a row that samples nothing
_FLAGS = {(s, f): astuple(SamplerFlags(s, f, penalties=False, grammar=False)) for s in (False, True)
          for f in (False, True)}  # (sampling, full_sort) -> the flags of a step of kept rows


class SamplingInputs:
    """Each step's sampler inputs (`build`): from the rows kept across steps when every row allows (module doc)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._kept: dict[tuple[int, int], _Kept] = {}  # (id(params), seed) -> its words
        self._last_key, self._last_words = None, None  # the last step's (R, counts, words) and its words per row
        self.hits = self.misses = 0  # steps built from kept rows / row by row

    def build(self, rows: list[StepRow | None], out, counts: np.ndarray, R: int, token_mask: np.ndarray | None = None,
              prev_rows: dict[str, int] | None = None, shift_from: np.ndarray | None = None) -> StepSampling:
        """`rows`: each scheduled sequence's sampler inputs (None: it samples nothing); `counts`: its logits rows;
        `token_mask`: grammar masks (row by row); `prev_rows`: the step in flight's row of each sequence's pending
        output (penalized rows read it on the device: `batch_builder.with_pending_output`), None when not pending;
        `shift_from`: each sequence's `ScheduledRequest.shift_from` (`BuiltBatch.shift_from`; None: no row moves)."""
        shifts = None  # (rows after a verification in flight: `SamplingTensors.shifts`)
        if shift_from is not None and (shift_from >= 0).any():
            per_row = np.repeat(shift_from[:len(counts)], counts)
            shifts = np.full(R, -1, np.int32)
            shifts[:len(per_row)] = per_row
        if token_mask is None and (fast := self._from_kept(rows, counts.tolist(), R, shifts)) is not None:
            self.hits += 1
            return fast
        self.misses += 1
        if prev_rows is not None:
            rows = [with_pending_output(r, s, prev_rows) for r, s in zip(rows, out.scheduled, strict=True)]
        st = sampling_tensors(logits_rows(rows, out, counts), R, self.vocab_size, token_mask, counts)
        st.shifts = shifts
        return StepSampling(pack_sampling(st), st.output_tokens.shape[1], st.prompt_mask.shape[1],
                            st.bias_ids.shape[1], astuple(SamplerFlags.of(st)))

    def _from_kept(self, rows: list[StepRow | None], counts: list[int], R: int,
                   shifts: np.ndarray | None = None) -> StepSampling | None:
        """The step's buffer from its rows' kept words, or None where a row needs more than its parameters."""
        words, steps, sampled, full_sort = [], [], False, False
        for r, n in zip(rows, counts, strict=True):
            if r is None:
                words.append(_PADDING)
                steps += [0] * n
                continue
            if r.bad_words or r.guided or r.allowed is not None:
                return None
            k = self._kept.get((id(r.params), r.seed))
            if k is None:
                if len(self._kept) >= MAX_KEPT:
                    self._kept.clear()
                k = self._kept[(id(r.params), r.seed)] = _kept(r)
            first = r.step - n + 1
            if not k.static or (k.min_tokens and r.min_tokens_ids and first < k.min_tokens):
                return None
            words.append(k.words)
            steps += range(first, r.step + 1)
            sampled |= k.sampled
            full_sort |= k.full_sort
        num = len(steps)
        key = (R, counts, words)
        if key != self._last_key:  # (a step like the last one, but for its steps, copies the last one's words)
            base = np.empty((8, R), np.int32)  # the float fields, top_k, seeds: pack_sampling's layout
            base[:, :num] = np.repeat(np.array(words, np.int32), counts, axis=0).T
            base[:, num:] = np.array(_PADDING, np.int32)[:, None]
            self._last_key, self._last_words = key, base
        buf = np.empty((10, R), np.int32)
        buf[:8] = self._last_words
        buf[8, :num] = steps
        buf[8, num:] = 0
        buf[9] = -1 if shifts is None else shifts
        return StepSampling(buf.ravel(), 0, 0, 0, _FLAGS[sampled, full_sort])


"""Structured outputs in the engine: one llguidance matcher per constrained sequence, and each step's
token masks.

A request's `StructuredOutputsParams` becomes an llguidance grammar string; the first request with a
given grammar compiles it against the model's tokenizer (an `LLMatcher`, kept in an LRU of
`MAX_COMPILED`, which also validates it); every sequence then gets a matcher compiled for it (about a
millisecond, and no state shared with other sequences, so llguidance's thread pool fills their masks
in parallel), or for grammars slower to compile a `deep_copy` of the cached one. Per step the engine
feeds each sequence's sampled token to its matcher (`advance`) and asks the matchers of the rows about
to sample for their masks (`fill_masks`, in parallel on llguidance's thread pool, straight into the
u32[B, ceil(V/32)] buffer the sampler unpacks on the device). A matcher is plain host state owned by
its sequence: it goes when the sequence finishes or is aborted, and preemption does not touch it (the
tokens it consumed stay the sequence's tokens).

The tokenizer llguidance needs is the model's own (`Tokenizer.backend`, a `tokenizers` object built
from tokenizer.json, a tiktoken file or a GGUF's vocabulary), serialized to JSON once per engine (~0.2 s for a
49k vocabulary). Its EOS ids are the engine's: a grammar that accepts lets them through, and one that
can go no further allows nothing else.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from jinfer.engine.sampling_tensors import mask_words
from jinfer.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_COMPILED = 128  # compiled grammars kept (LRU)
# A grammar that compiles faster than this gets a freshly compiled matcher per sequence; slower ones are
# deep-copied from the cached one. Deep copies share the grammar's lazily built lexer behind one lock:
# on the H100 machine's 16 cores, llguidance's thread pool filled 32 deep copies' masks no faster than
# one thread (7.1 vs 7.1 ms per step), and 32 separately compiled matchers 2.8x faster (2.1 vs 6.0 ms;
# benchmarks/results/structured_masks*_h100.json). Compiling a JSON schema takes ~1 ms.
FRESH_COMPILE_MAX_S = 0.02


class GrammarEngine:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer  # jinfer.tokenizer.Tokenizer or None
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self._executor = None
        # grammar -> (compiled LLMatcher, never advanced; whether sequences get their own compile)
        self._compiled: OrderedDict[str, tuple[Any, bool]] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance

            if self._tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer; this model has none")
            if self._tokenizer.vocab_size > self.vocab_size:
                raise ValueError(f"structured_outputs: the tokenizer's {self._tokenizer.vocab_size} tokens exceed "
                                 f"the model's vocab of {self.vocab_size}")
            # n_vocab = the model's vocab: ids past the tokenizer's (padding rows of the embedding) are never allowed
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=list(self.eos_token_ids))
        return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one sequence; ValueError naming the field if the grammar does not compile."""
        import llguidance

        grammar = params.to_grammar()
        hit = self._compiled.get(grammar)
        if hit is None:
            ll_tokenizer = self.ll_tokenizer  # built once per engine: not part of the grammar's compile time
            t0 = time.perf_counter()
            compiled = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{params.kind} is invalid: {compiled.get_error()}"[:2000])
            self.num_compiled += 1
            self._compiled[grammar] = hit = (compiled, time.perf_counter() - t0 < FRESH_COMPILE_MAX_S)
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()
        self._compiled.move_to_end(grammar)
        compiled, fresh = hit
        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0) if fresh else compiled.deep_copy()

    @staticmethod
    def advance(matcher: Any, token: int) -> bool:
        """Feed a sampled token; True when the sequence must end here (the grammar is complete, or broken)."""
        if not matcher.consume_token(token):
            log.warning("structured output: token %d rejected (%s); ending the sequence", token, matcher.get_error())
            return True
        return matcher.is_stopped()

    def fill_masks(self, rows: list[tuple[Any, int]], num_rows: int) -> np.ndarray:
        """i32[num_rows, ceil(V/32)] token bitsets: row b of each (matcher, b) from its matcher, all ones elsewhere."""
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        masks = np.full((num_rows, mask_words(self.vocab_size)), -1, np.int32)
        if rows:
            fill_next_token_bitmask_par(self._executor, rows, masks)
        return masks

    @staticmethod
    def fill_draft_masks(matcher: Any, drafts: list[int], masks: np.ndarray, row: int) -> None:
        """Speculative decoding: rows row .. row + len(drafts) of `masks` get the matcher's mask after each prefix of
        `drafts` (the matcher advances through them and rolls back)."""
        from llguidance.numpy import fill_next_token_bitmask

        consumed = 0
        for i in range(len(drafts) + 1):
            fill_next_token_bitmask(matcher, masks, row + i)
            if i == len(drafts) or not matcher.consume_token(drafts[i]):
                break  # (a draft the grammar forbids is never accepted: the rows after it are not used)
            consumed += 1
        if consumed:
            matcher.rollback(consumed)

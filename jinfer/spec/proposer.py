"""The drafters' interface, and the one the engine builds from a `SpeculativeConfig`.

A `Proposer` takes the requests that may be drafted this step (running, past their prefill, no token in flight) and
returns a draft per request: up to `num_speculative_tokens` token ids that the next step verifies. Model-free
drafters (n-gram) read the requests' tokens; the EAGLE-3 and MTP drafters will run their own device step here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jinfer.config.speculative import SpeculativeConfig


class Proposer(Protocol):
    k: int  # the most drafts it proposes per request and step

    def propose(self, requests: Sequence) -> list[list[int]]:
        """A draft (a list of up to k ids, maybe empty) per request, in order; a request's tokens are
        `request.all_token_ids` (prompt + accepted outputs), none in flight."""
        ...


def build_proposer(config: SpeculativeConfig, *, max_model_len: int, num_state_slots: int) -> Proposer:
    """The drafter `config` asks for; ValueError naming the field where it cannot run on this engine."""
    if num_state_slots:
        raise ValueError(f"speculative_config.method={config.method!r}: this model keeps a per-sequence recurrent "
                         "state (linear-attention layers), which cannot be rolled back over rejected drafts yet; "
                         "speculative decoding is not supported for it")
    if config.method == "ngram":
        from jinfer.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                             max_model_len)
    raise ValueError(f"speculative_config.method={config.method!r} is recognised but not implemented yet "
                     "(use 'ngram')")

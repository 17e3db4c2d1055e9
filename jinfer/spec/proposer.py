"""The drafters' interface, and the one the engine builds from a `SpeculativeConfig`.

A `Proposer` takes the requests that may be drafted this step (running, past their prefill, no token in flight) and
returns a draft per request: up to `num_speculative_tokens` token ids that the next step verifies. Model-free
drafters (n-gram) read the requests' tokens; the EAGLE-3 drafter launches its head on the device behind each step
(`after_launch`) and hands over the drafts it made; so does a Qwen3.5 checkpoint's MTP layer (jinfer/spec/mtp.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jinfer.config.speculative import SpeculativeConfig


class Proposer(Protocol):
    k: int  # the most drafts it proposes per request and step

    def propose(self, requests: Sequence) -> list[list[int]]:
        """A draft (a list of up to k ids, maybe empty) per request, in order; a request's tokens are
        `request.all_token_ids` (prompt + accepted outputs), none in flight. A drafter with `device_drafts` = True
        takes a second argument, a bool per request: whether its drafts may be handed over as the device holds them
        (`request.device_input` markers instead of ids: jinfer/spec/eagle.py)."""
        ...

    # Optional: `prepare(out, built)`, called with each step's built batch before anything of it is dispatched,
    # returning None or a function the runner calls with the `Launched` step (a model drafter launches its device
    # step behind the target's there: jinfer/spec/eagle.py).
    # Optional, a drafter whose drafts stay on the device, so the next step may be launched before the step in flight
    # is read back (EngineCore): `in_flight(request)` (it may draft a request that step samples), `shift_rows`
    # (request id -> the sampled-ids row where its device step writes that verification's rejected count, after a
    # `propose` with such requests); `accepted(request_id, kept)`: a verification read back kept that many drafts.


def check_proposer(config: SpeculativeConfig, *, num_state_slots: int) -> None:
    """ValueError naming the field where `config`'s drafter cannot run on this engine (checked before the weights
    load)."""
    if num_state_slots and config.method == "eagle3":
        raise ValueError(f"speculative_config.method={config.method!r} is not supported for models with a "
                         "per-sequence recurrent state (linear-attention layers) yet: use 'ngram'")
    if config.method not in ("ngram", "eagle3", "mtp"):
        raise ValueError(f"speculative_config.method={config.method!r} is recognised but not implemented yet "
                         "(use 'ngram', 'eagle3' or 'mtp')")


def build_proposer(config: SpeculativeConfig, *, max_model_len: int, num_state_slots: int, head=None, runner=None,
                   kv_manager=None) -> Proposer:
    """The drafter `config` asks for; ValueError naming the field where it cannot run on this engine. EAGLE-3 and MTP:
    `head` = (config, weights) from `jinfer.spec.eagle.load_head` / `jinfer.spec.mtp.load_head`, with the model
    runner and the page allocator."""
    check_proposer(config, num_state_slots=num_state_slots)
    if config.method == "ngram":
        from jinfer.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                             max_model_len)
    from jinfer.spec.eagle import Eagle3Proposer
    from jinfer.spec.mtp import MtpProposer

    if head is None or runner is None or kv_manager is None:
        raise ValueError(f"speculative_config.method={config.method!r} needs the loaded head, the runner and the KV "
                         "manager")
    proposer = MtpProposer if config.method == "mtp" else Eagle3Proposer
    return proposer(*head, config.num_speculative_tokens or 1, runner=runner, kv_manager=kv_manager,
                    max_model_len=max_model_len)

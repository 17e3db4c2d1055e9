"""MTP drafts in the engine (speculative_config {"method": "mtp", "num_speculative_tokens": k}): the MTP layer a
Qwen3.5 checkpoint ships (jinfer/models/qwen3_5_mtp.py) run as the EAGLE-3 head is (jinfer/spec/eagle.py, whose
proposer this one is): loaded after the target from the target's own checkpoint, its KV paged on the target's pages
(a page's bytes grow by its layer), the target's executables return its last layer's output (`aux_layers =
(num_layers,)`), and one jitted call launched behind each step runs the layer over the step's rows and k - 1 chain
steps.

On Qwen3.5 a rejected draft rolls the sequence back to its row's first draft (jinfer/engine/scheduler.py): the next
step recomputes the drafts accepted (none at k = 1) and verifies those the chain made from the last accepted row.
"""

from __future__ import annotations

from jinfer.config.model import ModelConfig
from jinfer.models import qwen3_5_mtp
from jinfer.spec.eagle import Eagle3Proposer
from jinfer.weights.mtp import load_mtp


def load_head(path: str | None, target: ModelConfig, target_weights, dtype: str, mesh, seed: int = 0
              ) -> tuple[ModelConfig, qwen3_5_mtp.MtpWeights]:
    """(the target's config, the MTP layer's weights) from the target's checkpoint directory `path` (None: a dummy
    target's, random from `seed`); ValueError naming the field where it has none."""
    try:
        return target, load_mtp(path, target, target_weights, dtype, mesh, seed=seed)
    except ValueError as e:
        raise ValueError(f"speculative_config.method='mtp': {e}") from None


def aux_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The target's boundary the layer reads: its last layer's output."""
    return (cfg.num_layers,)


def head_page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes the layer adds to a page on each device (its KV is replicated)."""
    return qwen3_5_mtp.cache_spec(cfg).page_bytes(page_size, dtype, 1)


def _chain(weights, kv, batch, aux, live, *, cfg, num_steps, ops):
    return qwen3_5_mtp.propose(weights, cfg, batch, aux, kv, num_steps, ops, live=live)


class MtpProposer(Eagle3Proposer):
    """The engine's `Proposer` for a Qwen3.5 MTP layer (module doc)."""

    cache_spec = staticmethod(qwen3_5_mtp.cache_spec)
    chain = staticmethod(_chain)

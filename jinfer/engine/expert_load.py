"""The expert-load recorder (`--expert-load-stats`; SGLang's expert distribution recorder, vLLM's EPLB load
statistics): how many (token, top-k slot) assignments each expert of each MoE layer got, per step and in total, and
how evenly that load falls on the expert-parallel ranks.

The device counts (jinfer/ops/moe.py `expert_counts`: the step's real tokens only, padding rows not): the forward's
last output, i32[MoE layers, E], copied to the host with the sampled tokens and read back with them (no sync of its
own). Everything here is host-side numpy on those counts.

Imbalance: rank r of R holds experts [r E/R, (r+1) E/R) (expert parallel's layout); a layer's rank load is the pairs
routed to that rank's experts, and a layer waits for its busiest rank, so a step's imbalance is the sum over its MoE
layers of the busiest rank's load over the sum of the mean rank loads (1.0: balanced; R: every pair on one rank). As
every layer routes the same pairs, that is also the mean over layers of max / mean. The expert imbalance is the same
with one expert per rank: what the busiest expert's rows cost against an even spread, on any number of devices.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

HISTORY = 4096  # steps whose summaries `ExpertLoadRecorder.history` keeps (the counts: the last step's only)
# Expert-parallel splits each step's imbalance is also computed for (those dividing E), whatever the engine's own:
# what an ep=2 / 4 / 8 layout would see of the same routing (a one-GPU benchmark's rows)
WHAT_IF_RANKS = (2, 4, 8)
RANK_TOKENS = "expert_load_rank_tokens_total_"  # + rank: a stats key per rank (a labelled series in /metrics)
EXPERT_TOKENS = "expert_load_expert_tokens_total_"  # + expert id


@dataclass(frozen=True)
class StepLoad:
    """One step's load, summed over its MoE layers."""

    tokens: int  # real tokens in the step (each layer routes tokens x top_k pairs)
    rank_tokens: tuple[int, ...]  # pairs routed to each rank's experts
    imbalance: float  # over the ranks (see the module's docstring)
    expert_imbalance: float  # over the experts
    what_if: dict[int, float]  # {R: the imbalance over R ranks} for the WHAT_IF_RANKS that divide E


def rank_loads(counts: np.ndarray, ranks: int) -> np.ndarray:
    """[L, R]: the pairs routed to each rank's experts per layer, of counts [L, E] (E divisible by ranks)."""
    layers, experts = counts.shape
    return counts.reshape(layers, ranks, experts // ranks).sum(axis=-1)


def imbalance(counts: np.ndarray, ranks: int) -> float:
    """The sum over layers of the busiest rank's load over the sum of the mean rank loads; 1.0 with no load."""
    loads = rank_loads(np.asarray(counts, np.int64), ranks)
    total = loads.sum()
    return float(loads.max(axis=1).sum() * ranks / total) if total else 1.0


class ExpertLoadRecorder:
    """Per step and cumulative expert load of an engine's MoE layers (`layers`: their indices, the rows of the
    counts) over `ranks` expert-parallel ranks (1 without expert parallel: the rank imbalance is then 1.0)."""

    def __init__(self, layers: tuple[int, ...], num_experts: int, top_k: int, ranks: int = 1,
                 history: int = HISTORY):
        if not layers:
            raise ValueError(f"layers={layers!r}: the expert-load recorder needs at least one MoE layer")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be an integer >= 1")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k!r} must be an integer in [1, num_experts={num_experts}]")
        if not isinstance(ranks, int) or ranks < 1 or num_experts % ranks:
            raise ValueError(f"ranks={ranks!r} must be an integer >= 1 dividing num_experts={num_experts}")
        self.layers, self.num_experts, self.top_k, self.ranks = tuple(layers), num_experts, top_k, ranks
        self.cumulative = np.zeros((len(layers), num_experts), np.int64)  # [L, E] pairs since start
        self.last_counts: np.ndarray | None = None  # [L, E] the last step's
        self.history: deque[StepLoad] = deque(maxlen=history)
        self.steps = 0
        self.imbalance_sum = self.expert_imbalance_sum = 0.0

    def record(self, counts: np.ndarray) -> StepLoad:
        """Add one step's counts [L, E] (the forward's expert-load output); returns its summary."""
        counts = np.asarray(counts)
        if counts.shape != self.cumulative.shape:
            raise ValueError(f"counts.shape={counts.shape} must be (MoE layers, experts) = {self.cumulative.shape}")
        self.last_counts = counts
        self.cumulative += counts
        per_rank = tuple(int(n) for n in rank_loads(counts, self.ranks).sum(0))
        step = StepLoad(int(counts[0].sum()) // self.top_k, per_rank, imbalance(counts, self.ranks),
                        imbalance(counts, self.num_experts),
                        {r: imbalance(counts, r) for r in WHAT_IF_RANKS if self.num_experts % r == 0})
        self.steps += 1
        self.imbalance_sum += step.imbalance
        self.expert_imbalance_sum += step.expert_imbalance
        self.history.append(step)
        return step

    def stats(self) -> dict[str, float]:
        """The engine stats' entries (jinfer/engine/stats_log.py's line, server/metrics.py's series): running totals
        (`_total`, `_sum`: an interval's mean is the change of a sum over the change of the steps) and the last
        step's values; per rank and per expert (summed over layers) the pairs since start."""
        last = self.history[-1] if self.history else None
        out = {"expert_load_steps_total": self.steps, "expert_load_ranks": self.ranks,
               "expert_load_imbalance": last.imbalance if last else 1.0,
               "expert_load_imbalance_sum": self.imbalance_sum,
               "expert_load_expert_imbalance": last.expert_imbalance if last else 1.0,
               "expert_load_expert_imbalance_sum": self.expert_imbalance_sum,
               "expert_load_cumulative_imbalance": imbalance(self.cumulative, self.ranks)}
        for r, n in enumerate(rank_loads(self.cumulative, self.ranks).sum(0)):
            out[f"{RANK_TOKENS}{r}"] = int(n)
        for e, n in enumerate(self.cumulative.sum(0)):
            out[f"{EXPERT_TOKENS}{e}"] = int(n)
        return out



def summarize(steps: list[StepLoad]) -> dict[str, float]:
    """Mean and max of each imbalance over some steps (a benchmark's decode steps: the engine's ranks', the
    experts', each what-if split's); {} for none."""
    if not steps:
        return {}
    series = {"imbalance": [s.imbalance for s in steps], "expert_imbalance": [s.expert_imbalance for s in steps]}
    series |= {f"ep{r}_imbalance": [s.what_if[r] for s in steps] for r in steps[0].what_if}
    out = {"steps": len(steps), "tokens_per_step_mean": float(np.mean([s.tokens for s in steps]))}
    for name, values in series.items():
        out |= {f"{name}_mean": float(np.mean(values)), f"{name}_max": float(np.max(values))}
    return out


def expert_load_recorder(config, model_config) -> ExpertLoadRecorder | None:
    """An engine's recorder (`EngineConfig.expert_load_stats`; None when off): its MoE layers over its expert-parallel
    ranks (1 without expert parallel)."""
    if not config.expert_load_stats:
        return None
    from jinfer.models.registry import moe_layers

    ranks = config.tensor_parallel_size if config.enable_expert_parallel else 1
    return ExpertLoadRecorder(moe_layers(model_config), model_config.num_experts, model_config.num_experts_per_tok,
                              ranks)

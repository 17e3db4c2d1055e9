"""`PoolingParams`: what an embedding request asks of the engine (vLLM's class of that name): an embedding request
is `add_request(request_id, prompt_token_ids, PoolingParams(...))` on an embedding model (`ModelConfig.pooling`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from jinfer.errors import InvalidParam
from jinfer.sampling_params import INT32_MAX


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: Matryoshka truncation: the first `dimensions` values of the pooled vector, normalised again
    (at most the model's hidden size: the engine checks; None: the whole vector)."""

    dimensions: int | None = None

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= INT32_MAX):
            raise InvalidParam("dimensions", f"dimensions={d!r} must be an integer >= 1")

    @property
    def n(self) -> int:
        """Sequences the request runs as (SamplingParams.n's meaning): one vector per prompt."""
        return 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

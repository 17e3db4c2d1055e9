"""RoPE settings (HF `rope_scaling` / `rope_parameters`) and the inverse frequencies they give, host-side.

JAX-free: `ModelConfig` holds a `RopeScaling`; jinfer/models/layers.py turns `rope_inv_freq` into the cos/sin
tables. YaRN (DeepSeek-V2/V3) also scales cos/sin by `yarn_attention_factor` and the softmax by
`yarn_softmax_mscale`, as transformers computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling`). Only the fields the type uses matter."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not given
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # 0: derived from factor and the mscales
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")


def rope_scaling_from_hf(rs: dict[str, Any] | None) -> RopeScaling:
    if not rs:
        return RopeScaling()
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rtype,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        beta_fast=float(rs.get("beta_fast") or 32.0),
        beta_slow=float(rs.get("beta_slow") or 1.0),
        mscale=float(rs.get("mscale") or 0.0),
        mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
        attention_factor=float(rs.get("attention_factor") or 0.0),
        truncate=bool(rs.get("truncate", True)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rs: RopeScaling) -> float:
    """What YaRN multiplies cos and sin by (transformers' `attention_factor`); 1 for the other types."""
    if rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    return _yarn_mscale(rs.factor)


def yarn_softmax_mscale(rs: RopeScaling) -> float:
    """DeepSeek's factor on the softmax scale with YaRN: mscale(factor, mscale_all_dim)^2 (HF `yarn_apply_mscale`)."""
    if rs.rope_type == "default" or not rs.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2


def rope_inv_freq(cfg) -> list[float]:
    """RoPE inverse frequencies (host-side, float64) with the configured scaling applied (`cfg`: a ModelConfig)."""
    d = cfg.rotary_dim  # head_dim unless partial RoPE (MLA: the rope part of q/k)
    inv = [1.0 / (cfg.rope_theta ** (i / d)) for i in range(0, d, 2)]
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return [f / rs.factor for f in inv]
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(inv, d, cfg.rope_theta, rs)
    if rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rs.factor)
            else:
                smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                    rs.high_freq_factor - rs.low_freq_factor)
                out.append((1 - smooth) * f / rs.factor + smooth * f)
        return out
    return inv


def _yarn_inv_freq(inv: list[float], d: int, base: float, rs: RopeScaling) -> list[float]:
    """transformers' `_compute_yarn_parameters`: interpolated (f / factor) below the correction range, extrapolated
    (f) above it, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(inv):
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / rs.factor * (1 - extrapolation) + f * extrapolation)
    return out

"""Model and engine configuration.

`ModelConfig` is static under jit (frozen, hashable): it is built from an HF `config.json` or from
GGUF metadata and validated once, so the forward pass can branch on it in Python at trace time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our family name. Every family here is the llama-style dense decoder
# (jinfer/models/llama.py) with a few switches (QKV bias for qwen2, per-head q/k RMSNorm for qwen3).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling`). Only the fields the type uses matter."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not supported; supported: {GGUF_ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | str | Path) -> ModelConfig:
        """Build from a parsed HF config.json (or a path to one, or to its directory)."""
        if not isinstance(cfg, dict):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"config.json not found at {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"config.json at {path} is not valid JSON: {e}") from None
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise ValueError(f"config field 'architectures'={archs!r} must be a non-empty list; "
                             f"supported: {sorted(HF_ARCHITECTURES)}")
        family = HF_ARCHITECTURES.get(archs[0])
        if family is None:
            raise ValueError(f"config field 'architectures'={archs!r} is not supported; "
                             f"supported: {sorted(HF_ARCHITECTURES)}")

        def req(name: str) -> Any:
            if cfg.get(name) is None:
                raise ValueError(f"config field {name!r} is missing (architecture {archs[0]})")
            return _positive_int(f"config field {name!r}", cfg[name])

        num_heads = req("num_attention_heads")
        hidden = req("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=family,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req("intermediate_size"),
            num_layers=req("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF field 'general.architecture'={arch!r} is not supported; "
                             f"supported: {GGUF_ARCHITECTURES}")

        def req(key: str) -> Any:
            full = f"{arch}.{key}"
            if meta.get(full) is None:
                raise ValueError(f"GGUF field {full!r} is missing")
            return _positive_int(f"GGUF field {full!r}", meta[full])

        num_heads = req("attention.head_count")
        hidden = req("embedding_length")
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            raise ValueError(f"GGUF field '{arch}.vocab_size' is missing and there is no tokenizer.ggml.tokens")
        scaling = RopeScaling()
        stype = meta.get(f"{arch}.rope.scaling.type")
        if stype == "linear":
            scaling = RopeScaling("linear", float(meta.get(f"{arch}.rope.scaling.factor", 1.0)))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        tied = tensor_names is not None and "output.weight" not in tensor_names
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(req("feed_forward_length")),
            num_layers=int(req("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=tied,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}={value!r} must be a positive integer")
    return value


def _rope_scaling_from_hf(rs: dict[str, Any] | None) -> RopeScaling:
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
    )


# Named real shapes for performance work with dummy weights.
NAMED_SHAPES: dict[str, ModelConfig] = {
    "qwen3-4b": ModelConfig("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, 40960, 1e-6, 1e6,
                            tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 40960, 1e-6, 1e6,
                            qk_norm=True, eos_token_ids=(151645,)),
    "llama3-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 1e-5, 5e5,
                             eos_token_ids=(128009,)),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e-5, 1e5,
                                tie_word_embeddings=True, eos_token_ids=(2,)),
}


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """RoPE inverse frequencies (host-side, float64) with the configured scaling applied."""
    d = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / d)) for i in range(0, d, 2)]
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return [f / rs.factor for f in inv]
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

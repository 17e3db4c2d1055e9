"""The model configuration.

`ModelConfig` is static under jit (frozen, hashable): it is built from an HF `config.json` or from
GGUF metadata and validated once, so the forward pass can branch on it in Python at trace time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinfer.config.deepseek_gguf import latent_from_gguf
from jinfer.config.hybrid import hybrid_from_hf
from jinfer.config.hybrid import positive_int as _positive_int
from jinfer.config.quantization import Fp8Config, quantization_from_hf
from jinfer.config.rope import RopeScaling, rope_inv_freq, rope_scaling_from_hf
from jinfer.models.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, HF_ARCHITECTURES, Architecture

__all__ = ["NAMED_SHAPES", "ModelConfig", "RopeScaling", "rope_inv_freq"]

LAYER_TYPES = ("full_attention", "linear_attention")
@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of ARCHITECTURES (jinfer/models/architectures.py)
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
    # Mixture of experts (qwen3_moe). A layer is sparse unless listed in `mlp_only_layers` or skipped by
    # `decoder_sparse_step` (HF's rule, `is_moe_layer`); dense layers use `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Hybrid models (qwen3_5): each layer "full_attention" (paged KV) or "linear_attention" (Gated
    # DeltaNet: a fixed-size state per sequence); () = every layer full attention. The linear layers'
    # shapes: q/k heads and dims, v heads and dims, the causal conv's kernel width.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head
    # Multi-head latent attention (deepseek_v2 / v3): q through a rank-`q_lora_rank` bottleneck (0: one projection),
    # K and V from a `kv_lora_rank` latent plus one shared RoPE key of `qk_rope_head_dim` (together the cached row);
    # head_dim = qk_nope_head_dim + qk_rope_head_dim (q and k). `rope_interleave`: RoPE on (even, odd) pairs.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeekMoE: shared experts beside the routed ones; scores by softmax or sigmoid (+ the checkpoint's correction
    # bias), top-k among the best `topk_group` of `n_group` expert groups, weights times `routed_scaling_factor`.
    num_shared_experts: int = 0
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3.5-MoE: one shared expert of this width beside the routed ones, its output times sigmoid(x @ its gate)
    shared_expert_intermediate_size: int = 0
    # An embedding model (`--runner pooling`, jinfer/config/pooling.py): the forward returns the last token's final
    # normed hidden state, L2-normalised, instead of logits; no lm_head is loaded. Static, so a separate executable.
    pooling: bool = False
    quantization: Fp8Config | None = None  # FP8 linear weights (jinfer/config/quantization.py); None: unquantized

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not supported; supported: {tuple(ARCHITECTURES)}")
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
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"{name}={value!r} must be a positive integer for a mixture-of-experts model")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be <= "
                                 f"num_experts={self.num_experts}")
        elif self.arch.mixture_of_experts:
            raise ValueError(f"num_experts={self.num_experts!r} must be a positive integer for {self.architecture}")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or shared < 0 or shared and (not self.num_experts or self.num_shared_experts):
            raise ValueError(f"shared_expert_intermediate_size={shared!r} must be an integer >= 0, and 0 without "
                             f"experts or beside num_shared_experts={self.num_shared_experts} (DeepSeek's form)")
        self._check_hybrid()
        self._check_latent()
        if not isinstance(self.mlp_only_layers, tuple) or any(
                not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers={self.mlp_only_layers!r} must be a tuple of layer indices "
                             f"in [0, {self.num_layers})")

    def _check_latent(self) -> None:
        if self.arch.latent_attention != bool(self.kv_lora_rank):
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank!r} must be > 0 exactly for latent-attention "
                             f"architectures ({self.architecture})")
        if self.kv_lora_rank:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _positive_int(name, getattr(self, name))
            if self.q_lora_rank:
                _positive_int("q_lora_rank", self.q_lora_rank)
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                                 f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func={self.scoring_func!r} must be 'softmax' or 'sigmoid'")
        if self.num_shared_experts < 0 or self.routed_scaling_factor <= 0:
            raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0 and "
                             f"routed_scaling_factor={self.routed_scaling_factor} > 0")
        if not 1 <= self.topk_group <= self.n_group or (self.num_experts and self.num_experts % self.n_group):
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}] and n_group "
                             f"must divide num_experts={self.num_experts}")

    def _check_hybrid(self) -> None:
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give an even "
                             f"rotary dimension of head_dim={self.head_dim}")
        if self.arch.linear_attention and not self.layer_types:
            raise ValueError(f"layer_types=() must list every layer's type for {self.architecture}")
        if not self.layer_types:
            return
        if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers
                or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types={self.layer_types!r} must be a tuple of num_layers={self.num_layers} "
                             f"entries from {LAYER_TYPES}")
        if not self.arch.linear_attention and "linear_attention" in self.layer_types:
            raise ValueError(f"layer_types: linear_attention layers need an architecture that has them "
                             f"({[a.name for a in ARCHITECTURES.values() if a.linear_attention]}), "
                             f"not {self.architecture!r}")
        if "linear_attention" not in self.layer_types:
            return
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer for linear_attention layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    @property
    def arch(self) -> Architecture:
        """The architecture's entry: its names and switches."""
        return ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def latent_dim(self) -> int:
        """Values per token of a latent KV row (MLA): the latent and the RoPE key (576 for DeepSeek-V2/V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_linear_layer(self, i: int) -> bool:
        """A Gated DeltaNet layer (qwen3_5): a fixed-size state per sequence instead of paged KV."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep paged KV (all of them but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.linear_key_size + self.linear_value_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule (Qwen3MoeDecoderLayer): sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def num_params(self, active: bool = False) -> int:
        """Parameter count; `active`: only the experts a token uses (top-k of each MoE layer)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.arch.linear_attention:
            return self._hybrid_params(active)
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.kv_lora_rank:
            r, heads, rank = self.q_lora_rank, self.num_heads, self.kv_lora_rank
            q = r * (h + 1) + r * self.q_size if r else h * self.q_size
            attn = (q + h * self.latent_dim + rank * (1 + heads * (self.qk_nope_head_dim + self.v_head_dim))
                    + heads * self.v_head_dim * h + 2 * h)
        experts = (self.num_experts_per_tok if active else self.num_experts) + self.num_shared_experts
        router = (h + (self.scoring_func == "sigmoid")) * self.num_experts  # (+ V3's routing bias)
        mlp = sum(router + experts * 3 * h * self.moe_intermediate_size if self.is_moe_layer(n)
                  else 3 * h * i for n in range(self.num_layers))
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * attn + mlp + h

    def _hybrid_params(self, active: bool) -> int:
        h, v = self.hidden_size, self.vocab_size
        full = h * (2 * self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * self.head_dim  # q has its gate
        hv, conv = self.linear_num_value_heads, self.linear_conv_dim
        linear = (h * (conv + self.linear_value_size + 2 * hv) + conv * self.linear_conv_kernel_dim + 2 * hv
                  + self.linear_value_head_dim + self.linear_value_size * h)
        experts = (self.num_experts_per_tok if active else self.num_experts) * self.moe_intermediate_size
        moe = h * self.num_experts + 3 * h * (experts + self.shared_expert_intermediate_size) + h  # router ... gate
        per_layer = [(linear if self.is_linear_layer(n) else full) + 2 * h
                     + (moe if self.is_moe_layer(n) else 3 * h * self.intermediate_size)
                     for n in range(self.num_layers)]
        return v * h * (1 if self.tie_word_embeddings else 2) + sum(per_layer) + h

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
        name = HF_ARCHITECTURES.get(archs[0])
        if name is None:
            raise ValueError(f"config field 'architectures'={archs!r} is not supported; "
                             f"supported: {sorted(HF_ARCHITECTURES)}")
        arch = ARCHITECTURES[name]
        if archs[0] in arch.hf_multimodal_names:  # the text model's config is nested
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"config field 'text_config'={text!r} must be an object (architecture {archs[0]})")
            tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            cfg = {**text, "architectures": archs, "tie_word_embeddings": tie,
                   "quantization_config": cfg.get("quantization_config", text.get("quantization_config"))}

        def req(name: str) -> Any:
            if cfg.get(name) is None:
                raise ValueError(f"config field {name!r} is missing (architecture {archs[0]})")
            return _positive_int(f"config field {name!r}", cfg[name])

        num_heads = req("num_attention_heads")
        hidden = req("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // num_heads
        latent = _latent_from_hf(cfg, name, req) if arch.latent_attention else {}
        head_dim = latent.pop("head_dim", head_dim)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        moe = {}
        if arch.mixture_of_experts:
            # transformers 5 writes `num_local_experts`; published checkpoints have `num_experts`
            experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
            if experts is None:
                raise ValueError(f"config field 'num_experts' is missing (architecture {archs[0]})")
            only = cfg.get("mlp_only_layers") or []
            if not isinstance(only, list):
                raise ValueError(f"config field 'mlp_only_layers'={only!r} must be a list of layer indices")
            moe = dict(num_experts=_positive_int("config field 'num_experts'", experts),
                       num_experts_per_tok=req("num_experts_per_tok"),
                       moe_intermediate_size=req("moe_intermediate_size"),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                       decoder_sparse_step=_positive_int("config field 'decoder_sparse_step'",
                                                         cfg.get("decoder_sparse_step", 1)),
                       mlp_only_layers=tuple(only) or tuple(range(latent.pop("first_k_dense_replace", 0))))
        hybrid = {}
        if arch.linear_attention:
            hybrid = hybrid_from_hf(cfg, req("num_hidden_layers"), archs[0], arch.mixture_of_experts)
        return cls(
            architecture=name,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            intermediate_size=hybrid.pop("intermediate_size", None) or req("intermediate_size"),
            num_layers=req("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch.attention_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pooling=archs[0] in arch.hf_pooling_names,
            quantization=quantization_from_hf(cfg.get("quantization_config")),
            **moe,
            **hybrid,
            **latent,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF field 'general.architecture'={arch!r} is not supported; "
                             f"supported: {tuple(GGUF_ARCHITECTURES)}")
        name = GGUF_ARCHITECTURES[arch]
        mixture_of_experts = ARCHITECTURES[name].mixture_of_experts

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
        num_layers = int(req("block_count"))
        moe = {}
        if mixture_of_experts:
            # llama.cpp has no mlp_only_layers: a layer with a dense ffn_gate and no experts is one
            only = tuple(i for i in range(num_layers) if tensor_names is not None
                         and f"blk.{i}.ffn_gate_exps.weight" not in tensor_names
                         and f"blk.{i}.ffn_gate.weight" in tensor_names)
            moe = dict(num_experts=req("expert_count"), num_experts_per_tok=req("expert_used_count"),
                       moe_intermediate_size=req("expert_feed_forward_length"),
                       norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)), mlp_only_layers=only)
        # a MoE model without dense layers may omit feed_forward_length
        inter = meta.get(f"{arch}.feed_forward_length") if mixture_of_experts else None
        # deepseek2: MLA, DeepSeekMoE and YaRN (jinfer/config/deepseek_gguf.py), over the generic fields
        latent = latent_from_gguf(meta, arch, num_heads) if ARCHITECTURES[name].latent_attention else {}
        return cls(**{**dict(
            architecture=name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(inter or moe.get("moe_intermediate_size") or req("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=tied,
            attention_bias=ARCHITECTURES[name].attention_bias,
            qk_norm=ARCHITECTURES[name].qk_norm,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **moe,
        ), **latent})

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def _latent_from_hf(cfg: dict[str, Any], name: str, req) -> dict[str, Any]:
    """deepseek_v2 / v3's fields: MLA's ranks and head dims, the first dense layers (as `mlp_only_layers`), shared
    experts and routing (V2: softmax, groups by their best expert when `topk_method` is group_limited_greedy; V3:
    sigmoid plus the correction bias, groups by their best two)."""
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config field 'moe_layer_freq'={cfg['moe_layer_freq']!r} is not supported (1 only)")
    v3 = name == "deepseek_v3"
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    out = dict(q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=req("kv_lora_rank"),
               qk_nope_head_dim=req("qk_nope_head_dim"), qk_rope_head_dim=req("qk_rope_head_dim"),
               v_head_dim=req("v_head_dim"), rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
               num_shared_experts=int(cfg.get("n_shared_experts") or 0),
               scoring_func=cfg.get("scoring_func", "sigmoid" if v3 else "softmax"),
               n_group=int(cfg.get("n_group") or 1) if grouped else 1,
               topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
               routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
               first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0))
    out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    return out


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
    # Qwen3-30B-A3B / Qwen3-235B-A22B (their published config.json): every layer sparse, top-8 of 128
    "qwen3-30b-a3b": ModelConfig("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, 40960, 1e-6, 1e6,
                                 qk_norm=True, eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768),
    "qwen3-235b-a22b": ModelConfig("qwen3_moe", 151936, 4096, 12288, 94, 64, 4, 128, 40960, 1e-6, 1e6,
                                   qk_norm=True, eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=1536),
}


def _qwen3_5(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, value_heads: int,
             tied: bool) -> ModelConfig:
    """A Qwen3.5 dense text model (the published config.json's `text_config`): three Gated DeltaNet layers
    to each gated full-attention layer, head_dim 256, RoPE on a quarter of it (theta 1e7), 16 q/k heads of
    128 in the linear layers, conv kernel 4, vocab 248,320."""
    return ModelConfig("qwen3_5", 248320, hidden, inter, layers, heads, kv_heads, 256, 262144, 1e-6, 1e7,
                       tie_word_embeddings=tied, qk_norm=True, eos_token_ids=(248046,),
                       layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                         for i in range(layers)),
                       linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)


def _deepseek(v3: bool) -> ModelConfig:
    """DeepSeek-V2-Lite / DeepSeek-V3 (their published config.json; V3's MTP layer not included): 128 + 64 q/k head
    dims, v 128, latent 512, YaRN (factor 40 over 4096 positions)."""
    yarn = RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, mscale=1.0 if v3 else 0.707,
                       mscale_all_dim=1.0 if v3 else 0.707)
    if v3:
        return ModelConfig("deepseek_v3", 129280, 7168, 18432, 61, 128, 128, 192, 163840, 1e-6, 1e4, yarn,
                           bos_token_id=0, eos_token_ids=(1,), num_experts=256, num_experts_per_tok=8,
                           moe_intermediate_size=2048, mlp_only_layers=(0, 1, 2), q_lora_rank=1536, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                           num_shared_experts=1, scoring_func="sigmoid", n_group=8, topk_group=4,
                           routed_scaling_factor=2.5)
    return ModelConfig("deepseek_v2", 102400, 2048, 10944, 27, 16, 16, 192, 163840, 1e-6, 1e4, yarn,
                       bos_token_id=100000, eos_token_ids=(100001,), num_experts=64, num_experts_per_tok=6,
                       moe_intermediate_size=1408, norm_topk_prob=False, mlp_only_layers=(0,), kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                       num_shared_experts=2)


NAMED_SHAPES |= {
    "deepseek-v2-lite": _deepseek(v3=False),
    "deepseek-v3": _deepseek(v3=True),
    "qwen3.5-0.8b": _qwen3_5(1024, 3584, 24, 8, 2, 16, tied=True),
    "qwen3.5-2b": _qwen3_5(2048, 6144, 24, 8, 2, 16, tied=True),
    "qwen3.5-4b": _qwen3_5(2560, 9216, 32, 16, 4, 32, tied=True),
    "qwen3.5-9b": _qwen3_5(4096, 12288, 32, 16, 4, 32, tied=False),
    # Qwen3.5-35B-A3B (its published text_config): every layer sparse, top-8 of 256 experts of 512 and a shared one
    "qwen3.5-35b-a3b": _qwen3_5(2048, 512, 40, 16, 2, 32, tied=False).replace(
        architecture="qwen3_5_moe", num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512),
}

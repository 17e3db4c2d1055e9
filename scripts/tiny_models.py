"""The tiny random-weight HF models behind the golden tests: one (model class, config, shard size) per architecture.

Imported by make_golden.py (which makes the checkpoints and their goldens with HF transformers).
"""

from __future__ import annotations

from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

VOCAB = 256
# Qwen3.5's attention and Gated DeltaNet shapes (tiny-qwen3_5 and tiny-qwen3_5_moe alike): 2 q/k heads of 16 serving 4 v
# heads of 16 in the linear layers, conv kernel 4; partial RoPE (8 of 32 dims) in the attention layers
QWEN3_5_SHAPE = dict(head_dim=32, tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Larger than the default 0.02 so random logits are peaked enough that greedy argmax
        # has clear margins (see min_margin in the report / npz).
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        attn_implementation="eager",
        dtype="float32",
    )
    base.update(kw)
    return base


def tiny_specs():
    return {
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                **_common(
                    num_hidden_layers=2,
                    intermediate_size=128,
                    tie_word_embeddings=False,
                    rope_scaling={
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32,
                        "rope_theta": 10000.0,
                    },
                    rope_theta=10000.0,
                )
            ),
            "100KB",  # shard -> model.safetensors.index.json + several shards
        ),
        "qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                **_common(
                    num_hidden_layers=3,
                    intermediate_size=160,
                    tie_word_embeddings=True,
                    rope_theta=1000000.0,
                    use_sliding_window=False,
                )
            ),
            None,
        ),
        "qwen3": (
            Qwen3ForCausalLM,
            Qwen3Config(
                **_common(
                    num_hidden_layers=2,
                    intermediate_size=128,
                    num_attention_heads=8,  # 8 q heads over 2 kv heads: tp=8 tests (kv heads replicated)
                    head_dim=32,  # != hidden/heads (8)
                    tie_word_embeddings=False,
                    rope_theta=1000000.0,
                    attention_bias=False,
                    use_sliding_window=False,
                )
            ),
            None,
        ),
        # 8 experts, top-2, layer 1 dense (mlp_only_layers): routing, stacked experts and a dense layer
        # inside one MoE model
        "qwen3_moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **_common(
                    num_hidden_layers=3,
                    intermediate_size=96,
                    moe_intermediate_size=32,
                    num_experts=8,
                    num_experts_per_tok=2,
                    norm_topk_prob=True,
                    decoder_sparse_step=1,
                    mlp_only_layers=[1],
                    num_attention_heads=8,  # tp / ep = 8 tests
                    head_dim=32,
                    tie_word_embeddings=False,
                    rope_theta=1000000.0,
                    attention_bias=False,
                    use_sliding_window=False,
                )
            ),
            None,
        ),
        # Hybrid: layers 0 and 2 Gated DeltaNet, layer 1 gated full attention (an attention layer between two
        # linear ones: layer indices and state-slot indices differ); 2 q/k heads serving 4 v heads in the linear
        # layers, partial RoPE (8 of 32 dims)
        "qwen3_5": (
            Qwen3_5ForCausalLM,
            Qwen3_5TextConfig(
                **_common(
                    num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    intermediate_size=128,
                    **QWEN3_5_SHAPE,
                )
            ),
            None,
        ),
        # MLA (no q low-rank, YaRN with mscale != mscale_all_dim so both the cos/sin factor and the softmax
        # scale differ from 1), layer 0 dense, then softmax routing limited to the best 2 of 4 groups, 2 shared
        "deepseek_v2": (
            DeepseekV2ForCausalLM,
            DeepseekV2Config(**_deepseek_common(
                q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                norm_topk_prob=False,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                                 "rope_theta": 10000.0})),
            None,
        ),
        # MLA with q low-rank, interleaved RoPE; sigmoid routing with the correction bias (set random below),
        # top-2 groups by their two best experts, renormalised and scaled
        "deepseek_v3": (
            DeepseekV3ForCausalLM,
            DeepseekV3Config(**_deepseek_common(
                q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
            None,
        ),
        # Qwen3.5's layers with a sparse MLP in every layer (the config has no dense ones): 8 experts top-2,
        # renormalised, beside a shared expert (wider than a routed one, 48 vs 32) scaled by
        # sigmoid(shared_expert_gate). Two layers (one Gated DeltaNet layer, then one gated attention layer), the
        # linear one shaped as tiny-qwen3_5's
        "qwen3_5_moe": _qwen3_5_moe(shared_expert_intermediate_size=48),
        # DeepSeek-V2-Lite's routing: softmax top-k over all experts (`topk_method: greedy`, one group), not
        # renormalised, times the routed scaling factor (1.5 here, 1.0 in V2-Lite, so that it shows); else as V2
        "deepseek_v2_lite": (
            DeepseekV2ForCausalLM,
            DeepseekV2Config(**_deepseek_common(
                q_lora_rank=None, n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1,
                routed_scaling_factor=1.5, norm_topk_prob=False,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                                 "rope_theta": 10000.0})),
            None,
        ),
        # tiny-qwen3_5_moe with heads enough to split 4 ways (4 linear key heads serving 8 value heads, 4 attention
        # heads over 2 kv heads, 8 experts): the 4-device tensor / expert parallel goldens (last: seeds go by position)
        "qwen3_5_moe_h4": _qwen3_5_moe(shared_expert_intermediate_size=64, linear_num_key_heads=4,
                                       linear_num_value_heads=8),
    }


def _qwen3_5_moe(**kw):
    """A two-layer Qwen3.5-MoE (a Gated DeltaNet layer, then a gated attention layer; 8 experts of 32, top-2), with
    `kw` over QWEN3_5_SHAPE and the MoE fields."""
    cfg = _common(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **QWEN3_5_SHAPE,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**(cfg | kw)), None


def _deepseek_common(**kw):
    """The tiny DeepSeek shapes: 3 layers (layer 0 dense), 4 heads of 16 + 8 (nope + rope) q/k dims, v 16, latent
    32, 8 routed experts of 32 top-2 in 4 groups of which 2 are kept."""
    base = _common(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                   n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   tie_word_embeddings=False, attention_bias=False)
    base.update(kw)
    return base

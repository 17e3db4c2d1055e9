"""KernelPolicy (jinfer/config/kernels.py): validation, the environment's switches, launch overrides, and the ops
that carry it (a policy is part of the ops' hash, so of every jit and executable-cache key)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jinfer.config.kernels import KernelPolicy


def test_defaults_are_the_measured_choices():
    p = KernelPolicy()
    assert p.pallas_mlp_tokens == (1,) and p.prefetch_o == 0.2 and p.moe_front_max_tokens == 8
    assert p.large_step_xla_options() == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert KernelPolicy(xla_dot_merger=True).large_step_xla_options() == {}


@pytest.mark.parametrize("field,value", [
    ("attention_backend", "cuda"), ("interpret", "yes"), ("pallas_mlp_tokens", (0,)), ("pallas_mlp_tokens", "1"),
    ("norm_qkv_max_tokens", -1), ("norm_qkv_max_tokens", 1.5), ("norm_qkv_k_splits", 0), ("prefetch_o", 1.5),
    ("prefetch_eviction", "evict_first"), ("pad_vector_dots", 1), ("fp8_skinny_o", 0),
    ("fp8_max_tokens", -1), ("launch", {"no_such_kernel": {}}),
    ("launch", {"fused_mlp": {"block_i": "64"}}),
])
def test_invalid_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field if field != "launch" else "launch"):
        KernelPolicy(**{field: value})


def test_from_env_reads_the_measurement_switches():
    env = {"JINFER_PALLAS_MLP_TOKENS": "8,1", "JINFER_NORM_QKV_TOKENS": "0", "JINFER_MOE_FRONT_TOKENS": "16",
           "JINFER_PREFETCH_O": "0.5", "JINFER_PREFETCH_EVICTION": "normal", "JINFER_XLA_DOT_MERGER": "1",
           "JINFER_FP8_SKINNY_O": "0", "JINFER_FP8_MAX_TOKENS": "8",
           "JINFER_MLA_RAGGED_KERNEL": "0", "JINFER_MLA_EXPAND_MIN_QUERY_LEN": "128"}
    p = KernelPolicy.from_env(env, attention_backend="pallas-triton")
    assert p == KernelPolicy(attention_backend="pallas-triton", pallas_mlp_tokens=(1, 8), norm_qkv_max_tokens=0,
                             moe_front_max_tokens=16, prefetch_o=0.5, prefetch_eviction="normal", xla_dot_merger=True,
                             fp8_skinny_o=False, fp8_max_tokens=8, mla_ragged_kernel=False,
                             mla_expand_min_query_len=128)
    assert KernelPolicy.from_env({}) == KernelPolicy()
    assert KernelPolicy.from_env({"JINFER_PALLAS_MLP_TOKENS": ""}).pallas_mlp_tokens == ()
    with pytest.raises(ValueError, match="JINFER_NORM_QKV_TOKENS"):
        KernelPolicy.from_env({"JINFER_NORM_QKV_TOKENS": "many"})


def test_launch_overrides_are_hashable_and_merge():
    p = KernelPolicy().with_launch("fused_mlp", block_i=64).with_launch("fused_mlp", num_warps=4)
    assert p.launch_args("fused_mlp") == {"block_i": 64, "num_warps": 4}
    assert p.launch_args("moe_route") == {}
    assert p == KernelPolicy(launch={"fused_mlp": {"num_warps": 4, "block_i": 64}}) and hash(p) == hash(
        KernelPolicy(launch={"fused_mlp": {"num_warps": 4, "block_i": 64}}))
    with pytest.raises(ValueError, match="kernel"):
        p.launch_args("persistent")


def test_the_policy_is_part_of_the_ops_key():
    from jinfer.ops import ModelOps, select_ops

    a, b = ModelOps("pallas"), ModelOps("pallas", policy=KernelPolicy(prefetch_o=0.0))
    assert a != b and repr(a) != repr(b)
    ops = select_ops("pallas", interpret=True, policy=KernelPolicy(norm_qkv_max_tokens=8))
    assert ops.backend == "pallas" and ops.interpret and not ops.mosaic_prefill
    assert ops.policy.norm_qkv_max_tokens == 8 and ops.policy.attention_backend == "pallas"
    assert select_ops(policy=KernelPolicy(attention_backend="reference")).backend == "reference"
    assert dataclasses.replace(ops, decode_step=True).policy == ops.policy


def test_kernel_policy_and_pallas_kernels_import_cleanly():
    """The policy is JAX-free (parsed where arguments are), and nothing in pallas_kernels imports jinfer."""
    def run(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert run("import sys, jinfer.config.kernels; print('jax' in sys.modules)") == "False"
    kernels = ("moe.moe_router", "moe.moe_gemm_mgpu", "dense.norm_qkv_rope", "dense.skinny_gemm", "dense.fused_mlp",
               "attention.prefill_attention_mgpu", "linear_attention.gated_delta_rule_chunked",
               "linear_attention.gated_delta_rule_decode", "linear_attention.causal_conv")
    imports = "; ".join(f"import pallas_kernels.{k}" for k in kernels)
    assert run(f"import sys; {imports}; print([m for m in sys.modules if m.startswith('jinfer')])") == "[]"

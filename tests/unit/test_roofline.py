"""The per-device decode bytes behind the multi-GPU rooflines (benchmarks/roofline.py)."""

import pytest

from benchmarks.roofline import busiest_device_experts, decode_bytes, decode_bytes_per_device
from jinfer.config.model import NAMED_SHAPES


@pytest.mark.parametrize("shape", ["qwen3-4b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
@pytest.mark.parametrize("batch", [1, 32])
def test_one_device_reads_what_the_model_step_reads(shape, batch):
    cfg = NAMED_SHAPES[shape]
    got, want = decode_bytes_per_device(cfg, batch, 1088, 1), decode_bytes(cfg, batch, 1088)
    assert [got[k] for k in ("weights", "kv", "total")] == pytest.approx([want[k] for k in ("weights", "kv", "total")])


def test_235b_on_eight_devices():
    cfg = NAMED_SHAPES["qwen3-235b-a22b"]
    even = decode_bytes(cfg, 1, 1088)["kv"] / 8
    tp = decode_bytes_per_device(cfg, 1, 1088, 8)
    assert tp["kv"] == 2 * even  # 4 kv heads on 8 devices: each stores one, twice the even share
    # top-8 of 128 experts, 16 per device: the busiest device holds 2.5 of the 8 hit experts on average
    assert 2.3 < busiest_device_experts(cfg, 1, 8) < 2.7
    assert busiest_device_experts(cfg, 256, 8) == 16  # a large batch hits every expert
    ep = decode_bytes_per_device(cfg, 1, 1088, 8, expert_parallel=True)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    extra = (busiest_device_experts(cfg, 1, 8) - 1) * per_expert * cfg.num_layers  # vs 1/8 of each of 8
    assert ep["weights"] == pytest.approx(tp["weights"] + extra)

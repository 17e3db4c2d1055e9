"""benchmarks/pallas_regs.py: a kernel's Triton IR for an H100, lowered on a host without a GPU."""

from benchmarks.pallas_regs import cases, ttir


def test_ttir_of_a_kernel_lowered_without_a_gpu():
    warps, fn = cases("conv:16x128:4")
    ir = ttir(fn)
    assert warps == 4 and ir.startswith("module @causal_conv") and "tt.func" in ir and "loc(" not in ir

"""Fused attention's price: the kernel's measured rate where the device has one, the
GEMM curve on the FLOPs it executes elsewhere; sharding splits batch and heads."""

from __future__ import annotations

import pytest

from alpasim.costmodels import get_cluster, op_time_s
from alpasim.costmodels._attention import KERNELS, SEQLENS, executed_flops, kernel_flops
from alpasim.costmodels._compute import KERNEL_LAUNCH_OVERHEAD_S, compute_time_s
from alpasim.graphs import forward_graph, training_graph


def _ops(seq: int, heads: int = 8, batch: int = 2):
    spec = f"gpt3:hidden={heads * 128},layers=1,heads={heads},seq={seq},vocab=64,batch={batch},attention=fused"
    g = training_graph(forward_graph(spec))
    fwd = next(op for op in g.ops if op.prim == "attention")
    bwd = next(op for op in g.ops if op.prim == "attention_grad")
    return g, fwd, bwd


def test_a100_prices_flashattention_2s_measured_rate():
    """At 2k causal, head dim 128, FlashAttention 2 runs forward + backward at 155
    TFLOP/s on an A100 (its paper's Figure 4), counting the causal forward as
    2 * b * h * s^2 * d: the two passes together take 3.5 times that over 155e12."""
    device = get_cluster("dgx-a100").device
    g, fwd, bwd = _ops(2048)
    both = op_time_s(fwd, g.tensors, device) + op_time_s(bwd, g.tensors, device)
    flops = 2 * 2 * 8 * 2048 ** 2 * 128
    assert both == pytest.approx(3.5 * flops / 155e12 + 2 * KERNEL_LAUNCH_OVERHEAD_S, rel=1e-9)
    # Between measured lengths the rate interpolates in log2(seqlen); outside, it clamps.
    kernel = KERNELS[device.name]
    assert kernel.tflops(False, True, 2896) == pytest.approx((155 + 173) / 2, rel=1e-3)
    assert kernel.tflops(False, True, 10 ** 6) == 189.0 and kernel.tflops(False, True, 256) == 99.0
    # Two shards (batch or heads split) take half the kernel each.
    assert op_time_s(fwd, g.tensors, device, num_shards=2) - KERNEL_LAUNCH_OVERHEAD_S == pytest.approx(
        (op_time_s(fwd, g.tensors, device) - KERNEL_LAUNCH_OVERHEAD_S) / 2)


def test_h100_backward_is_slower_than_its_forward_and_longer_sequences_run_faster():
    device = get_cluster("dgx-h100").device
    per_flop = []
    for seq in (1024, 4096):
        g, fwd, bwd = _ops(seq, batch=1)
        f, b = (op_time_s(op, g.tensors, device) for op in (fwd, bwd))
        assert b > 2.5 * f          # 2.5x the work at a lower rate (cuDNN's backward)
        per_flop.append(f / kernel_flops(8, seq, seq, 128, True, False))
    assert per_flop[1] < per_flop[0]
    assert len(SEQLENS) == len(KERNELS[device.name].backward[True])


def test_a_float32_kernel_is_priced_as_its_gemms_even_where_a_measurement_exists():
    """FlashAttention and cuDNN have no float32 path: a float32 model's fused attention on
    an H100 is its executed GEMMs at the float32 peak, not the BF16 kernel's rate."""
    device = get_cluster("dgx-h100").device
    spec = "gpt3:hidden=1024,layers=1,heads=8,seq=1024,vocab=64,batch=2,attention=fused"
    half, full = (training_graph(forward_graph(spec + dt)) for dt in ("", ",dtype=fp32"))
    t = {}
    for name, g in (("half", half), ("full", full)):
        op = next(op for op in g.ops if op.prim == "attention")
        t[name] = op_time_s(op, g.tensors, device)
    nbytes = sum(full.tensors[x].nbytes for op in full.ops if op.prim == "attention" for x in (*op.inputs, *op.outputs))
    assert t["full"] == pytest.approx(compute_time_s(executed_flops(16, 1024, 1024, 128, True, False), nbytes,
                                                     "float32", device, True))
    assert t["full"] > 5 * t["half"]


def test_a_device_without_a_measurement_prices_the_executed_gemms():
    """A V100 has no FlashAttention 2 (it needs Ampere): its fused attention is priced as
    the GEMMs the kernel executes, the causal tiles' share and the backward's recompute."""
    device = get_cluster("aws-p3.16xlarge").device
    g, fwd, bwd = _ops(1024)
    for op, backward in ((fwd, False), (bwd, True)):
        flops = executed_flops(2 * 8, 1024, 1024, 128, True, backward)
        nbytes = sum(g.tensors[t].nbytes for t in (*op.inputs, *op.outputs))
        assert op_time_s(op, g.tensors, device) == pytest.approx(
            compute_time_s(flops, nbytes, "float16", device, True))

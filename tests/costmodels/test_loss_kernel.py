"""The cross-entropy as Megatron-LM runs it (`graphs.with_loss_kernel`,
`costmodels._compute.loss_bytes`): a kernel per step of its fp32 vocab-parallel loss,
against the closed form of the bytes those steps move."""

from __future__ import annotations

import pytest

from alpasim.costmodels import AnalyticCostModel, fuse, get_cluster
from alpasim.costmodels._compute import KERNEL_LAUNCH_OVERHEAD_S, loss_bytes, traffic_bytes
from alpasim.costmodels._gemm import memory_bandwidth
from alpasim.graphs import forward_graph, training_graph, with_loss_kernel
from alpasim.solvers import get_system

TOKENS, VOCAB = 4 * 256, 4096


def _graph(dtype: str, kernel: str):
    fwd = forward_graph(f"gpt3:hidden=128,layers=1,heads=4,seq=256,vocab={VOCAB},batch=4,dtype={dtype}")
    return with_loss_kernel(training_graph(fwd), kernel)


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_megatrons_loss_moves_its_kernels_bytes(dtype, itemsize):
    """Forward: cast (w + 4, none for fp32), max 4, subtract 8, exp 8, sum 4, divide 8;
    backward: scale the kept softmax 8, cast back 4 + w. The fused kernel reads the
    logits once and writes the loss (forward), or reads them and writes the gradient."""
    g = _graph(dtype, "unfused-fp32")
    loss, grad = (next(op for op in g.ops if op.prim == p)
                  for p in ("softmax_cross_entropy", "softmax_cross_entropy_grad"))
    cast = itemsize + 4 if dtype != "float32" else 0
    assert loss_bytes(loss, g.tensors) == (32 + cast) * TOKENS * VOCAB
    assert loss_bytes(grad, g.tensors) == (8 + (4 + itemsize if cast else 0)) * TOKENS * VOCAB
    fused = _graph(dtype, "fused")
    plain = next(op for op in fused.ops if op.prim == "softmax_cross_entropy")
    assert traffic_bytes(plain, fused.tensors) == itemsize * TOKENS * VOCAB + 4 * TOKENS + 4   # logits, labels, loss
    # Priced at the device's streaming bandwidth, one kernel of its own.
    device = get_cluster("dgx-h100").device
    t = AnalyticCostModel(get_cluster("dgx-h100")).op_time_s(loss, g.tensors)
    want = (32 + cast) * TOKENS * VOCAB / memory_bandwidth(device.name, device.memory_bandwidth_bytes_per_s) \
        + KERNEL_LAUNCH_OVERHEAD_S
    assert t == pytest.approx(want, rel=1e-6)


def test_the_unfused_loss_is_a_kernel_of_its_own_and_only_the_loss_changes():
    unfused, fused = _graph("bfloat16", "unfused-fp32"), _graph("bfloat16", "fused")
    marked = [op.name for op in unfused.ops if op.param("kernel")]
    assert sorted(marked) == sorted(op.name for op in fused.ops if op.prim.startswith("softmax_cross_entropy"))
    kernels, fused_kernels = fuse(unfused), fuse(fused)
    for name in marked:      # in no fused kernel (fused, the loss joins its neighbours')
        assert name not in kernels.kernel_of and kernels.of(name) is None
    assert any(len(fused_kernels.kernels[fused_kernels.kernel_of[n]]) > 1
               for n in marked if n in fused_kernels.kernel_of)
    assert [op.replace(params=tuple((k, v) for k, v in op.params if k != "kernel")) for op in unfused.ops] == \
        list(fused.ops)
    with pytest.raises(ValueError, match="unknown loss kernel"):
        with_loss_kernel(fused, "triton")


def test_each_system_says_how_its_loss_ran():
    assert get_system("megatron-core-0.8").cross_entropy == "unfused-fp32"
    assert get_system("alpa-osdi22").cross_entropy == "fused"

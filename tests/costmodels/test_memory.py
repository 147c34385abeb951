import time

import pytest

from alpasim.costmodels import MemoryBreakdown, activation_peak_bytes, training_memory
from alpasim.graphs import GraphBuilder, Op, OpGraph, Tensor, training_graph


def _mlp_forward(dtype: str = "float32", relu: bool = True) -> OpGraph:
    b = GraphBuilder("t")
    x = b.input("x", (4, 8), dtype)  # 32 elements
    w = b.param("w", (8, 16), dtype)  # 128 elements
    y = b.einsum("ab,bc->ac", x, w)  # 64 elements
    if relu:
        y = b.ew("relu", y)
    return b.build([b.one("reduce", [y], kind="sum", axes=(0, 1))])


def test_forward_liveness_by_hand():
    # ops: 0 einsum(x, w -> y), 1 relu(y -> z), 2 reduce(z -> s); fp32 bytes:
    # x 128 live [0, 0], y 256 [0, 1], z 256 [1, 2], s 4 [2, 2] (an output).
    # step 0: x + y = 384; step 1: y + z = 512; step 2: z + s = 260.
    g = _mlp_forward()
    m = training_memory(g)
    assert m.activations_peak_bytes == 512
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (512, 0, 0)
    assert m.total_bytes == 1024


def test_outputs_stay_live_to_the_end():
    b = GraphBuilder("o")
    x = b.input("x", (4, 8))  # 128 bytes each
    a = b.ew("relu", x)
    e = b.ew("exp", x)
    f = b.ew("tanh", e)
    # ops: 0 relu(x -> a), 1 exp(x -> e), 2 tanh(e -> f). With a as an output it lives
    # to step 2: step 1 holds x, a, e = 384. Without, a dies at step 0: peak 256.
    assert activation_peak_bytes(b.build([a, f])) == 384
    assert activation_peak_bytes(b.build([f])) == 256


def test_training_graph_update_outputs_are_not_double_counted():
    g = training_graph(_mlp_forward(relu=False))
    assert any(t.endswith(":new") for t in g.tensors)
    # ops: 0 einsum(x, w -> y), 1 reduce(y -> loss), 2 full(-> seed), 3 broadcast(seed -> dy),
    # 4 einsum(dy, x -> dw: grad), 5 adam(w, dw, m, v -> w:new, m:new, v:new).
    # Live: x 128 [0, 4], y 256 [0, 1], loss 4 [1, 5] (output), seed 4 [2, 3], dy 256 [3, 4].
    # step 3: x + loss + seed + dy = 392 is the peak.
    m = training_memory(g)
    assert m == MemoryBreakdown(params_bytes=512, grads_bytes=512, optimizer_bytes=1024,
                                activations_peak_bytes=392, total_bytes=2440)


def test_mixed_precision_masters_are_optimizer_state():
    g = training_graph(_mlp_forward("float16", relu=False))
    m = training_memory(g)
    assert m.params_bytes == 128 * 2
    assert m.grads_bytes == 128 * 2
    assert m.optimizer_bytes == 3 * 128 * 4  # fp32 master, Adam m, Adam v
    assert m.activations_peak_bytes == 392 // 2


def test_shard_fraction_scales_every_part():
    g = training_graph(_mlp_forward(relu=False))
    half = training_memory(g, shard_fraction=0.5)
    assert (half.params_bytes, half.grads_bytes, half.optimizer_bytes, half.activations_peak_bytes) == \
        (256, 256, 512, 196)
    third = training_memory(g, shard_fraction=1 / 3)
    assert third.activations_peak_bytes == 131  # rounded up: ceil(392 / 3)
    for bad in (0, -0.5, 1.5, True):
        with pytest.raises(ValueError, match="shard_fraction"):
            training_memory(g, shard_fraction=bad)


def test_breakdown_validation():
    with pytest.raises(ValueError, match=r"grads_bytes.*-1"):
        MemoryBreakdown(1, -1, 0, 0, 0)
    with pytest.raises(ValueError, match="total_bytes 5"):
        MemoryBreakdown(1, 1, 1, 1, 5)
    m = MemoryBreakdown(1, 1, 1, 1, 4)
    assert m.fits(4) and not m.fits(3)


def test_ten_thousand_ops_in_well_under_a_second():
    # Built from the value types directly: the builder's naming is not what is timed here.
    n = 10_000
    tensors = [Tensor(f"t{i}", (64, 64), "float32", "input" if i == 0 else "activation") for i in range(n + 1)]
    ops = [Op(f"op{i}", "elementwise", (f"t{i}",), (f"t{i + 1}",), {"fn": "tanh"}) for i in range(n)]
    g = OpGraph("chain", tensors, ops, inputs=["t0"], outputs=[f"t{n}"])
    start = time.perf_counter()
    m = training_memory(g)
    elapsed = time.perf_counter() - start
    assert m.activations_peak_bytes == 2 * 64 * 64 * 4  # a chain holds one input and one output
    assert elapsed < 0.5

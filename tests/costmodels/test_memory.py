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
    # ops: 0 einsum(x, w -> y), 1 relu(y -> z), 2 reduce(z -> s); fp32 bytes: x 128 live
    # [0, 0], y 256 [0, 0] (relu writes over it: it dies there), z 256 [1, 2], s 4 [2, 2]
    # (an output, to the end of the forward). step 0: x + y = 384; 1: z = 256; 2: 260.
    g = _mlp_forward()
    m = training_memory(g)
    assert m.activations_peak_bytes == 384
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (512, 0, 0)
    assert m.total_bytes == 896


def test_outputs_stay_live_to_the_end_of_the_forward():
    b = GraphBuilder("o")
    x = b.input("x", (4, 8))  # 128 bytes each, transposes copy (no in-place)
    with b.scope(layer=0):   # one layer each: no two of them fuse into one kernel
        a = b.one("transpose", [x], perm=(1, 0))
    with b.scope(layer=1):
        e = b.one("transpose", [x], perm=(1, 0))
    with b.scope(layer=2):
        f = b.one("transpose", [e], perm=(1, 0))
    # ops: 0 a = x^T, 1 e = x^T, 2 f = e^T. x lives [0, 1], e [1, 2], f [2, 2]. As an
    # output a lives [0, 2]: step 1 holds x, a, e = 384. Otherwise a dies at 0: 256.
    assert activation_peak_bytes(b.build([a, f])) == 384
    assert activation_peak_bytes(b.build([f])) == 256


def test_elementwise_ops_write_over_a_dying_operand():
    b = GraphBuilder("e")
    x = b.input("x", (4, 8))       # 128 bytes; one layer per op: no two of them fuse
    with b.scope(layer=0):
        y = b.one("transpose", [x], perm=(1, 0))
    with b.scope(layer=1):
        z = b.ew("tanh", y)        # y is read again below: tanh cannot write over it
    with b.scope(layer=2):
        w = b.ew("add", z, y)      # z and y die here: the add writes over z
    g = b.build([w])
    # ops: 0 y = x^T, 1 z = tanh(y), 2 w = z + y. x [0, 0], y [0, 2], z [1, 1] (its
    # buffer becomes w's), w [2, 2]. step 0: x + y = 256, step 1: y + z = 256, step 2:
    # y + w = 256; without the in-place add step 2 would hold 384.
    assert activation_peak_bytes(g) == 256


def test_training_graph_update_outputs_are_not_double_counted():
    g = training_graph(_mlp_forward(relu=False))
    assert any(t.endswith(":new") for t in g.tensors)
    # ops: 0 einsum(x, w -> y), 1 reduce(y -> loss), 2 full(-> seed), 3 broadcast(seed -> dy),
    # 4 einsum(dy, x -> dw: grad), 5 adam(w, dw, m, v -> w:new, m:new, v:new).
    # Live: x 128 [0, 4], y 256 [0, 1], loss 4 [1, 1] (a forward output: to the end of the
    # forward), seed 4 [2, 3], dy 256 [3, 4], and the microbatch's gradient dw 512 [4, 4]
    # as the einsum makes it (the accumulator it is added into is persistent). Step 4:
    # x + dy + dw = 896 is the peak.
    m = training_memory(g)
    assert m == MemoryBreakdown(params_bytes=512, grads_bytes=512, optimizer_bytes=1024,
                                activations_peak_bytes=896, total_bytes=2944)


@pytest.mark.parametrize("precision, grads, peak", [
    # fp32 accumulators (4 B); the fp16 weight gradient (256 B) is live from its einsum
    # (op 4) to its cast into the accumulator (op 5, in place), next to x (64) and dy (128).
    ("mixed-fp32grad", 128 * 4, 64 + 128 + 256),
    # fp16 accumulators: the einsum's fp16 gradient (256 B), then added: the same peak.
    ("mixed", 128 * 2, 64 + 128 + 256),
])
def test_mixed_precision_masters_are_optimizer_state(precision, grads, peak):
    g = training_graph(_mlp_forward("float16", relu=False), precision=precision)
    m = training_memory(g)
    assert m.params_bytes == 128 * 2
    assert m.grads_bytes == grads
    assert m.optimizer_bytes == 3 * 128 * 4  # fp32 master, Adam m, Adam v
    assert m.activations_peak_bytes == peak


def test_shard_fraction_scales_every_part():
    g = training_graph(_mlp_forward(relu=False))
    half = training_memory(g, shard_fraction=0.5)
    assert (half.params_bytes, half.grads_bytes, half.optimizer_bytes, half.activations_peak_bytes) == \
        (256, 256, 512, 448)
    third = training_memory(g, shard_fraction=1 / 3)
    assert third.activations_peak_bytes == 299  # rounded up: ceil(896 / 3)
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


def test_a_ten_thousand_op_chain_holds_one_buffer():
    # Built from the value types directly. How long the estimate takes is a benchmark's
    # figure (`benchmarks/bench_graph_build.py`, column "memory s"), not a test's.
    n = 10_000
    tensors = [Tensor(f"t{i}", (64, 64), "float32", "input" if i == 0 else "activation") for i in range(n + 1)]
    ops = [Op(f"op{i}", "elementwise", (f"t{i}",), (f"t{i + 1}",), {"fn": "tanh"}) for i in range(n)]
    g = OpGraph("chain", tensors, ops, inputs=["t0"], outputs=[f"t{n}"])
    m = training_memory(g)
    assert m.activations_peak_bytes == 64 * 64 * 4  # each tanh writes over its operand: one buffer

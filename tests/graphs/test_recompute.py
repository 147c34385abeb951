"""recompute_fusible against brute force: the kept set is the cheapest one that works.

Random one-layer forward graphs mix elementwise ops (recomputable), reductions and
contractions (not), of several sizes. For each, every subset of the recomputable
values the forward makes (and of the others the backward does not read) is tried as
the kept set: it works when every value the
backward reads is free, kept, not recomputable (then kept by force) or recomputable
from values that work. The pass's kept bytes (forward values its backward reads) must
equal the cheapest working subset's, and the backward must still compute the same
gradients (checked in `test_autodiff` on the model families).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpasim.graphs import RECOMPUTABLE_PRIMS, GraphBuilder, OpGraph, training_graph

UNARY = ("exp", "tanh", "square", "gelu")
BINARY = ("add", "mul", "div")


@st.composite
def forward_graphs(draw) -> OpGraph:
    b = GraphBuilder("random")
    x = b.input("x", (4, 8))
    values = [b.einsum("ab,bc->ac", x, b.param("w", (8, 8)), name="proj")]
    for i in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(("unary", "binary", "binary", "matmul", "reduce")))
        a = draw(st.sampled_from(values))
        if kind == "unary":
            values.append(b.ew(draw(st.sampled_from(UNARY)), a))
        elif kind == "binary":
            values.append(b.ew(draw(st.sampled_from(BINARY)), a, draw(st.sampled_from(values))))
        elif kind == "matmul":
            values.append(b.einsum("ab,bc->ac", a, b.param(f"w{i}", (8, 8)), name="mm"))
        else:   # a row reduction broadcast back: small kept values next to full ones
            r = b.one("reduce", [a], kind="sum", axes=(1,))
            values.append(b.ew("mul", a, b.one("broadcast", [r], shape=(4, 8), dims=(0,))))
    total = b.ew("add", values[-1], draw(st.sampled_from(values)))
    return b.build([b.one("reduce", [total], kind="sum", axes=(0, 1))])


def kept_bytes(train: OpGraph) -> int:
    """Bytes of the forward values (not parameters or inputs) the backward reads."""
    fwd = {t for op in train.ops if op.phase == "forward" for t in op.outputs}
    read = {t for op in train.ops if op.phase == "backward" for t in op.inputs if t in fwd}
    return sum(train.tensors[t].nbytes for t in read)


def brute_force_bytes(train: OpGraph) -> int:
    producer = {t: op for op in train.ops if op.phase == "forward" for t in op.outputs}
    needed = {t for op in train.ops if op.phase == "backward" for t in op.inputs if t in producer}
    recomputable = {t for t, op in producer.items() if op.prim in RECOMPUTABLE_PRIMS}
    forced = needed - recomputable
    candidates = sorted(set(producer) - forced)   # a matmul's output may be kept to recompute from
    best = None
    for n in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, n):
            kept = set(subset) | forced
            memo: dict[str, bool] = {}

            def there(t: str) -> bool:
                if t not in producer or t in kept:
                    return True
                if t not in recomputable:
                    return False
                if t not in memo:
                    memo[t] = all(there(u) for u in producer[t].inputs)
                return memo[t]

            if all(there(t) for t in needed):
                cost = sum(train.tensors[t].nbytes for t in kept)
                best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forward_graphs())
def test_the_kept_set_is_the_cheapest_that_recomputes_everything(fwd):
    plain = training_graph(fwd)
    cut = training_graph(fwd, recompute="fusible")
    assert kept_bytes(cut) == brute_force_bytes(plain)
    assert kept_bytes(cut) <= kept_bytes(plain)
    # Every recomputed value is read in the backward only, and made there from kept ones.
    for op in cut.ops:
        if op.name.endswith(":recompute"):
            assert op.phase == "backward" and op.prim in RECOMPUTABLE_PRIMS


def test_a_gelu_written_out_keeps_only_its_input():
    """tanh-GeLU spelled as jax.nn.gelu traces it: its gradients read five
    intermediates of the input's size; recomputing keeps the input alone."""
    b = GraphBuilder("gelu")
    x = b.einsum("ab,bc->ac", b.input("x", (16, 32)), b.param("w", (32, 32)), name="proj")
    cube = b.ew("mul", b.ew("square", x), x)
    inner = b.ew("add", x, b.ew("mul", cube, scalar=0.044715, scalar_pos=1))
    t = b.ew("tanh", b.ew("mul", inner, scalar=0.7978845608, scalar_pos=1))
    y = b.ew("mul", b.ew("mul", x, scalar=0.5, scalar_pos=1), b.ew("add", t, scalar=1.0, scalar_pos=1))
    out = b.einsum("ab,bc->ac", y, b.param("w2", (32, 32)), name="proj2")
    fwd = b.build([b.one("reduce", [out], kind="sum", axes=(0, 1))])
    plain, cut = training_graph(fwd), training_graph(fwd, recompute="fusible")
    size = 16 * 32 * 4
    assert kept_bytes(plain) >= 5 * size
    assert kept_bytes(cut) == size    # x; y (proj2's input) is recomputed from it

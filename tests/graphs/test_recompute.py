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


def brute_force_bytes(train: OpGraph, fused: bool = False) -> int:
    """The cheapest working kept set; `fused`: under fused kernels, where a value a
    non-elementwise backward op reads (a contraction's, a reduction's) is saved by it."""
    producer = {t: op for op in train.ops if op.phase == "forward" for t in op.outputs}
    needed = {t for op in train.ops if op.phase == "backward" for t in op.inputs if t in producer}
    recomputable = {t for t, op in producer.items() if op.prim in RECOMPUTABLE_PRIMS}
    if fused:
        recomputable -= {t for op in train.ops if op.phase == "backward" and op.prim not in RECOMPUTABLE_PRIMS
                         for t in op.inputs}
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
    fused = training_graph(fwd, kernels="fused")
    assert kept_bytes(fused) == brute_force_bytes(plain, fused=True)
    assert kept_bytes(cut) <= kept_bytes(fused) <= kept_bytes(plain)
    # Every recomputed value is read in the backward only, and made there from kept ones.
    for op in (*cut.ops, *fused.ops):
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
    # A fused GeLU kernel saves its input, and the GEMM after it saves its own input.
    assert kept_bytes(training_graph(fwd, kernels="fused")) == 2 * size


LLAMA = "llama:hidden=64,layers=3,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=2,dtype=float32,attention=fused"


def test_fused_kernels_keep_what_transformer_engine_saves_for_a_llama_block():
    """A Llama block under fused kernels stashes what Megatron-core's modules save (in
    float32 here): the two norms' inputs and their per-token statistic, the norms'
    outputs (the QKV and first MLP GEMMs save them), Q and K after RoPE and V, the
    attention kernel's output and log-sum-exp, the first MLP GEMM's gate and up and
    SwiGLU's output (the second GEMM saves it). Op by op, the RMSNorm and SwiGLU
    intermediates and RoPE's tables are kept too; the GPT block, whose norms and
    activations are single ops, keeps the same stash either way."""
    from alpasim.costmodels import liveness
    from alpasim.graphs import build_training_graph
    from alpasim.solvers._stage_costs import layer_graphs

    def block_stash(spec: str, kernels: str) -> int:
        block = layer_graphs(build_training_graph(spec, kernels=kernels).graph)[1]
        return sum(block.tensors[t].nbytes for t in liveness(block).stash())

    b, s, h, heads, f = 2, 16, 64, 4, 96
    kv = 2 * (h // heads)
    saved = b * s * (2 * h + 2 + 2 * h + h + 2 * kv + h + heads + 3 * f)
    assert block_stash(LLAMA, "fused") == 4 * saved
    assert block_stash(LLAMA, "per-op") > 1.5 * block_stash(LLAMA, "fused")
    # Megatron's fused bias-dropout-add saves the hidden states' masks: never redrawn.
    gpt = "gpt3:hidden=64,layers=3,heads=4,seq=16,vocab=128,batch=2,dtype=float32,dropout=0.1"
    assert block_stash(gpt, "fused") == block_stash(gpt, "per-op")


def test_fused_kernels_give_the_same_gradients():
    """The recomputed chains compute what the kept ones held: every gradient of the
    fused-kernel graph equals the op-by-op graph's, both lowered into one JAX program."""
    import jax
    import numpy as np

    from alpasim.backends import lower_graph, random_leaves
    from alpasim.graphs import build_training_graph

    spec = "llama:hidden=32,layers=1,heads=4,kv_heads=2,ffn=48,seq=8,vocab=64,batch=2,dtype=float32,attention=fused"
    plain = build_training_graph(spec).graph
    fused = build_training_graph(spec, kernels="fused").graph
    assert sum(op.name.endswith(":recompute") and op.phase == "backward" for op in fused.ops) >= 10
    leaves = random_leaves(plain, seed=0, scale=0.05)
    grads = [op.inputs[1] for op in plain.ops if op.prim == "adam"]
    run_plain, run_fused = lower_graph(plain), lower_graph(fused)
    want, got = jax.jit(lambda v: ({g: run_plain(v)[g] for g in grads}, {g: run_fused(v)[g] for g in grads}))(leaves)
    for g in grads:
        np.testing.assert_allclose(np.asarray(got[g]), np.asarray(want[g]), rtol=1e-5, atol=1e-7, err_msg=g)

"""JAX lowering of every primitive, checked against jax.grad and independent numpy answers.

Each gradient test builds a tiny forward graph whose scalar loss is
sum(output * R) for a fixed random R, derives its training graph with the VJP rules,
lowers both to JAX and compares the derived gradients with `jax.grad` of the lowered
forward. That checks the VJP rule and the lowering of the backward primitives at once.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from alpasim.backends import (LOWERINGS, LoweringError, graph_leaves, lower_graph, random_leaves, top2_gating,
                              topk_gating)
from alpasim.graphs import ELEMENTWISE, PRIMITIVES, AdamConfig, GraphBuilder, OpGraph, training_graph


# ----------------------------------------------------------------- helpers
def scalar_graph(build, name: str = "unit") -> OpGraph:
    """Forward graph: out = build(b), loss = sum(out * R) with R a random input."""
    b = GraphBuilder(name)
    with b.scope(layer=0):
        out = build(b)
        r = b.input("r", b.shape(out), b.dtype(out))
        y = b.ew("mul", out, r)
        loss = b.one("reduce", [y], name="loss", kind="sum", axes=tuple(range(len(b.shape(out)))))
    return b.build([loss])


def derived_grads(train: OpGraph, values: dict) -> dict[str, np.ndarray]:
    """Each parameter's gradient: the second operand of its adam op."""
    return {op.inputs[0]: np.asarray(values[op.inputs[1]]) for op in train.ops if op.prim == "adam"}


def reference_grads(fwd: OpGraph, leaves: dict) -> dict[str, np.ndarray]:
    params = {t.name: leaves[t.name] for t in fwd.params if t.is_float}
    rest = {k: v for k, v in leaves.items() if k not in params}
    (loss,) = fwd.outputs
    f = lower_graph(fwd, [loss])
    grads = jax.jit(jax.grad(lambda p: f({**rest, **p})[loss]))(params)
    return {k: np.asarray(v) for k, v in grads.items()}


def assert_grads_close(got: dict, want: dict, rtol: float = 2e-5) -> None:
    # The absolute tolerance scales with the largest gradient, so that mathematically
    # zero gradients (rounding noise) do not fail a relative test.
    scale = max(float(np.abs(w).max()) for w in want.values())
    for name, w in want.items():
        g = got.get(name, np.zeros_like(w))  # a param with no adam op has no gradient
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=name)


def check_grads(build, *, positive: bool = False, rtol: float = 2e-5, seed: int = 0, overrides=None) -> OpGraph:
    fwd = scalar_graph(build)
    train = training_graph(fwd)
    leaves = random_leaves(train, seed=seed, scale=1.0)
    if positive:
        leaves.update({t.name: np.abs(leaves[t.name]) + 0.5 for t in fwd.params})
    leaves.update(overrides or {})
    values = jax.jit(lower_graph(train))(leaves)
    assert_grads_close(derived_grads(train, values), reference_grads(fwd, leaves), rtol)
    return train


# ------------------------------------------------------------ coverage, API
def test_every_primitive_is_lowered():
    assert set(LOWERINGS) == set(PRIMITIVES)
    fwd = scalar_graph(lambda b: b.ew("exp", b.param("x", (3,))))
    assert set(graph_leaves(fwd)) == {"x", "r"}


def test_every_elementwise_fn_has_its_declared_dtype_and_numpy_value():
    a = np.array([-1.5, 0.0, 2.0], np.float32)
    c = np.array([0.5, 0.0, 3.0], np.float32)
    p, q = a > 0, c > 0
    numpy_value = {
        "gt": a > c, "ge": a >= c, "lt": a < c, "le": a <= c, "eq": a == c, "ne": a != c,
        "and": p & q, "or": p | q, "not": ~p, "sign": np.sign(a), "max": np.maximum(a, c),
        "select": np.where(p, a, c), "relu_grad": np.where(c > 0, a, 0),
    }
    b = GraphBuilder("fns")
    xa, xc, xp, xq = b.input("a", (3,)), b.input("c", (3,)), b.input("p", (3,), "bool"), b.input("q", (3,), "bool")
    outs = {}
    for fn, spec in ELEMENTWISE.items():
        logical = fn in ("and", "or", "not")
        operands = {1: [xp if logical else xa], 2: [xp, xq] if logical else [xa, xc], 3: [xp, xa, xc]}[spec.arity]
        outs[fn] = b.ew(fn, *operands)
    graph = b.build(list(outs.values()))
    values = jax.jit(lower_graph(graph))({"a": a, "c": c, "p": p, "q": q})
    for fn, name in outs.items():
        assert str(values[name].dtype) == graph.tensors[name].dtype == ("bool" if ELEMENTWISE[fn].boolean
                                                                         else "float32"), fn
        if fn in numpy_value:
            np.testing.assert_array_equal(values[name], numpy_value[fn], err_msg=fn)


def test_lower_graph_outputs_subset_and_missing_leaf():
    fwd = scalar_graph(lambda b: b.ew("tanh", b.param("x", (2, 3))))
    leaves = random_leaves(fwd, seed=1, scale=1.0)
    all_values = lower_graph(fwd)(leaves)
    assert set(all_values) == set(fwd.tensors)
    only = lower_graph(fwd, outputs=fwd.outputs)(leaves)
    assert list(only) == list(fwd.outputs)
    np.testing.assert_allclose(only["loss"], np.sum(np.tanh(leaves["x"]) * leaves["r"]), rtol=1e-6)
    with pytest.raises(LoweringError, match="'r'"):
        lower_graph(fwd)({"x": leaves["x"]})
    with pytest.raises(LoweringError, match="nope"):
        lower_graph(fwd, outputs=["nope"])


def test_import_alpasim_does_not_import_jax():
    code = "import sys, alpasim, alpasim.graphs; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------- elementwise
UNARY = ["neg", "exp", "tanh", "logistic", "relu", "gelu", "square", "abs", "erf", "sin", "cos", "identity"]
UNARY_POSITIVE = ["log", "rsqrt", "sqrt", "reciprocal"]


@pytest.mark.parametrize("fn", UNARY + UNARY_POSITIVE)
def test_unary_elementwise_grads(fn):
    check_grads(lambda b: b.ew(fn, b.param("x", (3, 5))), positive=fn in UNARY_POSITIVE)


@pytest.mark.parametrize("fn", ["add", "sub", "mul", "div", "max", "min", "pow"])
def test_binary_elementwise_grads(fn):
    check_grads(lambda b: b.ew(fn, b.param("a", (3, 5)), b.param("b", (3, 5))), positive=fn in ("div", "pow"))


@pytest.mark.parametrize("fn,scalar,positive", [
    ("add", 1.5, False), ("sub", 1.5, False), ("mul", -2.0, False), ("div", 2.0, True),
    ("pow", 2.5, True), ("max", 0.1, False), ("min", 0.1, False),
])
@pytest.mark.parametrize("pos", [0, 1])
def test_scalar_operand_grads(fn, scalar, positive, pos):
    def build(b):
        return b.ew(fn, b.param("x", (4, 3)), scalar=scalar, scalar_pos=pos)
    check_grads(build, positive=positive)


def test_scalar_operand_values_by_position():
    x = np.array([1.0, 2.0, 4.0], np.float32)
    for pos, want in [(0, 3.0 - x), (1, x - 3.0)]:
        fwd = scalar_graph(lambda b, pos=pos: b.ew("sub", b.param("x", (3,)), scalar=3.0, scalar_pos=pos))
        out = lower_graph(fwd)({"x": x, "r": np.ones(3, np.float32)})
        np.testing.assert_allclose(out[fwd.ops[0].outputs[0]], want)


@pytest.mark.parametrize("fn", ["add", "mul", "sub", "div"])
def test_rank0_operand_grads(fn):
    # A rank-0 operand broadcasts against the other: its gradient is the sum.
    check_grads(lambda b: b.ew(fn, b.param("x", (3, 4)), b.param("s", ())), positive=fn == "div")
    check_grads(lambda b: b.ew(fn, b.param("s", ()), b.param("x", (3, 4))), positive=fn == "div")


def test_select_and_stop_gradient_grads():
    def build(b):
        x, y = b.param("x", (4, 5)), b.param("y", (4, 5))
        picked = b.ew("select", b.ew("gt", x, y), x, y)
        return b.ew("mul", picked, b.ew("stop_gradient", x))
    check_grads(build)


def test_gelu_grad_matches_jax_derivative():
    x = np.linspace(-4, 4, 41, dtype=np.float32)
    want = jax.jit(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True))))(x)
    fwd = scalar_graph(lambda b: b.ew("gelu", b.param("x", (41,))))
    train = training_graph(fwd)
    values = jax.jit(lower_graph(train))({**random_leaves(train), "x": x, "r": np.ones(41, np.float32)})
    np.testing.assert_allclose(derived_grads(train, values)["x"], want, rtol=1e-5, atol=1e-6)


def test_convert_and_bias_add_grads():
    def build(b):
        x = b.one("convert", [b.param("x", (2, 3, 4))], dtype="bfloat16")
        x = b.one("convert", [x], dtype="float32")
        x = b.one("bias_add", [x, b.param("b2", (3, 4))])
        return b.one("bias_add", [x, b.param("b1", (4,))])
    check_grads(build, rtol=1e-2)


# ------------------------------------------------------ shape and layout VJPs
LAYOUT_CASES = {
    "broadcast_expand": lambda b: b.one("broadcast", [b.param("x", (1, 3))], shape=(2, 3, 4), dims=(0, 1)),
    "broadcast_new_axes": lambda b: b.one("broadcast", [b.param("x", (3,))], shape=(2, 3, 4), dims=(1,)),
    "reduce_sum": lambda b: b.one("reduce", [b.param("x", (2, 3, 4))], kind="sum", axes=(0, 2)),
    "reduce_mean": lambda b: b.one("reduce", [b.param("x", (2, 3, 4))], kind="mean", axes=(1,)),
    "reduce_max": lambda b: b.one("reduce", [b.param("x", (2, 3, 4))], kind="max", axes=(-1,)),
    "reduce_min": lambda b: b.one("reduce", [b.param("x", (2, 3, 4))], kind="min", axes=(0, 1)),
    "slice": lambda b: b.one("slice", [b.param("x", (4, 5, 6))], start=(1, 0, 2), limit=(3, 5, 5)),
    "pad": lambda b: b.one("pad", [b.param("x", (2, 3))], low=(1, 0), high=(2, 3)),
    "concatenate": lambda b: b.one("concatenate", [b.param("x", (2, 1, 3)), b.input("c", (2, 2, 3)),
                                                   b.param("y", (2, 4, 3))], axis=1),
    "transpose": lambda b: b.one("transpose", [b.param("x", (2, 3, 4))], perm=(2, 0, 1)),
    "reshape": lambda b: b.one("reshape", [b.one("reshape", [b.param("x", (2, 3, 4))], shape=(6, 4))],
                               shape=(3, 8)),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_grads(case):
    check_grads(LAYOUT_CASES[case])


def test_pad_iota_full_values():
    b = GraphBuilder("values")
    x = b.input("x", (2, 2))
    padded = b.one("pad", [x], low=(1, 0), high=(0, 2))
    iota = b.one("iota", [], shape=(2, 3), dimension=1, dtype="int32")
    full = b.one("full", [], shape=(2,), value=7.5, dtype="float32")
    out = lower_graph(b.build([padded, iota, full]))({"x": np.arange(4, dtype=np.float32).reshape(2, 2)})
    np.testing.assert_array_equal(out[padded], [[0, 0, 0, 0], [0, 1, 0, 0], [2, 3, 0, 0]])
    np.testing.assert_array_equal(out[iota], [[0, 1, 2], [0, 1, 2]])
    assert out[iota].dtype == np.int32
    np.testing.assert_array_equal(out[full], [7.5, 7.5])


# ------------------------------------------------------------------- einsum
@pytest.mark.parametrize("equation,a,b", [
    ("ij,jk->k", (3, 4), (4, 5)),      # i is summed inside the first operand alone
    ("ij,jk->i", (3, 4), (4, 5)),      # k is summed inside the second operand alone
    ("ij,kl->ik", (2, 3), (4, 5)),     # one private letter in each operand
    ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)),
    ("i,i->", (6,), (6,)),
])
def test_einsum_grads(equation, a, b):
    check_grads(lambda g: g.einsum(equation, g.param("a", a), g.param("b", b)))


def test_einsum_same_operand_twice():
    def build(b):
        x = b.param("x", (3, 4))
        return b.einsum("ij,ij->ij", x, x)
    check_grads(build)


# ---------------------------------------------------------- softmax and norms
def _softmax_causal(b):
    return b.one("softmax", [b.param("x", (2, 2, 4, 4))], axis=-1, scale=0.5, causal=True)


def test_softmax_causal_values():
    fwd = scalar_graph(_softmax_causal)
    leaves = random_leaves(fwd, seed=3, scale=1.0)
    y = np.asarray(jax.jit(lower_graph(fwd))(leaves)[fwd.ops[0].outputs[0]])
    z = 0.5 * leaves["x"].astype(np.float64)
    z = np.where(np.tril(np.ones((4, 4), bool)), z, -np.inf)
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-7)
    assert np.all(y[..., 0, 1:] == 0)


@pytest.mark.parametrize("build", [
    _softmax_causal,
    lambda b: b.one("softmax", [b.param("x", (3, 4, 5))], axis=1, scale=1.0),
    lambda b: b.one("softmax", [b.param("x", (2, 5, 3))], axis=-1, scale=2.0, causal=True),  # q > k
], ids=["causal", "axis1", "causal_rect"])
def test_softmax_grads(build):
    check_grads(build)


def test_layer_norm_grads():
    check_grads(lambda b: b.one("layer_norm", [b.param("x", (2, 3, 8)), b.param("g", (8,)), b.param("beta", (8,))],
                                eps=1e-5), rtol=1e-4)


def test_batch_norm_grads_and_values():
    build = lambda b: b.one("batch_norm", [b.param("x", (4, 3, 3, 5)), b.param("g", (5,)),  # noqa: E731
                                           b.param("beta", (5,))], eps=1e-5)
    check_grads(build, rtol=1e-4)
    fwd = scalar_graph(build)
    leaves = random_leaves(fwd, seed=2, scale=1.0)
    y = np.asarray(jax.jit(lower_graph(fwd))(leaves)[fwd.ops[0].outputs[0]])
    x = leaves["x"].astype(np.float64)
    want = (x - x.mean((0, 1, 2))) / np.sqrt(x.var((0, 1, 2)) + 1e-5) * leaves["g"] + leaves["beta"]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------- embedding and loss
def test_embedding_grad_with_repeated_ids():
    ids = np.array([[1, 1, 3], [0, 1, 1]], np.int32)

    def build(b):
        return b.one("embedding", [b.param("table", (6, 4)), b.input("ids", (2, 3), "int32")])
    train = check_grads(build, overrides={"ids": ids})
    leaves = {**random_leaves(train, seed=4, scale=1.0), "ids": ids}
    grads = derived_grads(train, jax.jit(lower_graph(train))(leaves))
    r = leaves["r"]
    np.testing.assert_allclose(grads["table"][1], r[0, 0] + r[0, 1] + r[1, 1] + r[1, 2], rtol=1e-6)
    np.testing.assert_array_equal(grads["table"][[2, 4, 5]], 0.0)


def test_softmax_cross_entropy_value_and_grad():
    b = GraphBuilder("xent")
    with b.scope(layer=0):
        logits = b.param("logits", (2, 3, 5))
        labels = b.input("labels", (2, 3), "int32")
        loss = b.one("softmax_cross_entropy", [logits, labels])
    fwd = b.build([loss])
    train = training_graph(fwd)
    leaves = random_leaves(train, seed=5, scale=1.0)
    values = jax.jit(lower_graph(train))(leaves)
    x, y = leaves["logits"].astype(np.float64), leaves["labels"]
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, y[..., None], -1).mean()
    assert values[loss].dtype == np.float32 and values[loss].shape == ()
    np.testing.assert_allclose(values[loss], want, rtol=1e-6)
    assert_grads_close(derived_grads(train, values), reference_grads(fwd, leaves))


# ---------------------------------------------------------- conv and pooling
@pytest.mark.parametrize("x_shape,w_shape,strides,padding", [
    ((2, 7, 7, 3), (3, 3, 3, 4), (2, 2), ((1, 1), (1, 0))),
    ((2, 8, 6, 2), (3, 2, 2, 3), (2, 2), ((1, 1), (0, 0))),  # the last input row is never read
    ((1, 5, 5, 2), (1, 1, 2, 3), (1, 1), ((0, 0), (0, 0))),
])
def test_conv2d_grads(x_shape, w_shape, strides, padding):
    check_grads(lambda b: b.one("conv2d", [b.param("x", x_shape), b.param("w", w_shape)],
                                strides=strides, padding=padding), rtol=1e-4)


@pytest.mark.parametrize("x_shape,strides", [((2, 5, 5, 3), (1, 1)), ((2, 7, 6, 3), (2, 2)), ((1, 8, 8, 2), (2, 3))])
def test_pointwise_conv2d_is_a_matmul_over_the_strided_pixels(x_shape, strides):
    """The 1x1 convolutions lowered as matmuls: their value and both gradients against
    numpy loops over the pixels a 1x1 filter reads (every stride-th, the rest never)."""
    w_shape = (1, 1, x_shape[-1], 4)
    build = lambda b: b.one("conv2d", [b.param("x", x_shape), b.param("w", w_shape)],  # noqa: E731
                            strides=strides, padding=((0, 0), (0, 0)))
    fwd = scalar_graph(build)
    train = training_graph(fwd)
    leaves = random_leaves(train, seed=8, scale=1.0)
    values = jax.jit(lower_graph(train))(leaves)
    x, w = leaves["x"].astype(np.float64), leaves["w"][0, 0].astype(np.float64)
    (sh, sw), y = strides, np.asarray(values[fwd.ops[0].outputs[0]])
    read = x[:, ::sh, ::sw]
    np.testing.assert_allclose(y, np.einsum("nhwc,cd->nhwd", read, w), rtol=1e-5, atol=1e-6)
    dy, grads = leaves["r"].astype(np.float64), derived_grads(train, values)   # loss = sum(y * r)
    dx = np.zeros(x.shape)
    dx[:, ::sh, ::sw] = np.einsum("nhwd,cd->nhwc", dy, w)
    np.testing.assert_allclose(grads["x"], dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["w"][0, 0], np.einsum("nhwc,nhwd->cd", read, dy), rtol=1e-5, atol=1e-5)
    check_grads(build, rtol=1e-4)


def test_conv2d_input_is_not_differentiated_when_it_is_data():
    train = check_grads(lambda b: b.one("conv2d", [b.input("img", (2, 6, 6, 3)), b.param("w", (3, 3, 3, 2))],
                                        strides=(2, 2), padding=((1, 1), (1, 1))), rtol=1e-4)
    assert [op.prim for op in train.ops if op.prim.startswith("conv2d_")] == ["conv2d_filter_grad"]


@pytest.mark.parametrize("strides,padding", [((2, 2), ((1, 1), (1, 1))), ((1, 1), ((0, 0), (0, 0)))])
def test_max_pool_grads_and_values(strides, padding):
    build = lambda b: b.one("max_pool", [b.param("x", (2, 7, 7, 3))], window=(3, 3),  # noqa: E731
                            strides=strides, padding=padding)
    check_grads(build)
    fwd = scalar_graph(build)
    leaves = random_leaves(fwd, seed=6, scale=1.0)
    y = np.asarray(jax.jit(lower_graph(fwd))(leaves)[fwd.ops[0].outputs[0]])
    xp = np.pad(leaves["x"], ((0, 0), padding[0], padding[1], (0, 0)), constant_values=-np.inf)
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            window = xp[:, i * strides[0]:i * strides[0] + 3, j * strides[1]:j * strides[1] + 3]
            np.testing.assert_array_equal(y[:, i, j], window.max((1, 2)))


@pytest.mark.parametrize("strides,padding", [((2, 2), ((1, 1), (1, 1))), ((1, 1), ((0, 0), (0, 0))),
                                             ((2, 3), ((1, 0), (0, 1)))])
def test_max_pool_grad_sends_each_cotangent_to_its_windows_first_maximum(strides, padding):
    """The written-out max-pool cotangent against JAX's own transpose of a max
    reduce-window (XLA's select-and-scatter), on integer-valued inputs so that most
    windows hold their maximum more than once: ties go where XLA sends them."""
    p = {"window": (3, 3), "strides": strides, "padding": padding}
    x = np.round(np.random.default_rng(0).normal(size=(2, 7, 8, 3))).astype(np.float32)

    def pool(v):
        pads = ((0, 0), *padding, (0, 0))
        return jax.lax.reduce_window(v, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, *strides, 1), pads)

    dy = np.random.default_rng(1).normal(size=jax.eval_shape(pool, x).shape).astype(np.float32)
    got = jax.jit(functools.partial(LOWERINGS["max_pool_grad"], p))(dy, x)
    want = jax.jit(lambda v, d: jax.vjp(pool, v)[1](d)[0])(x, dy)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.tuples(*[st.integers(0, 2)] * 4), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_max_pool_grad_matches_jax_on_any_geometry(kh, kw, sh, sw, pads, h, w, seed):
    """Any window, stride, padding (each side its own, up to the window less one) and
    image, down to images the window reaches past on both sides: the written-out
    cotangent equals JAX's transpose, ties included (small integers)."""
    pt, pb, pl, pr = (min(v, k - 1) for v, k in zip(pads, (kh, kh, kw, kw), strict=True))
    pad = ((pt, pb), (pl, pr))
    assume(h + pt + pb >= kh and w + pl + pr >= kw)          # at least one window fits
    p = {"window": (kh, kw), "strides": (sh, sw), "padding": pad}
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, size=(2, h, w, 2)).astype(np.float32)

    def pool(v):
        return jax.lax.reduce_window(v, -np.inf, jax.lax.max, (1, kh, kw, 1), (1, sh, sw, 1), ((0, 0), *pad, (0, 0)))

    dy = rng.normal(size=jax.eval_shape(pool, x).shape).astype(np.float32)
    got = jax.jit(functools.partial(LOWERINGS["max_pool_grad"], p))(dy, x)
    want = jax.jit(lambda v, d: jax.vjp(pool, v)[1](d)[0])(x, dy)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ gating
def _top2_reference(gates: np.ndarray, capacity: int) -> np.ndarray:
    """GShard top-2 with capacity, written as loops: first choices queue before second."""
    g_, s_, e_ = gates.shape
    combine = np.zeros((g_, s_, e_, capacity))
    for g in range(g_):
        first = gates[g].argmax(-1)
        second = np.array([np.argmax(np.where(np.arange(e_) == first[s], -1.0, gates[g, s])) for s in range(s_)])
        fill = np.zeros(e_, int)
        slots = {}
        for which, choice in (("first", first), ("second", second)):
            for s in range(s_):
                e = choice[s]
                if fill[e] < capacity:
                    slots[which, s] = (e, fill[e])
                fill[e] += 1
        for s in range(s_):
            kept = [(slots[w, s], gates[g, s, slots[w, s][0]]) for w in ("first", "second") if (w, s) in slots]
            total = sum(v for _, v in kept)
            for (e, c), v in kept:
                combine[g, s, e, c] = v / total
    return combine


def test_top2_gating_matches_loop_reference():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(3, 10, 4)).astype(np.float32)
    gates = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    gating = jax.jit(top2_gating, static_argnums=1)
    for capacity in (1, 3, 5, 20):
        combine, dispatch = gating(gates, capacity)
        want = _top2_reference(gates, capacity)
        np.testing.assert_allclose(combine, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(dispatch, (want > 0).astype(np.float32))


def test_top2_gating_grads():
    def build(b):
        gates = b.one("softmax", [b.param("logits", (2, 8, 4))], axis=-1)
        combine, dispatch = b.apply("top2_gating", [gates], capacity=3)
        return b.ew("add", combine, b.ew("mul", dispatch, b.input("d", (2, 8, 4, 3))))
    check_grads(build)


def _topk_reference(gates: np.ndarray, k: int, capacity: int, normalize: bool) -> np.ndarray:
    """Top-k with capacity as loops: choice j of every token queues before choice j + 1."""
    g_, s_, e_ = gates.shape
    combine = np.zeros((g_, s_, e_, capacity))
    for g in range(g_):
        order = np.argsort(-gates[g], axis=-1, kind="stable")[:, :k]      # (S, k): best first
        fill = np.zeros(e_, int)
        kept: dict[int, list] = {s: [] for s in range(s_)}
        for j in range(k):
            for s in range(s_):
                e = order[s, j]
                if fill[e] < capacity:
                    kept[s].append((e, fill[e], gates[g, s, e]))
                    fill[e] += 1
        for s in range(s_):
            total = sum(v for _, _, v in kept[s]) if normalize else 1.0
            for e, c, v in kept[s]:
                combine[g, s, e, c] = v / total
    return combine


@pytest.mark.parametrize("k,normalize", [(1, True), (2, True), (3, False), (6, False)])
def test_topk_gating_matches_loop_reference(k, normalize):
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(2, 12, 8)).astype(np.float32)
    gates = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    gating = jax.jit(topk_gating, static_argnums=(1, 2, 3))
    for capacity in (1, 4, 9, 40):
        combine, dispatch = gating(gates, k, capacity, normalize)
        want = _topk_reference(gates, k, capacity, normalize)
        np.testing.assert_allclose(combine, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(dispatch, (want > 0).astype(np.float32))


def test_topk_gating_grads():
    def build(b):
        gates = b.one("softmax", [b.param("logits", (2, 8, 6))], axis=-1)
        combine, dispatch = b.apply("topk_gating", [gates], k=3, capacity=3, normalize=False)
        return b.ew("add", combine, b.ew("mul", dispatch, b.input("d", (2, 8, 6, 3))))
    check_grads(build)


# ------------------------------------------------------------------- adam
def _adam_numpy(w, g, m, v, cfg: AdamConfig):
    m = cfg.b1 * m + (1 - cfg.b1) * g
    v = cfg.b2 * v + (1 - cfg.b2) * g * g
    upd = cfg.lr * (m / (1 - cfg.b1)) / (np.sqrt(v / (1 - cfg.b2)) + cfg.eps) + cfg.weight_decay * w
    return w - upd, m, v


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adam_update_values(dtype):
    cfg = AdamConfig(lr=1e-2, weight_decay=0.1)
    b = GraphBuilder("adam")
    with b.scope(layer=0):
        x = b.param("x", (3, 4), dtype)
        y = b.ew("mul", b.one("convert", [x], dtype="float32"), b.input("r", (3, 4)))
        loss = b.one("reduce", [y], kind="sum", axes=(0, 1))
    train = training_graph(b.build([loss]), optimizer=cfg)
    (adam,) = [op for op in train.ops if op.prim == "adam"]
    assert len(adam.inputs) == (5 if dtype == "bfloat16" else 4)
    rng = np.random.default_rng(8)
    leaves = random_leaves(train, seed=8, scale=1.0)
    leaves["x:adam_m"] = rng.normal(size=(3, 4)).astype(np.float32)
    leaves["x:adam_v"] = np.abs(rng.normal(size=(3, 4))).astype(np.float32)
    values = jax.jit(lower_graph(train))(leaves)
    w = leaves["x:master" if dtype == "bfloat16" else "x"].astype(np.float64)
    g = np.asarray(values[adam.inputs[1]], np.float64)
    # The gradient arrives in the param dtype (bfloat16 rounds it); Adam takes it as given.
    np.testing.assert_allclose(g, leaves["r"], rtol=1e-6 if dtype == "float32" else 1e-2)
    w2, m2, v2 = _adam_numpy(w, g, leaves["x:adam_m"], leaves["x:adam_v"], cfg)
    outs = dict(zip(("param", "master", "m", "v") if dtype == "bfloat16" else ("param", "m", "v"), adam.outputs))
    np.testing.assert_allclose(values[outs["m"]], m2, rtol=1e-6)
    np.testing.assert_allclose(values[outs["v"]], v2, rtol=1e-6)
    assert str(values[outs["param"]].dtype) == dtype
    np.testing.assert_allclose(np.asarray(values[outs["param"]], np.float64), w2,
                               rtol=1e-6 if dtype == "float32" else 1e-2)
    if dtype == "bfloat16":
        np.testing.assert_allclose(values[outs["master"]], w2, rtol=1e-6)

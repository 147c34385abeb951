"""JAX import: op counts and FLOPs against closed forms, errors, abstract tracing, numerics."""

from __future__ import annotations

import importlib.util
import json
import math
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpasim.graphs import from_jax, graph_from_json, graph_to_json, op_flops, training_graph_from_jax
from alpasim.graphs import JaxImportError

S, F32, I32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
HAVE_LOWERING = importlib.util.find_spec("alpasim.backends._lowering") is not None


def prim_ops(graph, prim, phase=None):
    return [op for op in graph.ops if op.prim == prim and (phase is None or op.phase == phase)]


def flops(graph, prim, phase=None):
    return sum(op_flops(op, graph.tensors) for op in prim_ops(graph, prim, phase))


def concrete(tree, bounds=None, seed=0):
    """Random arrays for a pytree of ShapeDtypeStructs; integers below `bounds[last key]`."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        if jnp.issubdtype(s.dtype, jnp.integer):
            return rng.integers(0, bounds[path[-1].key], s.shape).astype(s.dtype)
        return (0.3 * rng.normal(size=s.shape)).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def leaf_names(tree, root):
    """The graph names of a pytree's leaves: `layers/0/w` for params, `batch/x` for inputs."""
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        names.append(key if root == "params" and key else "/".join(filter(None, (root, key))))
    return names


# ------------------------------------------------------------------- models
MLP_B, MLP_DIMS = 8, (16, 32, 24, 10)


def mlp_loss(params, batch):
    h = batch["x"]
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < len(params["layers"]) - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(batch["y"], MLP_DIMS[-1]) * logp, axis=-1))


def mlp_shapes():
    params = {"layers": [{"w": S((a, b), F32), "b": S((b,), F32)} for a, b in zip(MLP_DIMS, MLP_DIMS[1:])]}
    return params, {"x": S((MLP_B, MLP_DIMS[0]), F32), "y": S((MLP_B,), I32)}


TF = dict(B=2, T=8, H=16, N=4, V=32, L=2)  # batch, sequence, hidden, heads, vocab, blocks; ffn 4H


def layer_norm(x, p):
    m = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def block(p, x):
    B, T, H = x.shape
    h = layer_norm(x, p["ln1"])
    q, k, v = (jnp.einsum("bth,hnd->btnd", h, p[w]) for w in ("wq", "wk", "wv"))
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    o = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("btnd,ndh->bth", o, p["wo"])
    h = layer_norm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def gpt_loss(params, batch):
    x = jnp.take(params["wte"], batch["ids"], axis=0) + params["wpe"]
    for p in params["blocks"]:
        x = block(p, x)
    logits = layer_norm(x, params["ln_f"]) @ params["wte"].T  # tied head
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(batch["targets"], logits.shape[-1]) * logp, axis=-1))


def gpt_shapes(B, T, H, N, V, L):
    ln = {"g": S((H,), F32), "b": S((H,), F32)}
    blk = {"ln1": ln, "ln2": ln, "wo": S((N, H // N, H), F32), "w1": S((H, 4 * H), F32), "b1": S((4 * H,), F32),
           "w2": S((4 * H, H), F32), "b2": S((H,), F32), **{w: S((H, N, H // N), F32) for w in ("wq", "wk", "wv")}}
    params = {"wte": S((V, H), F32), "wpe": S((T, H), F32), "blocks": [blk] * L, "ln_f": ln}
    return params, {"ids": S((B, T), I32), "targets": S((B, T), I32)}


# -------------------------------------------------------------------- MLP
def test_mlp_names_and_roles():
    g = from_jax(mlp_loss, *mlp_shapes(), name="mlp")
    assert g.name == "mlp" and g.outputs == ("loss",) and g.tensors["loss"].shape == ()
    assert [t.name for t in g.params] == [f"layers/{i}/{k}" for i in range(3) for k in ("b", "w")]  # sorted dict keys
    assert g.inputs == ("batch/x", "batch/y")
    assert {op.layer for op in g.ops} == {0}
    assert sum(op.param("fn") == "relu" for op in g.ops) == 2  # jax.nn.relu is one op, not max + mask


def test_mlp_einsum_count_and_flops():
    B, d = MLP_B, MLP_DIMS
    fwd = 2 * B * sum(a * b for a, b in zip(d, d[1:]))
    g = from_jax(mlp_loss, *mlp_shapes())
    assert len(prim_ops(g, "einsum")) == 3
    assert flops(g, "einsum") == fwd
    t = training_graph_from_jax(mlp_loss, *mlp_shapes())
    # Backward: a weight and an input gradient per layer, except the first layer's
    # input gradient (the data needs none): 5 einsums, 2 x fwd - 2*B*d0*d1 FLOPs.
    assert len(prim_ops(t, "einsum", "forward")) == 3 and len(prim_ops(t, "einsum", "backward")) == 5
    assert flops(t, "einsum") == 3 * fwd - 2 * B * d[0] * d[1]
    assert len(prim_ops(t, "adam", "update")) == 6


# ------------------------------------------------------------- transformer
def test_transformer_einsum_count_and_flops():
    B, T, H, N, V, L = (TF[k] for k in "BTHNVL")
    g = from_jax(gpt_loss, *gpt_shapes(**TF))
    # Per block: q, k, v, out projections (4 * 2BTH^2), scores and context (2 * 2BT^2H),
    # MLP up and down (2 * 2BTH*4H): 24BTH^2 + 4BT^2H. Tied head: 2BTHV. The embedding
    # is a lookup (0 FLOPs).
    fwd = L * (24 * B * T * H * H + 4 * B * T * T * H) + 2 * B * T * H * V
    assert len(prim_ops(g, "einsum")) == 8 * L + 1
    assert flops(g, "einsum") == fwd
    assert len(prim_ops(g, "embedding")) == 1
    t = training_graph_from_jax(gpt_loss, *gpt_shapes(**TF))
    # Every einsum operand depends on a parameter (even block 0's input, through the
    # embedding), so backward has two einsums of the forward's size per forward einsum.
    assert len(prim_ops(t, "einsum", "backward")) == 2 * (8 * L + 1)
    assert flops(t, "einsum") == 3 * fwd
    assert len(prim_ops(t, "embedding_grad")) == 1


def test_remat_recomputes_the_forward():
    t = training_graph_from_jax(gpt_loss, *gpt_shapes(**TF), remat=True)
    assert len([op for op in t.ops if op.remat and op.prim == "einsum"]) == 8 * TF["L"] + 1


# ---------------------------------------------------------------- nesting
@jax.custom_vjp
def triple(x):
    return 3.0 * x


triple.defvjp(lambda x: (triple(x), None), lambda _, g: (3.0 * g,))


def nested_loss(params, x):
    @jax.jit
    def dense(w, h):
        return jnp.tanh(h @ w)

    h = jax.checkpoint(dense)(params["w1"], x)
    h = triple(jax.nn.gelu(h, approximate=False))
    return jnp.mean(jax.nn.softmax(dense(params["w2"], h)) ** 2)


def test_nested_calls_are_inlined_with_scoped_names():
    g = from_jax(nested_loss, {"w1": S((4, 6), F32), "w2": S((6, 5), F32)}, S((3, 4), F32))
    assert len(prim_ops(g, "einsum")) == 2
    assert any(op.name.startswith("dense/") for op in g.ops)
    assert g.inputs == ("batch",)
    fns = {op.param("fn") for op in prim_ops(g, "elementwise")}
    assert {"tanh", "erf", "exp", "square"} <= fns


# -------------------------------------------------------------- convolution
def cnn_loss(params, x):
    # NCHW activations and OIHW filters, as lax.conv defaults to: mapped to NHWC
    # conv2d with transposes around it.
    y = jax.nn.relu(jax.lax.conv(x, params["k"], (1, 1), ((1, 1), (1, 1))))
    y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    return jnp.mean(jnp.mean(y, axis=(2, 3)) @ params["w"])


CNN = ({"k": S((8, 3, 3, 3), F32), "w": S((8, 4), F32)}, S((2, 3, 6, 6), F32))


def test_conv_and_pool_map_to_conv2d_and_max_pool():
    g = from_jax(cnn_loss, *CNN)
    (conv,) = prim_ops(g, "conv2d")
    assert len(prim_ops(g, "max_pool")) == 1
    n, c, h, w, co, k = 2, 3, 6, 6, 8, 3
    assert op_flops(conv, g.tensors) == 2 * n * h * w * co * k * k * c  # "SAME"-sized output
    assert g.tensors[conv.inputs[0]].shape == (n, h, w, c) and g.tensors[conv.inputs[1]].shape == (k, k, c, co)


# -------------------------------------------------------------------- errors
def test_unsupported_primitives_are_all_named():
    def loss(p, x):
        return jnp.sum(jnp.sort(x @ p)) + jnp.sum(jnp.cumsum(x @ p))

    with pytest.raises(JaxImportError, match=r"unsupported JAX primitives: cumsum at \S+:\d+.*; sort at .*; "
                                             r"alpasim maps"):
        from_jax(loss, S((4, 4), F32), S((2, 4), F32))


@pytest.mark.parametrize("loss, why", [
    (lambda p, x: x @ p, r"one scalar float loss, got \(float32\[2,3\]\)"),
    (lambda p, x: (jnp.sum(x @ p), 0.0), "one scalar float loss"),
    (lambda p, x: jnp.argmax(x @ p).astype(jnp.float32), "unsupported JAX primitives: argmax"),
    (lambda p, x: jnp.sum((x @ p)[:, ::2]), "only where the stride divides the axis"),
    (lambda p, x: jax.lax.cond(jnp.sum(x) > 0, lambda: jnp.sum(x @ p), lambda: jnp.sum(p)),
     r"cond at \S+test_jax_import.py:\d+.*data-dependent control flow"),
])
def test_bad_losses_raise(loss, why):
    with pytest.raises(JaxImportError, match=why):
        from_jax(loss, S((4, 3), F32), S((2, 4), F32))


def test_a_captured_array_travels_in_the_graph_and_a_huge_one_is_refused(tmp_path):
    from alpasim.backends import lower_graph, random_leaves
    from alpasim.graphs import constant_array, load_graph, save_graph

    table = np.arange(12, dtype=np.float32).reshape(4, 3)

    def loss(p, x):
        return jnp.sum((x @ p) * table)

    save_graph(from_jax(loss, S((3, 3), F32), S((4, 3), F32)), tmp_path / "g.json")
    g = load_graph(tmp_path / "g.json")
    (const,) = [op for op in g.ops if op.prim == "constant"]
    np.testing.assert_array_equal(constant_array(dict(const.params)), table)
    leaves = random_leaves(g, 0)
    want = loss(leaves["params"], leaves["batch"])
    assert float(lower_graph(g, ["loss"])(leaves)["loss"]) == pytest.approx(float(want), rel=1e-6)
    huge = np.arange(1 << 23, dtype=np.float32)
    with pytest.raises(JaxImportError, match="pass it in `params` or `batch`"):
        from_jax(lambda p, x: jnp.sum(x * p * huge), S((1 << 23,), F32), S((1 << 23,), F32))


def test_strided_slices_and_stack_equal_jax():
    from alpasim.backends import lower_graph, random_leaves

    def loss(p, x):
        y = x @ p                                       # (2, 8)
        return jnp.sum(jnp.stack([y[:, 1::2] * 2.0, y[:, ::4].repeat(2, axis=1)], -1) ** 2)

    g = from_jax(loss, S((4, 8), F32), S((2, 4), F32))
    leaves = random_leaves(g, 0)
    want = loss(leaves["params"], leaves["batch"])
    assert float(lower_graph(g, ["loss"])(leaves)["loss"]) == pytest.approx(float(want), rel=1e-6)


# ---------------------------------------------------------- abstract inputs
def test_abstract_trace_allocates_nothing():
    def loss(p, ids):
        return jnp.mean(jnp.take(p["emb"], ids, axis=0) @ p["proj"])

    params = {"emb": S((100_000, 10_000), F32), "proj": S((10_000, 8), F32)}
    tracemalloc.start()
    try:
        g = training_graph_from_jax(loss, params, S((4, 16), I32))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert g.num_params() == 100_000 * 10_000 + 10_000 * 8
    assert peak < 50 * 2**20  # the embedding table alone would be 4 GB


def test_concrete_arrays_give_the_abstract_graph():
    params, batch = mlp_shapes()
    real = concrete((params, batch), bounds={"y": MLP_DIMS[-1]})
    assert from_jax(mlp_loss, *real) == from_jax(mlp_loss, params, batch)


# ------------------------------------------------------------------ numerics
def assert_matches_jax(loss_fn, params, batch, bounds=None, rtol=2e-4):
    """The lowered training graph's loss and gradients equal jax.value_and_grad's."""
    from alpasim.backends import lower_graph

    params, batch = concrete((params, batch), bounds)
    train = training_graph_from_jax(loss_fn, params, batch)
    grad_of = {op.inputs[0]: op.inputs[1] for op in train.ops if op.prim == "adam"}
    # Forward and backward only: the Adam ops add nothing to check and much to compile.
    step = train.replace(ops=[op for op in train.ops if op.phase != "update"], outputs=["loss"])
    env = dict(zip(leaf_names(params, "params"), jax.tree_util.tree_leaves(params)))
    env.update(zip(leaf_names(batch, "batch"), jax.tree_util.tree_leaves(batch)))
    values = jax.jit(lower_graph(step, ["loss", *grad_of.values()]))(env)
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(values["loss"], want_loss, rtol=rtol / 10, atol=1e-6)
    grads = {p: values[g] for p, g in grad_of.items()}
    names = leaf_names(params, "params")
    assert sorted(grads) == sorted(names)
    for name, want in zip(names, jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(grads[name], want, rtol=rtol, atol=1e-6, err_msg=name)


@pytest.mark.skipif(not HAVE_LOWERING, reason="needs alpasim.backends.lower_graph")
def test_mlp_numerics_match_jax():
    assert_matches_jax(mlp_loss, *mlp_shapes(), bounds={"y": MLP_DIMS[-1]})


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LOWERING, reason="needs alpasim.backends.lower_graph")
def test_transformer_numerics_match_jax():
    assert_matches_jax(gpt_loss, *gpt_shapes(**TF), bounds={"ids": TF["V"], "targets": TF["V"]})


@pytest.mark.skipif(not HAVE_LOWERING, reason="needs alpasim.backends.lower_graph")
def test_nested_and_cnn_numerics_match_jax():
    assert_matches_jax(nested_loss, {"w1": S((4, 6), F32), "w2": S((6, 5), F32)}, S((3, 4), F32))
    assert_matches_jax(cnn_loss, *CNN)


def assorted_loss(p, x):
    # Primitives the models above do not reach: split, concatenate, negative padding,
    # clamp, log1p/expm1/exp2, integer powers, constant-index dynamic_slice, an
    # integer select_n, NHWC convolution and a bf16 matmul with an f32 result.
    y = jnp.tanh(x["v"] @ p["w"])  # (4, 6)
    a, c = jnp.split(y, 2, axis=1)
    y = jnp.concatenate([c, a, jax.lax.pad(a, 0.0, [(0, 0, 0), (1, -1, 0)])], axis=1)  # (4, 9)
    y = jnp.clip(y, -0.5, 0.5) + jnp.log1p(y ** 2) + jnp.expm1(y / 4) + jnp.exp2(y) + y ** 3 + y ** -1 * 1e-3
    y = jax.lax.dynamic_slice(y, (1, 2), (3, 4)) * jax.lax.select_n(x["i"], y[:3, :4], 2.0 * y[1:, 5:])
    img = jax.lax.conv_general_dilated(x["img"], p["k"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    z = jnp.matmul(y.astype(jnp.bfloat16), p["u"].astype(jnp.bfloat16), preferred_element_type=F32)
    return jnp.mean(z) + jnp.mean(img ** 2)


ASSORTED = ({"w": S((5, 6), F32), "u": S((4, 2), F32), "k": S((3, 3, 2, 4), F32)},
            {"v": S((4, 5), F32), "i": S((3, 4), I32), "img": S((2, 5, 5, 2), F32)})


def test_assorted_primitives_map():
    g = from_jax(assorted_loss, *ASSORTED)
    prims = {op.prim for op in g.ops}
    assert {"slice", "concatenate", "pad", "conv2d", "einsum", "convert"} <= prims
    (mm,) = [op for op in prim_ops(g, "einsum") if op.param("dtype") == "float32"]
    assert {g.tensors[t].dtype for t in mm.inputs} == {"bfloat16"}


@pytest.mark.skipif(not HAVE_LOWERING, reason="needs alpasim.backends.lower_graph")
def test_assorted_numerics_match_jax():
    assert_matches_jax(assorted_loss, *ASSORTED, bounds={"i": 2}, rtol=2e-2)


# A cached table of RoPE's layout (positions, 1, features), captured by the function.
ROWS = np.arange(24, dtype=np.float32).reshape(6, 1, 4) / 24
TAKE = ({"t": S((6, 5, 4), F32)}, {"ids": S((2, 3), I32), "cols": S((2, 3), I32)})


def take_loss(p, x):
    """Gathers that are lookups along one axis by ids of rank 2: of a 3-D parameter along
    axis 0 and along axis 1 (offset dims on both sides of the ids' dims), a partial
    slice keeping the picked axis (lax.gather itself), and of a captured constant
    (`sincos[position_ids]` in Hugging Face's Flax Llama)."""
    t = p["t"]
    rows = jnp.take(t, x["ids"], axis=0)                                     # (2, 3, 5, 4)
    cols = jnp.take(t, x["cols"], axis=1)                                    # (6, 2, 3, 4)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(2, 3, 4), collapsed_slice_dims=(), start_index_map=(0,))
    part = jax.lax.gather(t, x["ids"][..., None], dn, slice_sizes=(1, 2, 4),
                          mode="promise_in_bounds")                          # (2, 3, 1, 2, 4)
    cached = jnp.asarray(ROWS)[x["ids"]]                                     # (2, 3, 1, 4)
    return (jnp.sum(rows ** 2) + jnp.sum(jnp.sin(cols) * jnp.arange(4.0)) + jnp.sum(part[:, :, 0] * rows[:, :, :2])
            + jnp.sum(cached * rows[:, :, 1:2]))


def test_a_lookup_along_one_axis_is_an_embedding_of_the_tables_rows():
    """Each lookup is one embedding of a 2-D view of its table, ids of any rank: no
    FLOPs, the gathered rows' bytes only, the ids' axes shardable in its output; the
    table is transposed only for a lookup along an axis other than 0. A gather with
    two index columns is no lookup and is refused."""
    from alpasim.costmodels import traffic_bytes
    from alpasim.graphs._primitives import op_dims

    g = from_jax(take_loss, *TAKE)
    lookups = prim_ops(g, "embedding")
    assert len(lookups) == 4
    assert sorted(g.tensors[op.inputs[0]].shape for op in lookups) == [(5, 24), (6, 4), (6, 8), (6, 20)]
    assert len(prim_ops(g, "transpose")) == 2              # axis 1: the table in, the result out
    for op in lookups:
        table, ids = (g.tensors[t] for t in op.inputs)
        out = g.tensors[op.outputs[0]]
        assert ids.shape == (2, 3) and out.shape == (2, 3, table.shape[1])
        assert op_flops(op, g.tensors) == 0
        assert traffic_bytes(op, g.tensors) == ids.nbytes + 2 * out.nbytes
        dims = op_dims(op, g.tensors)
        assert dims.outputs[0][:2] == dims.inputs[1] and dims.outputs[0][2] == dims.inputs[0][1]
    with pytest.raises(JaxImportError, match="gather maps to embedding only as a lookup along one axis"):
        from_jax(lambda p, x: jnp.sum(p["t"][x["ids"], x["cols"]]), *TAKE)


@pytest.mark.skipif(not HAVE_LOWERING, reason="needs alpasim.backends.lower_graph")
def test_a_lookup_along_one_axis_numerics_match_jax():
    """Loss and the table's gradient (the embedding's scatter-add, back through the views)
    equal JAX's, at random ids with repeats."""
    assert_matches_jax(take_loss, *TAKE, bounds={"ids": 6, "cols": 5})


def test_logsumexp_and_silu_map():
    def loss(p, x):
        h = x @ p
        return jnp.mean(jax.nn.logsumexp(h, axis=-1)) + jnp.mean(jax.nn.silu(h))

    g = from_jax(loss, S((4, 3), F32), S((2, 4), F32))
    assert {"logistic", "exp", "log", "eq"} <= {op.param("fn") for op in prim_ops(g, "elementwise")}
    if HAVE_LOWERING:
        assert_matches_jax(loss, S((4, 3), F32), S((2, 4), F32))


def test_constant_guards_fold_away_and_dead_ops_drop():
    # jnp.var guards its divisor with where(n > 0, ..., nan); n is a constant, so the
    # guard folds and leaves no op. The unused matmul is dropped.
    def loss(p, x):
        unused = x @ p  # noqa: F841
        return jnp.var(jnp.tanh(x))

    g = from_jax(loss, S((4, 3), F32), S((2, 4), F32))
    assert not prim_ops(g, "einsum") and not prim_ops(g, "full")
    assert "select" not in {op.param("fn") for op in prim_ops(g, "elementwise")}


def test_imported_graph_survives_json():
    # Imported ops carry scalars such as log_softmax's -inf.
    g = training_graph_from_jax(gpt_loss, *gpt_shapes(**TF))
    assert graph_from_json(json.loads(json.dumps(graph_to_json(g)))) == g

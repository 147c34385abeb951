"""Derived training graphs of the model families, checked against jax.grad.

The forward graph is lowered to JAX and differentiated by `jax.grad`; the training
graph (VJP rules + Adam) is lowered and run; the gradient of each parameter (the
second operand of its adam op) must agree, with and without rematerialisation, and
the updated parameters must equal an Adam step computed here from jax.grad. The GPT
loss is also checked against a plain-jnp GPT written in this file.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpasim.backends import lower_graph, random_leaves
from alpasim.costmodels import liveness
from alpasim.graphs import PRIMITIVES, AdamConfig, OpGraph, forward_graph, training_graph

GPT = dict(hidden=16, layers=2, heads=2, seq=8, vocab=32, batch=2)
FAMILIES = {
    "gpt3": "gpt3:hidden=16,layers=2,heads=2,seq=8,vocab=32,batch=2,dtype=fp32",
    "moe": "moe:hidden=16,layers=2,heads=2,experts=4,seq=8,vocab=32,batch=2,group_size=8,dtype=fp32",
    "wresnet": "wresnet:channels=2,width=1,image=32,classes=8,batch=4,dtype=fp32,depth=17",
}
ADAM = AdamConfig(lr=1e-2, weight_decay=0.01)
RTOL = {"gpt3": 1e-4, "moe": 1e-4, "wresnet": 1e-3}  # batch norm over few samples amplifies rounding


def derived_grads(train: OpGraph, values) -> dict[str, np.ndarray]:
    """Each parameter's gradient: the second operand of its adam op."""
    return {op.inputs[0]: np.asarray(values[op.inputs[1]]) for op in train.ops if op.prim == "adam"}


def assert_grads_close(got: dict, want: dict, rtol: float) -> None:
    # Absolute tolerance relative to the largest gradient: some gradients are zero
    # mathematically (the key bias under softmax) and only rounding noise remains.
    assert set(got) == set(want)
    scale = max(float(np.abs(w).max()) for w in want.values())
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=rtol * scale, err_msg=name)


class Run:
    """One family: graphs, leaf values, jax.grad of the forward, the lowered training graph."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.forward = forward_graph(FAMILIES[family])
        self.train = training_graph(self.forward, optimizer=ADAM)
        (self.loss,) = self.forward.outputs
        self.leaves = random_leaves(self.train, seed=0, scale=0.05)
        rng = np.random.default_rng(1)
        for t in self.train.tensors.values():  # non-trivial Adam moments
            if t.name.endswith(":adam_m"):
                self.leaves[t.name] = rng.normal(0, 1e-3, t.shape).astype(np.float32)
            elif t.name.endswith(":adam_v"):
                self.leaves[t.name] = np.abs(rng.normal(0, 1e-6, t.shape)).astype(np.float32)
        self.params = {t.name: self.leaves[t.name] for t in self.forward.params}
        data = {k: v for k, v in self.leaves.items() if k not in self.params}
        f = lower_graph(self.forward, [self.loss])
        loss_fn = lambda p: f({**data, **p})[self.loss]  # noqa: E731
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(self.params)
        self.ref_loss = float(loss)
        self.ref_grads = {k: np.asarray(v) for k, v in grads.items()}
        self.values = jax.jit(lower_graph(self.train))(self.leaves)

    def run_remat(self) -> dict:
        remat = training_graph(self.forward, remat=True, optimizer=ADAM)
        return remat, jax.jit(lower_graph(remat))(self.leaves)


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) if f == "wresnet" else f
                                        for f in sorted(FAMILIES)])
def run(request) -> Run:
    return Run(request.param)


# ------------------------------------------------------------------ numerics
@pytest.mark.slow
def test_derived_gradients_match_jax_grad(run):
    assert_grads_close(derived_grads(run.train, run.values), run.ref_grads, RTOL[run.family])
    np.testing.assert_allclose(run.values[run.loss], run.ref_loss, rtol=1e-6)


@pytest.mark.slow
def test_remat_gives_the_same_gradients(run):
    remat, values = run.run_remat()
    assert any(op.remat for op in remat.ops)
    assert_grads_close(derived_grads(remat, values), derived_grads(run.train, run.values), 1e-5)


@pytest.mark.slow
def test_recomputing_fusible_ops_gives_the_same_gradients_from_a_smaller_stash(run):
    cut = training_graph(run.forward, optimizer=ADAM, recompute="fusible")
    values = jax.jit(lower_graph(cut))(run.leaves)
    assert_grads_close(derived_grads(cut, values), derived_grads(run.train, run.values), 1e-5)
    stash = lambda g: sum(g.tensors[t].nbytes for t in liveness(g).stash())  # noqa: E731
    assert stash(cut) <= stash(run.train)
    assert all(op.phase == "backward" and op.remat for op in cut.ops if op.name.endswith(":recompute"))


@pytest.mark.slow
def test_adam_step_matches_an_independent_update(run):
    cfg = ADAM
    for op in run.train.ops:
        if op.prim != "adam":
            continue
        name = op.inputs[0]
        g = run.ref_grads[name].astype(np.float64)
        m = cfg.b1 * run.leaves[f"{name}:adam_m"] + (1 - cfg.b1) * g
        v = cfg.b2 * run.leaves[f"{name}:adam_v"] + (1 - cfg.b2) * g * g
        w = run.params[name].astype(np.float64)
        w_new = w - (cfg.lr * (m / (1 - cfg.b1)) / (np.sqrt(v / (1 - cfg.b2)) + cfg.eps) + cfg.weight_decay * w)
        new_param, new_m, new_v = op.outputs
        # Near-zero gradients make m/sqrt(v) sensitive; compare the step with the step size as scale.
        np.testing.assert_allclose(run.values[new_param], w_new, rtol=1e-4, atol=cfg.lr * 2e-2, err_msg=name)
        # The moments inherit the gradient's tolerance (see assert_grads_close).
        tol = RTOL[run.family]
        np.testing.assert_allclose(run.values[new_m], m, rtol=tol, atol=tol * np.abs(m).max(), err_msg=name)
        np.testing.assert_allclose(run.values[new_v], v, rtol=2 * tol, atol=2 * tol * np.abs(v).max(), err_msg=name)


def _reference_gpt_loss(P: dict, ids, labels, layers: int, heads: int):
    """GPT-3 (pre-LN, tied head) in plain jnp, independent of the graph code."""
    def ln(x, g, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    x = P["embed/wte"][ids] + P["embed/wpe"][None]  # (B, T, C)
    B, T, C = x.shape
    d = C // heads
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(layers):
        p = {k.split("/", 1)[1]: v for k, v in P.items() if k.startswith(f"layer{i}/")}
        h = ln(x, p["ln_attn_scale"], p["ln_attn_bias"])

        # One fused QKV matmul, (C, 3 * n * d), cut into Q, K and V (Megatron's linear_qkv).
        qkv = (h @ p["w_qkv"].reshape(C, 3 * C) + p["b_qkv"].reshape(3 * C)).reshape(B, T, 3, heads, d)
        q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))     # (B, n, T, d) each
        att = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d), -jnp.inf)
        y = jax.nn.softmax(att, axis=-1) @ v  # (B, n, T, d)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p["w_o"].reshape(C, C) + p["b_o"]
        h = ln(x, p["ln_ffn_scale"], p["ln_ffn_bias"])
        h = jax.nn.gelu(h @ p["w_fc1"] + p["b_fc1"], approximate=True)
        x = x + h @ p["w_fc2"] + p["b_fc2"]
    x = ln(x, P["head/ln_final_scale"], P["head/ln_final_bias"])
    logp = jax.nn.log_softmax(x @ P["embed/wte"].T, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


@pytest.mark.slow
def test_gpt_loss_matches_a_plain_jnp_gpt():
    fwd = forward_graph(FAMILIES["gpt3"])
    leaves = random_leaves(fwd, seed=3, scale=0.2)
    got = jax.jit(lower_graph(fwd, fwd.outputs))(leaves)[fwd.outputs[0]]
    params = {t.name: leaves[t.name] for t in fwd.params}
    want = jax.jit(_reference_gpt_loss, static_argnums=(3, 4))(params, leaves["token_ids"], leaves["labels"],
                                                                GPT["layers"], GPT["heads"])
    assert abs(float(want) - math.log(GPT["vocab"])) < 1.0  # a sane untrained loss
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
def test_mixed_precision_training_graph_runs():
    spec = FAMILIES["gpt3"].replace("fp32", "bf16")
    train = training_graph(forward_graph(spec))
    adams = [op for op in train.ops if op.prim == "adam"]
    assert adams and all(len(op.inputs) == 5 for op in adams)
    leaves = random_leaves(train, seed=0, scale=0.05)
    values = jax.jit(lower_graph(train))(leaves)
    for name in train.outputs:
        assert str(values[name].dtype) == train.tensors[name].dtype, name
        assert np.isfinite(np.asarray(values[name], np.float32)).all(), name
    fp32 = forward_graph(FAMILIES["gpt3"])
    fp32_leaves = {k: v.astype(np.float32) if str(v.dtype) == "bfloat16" else v
                   for k, v in leaves.items() if k in fp32.tensors}
    want = jax.jit(lower_graph(fp32, fp32.outputs))(fp32_leaves)[fp32.outputs[0]]
    np.testing.assert_allclose(values[train.outputs[0]], want, rtol=2e-2)


# ----------------------------------------------------------------- structure
@pytest.fixture(scope="module", params=[(f, remat) for f in sorted(FAMILIES) for remat in (False, True)],
                ids=lambda p: f"{p[0]}-remat" if p[1] else p[0])
def train_graph(request) -> tuple[OpGraph, OpGraph, bool]:
    family, remat = request.param
    fwd = forward_graph(FAMILIES[family])
    return fwd, training_graph(fwd, remat=remat), remat


def test_every_op_has_a_layer_and_a_phase(train_graph):
    fwd, train, remat = train_graph
    assert all(op.layer >= 0 for op in train.ops)
    assert {op.phase for op in train.ops} == {"forward", "backward", "update"}
    assert [op for op in train.ops if op.phase == "forward"] == list(fwd.ops)
    assert all(op.prim in PRIMITIVES for op in train.ops)


def test_backward_and_update_ops_follow_their_forward_op(train_graph):
    fwd, train, remat = train_graph
    forward_ops = {op.name: op for op in fwd.ops}
    for op in train.ops:
        if op.phase == "forward":
            continue
        assert op.origin in forward_ops, (op.name, op.origin)
        assert forward_ops[op.origin].layer == op.layer, (op.name, op.origin)
    phases = [op.phase for op in train.ops]
    assert phases == sorted(phases, key=["forward", "backward", "update"].index)


def test_remat_recomputes_layers_but_not_kept_ops(train_graph):
    fwd, train, remat = train_graph
    recomputed = [op for op in train.ops if op.remat]
    assert bool(recomputed) == remat
    for op in recomputed:
        assert op.phase == "backward" and "keep" not in fwd.op_by_name[op.origin].tags
    if remat:  # every layer is recomputed once: one remat copy per non-kept forward op
        assert len(recomputed) == sum("keep" not in op.tags for op in fwd.ops)


def test_each_float_param_gets_one_adam_op_reading_a_grad(train_graph):
    fwd, train, remat = train_graph
    adams = [op for op in train.ops if op.prim == "adam"]
    assert sorted(op.inputs[0] for op in adams) == sorted(t.name for t in fwd.params)
    for op in adams:
        assert train.tensors[op.inputs[1]].role == "grad"
        assert train.tensors[op.outputs[0]].role == "param"
    assert train.outputs[0] == fwd.outputs[0]

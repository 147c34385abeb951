"""Fused attention (`alpasim.graphs._prims_attention`): the same function as the explicit
einsum-softmax-einsum, priced as the kernel runs and stashing no (s, s) tensor.

Numerics: a model built with `attention=fused` and its derived training graph give the
loss and gradients of the same model built explicitly, differentiated by `jax.grad`
(GPT's multi-head and Llama's grouped-query attention, causal). FLOPs: closed forms of
the FlashAttention 2 paper's count. Memory: the stash is the explicit one less the
probabilities and scores, to the byte.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from alpasim.backends import lower_graph, random_leaves
from alpasim.costmodels import liveness
from alpasim.graphs import ModelSpecError, PrimitiveError, forward_graph, op_flops, training_graph
from alpasim.costmodels._attention import CAUSAL_TILE, causal_fraction, executed_flops

MODELS = {
    "gpt3": "gpt3:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=2,dtype=fp32",
    "llama": "llama:hidden=32,layers=2,heads=4,kv_heads=2,ffn=48,seq=16,vocab=64,batch=2,dtype=fp32",
}


def _grads(train, values):
    return {op.inputs[0]: np.asarray(values[op.inputs[1]]) for op in train.ops if op.prim == "adam"}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
def test_fused_model_trains_the_explicit_models_step(family):
    explicit = forward_graph(MODELS[family])
    fused = forward_graph(MODELS[family] + ",attention=fused")
    assert {p.name for p in fused.params} == {p.name for p in explicit.params}
    assert sum(op.prim == "attention" for op in fused.ops) == 2
    assert not any(op.prim == "softmax" for op in fused.ops)

    # jax.grad of the explicit model: an independent differentiation of other ops.
    (loss,) = explicit.outputs
    leaves = random_leaves(explicit, seed=0, scale=0.3)
    params = {p.name: leaves[p.name] for p in explicit.params}
    data = {k: v for k, v in leaves.items() if k not in params}
    f = lower_graph(explicit, [loss])
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: f({**data, **p})[loss]))(params)

    train = training_graph(fused)
    values = jax.jit(lower_graph(train))({**random_leaves(train, seed=0), **leaves})
    np.testing.assert_allclose(float(values[fused.outputs[0]]), float(ref_loss), rtol=1e-6)
    got = _grads(train, values)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    for name, g in ref_grads.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    # The check can fail: the attention inputs' gradients are not zero.
    assert float(np.abs(got.get("layer0/w_qkv", got.get("layer0/w_q"))).max()) > 1e-4 * scale


def test_flops_are_the_models_and_the_kernel_executes_its_own():
    """The graph counts attention as the model does, whatever the kernel: forward
    4 * b * n * s * s * d, the backward twice that (the explicit scores and context
    einsums' count). The kernel executes the causal tiles' share of the forward and
    2.5 times that in the backward (FlashAttention 2, sections 3.1.2 and 4.1)."""
    b, n, s, d = 2, 4, 512, 64
    spec = f"gpt3:hidden={n * d},layers=1,heads={n},seq={s},vocab=64,batch={b},dtype=fp32"
    train = training_graph(forward_graph(spec + ",attention=fused"))
    flops = {op.prim: op_flops(op, train.tensors) for op in train.ops if op.prim.startswith("attention")}
    assert flops["attention"] == 4 * b * n * s * s * d and flops["attention_grad"] == 2 * flops["attention"]
    explicit = training_graph(forward_graph(spec))
    core = [op for op in explicit.ops if op.prim == "einsum"
            and any(explicit.tensors[t].shape[-2:] == (s, s) for t in (*op.inputs, *op.outputs))]
    assert sum(op_flops(op, explicit.tensors) for op in core) == 3 * flops["attention"]

    tiles = s // CAUSAL_TILE
    assert causal_fraction(s, s) == (tiles + 1) / (2 * tiles) == 5 / 8
    assert executed_flops(b * n, s, s, d, True, False) == 4 * b * n * s * s * d * 5 / 8
    assert executed_flops(b * n, s, s, d, True, True) == 2.5 * executed_flops(b * n, s, s, d, True, False)
    # A sequence within one tile runs the whole tile.
    assert causal_fraction(CAUSAL_TILE, CAUSAL_TILE) == 1.0 and causal_fraction(8, 16) == 1.0


@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_stash_holds_no_score_tensor(family):
    """Per layer the fused stash keeps the kernel's log-sum-exp (b, heads, s float32) where
    the explicit one keeps the (b, heads, s, s) probabilities (and scores where the
    backward reads them); selective recomputation then has nothing left to recompute."""
    def stash(spec, **kw):
        g = training_graph(forward_graph(spec), **kw)
        return {t: g.tensors[t] for t in liveness(g).stash()}

    explicit, fused = stash(MODELS[family]), stash(MODELS[family] + ",attention=fused")
    square = [t for t in explicit.values() if t.shape[-2:] == (16, 16)]
    lse = [t for t in fused.values() if t.name.endswith("attention_lse")]
    assert square and len(lse) == 2 and all(t.dtype == "float32" and t.size == 2 * 4 * 16 for t in lse)
    assert not [t for t in fused.values() if t.shape[-2:] == (16, 16)]
    shared = set(explicit) & set(fused)
    assert sum(t.nbytes for t in explicit.values() if t.name not in shared) - sum(t.nbytes for t in square) == \
        sum(t.nbytes for t in fused.values() if t.name not in shared) - sum(t.nbytes for t in lse)
    selective = stash(MODELS[family] + ",attention=fused", recompute="selective")
    assert sum(t.nbytes for t in selective.values()) == sum(t.nbytes for t in fused.values())


def test_bad_kernels_and_equations_are_refused():
    with pytest.raises(ModelSpecError, match="attention must be one of explicit, fused"):
        forward_graph(MODELS["gpt3"] + ",attention=flash")
    from alpasim.graphs._prims_attention import attention_terms
    with pytest.raises(PrimitiveError, match="reserved|'q'"):
        attention_terms("bnsd,bntd,bntd->bnsd")
    with pytest.raises(PrimitiveError, match="k and v"):
        attention_terms("bnqd,bnkd,bnke->bnqd")
    assert math.isclose(causal_fraction(1024, 1024), 9 / 16)

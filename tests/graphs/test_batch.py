"""A saved graph's batch: marked at import by tracing twice, resized for any microbatch.

Independent figure: the graph resized to batch b against the same function traced at
batch b (every tensor's shape and every op's parameters equal).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from alpasim.graphs import (BatchError, batch_size, flops_by_kind, from_jax, graph_from_json, graph_to_json,
                            resize_batch)

sys.path.insert(0, str(Path(__file__).parent))
from test_jax_import import TF, gpt_loss, gpt_shapes, mlp_loss, mlp_shapes  # noqa: E402

S, F32 = jax.ShapeDtypeStruct, jnp.float32


def same_graph(a, b) -> bool:
    """Tensors (shape, dtype, role) and ops (name, primitive, wiring, parameters) alike."""
    return ({t: (x.shape, x.dtype, x.role) for t, x in a.tensors.items()}
            == {t: (x.shape, x.dtype, x.role) for t, x in b.tensors.items()}
            and [(op.name, op.prim, op.inputs, op.outputs, op.params) for op in a.ops]
            == [(op.name, op.prim, op.inputs, op.outputs, op.params) for op in b.ops])


@pytest.mark.parametrize("target", [3, 6])
def test_resized_gpt_equals_the_gpt_traced_at_that_batch(target):
    g = from_jax(gpt_loss, *gpt_shapes(**TF), name="g")
    assert batch_size(g) == TF["B"]
    want = from_jax(gpt_loss, *gpt_shapes(**{**TF, "B": target}), name="g")
    assert same_graph(resize_batch(g, target), want)


def test_a_gpt_resized_to_one_sample_does_a_sample_s_work():
    """At batch 1 JAX traces size-1 broadcasts differently, so the graphs are not
    op-for-op alike; the resized one still passes every primitive's shape rule and
    does 1/B of the matmul FLOPs, with the same parameters."""
    g = from_jax(gpt_loss, *gpt_shapes(**TF), name="g")
    one = resize_batch(g, 1)
    assert flops_by_kind(one)["matmul"] * TF["B"] == pytest.approx(flops_by_kind(g)["matmul"])
    assert one.num_params() == g.num_params()


def test_resized_mlp_keeps_its_mean_divisor_and_survives_a_json_round_trip():
    params, batch = mlp_shapes()
    g = graph_from_json(graph_to_json(from_jax(mlp_loss, params, batch)))
    for target in (12, 2):   # not the doubled batch the marking traced: the divisor is extrapolated
        resized = {k: S((target, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        assert same_graph(resize_batch(g, target), from_jax(mlp_loss, params, resized))
        assert batch_size(resize_batch(g, target)) == target


def test_a_function_whose_structure_depends_on_its_batch_is_left_unmarked():
    def loss(w, x):   # one matmul per sample: the op count is the batch
        return sum(jnp.sum(x[i] @ w) for i in range(x.shape[0]))

    g = from_jax(loss, S((4, 4), F32), S((3, 4), F32))
    assert batch_size(g) is None and "batch not marked" in g.meta["batch_note"]
    with pytest.raises(BatchError, match="records no batch dimension"):
        resize_batch(g, 6)

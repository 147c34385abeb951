"""Weight gradients accumulated unreduced and reduced once per iteration, as the plan
prices them (`alpasim.backends._partial_grads`).

Independent figures: each device's slice of a split weight-gradient einsum against the
einsum of that device's batch slice in numpy; the collectives of the compiled stage
programs read from their HLO (a data-parallel backward reduces no weight gradient,
its update reduces every one of them once); the gradients against a single-device
step; the accumulators' per-device bytes against the plan's unreduced accumulator.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.backends import check_numerics, lower_stage, measured_memory, per_device_bytes, run_local
from alpasim.backends._hlo import hlo_collectives
from alpasim.backends._partial_grads import PartialGrad, eval_split
from alpasim.costmodels import get_cluster
from alpasim.graphs import GraphBuilder
from alpasim.solvers import PlanOptions, SearchSpace, plan_pipeline, planning_graph

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# Compiles whole pipelined plans: `make test-fast` leaves these to `make test`.
pytestmark = pytest.mark.slow
DP_GPT = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=16,dtype=fp32"
REDUCING = ("all_reduce", "reduce_scatter")


def one_stage_plan(restriction: str | None, method: str = "alpa"):
    """The whole model as one stage on all 8 devices viewed as 4x2, microbatches of 8."""
    return plan_pipeline(DP_GPT, get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size == 8,
                                     views_of=lambda sh: [(4, 2)], num_stages=1, max_stages=1, restriction=restriction,
                                     method=method), PlanOptions(remat=True))


def reduced_bytes(compiled) -> float:
    return sum(c.nbytes for c in hlo_collectives(compiled.as_text()) if c.kind in REDUCING)


@needs_8
def test_each_device_holds_the_partial_of_its_own_batch_slice():
    """A weight gradient 'bsh,bsf->hf' with the batch on mesh axis x (2) and f on y (4):
    evaluated split, device (i, j) holds the contraction over batch slice i only, of its
    f slice j, with no collective; the slices sum to the whole gradient."""
    b = GraphBuilder("wgrad")
    x = b.input("x", (8, 4, 6), "float32")
    dy = b.input("dy", (8, 4, 12), "float32")
    (g,) = b.apply("einsum", [x, dy], name="w:grad", equation="bsh,bsf->hf")
    graph = b.build([g])
    op = graph.ops[0]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    sx = NamedSharding(mesh, PartitionSpec("x", None, None))
    sdy = NamedSharding(mesh, PartitionSpec("x", None, "y"))
    info = PartialGrad((("b", 2, (0,)),), ((), (1,)))
    rng = np.random.default_rng(0)
    xv, dyv = rng.standard_normal((8, 4, 6), np.float32), rng.standard_normal((8, 4, 12), np.float32)
    fn = jax.jit(lambda a, c: eval_split(op, [a, c], info, graph, mesh, [sx, sdy]),
                 in_shardings=(sx, sdy), out_shardings=info.sharding(mesh))
    out = fn(jax.device_put(xv, sx), jax.device_put(dyv, sdy))
    assert out.shape == (2, 6, 12)
    assert not [c for c in hlo_collectives(fn.lower(xv, dyv).compile().as_text()) if c.kind in REDUCING]
    for shard in out.addressable_shards:
        i, j = shard.index[0].start, shard.index[2]
        want = np.einsum("bsh,bsf->hf", xv[4 * i:4 * i + 4], dyv[4 * i:4 * i + 4])[:, j]
        np.testing.assert_allclose(np.asarray(shard.data)[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out).sum(0), np.einsum("bsh,bsf->hf", xv, dyv), rtol=1e-5, atol=1e-5)


@needs_8
def test_data_parallel_gradients_are_reduced_once_per_iteration(reference):
    """Plain data parallelism over 8 devices: the plan sums each device's unreduced
    gradients over the microbatches and all-reduces them once. The backward then
    reduces no weight gradient (before: every one, every microbatch); the update
    reduces every accumulator; each device holds every parameter's whole gradient; and
    the step equals one device's."""
    plan = one_stage_plan("data_parallel", "data_parallel")
    result = run_local(plan, steps=1)
    (stage,) = result.stages
    unreduced = [p for p in stage.ops.grads if stage.unreduced(p)]
    matrices = [p for p in stage.ops.grads if len(stage.params[p].shape) >= 2]
    assert matrices and set(matrices) <= set(unreduced)
    kept = sum(per_device_bytes(stage.params[p].shape, stage.acc[p].dtype, stage.shardings[f"{p}:grad"])
               for p in stage.ops.grads if p not in unreduced)
    assert reduced_bytes(stage.compiled["backward"]) <= kept  # only the layer norms' vectors, if any
    whole = sum(stage.params[p].size * stage.acc[p].dtype.itemsize for p in unreduced)
    assert reduced_bytes(stage.compiled["update"]) >= whole
    for p in unreduced:
        assert stage.acc[p].shape == (8, *stage.params[p].shape)
        assert per_device_bytes(stage.acc[p].shape, stage.acc[p].dtype, stage.acc[p].sharding) == \
            stage.params[p].size * stage.acc[p].dtype.itemsize
    m = measured_memory(stage, plan.stages[0].inflight_microbatches)
    # Pure data parallelism: every device holds every parameter's whole gradient.
    assert m.grads_bytes == sum(stage.params[p].size * stage.acc[p].dtype.itemsize for p in stage.ops.grads)
    assert check_numerics(result.losses[0], result.grads, reference(plan))["numerics_ok"]
    # The reported gradient of an unreduced accumulator, summed on the host, is the device's sum.
    rng = np.random.default_rng(0)
    for p in unreduced[:2]:
        acc = stage.acc[p]
        stage.acc[p] = jax.device_put(rng.standard_normal(acc.shape).astype(acc.dtype), acc.sharding)
        np.testing.assert_allclose(stage.host_grad(p), np.asarray(stage.grad(p)), rtol=1e-6, atol=1e-6)


@needs_8
def test_zero_scatters_its_gradients_every_microbatch():
    """ZeRO-2 is priced with its gradients reduce-scattered every microbatch (a device
    keeps only its slice): its accumulators stay reduced and its backward reduces them."""
    plan = one_stage_plan("zero2", "zero2")
    stage = lower_stage(plan, planning_graph(plan.model), 0, jax.devices()[:8])
    assert not any(stage.unreduced(p) for p in stage.ops.grads)
    assert reduced_bytes(stage.compiled["backward"]) > 0

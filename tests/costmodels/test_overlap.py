"""Gradient buckets overlapped with the backward: the closed form against the explicit
queue, the vectorised table against the closed form, and a data-parallel plan's
simulated iteration against both."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import (LayerSync, bucket_count, bucket_schedule, exposed_s, gather_exposed_s, get_cluster,
                                run_buckets)
from alpasim.simulator import simulate
from alpasim.solvers import plan_pipeline
from alpasim.solvers._stage_compose import exposed_ranges, gather_ranges
from alpasim.solvers import PlanOptions, SearchSpace

layer_syncs = st.builds(LayerSync, st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.integers(0, 6))


@settings(max_examples=300, deadline=None)
@given(st.lists(layer_syncs, min_size=1, max_size=8))
def test_closed_form_is_the_bucket_queue(layers):
    """E_l's three-term maximum is the queue of buckets run one at a time."""
    backward = sum(layer.backward_s for layer in layers)
    want = run_buckets(bucket_schedule(layers), backward)
    assert exposed_s(layers) == pytest.approx(want, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("layers, b, c_all, n", [(1, 10.0, 4.0, 4), (6, 2.0, 1.0, 8), (4, 1.0, 3.0, 2),
                                                 (3, 5.0, 5.0, 1), (5, 2.0, 7.0, 3)])
def test_identical_layers_hide_all_but_the_last_bucket_or_the_excess(layers, b, c_all, n):
    """L identical layers, each b of backward and C of collectives in n buckets: where
    the stream keeps up (C <= b) only the last bucket, C/n, is exposed; where it does not,
    it runs without a break from the first bucket on, b/n into the backward, so
    L C + b/n - L b is."""
    stack = [LayerSync(b, c_all, n)] * layers
    want = c_all / n if c_all <= b else layers * (c_all - b) + b / n
    assert exposed_s(stack) == pytest.approx(want, rel=1e-12)


def test_larger_buckets_expose_more_when_the_stream_keeps_up():
    """Compute-bound: the last bucket is what shows, so halving the bucket count doubles it."""
    few, many = LayerSync(10.0, 2.0, 2), LayerSync(10.0, 2.0, 8)
    assert exposed_s([few] * 3) == pytest.approx(4 * exposed_s([many] * 3))
    assert bucket_count(25 * 2 ** 20 + 1, 25 * 2 ** 20) == 2 and bucket_count(0, 1.0) == 0
    with pytest.raises(ValueError, match="bucket size"):
        bucket_count(10, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(layer_syncs, min_size=1, max_size=7))
def test_table_ranges_are_the_closed_form(layers):
    """`exposed_ranges` (every range at once, as the stage table needs it) equals
    `exposed_s` of each range on its own."""
    b = np.array([x.backward_s for x in layers])[:, None]
    c = np.array([x.sync_s for x in layers])[:, None]
    n = np.array([x.buckets for x in layers], dtype=float)[:, None]
    got = exposed_ranges(b, c, n)
    for k in range(len(layers)):
        for i in range(k, len(layers)):
            assert got[k, i, 0] == pytest.approx(exposed_s(layers[k:i + 1]), rel=1e-9, abs=1e-12)
        for i in range(k):
            assert got[k, i, 0] == np.inf


pairs = st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 10.0)), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None)
@given(pairs)
def test_the_forwards_wait_for_gathers_is_the_queue_and_the_table_its_ranges(layers):
    forward, gather = (np.array(x) for x in zip(*layers))
    # The explicit queue (`run_buckets`): layer l's forward is a job ready once the
    # gathers up to its own are done, run after the forward before it.
    queue = run_buckets(list(zip(itertools.accumulate(gather), forward)), float(sum(forward)))
    assert gather_exposed_s(forward, gather) == pytest.approx(queue, rel=1e-9, abs=1e-9)
    got = gather_ranges(forward[:, None], gather[:, None])
    for k in range(len(layers)):
        for i in range(k, len(layers)):
            assert got[k, i, 0] == pytest.approx(gather_exposed_s(forward[k:i + 1], gather[k:i + 1]),
                                                 rel=1e-9, abs=1e-9)


def test_gathers_shorter_than_the_forwards_before_them_cost_only_the_first():
    """Each layer's gather g <= its forward f: only the first layer waits, g_1; gathers
    longer than the forwards expose their excess, all of it by the last layer."""
    assert gather_exposed_s([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert gather_exposed_s([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == pytest.approx(6.0 - 2.0)


MODEL = "gpt3:hidden=1024,layers=8,heads=16,seq=1024,vocab=8192,batch=64"


@pytest.mark.slow
def test_overlapped_parameter_gathers_move_from_after_the_step_into_the_next_forward():
    """Megatron's distributed optimizer over two 25 Gb/s nodes, its layouts slicing the
    states: the backward's buckets stay the reduce-scatters they were, the step's
    all-gathers leave the time after the backward for the next forward, which waits
    only where they run ahead of it, and the simulated iteration charges exactly that."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    space = SearchSpace(restriction="megatron_distopt", max_stages=1, microbatches=4)
    plain = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=25 * 2 ** 20))
    plan = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=25 * 2 ** 20, gather_overlap=True))
    (a,), (b,) = plain.stages, plan.stages
    assert a.param_gather_s == a.gather_exposed_s == 0
    assert b.sync_buckets == a.sync_buckets and b.grad_sync_s == a.grad_sync_s and b.sync_s == a.sync_s
    assert 0 < b.gather_exposed_s < b.param_gather_s < b.sync_s - b.grad_sync_s
    assert b.exposed_sync_s == pytest.approx(run_buckets(b.sync_buckets, b.backward_s) + b.gather_exposed_s)
    hidden = b.param_gather_s - b.gather_exposed_s
    assert simulate(plan).iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)
    assert simulate(plan).iteration_s == pytest.approx(simulate(plain).iteration_s - hidden, rel=1e-9)


def test_overlapped_gathers_run_in_the_buckets_of_their_gradients():
    """With Megatron-core's --overlap-param-gather each bucket's parameters are gathered
    as one (param_and_grad_buffer.py), in the buckets of the gradients they come from:
    here 12 MiB of fp32 gradients over the data-parallel axis in two 6 MiB buckets, so
    two all-gathers of half the 6 MiB of bf16 weights each, by the ring closed form
    (n-1) alpha + (n-1)/n S/B; a gather over an axis no gradient bucket covers is
    bucketed by its own bytes."""
    from alpasim.costmodels import MeshAxis
    from alpasim.solvers import LogicalMesh
    from alpasim.solvers._layer_options import LayerOption
    from alpasim.solvers._stage_compose import layer_gathers

    link = get_cluster("aws-p3.16xlarge", nodes=2).inter_node
    mesh = LogicalMesh((MeshAxis(4, link), MeshAxis(2, link)))
    ring = lambda n, nbytes: (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bytes_per_s     # noqa: E731
    grads = 12 * 2 ** 20
    option = LayerOption(1.0, 0.5, 0.0, 0.0, (), (), grad_groups=(("reduce_scatter", (0,), grads),),
                         param_gather_s=9.0, gather_groups=(((0,), grads / 2),))
    assert layer_gathers(option, mesh, bucket_bytes=6 * 2 ** 20) == pytest.approx(
        2 * ring(4, grads / 4), rel=1e-12)
    other = LayerOption(1.0, 0.5, 0.0, 0.0, (), (), gather_groups=(((1,), 8 * 2 ** 20),))
    assert layer_gathers(other, mesh, bucket_bytes=6 * 2 ** 20) == pytest.approx(
        2 * ring(2, 4 * 2 ** 20), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("bucket_mb", [4, 25, 400])
def test_data_parallel_iteration_hides_the_reduction_up_to_the_closed_form(bucket_mb):
    """Data parallelism over two 25 Gb/s nodes, one stage: the simulated iteration with
    the buckets on their own stream is the one without overlap less what the closed
    form hides (the gradient collectives priced one per gradient, against the buckets'
    exposed part), and the planner predicted it."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    space = SearchSpace(restriction="data_parallel", max_stages=1, microbatches=4)
    plain = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=None))
    plan = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=bucket_mb * 2 ** 20))
    (st0,) = plan.stages
    assert st0.sync_buckets and 0 < st0.exposed_sync_s < st0.grad_sync_s
    assert st0.exposed_sync_s == pytest.approx(run_buckets(st0.sync_buckets, st0.backward_s), rel=1e-9)
    simulated, before = simulate(plan).iteration_s, simulate(plain).iteration_s
    assert simulated == pytest.approx(before - st0.grad_sync_s + st0.exposed_sync_s, rel=1e-9)
    assert simulated == pytest.approx(plan.predicted.iteration_s, rel=1e-9)
    assert simulate(plan, overlap=False).iteration_s == pytest.approx(before, rel=1e-9)
    # The buckets' total exceeds the backward: the stream never idles after its first bucket.
    total = sum(seconds for _, seconds in st0.sync_buckets)
    assert st0.exposed_sync_s == pytest.approx(st0.sync_buckets[0][0] + total - st0.backward_s, rel=1e-9)


@pytest.mark.slow
def test_the_planner_overlaps_only_where_it_pays():
    """Buckets of 4 KiB: each of thousands pays a collective's launch, more than the
    whole backward hides, so the planner keeps one collective per gradient after the
    backward (no buckets, the no-overlap iteration); at 25 MiB it overlaps."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    space = SearchSpace(restriction="data_parallel", max_stages=1, microbatches=4)
    plain = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=None))
    tiny = plan_pipeline(MODEL, cluster, space, PlanOptions(bucket_bytes=4096))
    assert not tiny.stages[0].sync_buckets
    assert tiny.stages[0].exposed_sync_s == pytest.approx(tiny.stages[0].grad_sync_s)
    assert tiny.predicted.iteration_s == pytest.approx(plain.predicted.iteration_s, rel=1e-9)
    assert simulate(tiny).iteration_s == pytest.approx(simulate(plain).iteration_s, rel=1e-9)
    usual = plan_pipeline(MODEL, cluster, space)
    assert usual.stages[0].sync_buckets and usual.predicted.iteration_s < plain.predicted.iteration_s


def test_input_gradient_all_reduces_hide_behind_their_weight_gradients():
    """Megatron-LM tp 4, one GPT layer: each column-parallel input gradient's all-reduce
    (Q, K, V and the first MLP matmul) runs while the weight gradients reading the same
    cotangent compute; the hidden seconds are, op by op, the smaller of the two, and a
    data-parallel layer (no per-microbatch collective) hides nothing."""
    import dataclasses as dc

    import alpasim.costmodels as cm
    import alpasim.graphs as gr
    from alpasim.solvers import BASELINES, LogicalMesh, solve_intra_op
    from alpasim.solvers._layer_options import hidden_collectives_s

    name, cfg = gr.resolve_model("gpt3:hidden=1024,layers=4,heads=16,seq=1024,vocab=4096,batch=4")
    layer = gr.stage_graph(gr.build_training_graph(gr.forward_graph(dc.replace(cfg, batch=4), name=name)).graph, 1, 1)
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    model = cm.AnalyticCostModel(cluster)
    mesh = LogicalMesh.on_cluster(cluster, (1, 4))
    restrict, leaves = BASELINES["megatron"](layer, mesh, model)
    plan = solve_intra_op(layer, mesh, model, restrict=restrict, leaf_specs=leaves, with_compute=True,
                          rewrite=False).plan
    grads = [op for op in layer.ops if op.phase == "backward"
             and any(gr.is_weight_grad(op, k, layer.tensors) for k in range(len(op.outputs)))]
    want, seen = 0.0, set()
    for op in layer.ops:
        s = plan.strategies[op.name]
        comm = sum(c.time_s(mesh) for c, x in zip(s.collectives, s.sync or (False,) * len(s.collectives)) if not x)
        if op.phase != "backward" or op in grads or not comm:
            continue
        siblings = [g for g in grads if set(g.inputs) & set(op.inputs)]
        assert siblings and not seen & {g.name for g in siblings}      # disjoint: no budget is shared
        seen |= {g.name for g in siblings}
        want += min(comm, sum(plan.strategies[g.name].compute_s for g in siblings))
    assert len(seen) >= 4 and want > 0
    assert hidden_collectives_s(layer, plan) == pytest.approx(want, rel=1e-12)
    restrict, leaves = BASELINES["data_parallel"](layer, mesh, model)
    dp = solve_intra_op(layer, mesh, model, restrict=restrict, leaf_specs=leaves, with_compute=True).plan
    assert hidden_collectives_s(layer, dp) == 0.0

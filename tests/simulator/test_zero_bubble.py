"""Zero-bubble schedules (Qi et al., ICLR 2024) against their closed forms and the
invariants every order must keep.

A backward split into B (input gradients) and W (weight gradients): ZB-H1 keeps
1F1B's memory and, with f = b = w, a third of its bubble; ZB-H2 holds about twice the
activations and fills every stage from its first pass to its last.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.simulator import Run, build_program, simulate, synthetic_plan
from alpasim.solvers import (
    PassTimes,
    PlanOptions,
    RunOptions,
    SearchSpace,
    split_backward,
    zb_h2_limits,
    zero_bubble_greedy,
)
from alpasim.solvers._pipeline_orders import zb_h1_order

times = st.floats(min_value=1e-2, max_value=5.0, allow_nan=False, allow_infinity=False)


def split_plan(S, B, f, b, w, *, act=0.0, stash=0.0, kept=0.0, params=0.0):
    """S balanced stages whose backward (b + w) splits into B = b and W = w."""
    plan = synthetic_plan([f] * S, [b + w] * S, B, activation_bytes=act, params_bytes=params)
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, backward_weight_s=w, stash_bytes=stash, weight_stash_bytes=kept) for s in plan.stages))


def runs(program, k):
    return [(i.phase, i.microbatch) for i in program.meshes[k] if type(i) is Run]


def check_order(order, B, limit=None, alive=None):
    """Each microbatch's F, B and W once each and in that order; F, B and W each in
    microbatch order; at most `limit` between F and B and `alive` between F and W."""
    want = sorted((p, m) for p in ("forward", "backward_input", "backward_weight") for m in range(B))
    assert sorted(order) == want
    done = {p: 0 for p in ("forward", "backward_input", "backward_weight")}
    before = {"backward_input": "forward", "backward_weight": "backward_input"}
    for phase, m in order:
        assert m == done[phase], (phase, m, "out of microbatch order")
        if phase in before:
            assert done[before[phase]] > m, (phase, m, "before its own earlier pass")
        done[phase] += 1
        if limit is not None:
            assert done["forward"] - done["backward_input"] <= limit
        if alive is not None:
            assert done["forward"] - done["backward_weight"] <= alive


# ------------------------------------------------------------------ orders
@pytest.mark.parametrize("S, B", [(1, 1), (1, 4), (4, 2), (4, 4), (4, 9), (8, 3), (8, 20)])
def test_zb_h1_orders_keep_1f1b_memory_and_defer_i_weight_passes(S, B):
    for i in range(S):
        order = [(p, m) for p, m, _ in zb_h1_order(S, B, i)]
        check_order(order, B, limit=min(S - i, B), alive=min(S, B))
        # Stage i lets i weight gradients wait; the first stage none (B and W adjacent).
        if i == 0:
            assert all(order[j + 1] == ("backward_weight", m) for j, (p, m) in enumerate(order)
                       if p == "backward_input")


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 8), B=st.integers(1, 24), f=times, b=times, w=times)
def test_zb_h2_orders_are_valid_for_any_pass_times(S, B, f, b, w):
    limits, alive = zb_h2_limits(S)
    orders, _ = zero_bubble_greedy([PassTimes(f, b, w, 1.0, 1.0)] * S, B, limits, alive)
    for i, order in enumerate(orders):
        check_order([(p, m) for p, m, _ in order], B, limit=limits[i], alive=alive)


# ------------------------------------------------------------------ time
@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 8), extra=st.integers(0, 16), t=times)
def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_b_w_are_equal(S, extra, t):
    """f = b = w = t, B >= S, free communication: 1F1B takes (S + B - 1) 3t, ZB-H1
    3Bt + (S - 1)t (the paper's (S - 1)(f + b - w) bubble)."""
    B = S + extra
    plan = split_plan(S, B, t, t, t)
    one = simulate(plan, "1f1b", free_communication=True).iteration_s
    h1 = simulate(plan, "zb-h1", free_communication=True).iteration_s
    assert one == pytest.approx((S + B - 1) * 3 * t, rel=1e-12)
    assert h1 == pytest.approx(3 * B * t + (S - 1) * t, rel=1e-12)
    assert h1 - 3 * B * t == pytest.approx((one - 3 * B * t) / 3, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 7), extra=st.integers(0, 10), t=times)
def test_zb_h2_fills_every_stage_from_its_first_pass_to_its_last(S, extra, t):
    """f = b = w = t and B >= 2S - 1: no stage idles between its first and last pass
    (the paper's parallelogram), so the flushed iteration takes 3Bt + (S - 1)t, the
    least any schedule can: the last stage cannot start before (S - 1)t."""
    B = 2 * S - 1 + extra
    tl = simulate(split_plan(S, B, t, t, t), "zb-h2", free_communication=True)
    for k in range(S):
        ev = [e for e in tl.events if e.track == f"mesh{k}" and e.kind == "compute"]
        span = max(e.end_s for e in ev) - min(e.start_s for e in ev)
        assert span == pytest.approx(3 * B * t, rel=1e-9)
    assert tl.iteration_s == pytest.approx(3 * B * t + (S - 1) * t, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 8), B=st.integers(1, 24), f=times, b=times, w=times)
def test_splitting_the_backward_never_loses_to_1f1b_and_never_beats_the_ramp(S, B, f, b, w):
    """Any pass times: ZB-H1 runs 1F1B's order with W moved later, so it is never
    slower; neither schedule beats B(f + b + w) + (S - 1)f, the busiest stage's work
    after the ramp up to the last stage."""
    plan = split_plan(S, B, f, b, w)
    one = simulate(plan, "1f1b", free_communication=True).iteration_s
    floor = B * (f + b + w) + (S - 1) * f
    for schedule in ("zb-h1", "zb-h2"):
        t = simulate(plan, schedule, free_communication=True).iteration_s
        assert floor * (1 - 1e-12) <= t
        if schedule == "zb-h1":
            assert t <= one * (1 + 1e-12)


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("S, B", [(4, 8), (4, 4), (4, 2), (8, 16), (1, 3), (6, 7)])
def test_zb_h1_peak_memory_is_1f1b_plus_the_waiting_weight_passes(S, B):
    """Stage i: params + one microbatch at its peak + (min(S - i, B) - 1) stashes, as
    under 1F1B, plus what each of its min(i, B - (S - i)) waiting W passes reads."""
    act, stash, kept, params = 1000.0, 100.0, 10.0, 5.0
    tl = simulate(split_plan(S, B, 1.0, 1.0, 1.0, act=act, stash=stash, kept=kept, params=params), "zb-h1",
                  free_communication=True)
    assert tl.peak_mesh_memory_bytes() == [
        params + act + (min(S - i, B) - 1) * stash + min(i, max(B - (S - i), 0)) * kept for i in range(S)]
    for samples in tl.memory:
        assert samples[-1][1] == params


@pytest.mark.parametrize("S, B", [(4, 7), (4, 8), (3, 9), (6, 11)])
def test_zb_h2_peak_memory_holds_twice_the_in_flight_microbatches(S, B):
    """f = b = w, B >= 2S - 1: stage i holds 2(S - i) - 1 microbatches between F and B
    at its peak and 2i waiting W passes."""
    act, stash, kept, params = 1000.0, 100.0, 10.0, 5.0
    tl = simulate(split_plan(S, B, 1.0, 1.0, 1.0, act=act, stash=stash, kept=kept, params=params), "zb-h2",
                  free_communication=True)
    assert tl.peak_mesh_memory_bytes() == [
        params + act + (2 * (S - i) - 2) * stash + 2 * i * kept for i in range(S)]


# ------------------------------------------------------------------ programs
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_cotangents_leave_after_b_and_activations_are_freed_after_w(schedule):
    plan = synthetic_plan([1.0] * 3, [2.0] * 3, 5, hidden_shape=(4, 8))
    program = build_program(plan, schedule)
    for k, mesh in enumerate(program.meshes):
        for j, ins in enumerate(mesh):
            name = type(ins).__name__
            if name == "Send" and program.transfers[ins.transfer].direction == "backward":
                assert type(mesh[j - 1]) is Run and mesh[j - 1].phase == "backward_input"
            if name == "Free":
                assert type(mesh[j - 1]) is Run and mesh[j - 1].phase == "backward_weight"
    tl = simulate(plan, schedule, free_communication=True)
    assert tl.iteration_s < simulate(plan, "1f1b", free_communication=True).iteration_s


def test_a_stage_without_a_priced_split_gets_half_of_each():
    st = synthetic_plan([1.0], [4.0], 2, activation_bytes=100.0).stages[0]
    p = split_backward(dataclasses.replace(st, stash_bytes=60.0), 2)
    assert (p.forward_s, p.input_s, p.weight_s, p.stash_bytes, p.weight_stash_bytes) == (1.0, 2.0, 2.0, 60.0, 30.0)


@pytest.mark.parametrize("remat", [False, True])
def test_the_planner_prices_the_weight_pass_op_by_op(remat):
    """On one device, a stage's W as the planner prices it layer by layer is the
    analytic time of the ops the local runtime's split runs as W (`split_backward_ops`,
    its own walk of the stage's ops), and what W holds is what that split hands from
    B to W."""
    from alpasim.backends._executable import split_backward_ops
    from alpasim.backends._stage_ops import stage_ops
    from alpasim.costmodels import AnalyticCostModel, fuse, get_cluster
    from alpasim.graphs import build_training_graph, is_weight_grad, stage_graph
    from alpasim.solvers import DiskCache, plan_pipeline
    from alpasim.solvers._planning_graph import planning_graph

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1)
    plan = plan_pipeline("gpt3:hidden=256,layers=2,heads=4,seq=64,vocab=512,batch=8", cluster,
                         SearchSpace(microbatches=2), PlanOptions(remat=remat),
                         RunOptions(cache=DiskCache(enabled=False)))
    train, model = build_training_graph(planning_graph(plan.model), remat=remat).graph, AnalyticCostModel(cluster)
    for st in plan.stages:
        _, weight_ops, kept = split_backward_ops(stage_ops(train, *st.layers), train)
        assert any(all(is_weight_grad(op, k, train.tensors) for k in range(len(op.outputs))) for op in weight_ops)
        graphs = {layer: stage_graph(train, layer, layer) for layer in range(st.layers[0], st.layers[1] + 1)}
        fusions = {layer: fuse(g) for layer, g in graphs.items()}
        seconds = sum(model.op_time_s(op, graphs[op.layer].tensors, num_shards=1,
                                      access=fusions[op.layer].of(op.name)) for op in weight_ops)
        assert 0 < st.backward_weight_s < st.backward_s
        assert st.backward_weight_s == pytest.approx(seconds, rel=1e-9)
        assert kept and st.weight_stash_bytes == sum(train.tensors[t].nbytes for t in kept)


# ------------------------------------------------------------------ choosing
@pytest.fixture(scope="module")
def deep_plan():
    """Eight one-device stages of a small GPT and 8 microbatches: 1F1B's ramp is about
    half of its iteration."""
    from alpasim.costmodels import get_cluster
    from alpasim.solvers import DiskCache, plan_pipeline

    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    plan = plan_pipeline("gpt3:hidden=256,layers=8,heads=4,seq=128,vocab=512,batch=64", cluster,
                         SearchSpace(microbatches=8, shape_ok=lambda sh: sh.size == 1), PlanOptions(remat=False),
                         RunOptions(cache=DiskCache(enabled=False)))
    assert len(plan.stages) == 8
    return plan, cluster


def test_the_planner_runs_zero_bubble_where_it_pays(deep_plan):
    from alpasim.simulator import choose_schedule, schedule_options

    plan, cluster = deep_plan
    options = {o.schedule: o for o in schedule_options(plan, cluster=cluster)}
    assert all(o.fits for o in options.values())
    chosen = choose_schedule(plan, cluster=cluster)
    assert chosen.schedule in ("zb-h1", "zb-h2")
    assert options[chosen.schedule].iteration_s == min(o.iteration_s for o in options.values())
    assert options[chosen.schedule].iteration_s < 0.9 * options["1f1b"].iteration_s
    assert simulate(chosen, cluster=cluster).iteration_s == options[chosen.schedule].iteration_s
    assert "schedule " + chosen.schedule in chosen.notes[-1]


def test_the_planner_keeps_1f1b_where_memory_forbids_zero_bubble(deep_plan):
    """A device just large enough for 1F1B's busiest stage: both zero-bubble schedules
    hold more (deferred W passes, or more microbatches in flight) and are refused."""
    from alpasim.simulator import choose_schedule, schedule_options

    plan, cluster = deep_plan
    one = schedule_options(plan, ("1f1b",), cluster)[0]
    tight = cluster.with_overrides(memory_gb=max(one.peak_memory_bytes) * 1.001 / 2 ** 30)
    options = {o.schedule: o for o in schedule_options(plan, cluster=tight)}
    assert not options["zb-h1"].fits and not options["zb-h2"].fits
    assert choose_schedule(plan, cluster=tight).schedule == "1f1b"


@pytest.mark.parametrize("S, B, v", [(4, 8, 2), (4, 4, 2), (4, 12, 3), (2, 6, 2), (8, 16, 2), (4, 8, 4), (4, 6, 2),
                                     (3, 7, 3), (2, 5, 2)])
def test_interleaved_peak_memory_is_its_warm_up_of_chunk_stashes(S, B, v):
    """Megatron's interleaved 1F1B: mesh i warms up with min(2(S - 1 - i) + (v - 1)g,
    Bv - 1) chunk forwards (g the largest group: S plus the remainder of B / S, or B),
    each holding 1/v of the stage's stash, while one more chunk runs at its peak (1/v
    of the activations)."""
    act, stash, params = 1000.0, 100.0, 5.0
    plan = synthetic_plan([1.0] * S, [2.0] * S, B, activation_bytes=act, params_bytes=params)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, stash_bytes=stash) for s in plan.stages))
    tl = simulate(plan, "interleaved", chunks=v, free_communication=True)
    g = S + B % S if B >= S else B
    want = [params + act / v + min(2 * (S - 1 - i) + (v - 1) * g, B * v - 1) * stash / v for i in range(S)]
    assert tl.peak_mesh_memory_bytes() == pytest.approx(want, rel=1e-12)


def uneven_plan(fbw, B):
    """One stage per (f, b, w): its forward, input-gradient and weight-gradient times."""
    plan = synthetic_plan([f for f, _, _ in fbw], [b + w for _, b, w in fbw], B)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, backward_weight_s=w)
                                                  for s, (_, _, w) in zip(plan.stages, fbw, strict=True)))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), S=st.integers(1, 6), B=st.integers(1, 16))
def test_the_zb_h2_greedy_decides_in_time_order(data, S, B):
    """Unequal stages: the greedy's own finishing time equals the simulator running its
    order as soon as every input is there (a stage that decided past another still to
    decide at the same moment scheduled passes later than they can run)."""
    fbw = [tuple(data.draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for _ in range(3)) for _ in range(S)]
    _, end = zero_bubble_greedy([PassTimes(f, b, w, 1.0, 1.0) for f, b, w in fbw], B, *zb_h2_limits(S))
    assert simulate(uneven_plan(fbw, B), "zb-h2", free_communication=True).iteration_s == pytest.approx(end, rel=1e-12)


def test_the_zb_h2_greedy_case_that_decided_out_of_order():
    """Three uneven stages, three microbatches: out of time order ZB-H2 took 21.0,
    against ZB-H1's 19.5."""
    plan = uneven_plan([(2, 2, 2), (1, 2, 2), (2, 0.5, 2)], 3)
    assert simulate(plan, "zb-h2", free_communication=True).iteration_s == pytest.approx(19.5)


def test_a_weight_pass_adds_no_working_set_of_its_own():
    """One stage, one microbatch, W keeping more than the stash (recomputed
    activations): the peak is the larger of F's activations and what W holds, not
    their sum with B's transient."""
    tl = simulate(split_plan(1, 1, 1.0, 1.0, 1.0, act=1000.0, stash=100.0, kept=300.0), "zb-h1",
                  free_communication=True)
    assert tl.peak_mesh_memory_bytes() == [1000.0]
    tl = simulate(split_plan(1, 1, 1.0, 1.0, 1.0, act=1000.0, stash=100.0, kept=1500.0), "zb-h1",
                  free_communication=True)
    assert tl.peak_mesh_memory_bytes() == [1500.0]

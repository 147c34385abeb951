"""Plans cut into chunks (interleaved 1F1B with S x v real stages), against closed forms
and against the planner's own rules: the liveness of an order (`order_peak_bytes`) and
the makespan of the orders (`order_makespan`) are independent re-implementations of
what the SimPy engine does, and must agree with it exactly."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.simulator import Run, build_program, simulate, synthetic_plan
from alpasim.solvers import PlanFormatError
from alpasim.solvers._interleave import interleaved_proxy_s, order_makespan
from alpasim.solvers._pipeline_orders import interleaved_order, order_peak_bytes, zb_h1_order

times = st.floats(min_value=0.05, max_value=4.0, allow_nan=False, allow_infinity=False)
sizes = st.floats(min_value=0.0, max_value=100.0, allow_nan=False, allow_infinity=False)


def chunked(fwd, bwd, S, v, B, *, act=None, stash=None, params=None):
    """A synthetic interleaved plan of S meshes x v chunks (chunk j on mesh j mod S)."""
    n = S * v
    plan = synthetic_plan(fwd, bwd, B, chunks=v)
    act, stash, params = act or [0.0] * n, stash or [0.0] * n, params or [0.0] * n
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, activation_bytes=a, stash_bytes=z, params_bytes=p)
        for s, a, z, p in zip(plan.stages, act, stash, params, strict=True)))


@settings(max_examples=60, deadline=None)
@given(S=st.integers(2, 4), v=st.integers(2, 3), B=st.integers(1, 9), t=times)
def test_balanced_chunks_take_megatrons_time(S, v, B, t):
    """Balanced chunks of t (f = t/3, b = 2t/3), free communication, B >= S: the
    iteration is B v t + (S - 1) t (Megatron-LM sec. 2.2.2): the 1F1B bubble of a stage
    of v t divided by v. With B < S every microbatch is one group and the ramp is that
    of S x v stages of t run by S meshes: it is never slower than 1F1B's (B + S - 1) v t."""
    plan = chunked([t / 3] * (S * v), [2 * t / 3] * (S * v), S, v, B)
    tl = simulate(plan, free_communication=True)
    assert tl.schedule == "interleaved" and tl.chunks == v
    if B >= S:
        assert tl.iteration_s == pytest.approx(B * v * t + (S - 1) * t, rel=1e-9)
        assert interleaved_proxy_s([t] * (S * v), S, v, B) == pytest.approx(tl.iteration_s, rel=1e-9)
    assert tl.iteration_s <= (B + S - 1) * v * t * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), S=st.integers(2, 4), v=st.integers(2, 3), B=st.integers(1, 8))
def test_the_planner_makespan_is_the_simulators(data, S, v, B):
    """Unequal chunks: `order_makespan` (the planner's ranking) equals the engine's free
    communication iteration of the same plan."""
    n = S * v
    fwd = [data.draw(times) for _ in range(n)]
    bwd = [data.draw(times) for _ in range(n)]
    plan = chunked(fwd, bwd, S, v, B)
    orders = [interleaved_order(S, B, k, v) for k in range(S)]
    assert order_makespan(orders, fwd, bwd) == pytest.approx(simulate(plan, free_communication=True).iteration_s,
                                                             rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), S=st.integers(2, 4), v=st.integers(2, 3), B=st.integers(1, 8))
def test_the_planner_liveness_is_the_simulators(data, S, v, B):
    """Each mesh's simulated peak is its chunks' states plus `order_peak_bytes` of its
    order (what the planner checks memory with), for chunks of unequal stash and peak
    (a stash of 0 means "not priced" to the engine, which then keeps the whole peak)."""
    n = S * v
    stash = [0.5 + data.draw(sizes) for _ in range(n)]
    act = [z + data.draw(sizes) for z in stash]
    params = [data.draw(sizes) for _ in range(n)]
    plan = chunked([1.0] * n, [2.0] * n, S, v, B, act=act, stash=stash, params=params)
    tl = simulate(plan, free_communication=True)
    want = [sum(params[k::S]) + order_peak_bytes(interleaved_order(S, B, k, v), stash[k::S], act[k::S])
            for k in range(S)]
    assert tl.peak_mesh_memory_bytes() == pytest.approx(want, rel=1e-12, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 5), B=st.integers(1, 8), stash=sizes, extra=sizes, kept=sizes)
def test_the_liveness_rule_reads_split_backwards_too(S, B, stash, extra, kept):
    """ZB-H1's order: B keeps what W reads (`kept`) until W; the rule and the engine agree."""
    stash, kept = stash + 0.5, min(kept, stash) + 0.25     # 0: not priced, to the engine
    plan = synthetic_plan([1.0] * S, [2.0] * S, B, activation_bytes=stash + extra)
    plan = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, stash_bytes=stash, backward_weight_s=1.0, weight_stash_bytes=kept)
        for s in plan.stages))
    tl = simulate(plan, "zb-h1", free_communication=True)
    want = [order_peak_bytes(zb_h1_order(S, B, k), [stash], [stash + extra], [kept]) for k in range(S)]
    assert tl.peak_mesh_memory_bytes() == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_a_chunked_plan_runs_its_own_chunks():
    """The program of a chunked plan: mesh k runs chunks k, S + k, ... with their own
    times (not 1/v of a stage), transfers between virtual stages map to (mesh, chunk),
    and schedules of one stage per mesh are refused by name."""
    S, v, B = 2, 2, 2
    fwd = [1.0, 2.0, 3.0, 4.0]
    plan = chunked(fwd, [2 * f for f in fwd], S, v, B)
    program = build_program(plan, "interleaved", chunks=5)      # the plan's own chunk count wins
    assert program.chunks == v and program.num_meshes == S
    runs = {(i.stage, i.chunk) for mesh in program.meshes for i in mesh if type(i) is Run}
    assert runs == {(0, 0), (1, 0), (0, 1), (1, 1)}
    tl = simulate(plan, free_communication=True)
    busy = {(e.stage, e.chunk, e.name): e.duration_s for e in tl.events if e.kind == "compute"}
    assert busy[0, 1, "forward"] == pytest.approx(3.0) and busy[1, 0, "backward"] == pytest.approx(4.0)
    # Mesh 1 chunk 0 (stage 1) feeds mesh 0 chunk 1 (stage 2): a control message, wrap-around.
    assert any((t.src_stage, t.src_chunk, t.dst_stage, t.dst_chunk) == (1, 0, 0, 1) for t in program.transfers)
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        with pytest.raises(PlanFormatError, match="interleaved schedule, not"):
            build_program(plan, schedule)


def test_a_chunked_plan_must_share_its_meshes():
    plan = chunked([1.0] * 4, [2.0] * 4, 2, 2, 2)
    moved = dataclasses.replace(plan.stages[2], devices=(5,))
    with pytest.raises(ValueError, match="chunk 1 of mesh 0"):
        dataclasses.replace(plan, stages=(*plan.stages[:2], moved, plan.stages[3]))
    with pytest.raises(ValueError, match="multiple of 3"):
        dataclasses.replace(plan, chunks=3)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 8), B=st.integers(1, 16), stash=sizes, extra=sizes)
def test_the_dps_in_flight_rule_is_the_1f1b_orders_liveness(S, B, stash, extra):
    """The stage DP prices stage i (s = S - i stages from here) with min(s, B)
    microbatches stashed while one more runs at its peak (eq. 5): what the 1F1B order
    holds by the shared liveness rule, and what the engine simulates."""
    from alpasim.solvers._pipeline_orders import most_live, one_f_one_b_order

    stash += 0.5
    plan = synthetic_plan([1.0] * S, [2.0] * S, B, activation_bytes=stash + extra)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, stash_bytes=stash) for s in plan.stages))
    peaks = simulate(plan, free_communication=True).peak_mesh_memory_bytes()
    for i in range(S):
        order = one_f_one_b_order(S, B, i)
        assert most_live(order, 1) == [min(S - i, B)]
        rule = order_peak_bytes(order, [stash], [stash + extra])
        assert rule == pytest.approx((min(S - i, B) - 1) * stash + stash + extra)
        assert peaks[i] == pytest.approx(rule)

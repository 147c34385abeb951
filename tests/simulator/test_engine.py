"""The engine against independent answers: eq. 2, a start-time recurrence, Megatron's
interleaved bubble, hand-computed link sharing and cross-mesh byte counts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import get_cluster
from alpasim.simulator import (
    GradSync,
    Program,
    Recv,
    Run,
    Send,
    StageTransfer,
    simulate,
    synthetic_plan,
)
from alpasim.solvers import PlanFormatError, PlanTransfer

times = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------ oracles
def gpipe_orders(S, B):
    return [[("forward", m) for m in range(B)] + [("backward", m) for m in reversed(range(B))]] * S


def one_f_one_b_orders(S, B):
    orders = []
    for i in range(S):
        w = min(S - 1 - i, B)  # PipeDream-flush warm-up
        o = [("forward", m) for m in range(w)]
        for k in range(B - w):
            o += [("forward", w + k), ("backward", k)]
        orders.append(o + [("backward", m) for m in range(B - w, B)])
    return orders


def recurrence_s(orders, fwd, bwd, delay=lambda i, j: 0.0, blocking=False):
    """Start-time recurrence: an op starts when its stage is free and its input exists
    (forward m of stage i needs forward m of i-1, backward m needs backward m of i+1),
    the input arriving `delay(src, dst)` after it was produced. `blocking`: a stage that
    sends its output is free again only once it has arrived."""
    S = len(orders)
    end, pos, free = {}, [0] * S, [0.0] * S
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for i in range(S):
            while pos[i] < len(orders[i]):
                phase, m = orders[i][pos[i]]
                src = i - 1 if phase == "forward" else i + 1
                ready = 0.0
                if 0 <= src < S:
                    if (phase, src, m) not in end:
                        break
                    ready = end[phase, src, m] + delay(src, i)
                free[i] = end[phase, i, m] = max(free[i], ready) + (fwd[i] if phase == "forward" else bwd[i])
                dst = i + 1 if phase == "forward" else i - 1
                if blocking and 0 <= dst < S:
                    free[i] += delay(i, dst)
                pos[i] += 1
                moved = True
        assert moved, "the oracle's orders deadlock"
    return max(free)


# ------------------------------------------------------------------- eq. 2
@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 8), B=st.integers(1, 64), tf=times, tb=times, schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_balanced_stages_take_exactly_eq2(S, B, tf, tb, schedule):
    plan = synthetic_plan([tf] * S, [tb] * S, B)
    tl = simulate(plan, schedule, free_communication=True)
    t = tf + tb
    assert tl.iteration_s == pytest.approx(S * t + (B - 1) * t, rel=1e-12)
    assert tl.bubble_fraction == pytest.approx((S - 1) / (S + B - 1), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), S=st.integers(1, 6), B=st.integers(1, 24), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_unequal_stages_follow_the_start_time_recurrence(data, S, B, schedule):
    fwd = data.draw(st.lists(times, min_size=S, max_size=S))
    bwd = data.draw(st.lists(times, min_size=S, max_size=S))
    tl = simulate(synthetic_plan(fwd, bwd, B), schedule, free_communication=True)
    orders = gpipe_orders(S, B) if schedule == "gpipe" else one_f_one_b_orders(S, B)
    assert tl.iteration_s == pytest.approx(recurrence_s(orders, fwd, bwd), rel=1e-12)


def test_sync_runs_once_at_the_end_and_counts_as_work():
    S, B, sync = 4, 8, 0.5
    tl = simulate(synthetic_plan([1.0] * S, [2.0] * S, B, sync_s=sync), "1f1b", free_communication=True)
    assert tl.iteration_s == pytest.approx((S + B - 1) * 3.0 + sync)
    assert [m["sync_s"] for m in tl.mesh_stats()] == [sync] * S
    assert tl.count("sync") == S


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("S, B", [(4, 8), (4, 2), (1, 3), (6, 6)])
def test_peak_activations_are_min_s_minus_i_b_for_1f1b_and_b_for_gpipe(S, B):
    act, params = 1000.0, 5.0
    plan = synthetic_plan([1.0] * S, [2.0] * S, B, params_bytes=params, activation_bytes=act)
    one = simulate(plan, "1f1b", free_communication=True)
    assert one.peak_mesh_memory_bytes() == [params + min(S - i, B) * act for i in range(S)]
    assert one.peak_memory_bytes == [params + min(S - i, B) * act for i in range(S)]  # one device per stage
    gp = simulate(plan, "gpipe", free_communication=True)
    assert gp.peak_mesh_memory_bytes() == [params + B * act] * S
    for samples in one.memory:  # everything allocated is freed by the end
        assert samples[0] == (0.0, params) and samples[-1][1] == params


@pytest.mark.parametrize("S, B", [(4, 8), (4, 2), (1, 3), (6, 6)])
def test_in_flight_microbatches_hold_only_their_stash(S, B):
    """Eq. 5 as the planner prices it: one microbatch at its peak, the other
    min(S - i, B) - 1 in flight holding only what backward reads of the forward."""
    act, stash, params = 1000.0, 100.0, 5.0
    plan = synthetic_plan([1.0] * S, [2.0] * S, B, params_bytes=params, activation_bytes=act)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, stash_bytes=stash) for st in plan.stages))
    one = simulate(plan, "1f1b", free_communication=True)
    assert one.peak_mesh_memory_bytes() == [params + act + (min(S - i, B) - 1) * stash for i in range(S)]
    gp = simulate(plan, "gpipe", free_communication=True)
    assert gp.peak_mesh_memory_bytes() == [params + act + (B - 1) * stash] * S
    for samples in one.memory:
        assert samples[-1][1] == params


def test_receive_buffers_count_until_their_run(two_nodes):
    plan = synthetic_plan([1.0, 1.0], [1.0, 1.0], 1, devices_per_stage=2, cluster=two_nodes, hidden_shape=(4, 8))
    tl = simulate(plan, "gpipe", free_communication=True)
    # No params, no activations: the peak is one received tensor, split evenly over 2 devices.
    assert tl.peak_mesh_memory_bytes() == [4 * 8 * 2 / 2] * 2
    assert all(samples[-1][1] == 0.0 for samples in tl.memory)


# ------------------------------------------------------------- interleaved
@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 6), extra=st.integers(0, 12), v=st.integers(2, 4), tf=times, tb=times)
def test_interleaved_matches_megatron_bubble_for_b_at_least_s(S, extra, v, tf, tb):
    B = S + extra
    plan = synthetic_plan([tf] * S, [tb] * S, B)
    tl = simulate(plan, "interleaved", chunks=v, free_communication=True)
    # Megatron-LM (SC'21) sec. 2.2.2: ideal B (t_f + t_b) plus a bubble of (S - 1)(t_f + t_b) / v.
    assert tl.iteration_s == pytest.approx(B * (tf + tb) + (S - 1) * (tf + tb) / v, rel=1e-9)
    if S > 1:
        assert tl.iteration_s < simulate(plan, "1f1b", free_communication=True).iteration_s


def test_interleaved_never_deadlocks_and_never_loses_to_1f1b():
    for S in range(1, 6):
        for B in range(1, 13):
            for v in (2, 3):
                plan = synthetic_plan([1.0] * S, [2.0] * S, B)
                tl = simulate(plan, "interleaved", chunks=v, free_communication=True)
                assert tl.iteration_s <= (S + B - 1) * 3.0 + 1e-9
                assert tl.count("compute") == 2 * S * B * v


def test_a_cyclic_program_is_reported_as_a_deadlock():
    plan = synthetic_plan([1.0, 1.0], [1.0, 1.0], 1)
    t = (StageTransfer("a", (), "", 0.0, 0, 1, "forward"), StageTransfer("b", (), "", 0.0, 1, 0, "backward"))
    meshes = ((Recv(1, 0, 1, 0), Run(0, 0, "forward"), Send(0, 0, 0, 1)),
              (Recv(0, 0, 0, 1), Run(1, 0, "backward"), Send(1, 0, 1, 0)))
    program = Program("custom", 1, 1, ((0,), (1,)), meshes, t)
    with pytest.raises(RuntimeError, match="deadlocked: mesh 0 waits forever at instruction 0"):
        simulate(plan, program, free_communication=True)


# ---------------------------------------------------------- communication
def nic_plan(cluster, devices_per_stage):
    """Two stages on two nodes passing a 100 MB tensor, near-zero compute."""
    return synthetic_plan([1e-6, 1e-6], [1e-6, 1e-6], 1, devices_per_stage=devices_per_stage, cluster=cluster,
                          hidden_shape=(50_000_000,))


def test_two_messages_through_one_card_take_twice_as_long_as_one(two_nodes):
    nbytes = 100e6
    bw = two_nodes.inter_node.bytes_per_s
    lone = simulate(nic_plan(get_cluster("aws-p3.16xlarge", nodes=2, devices_per_node=1), 1))
    lone_sends = [e for e in lone.events if e.kind == "send"]
    assert lone_sends and [e.duration_s for e in lone_sends] == [pytest.approx(nbytes / bw)] * len(lone_sends)
    # Two devices per stage: each receiver gets half the tensor from its own sender,
    # both messages through the node's one card, so each flows at half the speed.
    shared = simulate(nic_plan(two_nodes, 2))
    sends = [e for e in shared.events if e.kind == "send" and e.track == "node0 nic0 out"]
    assert len(sends) == 2  # the forward copies; the backward ones leave node 1
    for e in sends:
        assert e.duration_s == pytest.approx((nbytes / 2) / (bw / 2))
    # With a card per device the two halves do not meet: half the time.
    own_cards = simulate(nic_plan(dataclasses.replace(two_nodes, nics_per_node=2), 2))
    for e in (e for e in own_cards.events if e.kind == "send" and "nic" in e.track):
        assert e.duration_s == pytest.approx((nbytes / 2) / bw)
    assert own_cards.iteration_s < shared.iteration_s


def test_without_contention_messages_add_alpha_plus_bytes_over_bandwidth():
    S, B, shape = 4, 6, (256, 1024)
    cluster = get_cluster("dgx-a100", nodes=2, devices_per_node=2)
    plan = synthetic_plan([0.01] * S, [0.02] * S, B, cluster=cluster, hidden_shape=shape, specs=("RR", "RR"))
    nbytes = 256 * 1024 * 2

    def delay(i, j):
        link = cluster.intra_node if i // 2 == j // 2 else cluster.inter_node
        return link.latency_s + nbytes / link.bytes_per_s

    tl = simulate(plan, "1f1b")
    assert tl.iteration_s == pytest.approx(recurrence_s(one_f_one_b_orders(S, B), [0.01] * S, [0.02] * S, delay),
                                           rel=1e-12)
    # Where the system's sends block (DeepSpeed's, Megatron's), a stage runs on only once
    # its output has landed.
    blocked = simulate(plan, "1f1b", blocking_sends=True)
    assert blocked.iteration_s == pytest.approx(
        recurrence_s(one_f_one_b_orders(S, B), [0.01] * S, [0.02] * S, delay, blocking=True), rel=1e-12)
    assert blocked.iteration_s > tl.iteration_s
    assert tl.cross_mesh_bytes == pytest.approx(2 * (S - 1) * B * nbytes)
    assert tl.inter_node_bytes == pytest.approx(2 * B * nbytes)  # only the boundary 1 -> 2 crosses nodes


def test_local_all_gather_moves_fewer_bytes_across_nodes_than_send_recv(two_nodes):
    shape = (64, 1024, 1024)  # fp16, 128 MiB; senders hold halves, receivers want it replicated
    nbytes = 64 * 1024 * 1024 * 2
    plan = synthetic_plan([0.01] * 2, [0.02] * 2, 4, devices_per_stage=2, cluster=two_nodes, hidden_shape=shape,
                          specs=("RS1R", "RRR"))
    runs = {m: simulate(plan, "1f1b", cross_mesh=m) for m in ("send_recv", "local_all_gather", "signal")}
    messages = 2 * 4  # two directions, four microbatches
    # send_recv: each of the 2 receivers fetches the whole tensor; the rewrite fetches it
    # once (half per receiver) and all-gathers on NVLink; signal sends 1 byte per message.
    assert runs["send_recv"].cross_mesh_bytes == pytest.approx(messages * 2 * nbytes)
    assert runs["local_all_gather"].cross_mesh_bytes == pytest.approx(messages * nbytes)
    assert runs["local_all_gather"].inter_node_bytes == pytest.approx(messages * nbytes)
    assert runs["signal"].cross_mesh_bytes == pytest.approx(messages * 4)  # 2 receivers x 2 pieces
    assert runs["local_all_gather"].count("allgather") == messages
    assert (runs["signal"].iteration_s < runs["local_all_gather"].iteration_s < runs["send_recv"].iteration_s)
    assert not runs["send_recv"].notes  # the cross-mesh planner handled every tensor


def test_per_iteration_tensors_move_once_before_the_gradient_sync(two_nodes):
    plan = synthetic_plan([1.0] * 2, [1.0] * 2, 3, devices_per_stage=2, cluster=two_nodes, hidden_shape=(8,))
    tied = PlanTransfer("embedding:grad", 64 * 32 * 4.0, 1, 0, (64, 32), "float32", "backward", True, "RR", "RR")
    plan = dataclasses.replace(plan, transfers=(*plan.transfers, tied))
    tl = simulate(plan, "1f1b")
    program_sends = [e for e in tl.events if e.kind == "send" and e.name == "embedding:grad"]
    assert program_sends and {e.microbatch for e in program_sends} == {-1}
    last_sync = max(e.start_s for e in tl.events if e.kind == "sync")
    assert max(e.end_s for e in program_sends) <= last_sync


# ------------------------------------------------------------ plan checks
def test_the_cluster_comes_from_the_plan_and_is_needed_for_communication(two_nodes):
    plan = synthetic_plan([1.0] * 2, [1.0] * 2, 2, hidden_shape=(8,))
    with pytest.raises(ValueError, match="no preset"):
        simulate(plan)
    assert simulate(plan, cluster=two_nodes).iteration_s > simulate(plan, free_communication=True).iteration_s
    with pytest.raises(ValueError, match="cross-mesh method"):
        simulate(plan, cross_mesh="carrier-pigeon", cluster=two_nodes)


@pytest.mark.parametrize("change, fragment", [
    ({"devices": ()}, "stages[1]: field 'devices' is empty"),
    ({"devices": (0,)}, "device 0 is also in stages[0]"),
    ({"logical_mesh": (2, 2)}, "stages[1].logical_mesh"),
    ({"forward_s": -1.0}, "stages[1].forward_s"),
])
def test_bad_stages_are_named(change, fragment):
    plan = synthetic_plan([1.0] * 2, [1.0] * 2, 2)
    stages = (plan.stages[0], dataclasses.replace(plan.stages[1], **change))
    with pytest.raises(PlanFormatError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        simulate(dataclasses.replace(plan, stages=stages), free_communication=True)


def test_plans_without_a_forward_backward_split_use_one_third_forward():
    plan = synthetic_plan([0.0] * 2, [0.0] * 2, 1)
    stages = tuple(dataclasses.replace(s, compute_s=3.0, forward_s=0.0, backward_s=0.0) for s in plan.stages)
    tl = simulate(dataclasses.replace(plan, stages=stages), "1f1b", free_communication=True)
    runs = sorted((e.stage, e.name, e.duration_s) for e in tl.events if e.kind == "compute")
    assert runs == [(0, "backward", 2.0), (0, "forward", 1.0), (1, "backward", 2.0), (1, "forward", 1.0)]
    assert tl.iteration_s == pytest.approx(6.0)
    assert isinstance(GradSync(0), GradSync)


@pytest.mark.parametrize("scatter", [0.5, 2.0])
def test_sharded_gradient_scatters_run_on_the_stream_beside_the_next_microbatch(scatter):
    """Each backward's gradient reduce-scatters (ZeRO-2, Llama 3's FSDP) go on the
    mesh's stream as the backward ends, one after another: shorter than a microbatch's
    work they hide behind it but for the last; longer, the stream falls behind by the
    difference each microbatch. The planner's tail (`scatter_tail_s`, in sync_s) is
    replaced by the stream's; without overlap the scatters run in the backward."""
    from alpasim.solvers import scatter_tail_s

    f, b, B, sync = 1.0, 2.0, 4, 0.25
    base = synthetic_plan([f], [b], B, sync_s=sync)
    tail = scatter_tail_s(scatter, f + b, B)
    plan = dataclasses.replace(base, stages=(dataclasses.replace(base.stages[0], grad_scatter_s=scatter,
                                                                  sync_s=sync + tail),))
    stream_end = 0.0
    for k in range(1, B + 1):                      # backward k ends at k (f + b)
        stream_end = max(stream_end, k * (f + b)) + scatter
    tl = simulate(plan, "1f1b", free_communication=True)
    assert tl.iteration_s == pytest.approx(stream_end + sync)
    assert B * (f + b) + tail == pytest.approx(stream_end)          # the planner's tail, exact on one stage
    inline = simulate(plan, "1f1b", free_communication=True, overlap=False)
    assert inline.iteration_s == pytest.approx(B * (f + b + scatter) + sync)

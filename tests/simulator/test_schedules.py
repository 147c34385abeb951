"""Schedules as programs: run orders, message pairing, JSON round trip, bad names, and
each schedule's record against the program built from it."""

from __future__ import annotations

import dataclasses

import pytest

from alpasim.simulator import (
    AUTO_SCHEDULES,
    SCHEDULES,
    Free,
    GradSync,
    Program,
    Recv,
    Run,
    Send,
    build_program,
    synthetic_plan,
)
from alpasim.solvers._pipeline_orders import interleaved_order, one_f_one_b_order


def in_flight_peak(order):
    live = peak = 0
    for phase, _, _ in order:
        live += 1 if phase == "forward" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages, microbatches", [(1, 1), (4, 1), (4, 3), (4, 8), (8, 64)])
def test_1f1b_order_holds_min_of_s_minus_i_and_b_in_flight(stages, microbatches):
    for i in range(stages):
        order = one_f_one_b_order(stages, microbatches, i)
        assert sorted(order) == sorted([(p, m, 0) for p in ("forward", "backward") for m in range(microbatches)])
        assert in_flight_peak(order) == min(stages - i, microbatches)
        # A backward never comes before its own forward.
        seen = set()
        for phase, m, _ in order:
            assert phase == "forward" or m in seen
            seen.add(m)


def test_1f1b_order_of_the_last_stage_alternates():
    assert one_f_one_b_order(3, 3, 2) == [("forward", 0, 0), ("backward", 0, 0), ("forward", 1, 0),
                                          ("backward", 1, 0), ("forward", 2, 0), ("backward", 2, 0)]
    assert one_f_one_b_order(3, 3, 0)[:3] == [("forward", 0, 0), ("forward", 1, 0), ("forward", 2, 0)]


@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 4, 2), (4, 8, 3), (3, 5, 2), (4, 2, 2)])
def test_interleaved_order_runs_every_chunk_of_every_microbatch_once(stages, microbatches, chunks):
    for k in range(stages):
        order = interleaved_order(stages, microbatches, k, chunks)
        want = [(p, m, c) for p in ("forward", "backward") for m in range(microbatches) for c in range(chunks)]
        assert sorted(order) == sorted(want)
        done = set()
        for phase, m, c in order:
            if phase == "forward":
                assert c == 0 or ("forward", m, c - 1) in done   # chunks of one microbatch in model order
            else:
                assert ("forward", m, c) in done
            done.add((phase, m, c))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_send_has_one_matching_recv_on_the_right_mesh(schedule):
    plan = synthetic_plan([1.0] * 3, [2.0] * 3, 4, hidden_shape=(2, 8))
    program = build_program(plan, schedule, chunks=2)
    sends = {(i.transfer, i.microbatch): (k, i) for k, mesh in enumerate(program.meshes) for i in mesh
             if isinstance(i, Send)}
    recvs = {(i.transfer, i.microbatch): (k, i) for k, mesh in enumerate(program.meshes) for i in mesh
             if isinstance(i, Recv)}
    assert sends.keys() == recvs.keys() and sends
    for key, (k, send) in sends.items():
        t = program.transfers[key[0]]
        assert k == t.src_stage == send.src_stage and recvs[key][0] == t.dst_stage == send.dst_stage
    chunks = 2 if schedule == "interleaved" else 1
    passes = 3 if schedule.startswith("zb") else 2      # zero bubble: F, B and W
    assert program.count(Run) == 3 * 4 * passes * chunks
    assert all(isinstance(mesh[-2], GradSync) for mesh in program.meshes)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("S, B", [(1, 3), (4, 2), (4, 9)])
def test_each_record_says_what_its_program_does(name, S, B):
    """A plan naming the schedule builds; its program has B and W runs exactly when the
    record splits the backward, runs of chunks past 0 exactly when it is chunked, and
    `inflight` is the most forwards each mesh holds until their `Free` (F = B = W
    here: the times ZB-H2's rule counts its order at)."""
    rec, v = SCHEDULES[name], 3
    plan = dataclasses.replace(synthetic_plan([1.0] * S, [2.0] * S, B, layers_per_stage=v), schedule=name)
    program = build_program(plan, chunks=v)
    runs = [i for mesh in program.meshes for i in mesh if isinstance(i, Run)]
    phases = {r.phase for r in runs}
    assert rec.name == name == program.schedule
    assert phases == ({"forward", "backward_input", "backward_weight"} if rec.splits_backward
                      else {"forward", "backward"})
    assert any(r.chunk > 0 for r in runs) == rec.chunked
    for k, mesh in enumerate(program.meshes):
        live = most = 0
        for ins in mesh:
            if isinstance(ins, Run) and ins.phase == "forward":
                live += 1
                most = max(most, live)
            live -= isinstance(ins, Free)
        assert live == 0 and rec.inflight(S, B, k, v) == most, (k, most)
    # `choose_schedule` tries the automatic ones on the DP's plan: one stage per mesh.
    assert AUTO_SCHEDULES == ("1f1b", "zb-h1", "zb-h2") and not (rec.automatic and rec.chunked)


def test_plans_without_transfers_get_control_messages_between_adjacent_stages():
    program = build_program(synthetic_plan([1.0] * 3, [1.0] * 3, 2), "1f1b")
    pairs = sorted((t.src_stage, t.dst_stage, t.direction, t.nbytes) for t in program.transfers)
    assert pairs == [(0, 1, "forward", 0.0), (1, 0, "backward", 0.0), (1, 2, "forward", 0.0),
                     (2, 1, "backward", 0.0)]


def test_interleaved_adds_the_wrap_around_boundary():
    program = build_program(synthetic_plan([1.0] * 2, [1.0] * 2, 2, hidden_shape=(4,)), "interleaved", chunks=3)
    fwd = sorted((t.src_stage, t.src_chunk, t.dst_stage, t.dst_chunk) for t in program.transfers
                 if t.direction == "forward")
    # Virtual stages 0..5 on meshes 0,1,0,1,0,1: every consecutive pair is a message.
    assert fwd == [(0, 0, 1, 0), (0, 1, 1, 1), (0, 2, 1, 2), (1, 0, 0, 1), (1, 1, 0, 2)]


def test_program_json_round_trips():
    program = build_program(synthetic_plan([1.0] * 2, [2.0] * 2, 3, hidden_shape=(4, 4)), "interleaved")
    assert Program.from_json(program.to_json()) == program
    bad = program.to_json()
    bad["meshes"][0][0]["op"] = "jump"
    with pytest.raises(ValueError, match=r"meshes\[0\]\[0\].*'jump'"):
        Program.from_json(bad)


def test_unknown_schedule_and_bad_chunks_are_named():
    plan = synthetic_plan([1.0], [1.0], 2)
    with pytest.raises(ValueError, match="1f1b, gpipe, interleaved"):
        build_program(plan, "zigzag")
    with pytest.raises(ValueError, match="chunks"):
        build_program(plan, "interleaved", chunks=0)

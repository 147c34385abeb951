"""Folding identical network lanes (`simulator._lanes`): the same finish times as
running every copy, checked against the unfolded fluid network and the unfolded engine."""

from __future__ import annotations

import dataclasses
import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import SpineTier, get_cluster
from alpasim.simulator import FluidNetwork, simulate, synthetic_plan
from alpasim.simulator import _engine
from alpasim.simulator._lanes import fold_lanes
from alpasim.simulator._routes import Copy, Route


def _route(copies):
    return Route(tuple(Copy(0, 1, b, links, 0.0) for links, b in copies), 0.0, 0.0, 0.0, 0.0, True)


def _finish_times(routes, capacities, starts):
    """Every copy of route r started at starts[r] on a fluid network, run to the end:
    {(route, copy): finish time}. An independent driver of `FluidNetwork` (no engine)."""
    net, heap, ids, version, out = FluidNetwork(capacities), [], {}, {}, {}
    for r, t in sorted(enumerate(starts), key=lambda x: x[1]):
        heapq.heappush(heap, (t, 0, ("start", r)))
    while heap:
        now, _, item = heapq.heappop(heap)
        if item[0] == "start":
            for j, c in enumerate(routes[item[1]].copies):
                fid = len(ids)
                ids[fid] = (item[1], j)
                changed = net.add(fid, c.links, c.nbytes, now)
                for f, finish, v in changed:
                    version[f] = v
                    heapq.heappush(heap, (finish, 1, ("end", f, v)))
        else:
            _, f, v = item
            if version.get(f) != v or not net.is_current(f, v):
                continue
            out[ids[f]] = now
            for g, finish, w in net.remove(f, now):
                version[g] = w
                heapq.heappush(heap, (finish, 1, ("end", g, w)))
    return out


@st.composite
def symmetric_traffic(draw):
    """K lanes of one random template (routes over lane-local links and links every
    lane shares), the lanes' links interleaved in the id space."""
    k = draw(st.integers(2, 4))
    local, shared = draw(st.integers(1, 4)), draw(st.integers(0, 2))
    caps = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0]), min_size=local, max_size=local))
    shared_caps = draw(st.lists(st.sampled_from([2.0, 4.0, 6.0]), min_size=shared, max_size=shared))
    template = []
    for _ in range(draw(st.integers(1, 5))):
        own = draw(st.lists(st.integers(0, local - 1), min_size=1, max_size=2, unique=True))
        over = draw(st.lists(st.integers(0, shared - 1), max_size=min(shared, 1))) if shared else []
        template.append((own, over, draw(st.sampled_from([1.0, 2.0, 4.0, 7.0]))))
    perm = draw(st.permutations(range(k)))
    link = lambda lane, i: i * k + perm[lane]           # noqa: E731  lane-local link i of `lane`
    routes = [_route([(tuple(link(lane, i) for i in own) + tuple(local * k + s for s in over), b)
                      for lane in range(k)]) for own, over, b in template]
    capacities = [caps[i // k] for i in range(local * k)] + shared_caps
    starts = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=len(routes), max_size=len(routes)))
    return k, routes, capacities, starts


@settings(max_examples=60, deadline=None)
@given(symmetric_traffic())
def test_folded_lanes_finish_when_every_copy_does(traffic):
    k, routes, capacities, starts = traffic
    fold = fold_lanes(routes, capacities)
    assert fold is not None and fold.lanes == k
    whole = _finish_times(routes, capacities, starts)
    lane = _finish_times(list(fold.routes), list(fold.capacities), starts)
    for (r, _), t in whole.items():
        assert t == pytest.approx(lane[(r, 0)], rel=1e-9)
    # The orbit names each lane-0 link's counterpart in every lane.
    for r, route in enumerate(routes):
        for c0 in fold.routes[r].copies:
            assert {tuple(fold.orbit[x][j] for x in c0.links) for j in range(k)} == {c.links for c in route.copies}


def test_lanes_that_differ_are_not_folded():
    same = [_route([((0,), 1.0), ((1,), 1.0)])]
    assert fold_lanes(same, [1.0, 1.0]).lanes == 2
    assert fold_lanes([_route([((0,), 1.0), ((1,), 2.0)])], [1.0, 1.0]) is None      # bytes differ
    assert fold_lanes(same, [1.0, 2.0]) is None                                        # capacities differ
    assert fold_lanes(same + [_route([((0,), 1.0)])], [1.0, 1.0]) is None              # one copy, not K
    # A link two of three copies share is neither a lane's nor every lane's.
    assert fold_lanes([_route([((0, 3), 1.0), ((1, 3), 1.0), ((2,), 1.0)])], [1.0] * 4) is None
    # Lanes joined by another route's copy (0 and 1 in one component) are one lane.
    assert fold_lanes(same + [_route([((0, 1), 1.0), ((2,), 1.0)])], [1.0] * 3) is None


def _both(plan, schedule="1f1b", chunks=2, monkeypatch=None):
    folded = simulate(plan, schedule, chunks=chunks)
    monkeypatch.setattr(_engine, "fold_lanes", lambda *a: None)
    whole = simulate(plan, schedule, chunks=chunks)
    monkeypatch.undo()
    return folded, whole


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_engine_gives_the_same_iteration_and_events_folded(schedule, monkeypatch):
    # Four meshes of two nodes x 4 devices, a card per device, a leaf per mesh behind a
    # 1:3 spine: every send crosses the spine, where all 8 lanes meet. (Leaves of 3
    # nodes would send half of a tensor's copies over the spine: no fold.)
    cluster = dataclasses.replace(get_cluster("dgx-a100", nodes=8, devices_per_node=4), nics_per_node=4,
                                  spine=SpineTier(2, 3.0))
    chunks = 2 if schedule == "interleaved" else 1
    plan = synthetic_plan([0.002] * 4 * chunks, [0.004] * 4 * chunks, 6, devices_per_stage=8, cluster=cluster,
                          hidden_shape=(8, 1024, 1024), chunks=chunks)
    folded, whole = _both(plan, schedule, monkeypatch=monkeypatch)
    assert folded.lanes == 8 and whole.lanes == 1
    assert folded.iteration_s == pytest.approx(whole.iteration_s, rel=1e-12)
    assert any("spine" in name for name, _ in whole.links)
    assert sorted(folded.links) == sorted(whole.links)
    key = lambda e: (e.track, e.start_s, e.end_s, e.kind, e.stage, e.microbatch, e.name)  # noqa: E731
    assert len(folded.events) == len(whole.events)
    for a, b in zip(sorted(folded.events, key=key), sorted(whole.events, key=key)):
        assert a.track == b.track and a.kind == b.kind and a.nbytes == b.nbytes
        assert a.start_s == pytest.approx(b.start_s, rel=1e-12, abs=1e-15)
        assert a.end_s == pytest.approx(b.end_s, rel=1e-12, abs=1e-15)
    for a, b in zip(folded.mesh_stats(), whole.mesh_stats()):
        assert (a["busy_s"], a["comm_s"], a["idle_s"]) == pytest.approx((b["busy_s"], b["comm_s"], b["idle_s"]))
    assert folded.to_json()["network_lanes"] == 8


def test_a_megatron_llama_plan_folds_into_one_lane_per_device(monkeypatch):
    """Megatron's stage inputs are split on the batch over dp (`_megatron_inputs`): the
    embedding chunk takes its cotangent as each data-parallel rank's own sequences, so
    every device of a mesh sends to one counterpart over its own card, and the 16
    devices of each 2-node mesh are 16 lanes."""
    from alpasim import solvers as sv

    cluster = get_cluster("dgx-h100", nodes=4)
    model = "llama3-405b:hidden=512,layers=2,heads=8,kv_heads=2,ffn=1024,seq=256,vocab=1024,batch=16"
    config = sv.MegatronConfig(4, 2, 4, 1, sequence_parallel=True, ends_as_layers=True)
    plan = sv.plan_model(model, cluster, "megatron", megatron=config, system="llama3", distributed_optimizer=True,
                         schedule="interleaved", chunk_options=(2,))
    embedding = plan.stages[0].layer_specs[0]
    assert embedding["token_ids"] == "S0R" and embedding["layer0/attn_norm/upcast:grad_acc"].startswith("S0")
    folded, whole = _both(plan, plan.schedule, chunks=plan.chunks, monkeypatch=monkeypatch)
    assert folded.lanes == 16
    assert folded.iteration_s == pytest.approx(whole.iteration_s, rel=1e-12)
    assert len(folded.events) == len(whole.events)

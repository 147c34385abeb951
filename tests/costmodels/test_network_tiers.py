"""Network tiers: NVLink inside a node, rail-optimised cards across nodes, an optional
oversubscribed spine between leaf switches, and the one routing rule
(`Cluster.route`) the cross-mesh pricing and the simulator share."""

from __future__ import annotations

import dataclasses
import json

import pytest

from alpasim.costmodels import Cluster, ClusterError, SpineTier, get_cluster, group_link, mesh_axes
from alpasim.simulator import simulate, synthetic_plan
from alpasim.solvers import SearchSpace

H100 = get_cluster("dgx-h100", nodes=4)
SPINE = dataclasses.replace(H100, spine=SpineTier(nodes_per_leaf=2, oversubscription=4.0))


def test_routes_take_nvlink_then_the_rail_card_then_the_spine():
    assert [h.port for h in H100.route(1, 5)] == [("out", 1), ("in", 5)]
    # Rails: device 3 of node 0 leaves on card 3 and enters node 1's card 3.
    hops = H100.route(3, 8 + 3)
    assert [h.port for h in hops] == [("nic-out", 0, 3), ("nic-in", 1, 3)]
    assert all(h.link == H100.inter_node for h in hops)
    # Same leaf (nodes 0 and 1): no spine; leaves 0 and 1 (nodes 1 and 2): both uplinks.
    assert len(SPINE.route(3, 11)) == 2
    ports = [h.port for h in SPINE.route(11, 16)]
    assert ports == [("nic-out", 1, 3), ("spine-up", 0), ("spine-down", 1), ("nic-in", 2, 0)]
    up = SPINE.spine_uplink()
    assert up.bandwidth_gbps == pytest.approx(2 * 8 * 400 / 4)


def test_collectives_across_leaves_see_the_oversubscribed_spine():
    share = SPINE.inter_node_per_device
    assert group_link(SPINE, [0, 8]) == share                       # one leaf
    across = group_link(SPINE, [0, 16])
    assert across.bandwidth_gbps == pytest.approx(share.bandwidth_gbps / 4)
    # A 4 x 8 mesh: axis 0 spans both leaves, axis 1 stays on NVLink.
    axes = mesh_axes(SPINE, (4, 8))
    assert axes[0].link.bandwidth_gbps == pytest.approx(share.bandwidth_gbps / 4)
    assert axes[1].link == SPINE.intra_node
    assert mesh_axes(H100, (4, 8))[0].link == share


def test_spine_round_trips_and_bad_spines_are_refused():
    assert Cluster.from_json(json.loads(json.dumps(SPINE.to_json()))) == SPINE
    assert "spine" not in H100.to_json()                # clusters without one keep their JSON (and cache keys)
    assert [t["tier"] for t in SPINE.tiers()] == ["nvlink", "rails", "spine"]
    with pytest.raises(ClusterError, match="oversubscription must be at least 1"):
        SpineTier(2, 0.5)
    bad = {**SPINE.to_json(), "spine": {"nodes_per_leaf": 0, "oversubscription": 2.0}}
    with pytest.raises(ClusterError, match="nodes_per_leaf"):
        Cluster.from_json(bad)


@pytest.mark.parametrize("oversubscription", [4.0, 2.0, 1.0])
def test_simulated_transfers_share_the_spine_uplink(oversubscription):
    """Two one-node stages on different leaves (one node a leaf): a boundary split over
    all 8 devices sends 8 copies at once, one per rail card, through one uplink of 8
    cards' bandwidth / oversubscription, so each copy's bytes take that many times
    longer than on the same cluster without a spine (a non-blocking spine: no change)."""
    base = get_cluster("dgx-h100", nodes=2)
    spine = dataclasses.replace(base, spine=SpineTier(nodes_per_leaf=1, oversubscription=oversubscription))
    seconds = {}
    for name, cluster in (("flat", base), ("spine", spine)):
        plan = synthetic_plan([1.0, 1.0], [2.0, 2.0], 1, devices_per_stage=8, cluster=cluster,
                              hidden_shape=(8, 4096, 4096), specs=("S1RR", "S1RR"))
        tl = simulate(plan)
        seconds[name] = max(e.end_s - e.start_s for e in tl.events if e.kind == "recv")
    wire = {k: v - base.inter_node.latency_s for k, v in seconds.items()}   # the message's latency, then its bytes
    assert wire["spine"] / wire["flat"] == pytest.approx(oversubscription, rel=1e-6)


def test_stage_boundaries_between_leaves_pay_the_spine():
    """The stage DP's boundary price between nodes: one node's cards, or on a cluster
    whose every node is a leaf of its own, the 4:1 uplink (4x the bytes' time)."""
    from alpasim.graphs import forward_graph, resolve_model
    from alpasim.solvers._boundary import stage_boundary_s

    name, cfg = resolve_model("gpt3:hidden=256,layers=4,heads=4,seq=128,vocab=512,batch=8")
    graph = forward_graph(cfg, name=name)
    base = get_cluster("dgx-h100", nodes=2)
    flat = stage_boundary_s(graph, base)
    own_leaf = stage_boundary_s(graph, dataclasses.replace(base, spine=SpineTier(1, 4.0)))
    shared_leaf = stage_boundary_s(graph, dataclasses.replace(base, spine=SpineTier(2, 4.0)))
    latency = base.inter_node.latency_s               # one message a boundary: a forward graph
    moved = flat.inter[1:] > 0
    assert moved.any()
    assert (own_leaf.inter[1:][moved] - latency) == pytest.approx(4 * (flat.inter[1:][moved] - latency))
    assert list(shared_leaf.inter) == list(flat.inter) and list(own_leaf.intra) == list(flat.intra)


@pytest.mark.slow
def test_a_gb200_nvl72_plan_follows_its_72_gpu_nvlink_domain():
    """Two NVL72 racks: every stage is a power-of-two part of a rack that divides 72, a
    whole rack or both racks; one-rack pieces stay on one rack; all 144 GPUs are used."""
    from alpasim.solvers import plan_pipeline, submesh_shapes

    cluster = get_cluster("gb200-nvl72", nodes=2)
    assert cluster.devices_per_node == 72 and cluster.nics_per_node == 72
    assert [s.m for s in submesh_shapes(1, 72)] == [1, 2, 4, 8, 72]
    plan = plan_pipeline("gpt3:hidden=512,layers=4,heads=8,seq=256,vocab=4096,batch=144", cluster,
                         SearchSpace(microbatches=1, max_stages=4, pareto=False))
    assert sorted(d for s in plan.stages for d in s.devices) == list(range(144))
    for s in plan.stages:
        assert tuple(s.submesh) in {(1, 1), (1, 2), (1, 4), (1, 8), (1, 72), (2, 72)}
        if s.submesh[0] == 1:
            assert len({d // 72 for d in s.devices}) == 1

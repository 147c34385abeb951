"""The stage DP's boundary term against the GPT closed form: one residual stream
(b, s, h) in half precision crosses every block boundary forward, its cotangent back."""

from __future__ import annotations

import numpy as np
import pytest

from alpasim.costmodels import get_cluster
from alpasim.graphs import build_training_graph, forward_graph, resolve_model
from alpasim.solvers import planning_units
from alpasim.solvers._boundary import cut_bytes, stage_boundary_s

B, S, H = 8, 16, 64


@pytest.fixture(scope="module")
def gpt():
    name, cfg = resolve_model(f"gpt3:hidden={H},layers=3,heads=4,seq={S},vocab=128,batch={B}")
    return build_training_graph(planning_units(forward_graph(cfg, name=name)), remat=True).graph


def test_cut_bytes_is_the_residual_stream(gpt):
    forward, backward = cut_bytes(gpt)
    stream = B * S * H * 2
    assert gpt.num_layers == 5  # embedding, 3 blocks, head
    np.testing.assert_array_equal(forward, [0] + [stream] * 4)
    np.testing.assert_array_equal(backward, [0] + [stream] * 4)


def test_boundary_seconds_by_link(gpt):
    """Into a stage whose predecessor is on another node: over the network cards; on the
    same node: NVLink. Nothing moves into the first layer."""
    cluster = get_cluster("aws-p3.16xlarge").with_overrides(nodes=2)
    boundary = stage_boundary_s(gpt, cluster)
    stream = B * S * H * 2
    assert boundary.intra.shape == boundary.inter.shape == (5,)
    assert boundary.intra[0] == boundary.inter[0] == 0.0
    inter, intra = cluster.inter_node, cluster.intra_node
    cards = min(cluster.nics_per_node, cluster.devices_per_node)
    assert boundary.inter[2] == pytest.approx(2 * stream / (inter.bytes_per_s * cards) + 2 * inter.latency_s)
    assert boundary.intra[2] == pytest.approx(2 * stream / intra.bytes_per_s + 2 * intra.latency_s)
    assert boundary.inter[2] > 5 * boundary.intra[2]


def test_stages_of_whole_nodes_cross_over_all_their_cards(gpt):
    """A stage of 4 whole nodes receives its microbatch over the 4 nodes' cards at once
    (each node's devices exchange their share with the matching node): a quarter of the
    bytes' time, the same latency. One node's cards for a 512-GPU Llama 3 stage had
    priced a crossing at 43 ms where 64 nodes' take 0.7."""
    cluster = get_cluster("dgx-h100", nodes=8)
    one, four = stage_boundary_s(gpt, cluster), stage_boundary_s(gpt, cluster, nodes=4)
    stream = B * S * H * 2
    inter = cluster.inter_node
    cards = min(cluster.nics_per_node, cluster.devices_per_node)
    assert four.inter[2] == pytest.approx(2 * stream / (inter.bytes_per_s * cards * 4) + 2 * inter.latency_s)
    assert one.inter[2] - 2 * inter.latency_s == pytest.approx(4 * (four.inter[2] - 2 * inter.latency_s))
    np.testing.assert_array_equal(four.intra, one.intra)


def test_stages_spanning_a_leaf_cross_over_the_spine_uplinks_of_their_leaves(gpt):
    """Two-node leaves, 4:1 oversubscribed: a stage of 4 nodes crosses to its neighbour's
    first node on another leaf, so the two leaves' uplinks bound it (each a leaf's cards
    over 4), not its 4 nodes' cards; a stage of one node inside a leaf of two keeps its
    card rate."""
    import dataclasses

    from alpasim.costmodels import SpineTier

    base = get_cluster("dgx-h100", nodes=8)
    cluster = dataclasses.replace(base, spine=SpineTier(2, 4.0))
    stream = B * S * H * 2
    inter = cluster.inter_node
    cards = min(cluster.nics_per_node, cluster.devices_per_node)
    four = stage_boundary_s(gpt, cluster, nodes=4)
    uplink = cluster.spine_uplink().bytes_per_s
    assert uplink == pytest.approx(2 * cards * inter.bytes_per_s / 4)
    assert four.inter[2] == pytest.approx(2 * stream / (2 * uplink) + 2 * inter.latency_s)
    assert four.inter[2] > stage_boundary_s(gpt, base, nodes=4).inter[2]
    one = stage_boundary_s(gpt, cluster)
    assert one.inter[2] == pytest.approx(2 * stream / (inter.bytes_per_s * cards) + 2 * inter.latency_s)

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

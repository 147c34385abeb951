import json
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from alpasim.costmodels import (
    COLLECTIVE_KINDS,
    BusSweep,
    Cluster,
    ClusterError,
    Link,
    MeshAxis,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    collective_time_s,
    get_cluster,
    group_link,
    mesh_axes,
    reduce_scatter_time_s,
    send_recv_time_s,
)

GB = 1e9
RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def test_all_reduce_closed_form(link_100gb):
    # 8-way ring all-reduce of 1 GB at 100 GB/s: 2*7/8 * 10 ms of transfer + 14 steps of 10 us.
    assert all_reduce_time_s(GB, 8, link_100gb) == pytest.approx(2 * 7 / 8 * 0.01 + 14 * 1e-5)
    assert collective_time_s("all_reduce", GB, [MeshAxis(8, link_100gb)]) == pytest.approx(0.01764)


def test_gather_scatter_all_to_all_closed_forms(link_100gb):
    assert all_gather_time_s(GB, 4, link_100gb) == pytest.approx(3 / 4 * 0.01 + 3 * 1e-5)
    assert reduce_scatter_time_s(GB, 4, link_100gb) == pytest.approx(3 / 4 * 0.01 + 3 * 1e-5)
    assert all_to_all_time_s(GB, 8, link_100gb) == pytest.approx(7 / 8 * 0.01 + 7 * 1e-5)
    assert send_recv_time_s(GB, link_100gb) == pytest.approx(0.01 + 1e-5)


def test_send_recv_on_25_gbps():
    # 100 MB over 25 Gbit/s = 3.125 GB/s: 32 ms.
    assert send_recv_time_s(100e6, Link("eth", 25.0, 0.0)) == pytest.approx(0.032)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_one_device_and_empty_messages_are_free(kind, link_100gb):
    assert collective_time_s(kind, GB, [MeshAxis(1, link_100gb)]) == 0.0
    assert collective_time_s(kind, GB, [MeshAxis(1, link_100gb), MeshAxis(1, link_100gb)]) == 0.0
    assert collective_time_s(kind, GB, []) == 0.0
    assert collective_time_s(kind, 0, [MeshAxis(8, link_100gb)]) == 0.0


def test_reduce_scatter_plus_all_gather_is_all_reduce(link_100gb):
    for n in (2, 3, 8, 64):
        rs_ag = reduce_scatter_time_s(GB, n, link_100gb) + all_gather_time_s(GB, n, link_100gb)
        assert rs_ag == pytest.approx(all_reduce_time_s(GB, n, link_100gb))


sizes = st.floats(min_value=0, max_value=1e12, allow_nan=False)
links = st.builds(Link, st.just("l"), st.floats(1e-2, 1e4), st.floats(0, 1e-3))


@given(kind=st.sampled_from(COLLECTIVE_KINDS), a=sizes, b=sizes, n=st.integers(1, 512), link=links)
def test_monotone_in_bytes(kind, a, b, n, link):
    lo, hi = sorted((a, b))
    axes = [MeshAxis(n, link)]
    assert collective_time_s(kind, lo, axes) <= collective_time_s(kind, hi, axes)


@given(kind=st.sampled_from(RING_KINDS), s=st.floats(1, 1e12), n=st.integers(1, 512), link=links)
def test_monotone_in_group_size(kind, s, n, link):
    assert collective_time_s(kind, s, [MeshAxis(n, link)]) <= collective_time_s(kind, s, [MeshAxis(n + 1, link)])


@given(kind=st.sampled_from(RING_KINDS), s=st.floats(0, 1e12), n=st.integers(2, 512), link=links)
def test_bandwidth_term_bounded_by_ring_factor(kind, s, n, link):
    zero_latency = Link("l", link.bandwidth_gbps, 0.0)
    factor = 2.0 if kind == "all_reduce" else 1.0
    t = collective_time_s(kind, s, [MeshAxis(n, zero_latency)])
    assert t == pytest.approx(factor * (n - 1) / n * s / zero_latency.bytes_per_s)
    assert t <= factor * s / zero_latency.bytes_per_s * (1 + 1e-12)


def test_multi_axis_all_reduce_is_hierarchical(link_100gb, slow_link):
    s = 8 * GB
    fast, slow = MeshAxis(8, link_100gb), MeshAxis(2, slow_link)
    # Reduce-scatter on the fast axis, all-reduce the 1/8 piece on the slow axis, all-gather back.
    expected = (2 * 7 / 8 * s / 100e9 + 14 * 1e-5) + (2 * 1 / 2 * (s / 8) / 1e9 + 2 * 5e-5)
    assert collective_time_s("all_reduce", s, [slow, fast]) == pytest.approx(expected)
    assert collective_time_s("all_reduce", s, [fast, slow]) == pytest.approx(expected)  # order-free
    flat_over_slow = all_reduce_time_s(s, 16, slow_link)
    assert collective_time_s("all_reduce", s, [slow, fast]) < flat_over_slow


def test_multi_axis_gather_scatter_and_all_to_all(link_100gb, slow_link):
    s = 8 * GB
    axes = [MeshAxis(2, slow_link), MeshAxis(4, link_100gb)]
    shrinking = all_gather_time_s(s, 4, link_100gb) + all_gather_time_s(s / 4, 2, slow_link)
    assert collective_time_s("all_gather", s, axes) == pytest.approx(shrinking)
    assert collective_time_s("reduce_scatter", s, axes) == pytest.approx(shrinking)
    whole = all_to_all_time_s(s, 4, link_100gb) + all_to_all_time_s(s, 2, slow_link)
    assert collective_time_s("all_to_all", s, axes) == pytest.approx(whole)
    # Point-to-point crosses the slowest link; an axis of size 1 is not crossed.
    assert collective_time_s("send_recv", s, axes) == pytest.approx(send_recv_time_s(s, slow_link))
    assert collective_time_s("send_recv", s, [MeshAxis(1, slow_link), MeshAxis(4, link_100gb)]) == \
        pytest.approx(send_recv_time_s(s, link_100gb))


@given(kind=st.sampled_from(RING_KINDS), s=st.floats(0, 1e12), n=st.integers(1, 64), link=links)
def test_single_axis_matches_one_axis_function_and_size_one_axes_are_neutral(kind, s, n, link):
    one = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s,
           "reduce_scatter": reduce_scatter_time_s, "all_to_all": all_to_all_time_s}[kind]
    expected = one(s, n, link)
    assert collective_time_s(kind, s, MeshAxis(n, link)) == pytest.approx(expected)
    assert collective_time_s(kind, s, [(1, link), (n, link), (1, link)]) == pytest.approx(expected)


def test_bad_arguments(link_100gb):
    with pytest.raises(ValueError, match="all_reduce"):
        collective_time_s("allreduce", GB, [MeshAxis(2, link_100gb)])
    with pytest.raises(ValueError, match="-1"):
        collective_time_s("all_reduce", -1, [MeshAxis(2, link_100gb)])
    with pytest.raises(ClusterError, match=r"size.*0"):
        MeshAxis(0, link_100gb)
    with pytest.raises(ClusterError, match=r"group size n.*0"):
        all_reduce_time_s(GB, 0, link_100gb)


def test_group_link(p3):
    assert group_link(p3, range(8)) == p3.intra_node
    assert group_link(p3, [3]) == p3.intra_node
    spanning = group_link(p3, [0, 8])
    assert spanning.bandwidth_gbps == pytest.approx(25 / 8)
    assert spanning.latency_s == p3.inter_node.latency_s
    assert group_link(get_cluster("dgx-a100"), [7, 8]).bandwidth_gbps == 200.0
    # A ring through all 16 devices of two nodes crosses each node's one card once per
    # pass: the whole card is its (NCCL's multi-node ring), not 1/8 of it; of its 16
    # steps, 2 cross the network and 14 are NVLink hops.
    ring = group_link(p3, range(16))
    assert ring.bandwidth_gbps == pytest.approx(25.0)
    assert ring.latency_s == pytest.approx((2 * p3.inter_node.latency_s + 14 * p3.intra_node.latency_s) / 16)
    # Four devices in each of two DGX A100 nodes: their four HDR cards (the other four
    # serve the node's other group), capped by nothing slower.
    a100 = get_cluster("dgx-a100", nodes=2)
    assert group_link(a100, [0, 2, 4, 6, 8, 10, 12, 14]).bandwidth_gbps == pytest.approx(4 * 200.0)
    # Uneven: the node holding fewer of the group's devices sets the share.
    assert group_link(a100, [5, 6, 7, 8]).bandwidth_gbps == pytest.approx(200.0)
    with pytest.raises(ClusterError):
        group_link(p3, [])
    with pytest.raises(ClusterError, match="64"):
        group_link(p3, [0, 64])


def test_mesh_axes_on_p3(p3):
    across, within = mesh_axes(p3, (2, 8))
    assert (across.size, within.size) == (2, 8)
    assert across.link.bandwidth_gbps == pytest.approx(25 / 8)
    assert within.link == p3.intra_node
    assert mesh_axes(p3, (4,))[0].link == p3.intra_node
    assert mesh_axes(p3, (16,))[0].link.bandwidth_gbps == pytest.approx(25.0)   # the card, whole
    # 8x2: axis 0 strides by 2 over 16 devices, so it spans nodes, 4 devices in each: the
    # two columns share the card. The pairs stay inside.
    a0, a1 = mesh_axes(p3, (8, 2))
    assert a0.link.bandwidth_gbps == pytest.approx(4 * 25 / 8) and a1.link == p3.intra_node
    # 2x6 on 8-GPU nodes: the second row (devices 6..11) straddles the node boundary, 2
    # of its devices in node 0.
    assert mesh_axes(p3, (2, 6))[1].link.bandwidth_gbps == pytest.approx(2 * 25 / 8)
    with pytest.raises(ClusterError, match="128"):
        mesh_axes(p3, (16, 8))


def test_data_parallel_across_p3_nodes_is_slow(p3):
    # A 1.3B-parameter fp16 gradient all-reduced over 2 nodes x 8 GPUs: the cross-node
    # share (25/8 Gbps) dominates. Hierarchical: NVLink on 2.6 GB, then 2 nodes on 1/8.
    s = 2.6e9
    t = collective_time_s("all_reduce", s, mesh_axes(p3, (2, 8)))
    nvlink = 2 * 7 / 8 * s / 130e9 + 14 * 3.4e-6
    network = 2 * 1 / 2 * (s / 8) / (25e9 / 8 / 8) + 2 * 30e-6
    assert t == pytest.approx(nvlink + network)
    assert network > 10 * nvlink


def test_an_all_to_all_across_nodes_leaves_through_each_devices_own_share(p3):
    """Rings through 16 devices of two p3 nodes use the whole card; an all-to-all's bytes
    do not ring: each device sends its own 15/16 through its eighth of the card."""
    (axis,) = mesh_axes(p3, (16,))
    assert axis.link.bandwidth_gbps == pytest.approx(25.0)
    assert axis.message_link == p3.inter_node_per_device
    s = 1e9
    assert collective_time_s("all_to_all", s, [axis]) == pytest.approx(
        all_to_all_time_s(s, 16, p3.inter_node_per_device))
    assert collective_time_s("all_gather", s, [axis]) == pytest.approx(all_gather_time_s(s, 16, axis.link))
    assert collective_time_s("send_recv", s, [axis]) == pytest.approx(send_recv_time_s(s, p3.inter_node_per_device))
    # Inside a node there is one link for both.
    (inside,) = mesh_axes(p3, (8,))
    assert inside.device_link is None and inside.message_link == p3.intra_node


def test_mesh_axes_and_submesh_meshes_take_the_same_slowest_group():
    """A leaf-spanning group with many devices per node can be faster than a node-spanning
    group with few: an axis is its slowest group, whichever that is, on both paths."""
    import dataclasses

    from alpasim.costmodels import SpineTier
    from alpasim.solvers._submesh import logical_mesh

    cluster = dataclasses.replace(get_cluster("dgx-a100", nodes=6), spine=SpineTier(3, 1.0))
    axes = mesh_axes(cluster, (4, 10))
    groups = [list(range(r * 10, r * 10 + 10)) for r in range(4)]
    slowest = min((group_link(cluster, g) for g in groups), key=lambda link: link.bytes_per_s)
    assert axes[1].link.bandwidth_gbps == slowest.bandwidth_gbps
    assert logical_mesh(cluster, list(range(40)), (4, 10)).axes == axes


# ---------------------------------------------------------------- measured sweeps
SWEPT = Link("swept", 8 * 100.0, 1e-5, BusSweep("test", (
    ("all_reduce", ((1e6, 10.0), (1e8, 100.0), (1e9, 200.0))),
    ("all_gather", ((1e6, 5.0), (1e9, 150.0))))))


def test_a_swept_link_prices_ring_collectives_from_the_measured_bus_bandwidth():
    # At a measured size, exactly k(n-1)/n * S / busbw(S): no alpha term.
    assert all_reduce_time_s(1e8, 8, SWEPT) == pytest.approx(2 * 7 / 8 * 1e8 / 100e9)
    assert all_gather_time_s(1e9, 4, SWEPT) == pytest.approx(3 / 4 * 1e9 / 150e9)
    # Between sizes, log-log: 1e7 B is halfway (in log) from 1e6 to 1e8, so sqrt(10 * 100).
    assert all_reduce_time_s(1e7, 8, SWEPT) == pytest.approx(2 * 7 / 8 * 1e7 / (10 ** 1.5 * 1e9))
    # Below the smallest size the time stays that size's (latency-bound); above the
    # largest, the rate stays the largest's.
    assert all_reduce_time_s(1e3, 8, SWEPT) == pytest.approx(all_reduce_time_s(1e6, 8, SWEPT))
    assert all_reduce_time_s(1e10, 8, SWEPT) == pytest.approx(2 * 7 / 8 * 1e10 / 200e9)
    # A kind with no sweep of its own takes the all-reduce's, capped at the link (100 GB/s).
    assert reduce_scatter_time_s(1e8, 8, SWEPT) == pytest.approx(7 / 8 * 1e8 / 100e9)
    assert reduce_scatter_time_s(1e9, 8, SWEPT) == pytest.approx(7 / 8 * 1e9 / 100e9)
    # All-to-all does not ring: alpha-beta on the link's rate.
    assert all_to_all_time_s(1e8, 8, SWEPT) == pytest.approx(7 * 1e-5 + 7 / 8 * 1e8 / 100e9)


SWEPT_LINKS = (SWEPT, get_cluster("dgx-a100").intra_node, get_cluster("dgx-h100").intra_node)


@given(st.sampled_from(("all_reduce", "all_gather", "reduce_scatter")), st.floats(1e3, 1e11), st.floats(1e3, 1e11))
@example("all_reduce", 1000.0, 1049.0)    # below the smallest size: S / (S / t) rounded either way
def test_a_swept_collective_is_monotone_in_bytes(kind, a, b):
    lo, hi = sorted((a, b))
    for link in SWEPT_LINKS:
        assert collective_time_s(kind, lo, [MeshAxis(8, link)]) <= collective_time_s(kind, hi, [MeshAxis(8, link)])


def test_a_swept_collective_is_monotone_across_every_measured_size():
    """At each size of a table, one ulp below, the size itself and one ulp above: where
    two interpolation segments (or a segment and the flat ends) meet, rounding must not
    let the time fall."""
    for link in SWEPT_LINKS:
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            for _, pts in link.sweep.points:
                for size, _ in pts:
                    sizes = (math.nextafter(size, 0), size, math.nextafter(size, math.inf))
                    times = [collective_time_s(kind, s, [MeshAxis(8, link)]) for s in sizes]
                    assert times == sorted(times), (link.name, kind, size, times)


def test_dgx_nodes_carry_nccl_tests_sweeps():
    """The DGX A100's 64 MiB all-reduce as SuperBench's nccl-tests measured it (200.91
    GB/s bus bandwidth), well below NVLink3's 300 GB/s, and H100's all-reduce through
    NVLink SHARP above NVLink4's 450 GB/s line rate at 8 GiB (478.87)."""
    a100, h100 = get_cluster("dgx-a100").intra_node, get_cluster("dgx-h100").intra_node
    assert all_reduce_time_s(2**26, 8, a100) == pytest.approx(2 * 7 / 8 * 2**26 / 200.91e9)
    assert all_reduce_time_s(2**26, 8, a100) > 1.3 * (14 * a100.latency_s + 2 * 7 / 8 * 2**26 / a100.bytes_per_s)
    assert all_reduce_time_s(2**33, 8, h100) == pytest.approx(2 * 7 / 8 * 2**33 / 478.87e9)
    assert reduce_scatter_time_s(2**27, 8, h100) == pytest.approx(7 / 8 * 2**27 / 308.73e9)
    # Across nodes there is no sweep: the network's alpha-beta.
    assert group_link(get_cluster("dgx-a100", nodes=2), [0, 8]).sweep is None


def test_a_sweep_round_trips_through_cluster_json_and_refuses_malformed_points():
    cluster = get_cluster("dgx-h100")
    again = Cluster.from_json(json.loads(json.dumps(cluster.to_json())))
    assert again == cluster and again.intra_node.sweep.points == cluster.intra_node.sweep.points
    with pytest.raises(ClusterError, match="include all_reduce"):
        BusSweep("x", (("all_gather", ((1.0, 1.0),)),))
    with pytest.raises(ClusterError, match="sizes increasing"):
        BusSweep("x", (("all_reduce", ((2.0, 1.0), (1.0, 1.0))),))
    bad = cluster.to_json()
    bad["intra_node"]["sweep"]["all_reduce"] = [[1, 2, 3]]
    with pytest.raises(ClusterError, match="intra_node.sweep.all_reduce"):
        Cluster.from_json(bad)

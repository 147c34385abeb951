"""Cross-mesh resharding plans against a numpy oracle and hand-computed cases (seed 3.4.10)."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import Link, all_gather_time_s, get_cluster
from alpasim.solvers import (
    CROSS_MESH_METHODS,
    CrossMeshPlan,
    LocalGather,
    LogicalMesh,
    ShardingError,
    ShardingSpec,
    Tile,
    Transfer,
    all_specs,
    cross_mesh_plan,
)

LINK = Link("test", 100.0, 1e-6)
MESH_SHAPES = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (2, 4), (1, 8)]
DIM_SIZES = [1, 2, 4, 8, 12, 16]
ITEMSIZE = 4
NODE_SIZE = 8


def on_nodes_of_8(d: int) -> int:
    return d // NODE_SIZE


# ---------------------------------------------------------------- oracle
def block_slices(spec: ShardingSpec, shape, mesh_shape, flat: int) -> tuple[slice, ...]:
    """The slice of the global tensor that the `flat`-th device (row-major) holds under `spec`.

    Written against the seed's definition, not the module: a dim sharded on axes
    (a, b, ...) is cut by np.split into prod(n_a, n_b, ...) pieces, and the device takes
    piece number ravel_multi_index((i_a, i_b, ...)) in C order (first axis major).
    """
    coord = np.unravel_index(flat, mesh_shape)
    out = []
    for n, axes in zip(shape, spec.dims):
        sizes = [mesh_shape[a] for a in axes]
        index = int(np.ravel_multi_index([coord[a] for a in axes], sizes)) if axes else 0
        piece = np.split(np.arange(n), math.prod(sizes))[index]
        out.append(slice(int(piece[0]), int(piece[-1]) + 1))
    return tuple(out)


def local(bounds, block: tuple[slice, ...]) -> tuple[slice, ...]:
    """`bounds` (global) as a slice into `block`'s local array; asserts it lies inside."""
    for (lo, hi), s in zip(bounds, block):
        assert s.start <= lo < hi <= s.stop, f"tile {bounds} outside block {block}"
    return tuple(slice(lo - s.start, hi - s.start) for (lo, hi), s in zip(bounds, block))


def simulate(plan: CrossMeshPlan, shape, src, dst) -> dict[int, dict]:
    """Run the plan on real data; check every receiver ends with exactly its dst block.

    `src`/`dst` are (devices, mesh shape, spec). Returns, per receiver, the tiles it got.
    """
    full = np.arange(math.prod(shape)).reshape(shape)
    devices, mshape, spec = src
    sender = {d: (blk := block_slices(spec, shape, mshape, k), full[blk]) for k, d in enumerate(devices)}
    got: dict[int, dict] = {}
    for t in plan.transfers:
        blk, data = sender[t.src]
        got.setdefault(t.dst, {})[t.tile.bounds] = data[local(t.tile.bounds, blk)].copy()
    for g in plan.gathers:
        union = [(tile.bounds, got[d][tile.bounds]) for d, tile in g.tiles]  # each arrived by a transfer
        for m in g.devices:
            got.setdefault(m, {}).update(union)
    devices, mshape, spec = dst
    for k, d in enumerate(devices):
        blk = block_slices(spec, shape, mshape, k)
        out = np.full(full[blk].shape, -1)
        for bounds, data in got[d].items():
            out[local(bounds, blk)] = data
        np.testing.assert_array_equal(out, full[blk], err_msg=f"receiver {d} ({plan.method})")
    return got


def volume(bounds) -> int:
    return math.prod(hi - lo for lo, hi in bounds)


def slices_volume(slices) -> int:
    return math.prod(s.stop - s.start for s in slices)


def overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> int:
    return math.prod(max(0, min(x.stop, y.stop) - max(x.start, y.start)) for x, y in zip(a, b))


# ---------------------------------------------------------------- random cases
@st.composite
def cases(draw, overlap_devices: bool = True):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(rank))
    sides = []
    for offset in (0, None):
        ms = draw(st.sampled_from(MESH_SHAPES))
        spec = draw(st.sampled_from(all_specs(shape, LogicalMesh.of(ms, LINK))))
        n = math.prod(ms)
        if offset is None:  # receivers: on the next node, or sharing some of the senders' ids
            n_src = math.prod(sides[0][1])
            offset = draw(st.sampled_from([NODE_SIZE, 0, n_src // 2, n_src])) if overlap_devices else NODE_SIZE
        devices = draw(st.permutations(range(offset, offset + n)))
        sides.append((list(devices), ms, spec))
    return shape, sides[0], sides[1]


NODE_OF = {"none": None, "own node": lambda d: d, "pairs": lambda d: d // 2, "nodes of 8": on_nodes_of_8}


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from(sorted(NODE_OF)))
def test_every_method_delivers_the_destination_blocks(case, node_of_name):
    shape, src, dst = case
    node_of = NODE_OF[node_of_name]
    plans = {m: cross_mesh_plan(shape, ITEMSIZE, *src, *dst, method=m, node_of=node_of) for m in CROSS_MESH_METHODS}
    for plan in plans.values():
        got = simulate(plan, shape, src, dst)
        assert {d: sorted(t.bounds for t in ts) for d, ts in plan.received().items()} == \
               {d: sorted(tiles) for d, tiles in got.items()}

    # send_recv: every receiver gets each element of its block exactly once, and only those;
    # copies off a device that is a sender too cover what its sender block shares with it.
    sr = plans["send_recv"]
    dst_blocks = {d: block_slices(dst[2], shape, dst[1], k) for k, d in enumerate(dst[0])}
    src_blocks = {d: block_slices(src[2], shape, src[1], k) for k, d in enumerate(src[0])}
    for d, tiles in sr.received().items():
        assert sum(volume(t.bounds) for t in tiles) == slices_volume(dst_blocks[d])
    assert sr.transfer_bytes() == ITEMSIZE * sum(slices_volume(b) for b in dst_blocks.values())
    moved = sum(t.nbytes for t in sr.transfers if t.src != t.dst)
    assert moved == ITEMSIZE * sum(slices_volume(b) - (overlap(b, src_blocks[d]) if d in src_blocks else 0)
                                   for d, b in dst_blocks.items())
    assert [(t.src, t.dst, t.tile) for t in plans["signal"].transfers] == [(t.src, t.dst, t.tile) for t in sr.transfers]
    assert all(t.nbytes == 1.0 for t in plans["signal"].transfers)


@settings(max_examples=200, deadline=None)
@given(cases(overlap_devices=False))
def test_local_all_gather_crosses_nodes_once(case):
    """Senders on node 0, receivers on node 1: the rewrite moves the tensor across once."""
    shape, src, dst = case
    tensor_bytes = ITEMSIZE * math.prod(shape)
    sr = cross_mesh_plan(shape, ITEMSIZE, *src, *dst, method="send_recv", node_of=on_nodes_of_8)
    ag = cross_mesh_plan(shape, ITEMSIZE, *src, *dst, method="local_all_gather", node_of=on_nodes_of_8)
    n_dst = math.prod(dst[1])
    shards = dst[2].num_shards(LogicalMesh.of(dst[1], LINK))
    assert sr.bytes_between_nodes(on_nodes_of_8) == tensor_bytes * n_dst / shards
    assert ag.bytes_between_nodes(on_nodes_of_8) == tensor_bytes
    assert ag.bytes_between_nodes(on_nodes_of_8) <= sr.bytes_between_nodes(on_nodes_of_8)
    if shards < n_dst:  # the receiver spec replicates over an axis of size > 1
        assert ag.bytes_between_nodes(on_nodes_of_8) < sr.bytes_between_nodes(on_nodes_of_8)
        assert ag.gathers
    # Greedy least-fetched-first: members' shares differ by at most one piece.
    for g in ag.gathers:
        fetched = [sum(t.nbytes(ITEMSIZE) for d, t in g.tiles if d == m) for m in g.devices]
        assert max(fetched) - min(fetched) <= max(t.nbytes(ITEMSIZE) for _, t in g.tiles)


# ---------------------------------------------------------------- closed forms
def test_sharded_to_replicated_moves_the_tensor_once_instead_of_four_times():
    # (8, 4) float32 = 128 bytes, S1R on 1x4 (each sender two rows) -> RR on 1x4.
    args = ((8, 4), 4, [0, 1, 2, 3], (1, 4), "S1R", [8, 9, 10, 11], (1, 4), "RR")
    sr = cross_mesh_plan(*args, method="send_recv")
    ag = cross_mesh_plan(*args, method="local_all_gather")
    assert sr.transfer_bytes() == sr.bytes_between_nodes(on_nodes_of_8) == 4 * 128
    assert len(sr.transfers) == 16
    assert ag.transfer_bytes() == ag.bytes_between_nodes(on_nodes_of_8) == 128
    assert [(t.src, t.dst, t.tile.bounds) for t in ag.transfers] == [
        (k, 8 + k, ((2 * k, 2 * k + 2), (0, 4))) for k in range(4)]
    assert ag.gathers == (LocalGather((8, 9, 10, 11), 128.0,
                                      tuple((8 + k, Tile(((2 * k, 2 * k + 2), (0, 4)))) for k in range(4))),)


def test_column_to_row_sharding_on_2x2_fetches_each_half_once_per_row():
    # (4, 4) float32 = 64 bytes. Senders RS1: devices 0, 2 hold columns [0, 2), 1, 3
    # columns [2, 4). Receivers S0R: 8, 9 need rows [0, 2); 10, 11 rows [2, 4).
    args = ((4, 4), 4, [0, 1, 2, 3], (2, 2), "RS1", [8, 9, 10, 11], (2, 2), "S0R")
    assert cross_mesh_plan(*args, method="send_recv").transfer_bytes() == 4 * 32
    ag = cross_mesh_plan(*args)
    left, right = (0, 2), (2, 4)
    # Sender load balance: 0 sends the first left quarter, 2 (replica of 0) the second.
    assert [(t.src, t.dst, t.tile.bounds, t.nbytes) for t in ag.transfers] == [
        (0, 8, (left, left), 16.0), (1, 9, (left, right), 16.0),
        (2, 10, (right, left), 16.0), (3, 11, (right, right), 16.0)]
    assert [(g.devices, g.nbytes) for g in ag.gathers] == [((8, 9), 32.0), ((10, 11), 32.0)]


def test_replicated_senders_split_the_tile_so_each_receiver_fetches_a_quarter():
    args = ((8, 4), 2, [0, 1, 2, 3], (1, 4), "RR", [8, 9, 10, 11], (1, 4), "RR")
    ag = cross_mesh_plan(*args)
    assert [(t.src, t.dst, t.nbytes) for t in ag.transfers] == [(k, 8 + k, 16.0) for k in range(4)]
    assert ag.transfer_bytes() == 64
    assert cross_mesh_plan(*args, method="send_recv").transfer_bytes() == 4 * 64


def test_fully_sharded_both_sides_needs_no_gather():
    args = ((16, 8), 2, list(range(8)), (2, 4), "S01R", list(range(8, 16)), (4, 2), "RS01")
    sr, ag = cross_mesh_plan(*args, method="send_recv"), cross_mesh_plan(*args)
    assert ag.gathers == () and ag.transfers == sr.transfers
    assert ag.transfer_bytes() == 16 * 8 * 2


def test_same_devices_same_spec_is_all_local():
    args = ((8, 8), 4, [4, 5, 6, 7], (2, 2), "S0S1", [4, 5, 6, 7], (2, 2), "S0S1")
    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    for method in CROSS_MESH_METHODS:
        plan = cross_mesh_plan(*args, method=method)
        assert all(t.src == t.dst for t in plan.transfers) and not plan.gathers
        assert plan.bytes_between_nodes(lambda d: d) == 0 and plan.time_s(cluster) == 0.0


def test_receiver_that_holds_its_tile_copies_locally_and_skips_the_gather():
    # Receivers 0..3 want RR; device 0 is also the only sender (RR on 1x1).
    plan = cross_mesh_plan((4,), 4, [0], (1, 1), "R", [0, 1, 2, 3], (1, 4), "R")
    assert [(t.src, t.dst) for t in plan.transfers] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [t.tile.bounds for t in plan.transfers[1:]] == [((0, 1),), ((1, 2),), ((2, 4),)]  # 4 into 3: cuts at 4p//3
    assert [g.devices for g in plan.gathers] == [(1, 2, 3)]


def test_the_sender_on_the_receivers_node_is_preferred():
    # Senders 0 (node 0) and 8 (node 1) both hold the whole tensor; receiver 9 is on node 1.
    plan = cross_mesh_plan((4,), 4, [0, 8], (1, 2), "R", [9], (1, 1), "R", node_of=on_nodes_of_8)
    assert [(t.src, t.dst) for t in plan.transfers] == [(8, 9)]


# ---------------------------------------------------------------- time
def test_local_all_gather_is_faster_across_25_gbps():
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    nbytes = 1024 * 1024 * 2  # fp16 (1024, 1024)
    args = ((1024, 1024), 2, [0, 1, 2, 3], (1, 4), "S1R", [8, 9, 10, 11], (1, 4), "RR")
    sr, ag = cross_mesh_plan(*args, method="send_recv"), cross_mesh_plan(*args)
    net, alpha = 25e9 / 8, cluster.inter_node.latency_s  # one 25 GbE card per node
    # send_recv: all 16 copies of a quarter each go through the one card of each node.
    assert sr.time_s(cluster) == pytest.approx(16 * alpha + 4 * nbytes / net)
    # local_all_gather: 4 quarters through the cards, then a ring all-gather on NVLink.
    gather_s = all_gather_time_s(nbytes, 4, cluster.intra_node)
    assert ag.time_s(cluster) == pytest.approx(4 * alpha + nbytes / net + gather_s)
    assert ag.time_s(cluster) < sr.time_s(cluster) / 3
    signal = cross_mesh_plan(*args, method="signal")
    assert signal.time_s(cluster) == pytest.approx(16 * alpha + 16 / net)


def test_within_one_node_copies_use_each_devices_nvlink():
    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    plan = cross_mesh_plan((8,), 4, [0, 1], (1, 2), "S1", [2, 3], (1, 2), "S1", method="send_recv")
    link = cluster.intra_node
    assert plan.time_s(cluster) == pytest.approx(link.latency_s + 16 / link.bytes_per_s)


def test_plan_json_is_plain_data():
    plan = cross_mesh_plan((4, 4), 4, [0, 1], (1, 2), "RS1", [2, 3], (2, 1), "RR")
    data = json.loads(json.dumps(plan.to_json()))
    assert data["method"] == "local_all_gather" and data["transfer_bytes"] == 64
    assert data["transfers"][0] == {"src": 0, "dst": 2, "tile": [[0, 4], [0, 2]], "bytes": 32.0}
    assert data["gathers"][0]["devices"] == [2, 3]


# ---------------------------------------------------------------- bad inputs
GOOD = {"shape": (8, 4), "itemsize": 4, "src_devices": [0, 1], "src_mesh_shape": (1, 2), "src_spec": "RS1",
        "dst_devices": [2, 3], "dst_mesh_shape": (2, 1), "dst_spec": "S0R"}


@pytest.mark.parametrize("change, error, words", [
    ({"method": "broadcast"}, ValueError, "'broadcast'.*send_recv.*local_all_gather.*signal"),
    ({"src_spec": "S1"}, ShardingError, "1 dims.*\\(8, 4\\) has 2"),
    ({"dst_spec": ShardingSpec.parse("RRS0")}, ShardingError, "3 dims"),
    ({"shape": (8, 3)}, ShardingError, "dimension 1 of size 3"),
    ({"dst_devices": [2, 3, 4]}, ValueError, "receiver mesh 2x1 needs 2 distinct device ids"),
    ({"src_devices": [1, 1]}, ValueError, "sender mesh 1x2 needs 2 distinct"),
    ({"itemsize": 0}, ValueError, "itemsize"),
    ({"shape": (0, 4)}, ValueError, "empty dim"),
])
def test_bad_inputs_are_named(change, error, words):
    with pytest.raises(error, match=words):
        cross_mesh_plan(**{**GOOD, **change})


def test_value_types_validate():
    with pytest.raises(ValueError, match="start < stop"):
        Tile(((2, 2),))
    with pytest.raises(ValueError, match="finite"):
        Transfer(0, 1, Tile(((0, 1),)), -1.0)
    with pytest.raises(ValueError, match="2 distinct"):
        LocalGather((3,), 4.0, ())
    with pytest.raises(ValueError, match="unknown cross-mesh method"):
        CrossMeshPlan("multicast", (4,), 4, (), ())
    with pytest.raises(ValueError, match="outside tensor shape"):
        CrossMeshPlan("send_recv", (4,), 4, (Transfer(0, 1, Tile(((2, 6),)), 16.0),), ())

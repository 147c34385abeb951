"""ShardingSpec, check_spec, all_specs and LogicalMesh against hand-derived answers (seed 3.4.1-3.4.2)."""

import itertools

import pytest

from alpasim.costmodels import Link, get_cluster
from alpasim.solvers import (LogicalMesh, ShardingError, ShardingSpec, all_specs, check_spec, parse_mesh_shape,
                             spec_fits)

LINK = Link("test", 100.0, 1e-6)


def mesh(n0: int, n1: int) -> LogicalMesh:
    return LogicalMesh.of((n0, n1), LINK)


# ---------------------------------------------------------------- parse / print
@pytest.mark.parametrize("text, dims", [
    ("S0R", ((0,), ())),
    ("RS1", ((), (1,))),
    ("S01R", ((0, 1), ())),
    ("S0S1", ((0,), (1,))),
    ("S1S0", ((1,), (0,))),
    ("RR", ((), ())),
    ("RS01", ((), (0, 1))),
    ("RS0R", ((), (0,), ())),
    ("S10", ((1, 0),)),
])
def test_parse_and_print_round_trip(text, dims):
    spec = ShardingSpec.parse(text)
    assert spec.dims == dims
    assert spec.rank == len(dims)
    assert str(spec) == text
    assert ShardingSpec.parse(str(spec)) == spec
    assert spec == ShardingSpec(dims) and hash(spec) == hash(ShardingSpec(dims))


def test_scalar_spec_round_trips():
    spec = ShardingSpec.parse("")
    assert spec.dims == () and spec.rank == 0
    assert spec == ShardingSpec.replicated(0)
    assert ShardingSpec.parse(str(spec)) == spec


def test_replicated_and_axes_used():
    assert ShardingSpec.replicated(3) == ShardingSpec.parse("RRR")
    assert ShardingSpec.parse("S1S0").axes_used() == (0, 1)
    assert ShardingSpec.parse("RS01").dim_of_axis(1) == (1, 1)
    assert ShardingSpec.parse("RS01").dim_of_axis(0) == (1, 0)
    assert ShardingSpec.parse("S1R").dim_of_axis(0) is None


def test_dims_are_normalised_to_int_tuples():
    spec = ShardingSpec([[0], []])
    assert spec.dims == ((0,), ())
    assert spec == ShardingSpec.parse("S0R")


@pytest.mark.parametrize("text", ["S0S0", "S00", "S01S1", "S2", "S", "SX", "S0X", "X", "r", "S0r"])
def test_parse_rejects_invalid_text(text):
    with pytest.raises(ShardingError):
        ShardingSpec.parse(text)


@pytest.mark.parametrize("dims", [((0,), (0,)), ((0, 0),), ((2,),), ((0,), (1, 0)), ((-1,),)])
def test_constructor_rejects_invalid_dims(dims):
    with pytest.raises(ShardingError):
        ShardingSpec(dims)


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)


def test_spec_is_frozen():
    spec = ShardingSpec.parse("S0R")
    with pytest.raises(AttributeError):
        spec.dims = ((), ())  # type: ignore[misc]


# ---------------------------------------------------------------- check_spec / shard_shape
def test_check_spec_names_the_dimension_that_does_not_divide():
    m = mesh(2, 4)
    check_spec(ShardingSpec.parse("S0S1"), (6, 8), m)  # 6 % 2 == 0, 8 % 4 == 0
    with pytest.raises(ShardingError, match=r"dimension 1 of size 6"):
        check_spec(ShardingSpec.parse("S0S1"), (8, 6), m)
    with pytest.raises(ShardingError, match=r"dimension 0 of size 4"):
        check_spec(ShardingSpec.parse("S01R"), (4, 3), m)  # 4 into 8 shards
    with pytest.raises(ShardingError, match=r"dimension 2 of size 3"):
        check_spec(ShardingSpec.parse("RRS0"), (1, 1, 3), m)


def test_check_spec_rejects_rank_mismatch():
    with pytest.raises(ShardingError):
        check_spec(ShardingSpec.parse("S0R"), (4,), mesh(2, 2))
    assert not spec_fits(ShardingSpec.parse("S0R"), (4,), mesh(2, 2))


def test_spec_fits_matches_check_spec():
    m = mesh(2, 4)
    for shape in [(4, 8), (2, 6), (8, 4, 2), (3, 5), (1, 1)]:
        for dims in itertools.product([(), (0,), (1,), (0, 1), (1, 0)], repeat=len(shape)):
            try:
                spec = ShardingSpec(dims)
            except ShardingError:
                continue
            fits = all(n % (m.axis_size(d)) == 0 for n, d in zip(shape, dims))
            assert spec_fits(spec, shape, m) == fits
            if fits:
                check_spec(spec, shape, m)
            else:
                with pytest.raises(ShardingError):
                    check_spec(spec, shape, m)


@pytest.mark.parametrize("text, shape, expected", [
    ("RR", (4, 8), (4, 8)),
    ("S0R", (4, 8), (2, 8)),
    ("RS1", (4, 8), (4, 2)),
    ("S0S1", (4, 8), (2, 2)),
    ("S1S0", (4, 8), (1, 4)),
    ("S01R", (16, 8), (2, 8)),
    ("RS01", (4, 8), (4, 1)),
    ("RS0S1", (3, 4, 8), (3, 2, 2)),
    ("", (), ()),
])
def test_shard_shape_on_2x4(text, shape, expected):
    assert ShardingSpec.parse(text).shard_shape(shape, mesh(2, 4)) == expected


def test_shard_shape_checks_divisibility():
    with pytest.raises(ShardingError, match="dimension 0"):
        ShardingSpec.parse("S1R").shard_shape((6, 8), mesh(2, 4))


@pytest.mark.parametrize("text, expected", [
    ("S01R", (("x", "y"), None)),
    ("RS10", (None, ("y", "x"))),
    ("S0S1", ("x", "y")),
    ("S1R", ("y", None)),
    ("RR", (None, None)),
    ("", ()),
])
def test_partition_spec(text, expected):
    assert ShardingSpec.parse(text).partition_spec() == expected


def test_partition_spec_custom_names():
    assert ShardingSpec.parse("S1S0").partition_spec(("dp", "tp")) == ("tp", "dp")


# ---------------------------------------------------------------- all_specs
def test_all_specs_of_a_matrix_on_2x2_is_table_1():
    # Seed Table 1: per mesh axis pick a dim or none (3 x 3 = 9); when both pick the
    # same dim the enumerator shards it axis 0 major (S01), never S10.
    got = [str(s) for s in all_specs((4, 4), mesh(2, 2))]
    assert len(got) == len(set(got)) == 9
    assert set(got) == {"RR", "S0R", "RS0", "S1R", "RS1", "S0S1", "S1S0", "S01R", "RS01"}


def test_all_specs_count_for_rank_3():
    # (rank + 1) ** 2 choices, all distinct, all fit (every dim divisible by 4).
    specs = all_specs((4, 8, 4), mesh(2, 2))
    assert len(specs) == len(set(specs)) == 16
    assert ShardingSpec.parse("RS01R") in specs and ShardingSpec.parse("RS10R") not in specs


def test_all_specs_never_uses_axes_of_size_one():
    assert {str(s) for s in all_specs((4, 4), mesh(1, 4))} == {"RR", "S1R", "RS1"}
    assert {str(s) for s in all_specs((4, 4), mesh(2, 1))} == {"RR", "S0R", "RS0"}
    assert [str(s) for s in all_specs((4, 4), mesh(1, 1))] == ["RR"]


def test_all_specs_drops_specs_that_do_not_divide():
    # dim 0 of size 2 takes only S0 (2 shards); dim 1 of size 4 takes S1 (4) but not S01 (8).
    got = {str(s) for s in all_specs((2, 4), mesh(2, 4))}
    assert got == {"RR", "S0R", "RS0", "RS1", "S0S1"}


def test_all_specs_of_a_scalar_and_a_vector():
    assert all_specs((), mesh(2, 2)) == [ShardingSpec(())]
    assert {str(s) for s in all_specs((8,), mesh(2, 4))} == {"R", "S0", "S1", "S01"}


def test_all_specs_matches_brute_force():
    for (n0, n1), shape in itertools.product([(2, 2), (2, 4), (4, 2), (1, 4), (3, 1)], [(4, 8), (6, 4, 2), (12,)]):
        m = mesh(n0, n1)
        live = [a for a in (0, 1) if m.shape[a] > 1]
        expected = set()
        for choice in itertools.product([None, *range(len(shape))], repeat=len(live)):
            dims = [[] for _ in shape]
            for a, d in zip(live, choice):
                if d is not None:
                    dims[d].append(a)
            if all(n % m.axis_size(d) == 0 for n, d in zip(shape, dims)):
                expected.add(ShardingSpec(tuple(map(tuple, dims))))
        got = all_specs(shape, m)
        assert len(got) == len(set(got)) and set(got) == expected


# ---------------------------------------------------------------- LogicalMesh
def test_mesh_of_one_link_or_two(slow_link, fast_link):
    m = LogicalMesh.of((2, 4), [slow_link, fast_link])
    assert m.shape == (2, 4) and m.num_devices == 8 and str(m) == "2x4"
    assert m.axes[0].link == slow_link and m.axes[1].link == fast_link
    assert m.axis_size((0,)) == 2 and m.axis_size((1,)) == 4 and m.axis_size((0, 1)) == 8 and m.axis_size(()) == 1
    same = LogicalMesh.of((2, 4), fast_link)
    assert same.axes[0].link == same.axes[1].link == fast_link
    assert hash(same) == hash(LogicalMesh.of([2, 4], fast_link))


@pytest.mark.parametrize("shape", [(2,), (2, 2, 2)])
def test_mesh_must_be_2d(shape, fast_link):
    with pytest.raises(ValueError):
        LogicalMesh.of(shape, fast_link)


def test_mesh_rejects_zero_size(fast_link):
    with pytest.raises(ValueError):
        LogicalMesh.of((0, 4), fast_link)


def test_on_cluster_2x8_spans_nodes_on_axis_0():
    p3 = get_cluster("aws-p3.16xlarge")
    m = LogicalMesh.on_cluster(p3, (2, 8))
    assert m.shape == (2, 8)
    assert m.axes[0].link == p3.inter_node_per_device
    assert m.axes[1].link == p3.intra_node
    # one 25 Gbit/s card shared by 8 GPUs
    assert m.axes[0].link.bandwidth_gbps == pytest.approx(25.0 / 8)


def test_on_cluster_1x8_stays_in_a_node():
    p3 = get_cluster("aws-p3.16xlarge")
    m = LogicalMesh.on_cluster(p3, (1, 8))
    assert m.axes[0].link == p3.intra_node and m.axes[1].link == p3.intra_node


def test_on_cluster_4x4_on_two_nodes():
    p3 = get_cluster("aws-p3.16xlarge", nodes=2)
    m = LogicalMesh.on_cluster(p3, (4, 4))
    # devices 0..15 row-major: columns {j, 4+j, 8+j, 12+j} cross nodes (two devices in
    # each: two devices' share of the card), rows stay inside one.
    assert m.axes[0].link.bandwidth_gbps == pytest.approx(2 * p3.inter_node_per_device.bandwidth_gbps)
    assert m.axes[1].link == p3.intra_node
    m = LogicalMesh.on_cluster(p3, (8, 2))
    assert m.axes[0].link.bandwidth_gbps == pytest.approx(4 * p3.inter_node_per_device.bandwidth_gbps)
    assert m.axes[1].link == p3.intra_node


def test_on_cluster_axis_crosses_nodes_if_any_group_does():
    # 4x3 on 8-GPU nodes: rows {0,1,2} {3,4,5} stay inside node 0 but {6,7,8} crosses,
    # and all groups of an axis run at once, so axis 1 is as slow as the network.
    p3 = get_cluster("aws-p3.16xlarge", nodes=2)
    m = LogicalMesh.on_cluster(p3, (4, 3))
    share = p3.inter_node_per_device.bandwidth_gbps
    assert m.axes[0].link.bandwidth_gbps == m.axes[1].link.bandwidth_gbps == pytest.approx(share)
    # {6, 7, 8}: of its ring's 3 steps, 2 cross the network (one into each node).
    inter, intra = p3.inter_node.latency_s, p3.intra_node.latency_s
    assert m.axes[1].link.latency_s == pytest.approx((2 * inter + intra) / 3)
    m = LogicalMesh.on_cluster(p3, (2, 4))
    assert m.axes[0].link == p3.intra_node and m.axes[1].link == p3.intra_node


def test_on_cluster_rejects_too_many_devices_and_wrong_rank():
    p3 = get_cluster("aws-p3.16xlarge", nodes=2)
    with pytest.raises(ValueError):
        LogicalMesh.on_cluster(p3, (4, 8))
    with pytest.raises(ValueError):
        LogicalMesh.on_cluster(p3, (2, 2, 2))


@pytest.mark.parametrize("text, shape", [("2x4", (2, 4)), ("8", (1, 8)), ("4X2", (4, 2)), ("1x1", (1, 1)),
                                         ("2*8", (2, 8))])
def test_parse_mesh_shape(text, shape):
    assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize("text", ["", "x", "2x", "axb", "2x4x2", "0x4", "2x0", "-2x4", "2.5x2", "2,4"])
def test_parse_mesh_shape_rejects(text):
    with pytest.raises(ValueError):
        parse_mesh_shape(text)

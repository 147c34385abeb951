"""GEMMs priced by their shard's shape from a device's measured grid (H100: XLA's
table), as XLA's GPU cost model prices them: clamped into the grid, interpolated
between its points."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alpasim.costmodels import (AnalyticCostModel, compute_time_s, get_cluster, op_time_s,
                                traffic_bytes)
from alpasim.costmodels._compute import gemm_shape
from alpasim.costmodels._gemm import GRID, H100_BF16_GRID, SHAPE_TABLES, SWEEPS, GemmTable, gemm_table
from alpasim.graphs import GraphBuilder, OpGraph, op_flops
from alpasim.solvers._mesh import LogicalMesh
from alpasim.solvers._strategies import enumerate_strategies

H100 = get_cluster("dgx-h100", nodes=1, devices_per_node=8)
TABLE = SHAPE_TABLES["H100-SXM-80GB"]


def _rate(m: int, n: int, k: int) -> float:
    """The published grid's TFLOP/s at grid point (m, n, k), read from its rows."""
    i, j, l = GRID.index(m), GRID.index(n), GRID.index(k)
    return H100_BF16_GRID[i * len(GRID) + j][l] * 1e12


def test_the_table_returns_every_measured_point():
    for m, n, k in itertools.product(GRID, repeat=3):
        assert TABLE.flops_per_s(m, n, k) == pytest.approx(_rate(m, n, k), rel=1e-12)


def test_the_curve_of_the_h100_is_fitted_to_points_of_the_same_grid():
    for (m, n, k), tflops in SWEEPS["H100-SXM-80GB"][2]:
        assert tflops * 1e12 == pytest.approx(_rate(m, n, k))


@given(*(st.floats(8.0, 12.0) for _ in range(3)))
def test_between_points_the_rate_lies_between_its_corners(lm, ln, lk):
    m, n, k = 2 ** lm, 2 ** ln, 2 ** lk
    corners = [_rate(*(2 ** int(f(x)) for f, x in zip(fs, (lm, ln, lk))))
               for fs in itertools.product((math.floor, lambda x: min(math.floor(x) + 1, 12)), repeat=3)]
    assert min(corners) * (1 - 1e-9) <= TABLE.flops_per_s(m, n, k) <= max(corners) * (1 + 1e-9)


@given(st.floats(4096, 1e6), st.floats(4096, 1e6), st.floats(1, 256))
def test_beyond_the_grid_the_edges_stand_for_it(m, n, k):
    """XLA clamps each dimension into the grid: a GEMM larger than 4096 in every
    dimension runs at the 4096 cube's rate, one thinner than 256 at 256's."""
    assert TABLE.flops_per_s(m, n, 4096 + k) == pytest.approx(_rate(4096, 4096, 4096))
    assert TABLE.flops_per_s(m, n, k) == pytest.approx(_rate(4096, 4096, 256))


def test_a_table_refuses_a_grid_that_is_not_powers_of_two_or_incomplete():
    with pytest.raises(ValueError, match="consecutive powers of two"):
        GemmTable((256, 768), ((((1.0,) * 2),) * 2,) * 2, "x")
    with pytest.raises(ValueError, match="positive rate"):
        GemmTable((256, 512), ((((1.0,) * 2),) * 2,), "x")


def _gemm(m: int, k: int, n: int, equation: str = "mk,kn->mn") -> OpGraph:
    b = GraphBuilder("mm")
    x = b.input("x", (m, k), "bfloat16")
    w = b.param("w", (k, n), "bfloat16")
    return b.build([b.einsum(equation, x, w)])


def test_a_skinny_gemm_is_slower_than_a_square_one_of_the_same_flops():
    """4096 x 4096 x 256 (XLA: 399 TFLOP/s) against 1625^3 (the same FLOPs, between
    the 1024 and 2048 cubes, about 480): the FLOPs-only curve priced them alike."""
    skinny, square = _gemm(4096, 256, 4096), _gemm(1625, 1625, 1625)
    t_skinny = op_time_s(skinny.ops[0], skinny.tensors, H100.device)
    t_square = op_time_s(square.ops[0], square.tensors, H100.device)
    flops = op_flops(skinny.ops[0], skinny.tensors)
    assert t_skinny == pytest.approx(flops / _rate(4096, 4096, 256))     # the measured time holds the launch
    assert t_skinny > 1.2 * t_square


def test_a_shard_is_priced_at_its_own_shape():
    """Tensor parallelism's column split (n / 8) and row split (k / 8) do the same FLOPs
    per shard but are different GEMMs; each is priced at its own shape, and without
    the split (only a shard count) by FLOPs on the curve."""
    g = _gemm(4096, 4096, 4096)
    op = g.ops[0]
    flops = op_flops(op, g.tensors) / 8
    column = op_time_s(op, g.tensors, H100.device, 8, split={"n": 8})
    row = op_time_s(op, g.tensors, H100.device, 8, split={"k": 8})
    assert gemm_shape(op, g.tensors, {"n": 8}) == (4096, 512, 4096)
    assert gemm_shape(op, g.tensors, {"k": 8}) == (4096, 4096, 512)
    assert column == pytest.approx(flops / _rate(4096, 512, 4096))
    assert row == pytest.approx(flops / _rate(4096, 4096, 512))
    assert column != pytest.approx(row, rel=1e-3)
    nbytes = traffic_bytes(op, g.tensors) / 8
    assert op_time_s(op, g.tensors, H100.device, 8) == pytest.approx(
        compute_time_s(flops, nbytes, "bfloat16", H100.device, True))
    with pytest.raises(ValueError, match="is not 8 shards"):
        op_time_s(op, g.tensors, H100.device, 8, split={"n": 4})


def test_a_batched_gemm_counts_its_batch_into_m():
    b = GraphBuilder("bmm")
    x = b.input("x", (16, 512, 128), "bfloat16")
    y = b.input("y", (16, 128, 512), "bfloat16")
    g = b.build([b.einsum("bik,bkj->bij", x, y)])
    assert gemm_shape(g.ops[0], g.tensors) == (16 * 512, 512, 128)
    assert gemm_shape(g.ops[0], g.tensors, {"b": 4}) == (4 * 512, 512, 128)


def test_an_einsum_that_is_not_one_gemm_has_no_shape():
    """A letter summed out of one operand alone (a row sum folded into the product) is
    not an m x n x k GEMM: 2 m n k would not be its FLOPs, so it keeps the curve."""
    for equation, shapes in (("ab,bc->c", ((64, 32), (32, 16))), ("ab,cd->ad", ((8, 4), (2, 6)))):
        b = GraphBuilder("odd")
        x = b.input("x", shapes[0], "bfloat16")
        y = b.input("y", shapes[1], "bfloat16")
        g = b.build([b.einsum(equation, x, y)])
        assert gemm_shape(g.ops[0], g.tensors) is None


def test_a_gemm_priced_from_the_grid_with_or_without_its_split_agrees_unsplit():
    """One shard, with or without a split given, and the time at a grid point is the
    measured time (which holds the launch): no second launch on top."""
    g = _gemm(512, 512, 512)
    op = g.ops[0]
    flops = op_flops(op, g.tensors)
    assert op_time_s(op, g.tensors, H100.device) == op_time_s(op, g.tensors, H100.device, 1, split={})
    assert op_time_s(op, g.tensors, H100.device) == pytest.approx(flops / _rate(512, 512, 512))


def test_the_ilp_prices_each_strategy_at_its_shards_shape():
    """The intra-op ILP's strategies of one GEMM on a tp 8 mesh: the column-parallel and
    the row-parallel one cost what their shards' shapes cost in the grid."""
    g = _gemm(4096, 8192, 8192)
    op = g.ops[0]
    mesh = LogicalMesh.on_cluster(H100, (1, 8))
    by_loops = {s.loops: s for s in enumerate_strategies(op, g.tensors, mesh, AnalyticCostModel(H100))}
    flops = op_flops(op, g.tensors) / 8
    for letter, shape in (("n", (4096, 1024, 8192)), ("k", (4096, 8192, 1024))):
        s = by_loops[((letter, (1,)),)]
        assert s.compute_s == pytest.approx(flops / TABLE.flops_per_s(*shape))


def test_devices_without_a_grid_keep_their_curve():
    assert gemm_table("A100-SXM-80GB", "float16") is None
    assert gemm_table("H100-SXM-80GB", "float32") is None
    assert gemm_table("H100-SXM-80GB", "float16") is TABLE       # the same tensor cores as bf16

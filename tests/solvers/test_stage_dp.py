"""The stage-mesh DP (eqs. 2-4) against brute force, and the submesh coverage theorem."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.solvers._stage_dp import StageBoundary, pipeline_latency_s, stage_dp
from alpasim.solvers._submesh import SubmeshShape, covers_exactly, pack_runs, place_submeshes, submesh_shapes


def brute_force(cost, sizes, num_devices, microbatches, boundary=None, per_node=None):
    """Every slicing into contiguous stages x every shape per stage, exact device cover.
    With `boundary` (a StageBoundary), also every placement: each one-node piece (fewer
    than `per_node` devices) on any of the nodes the several-node pieces leave, each of
    those nodes filled exactly; the transfer into a stage whose predecessor sits on the
    same node costs `boundary.intra[first layer]`, else `boundary.inter[...]`, and counts
    as a stage of its own (sum and bottleneck)."""
    num_layers = cost.shape[0]
    per_node = min(per_node or num_devices, num_devices)
    best = np.inf
    for n_stages in range(1, num_layers + 1):
        for cuts in itertools.combinations(range(1, num_layers), n_stages - 1):
            bounds = list(zip((0,) + cuts, cuts + (num_layers,)))
            for shapes in itertools.product(range(len(sizes)), repeat=n_stages):
                if sum(sizes[h] for h in shapes) != num_devices:
                    continue
                ts = [cost[a, b - 1, h, n_stages - j - 1] for j, ((a, b), h) in enumerate(zip(bounds, shapes))]
                if not all(np.isfinite(ts)):
                    continue
                if boundary is None:
                    best = min(best, pipeline_latency_s(ts, microbatches))
                    continue
                small = [j for j, h in enumerate(shapes) if sizes[h] < per_node]
                free = (num_devices - sum(sizes[h] for h in shapes if sizes[h] >= per_node)) // per_node
                for nodes in itertools.product(range(free), repeat=len(small)):
                    fill = [0] * free
                    for j, n in zip(small, nodes):
                        fill[n] += sizes[shapes[j]]
                    if any(f != per_node for f in fill):
                        continue
                    node_of = dict(zip(small, nodes))
                    cs = [0.0] + [boundary.intra[a] if j - 1 in node_of and node_of.get(j) == node_of[j - 1]
                                  else boundary.inter[a] for j, (a, _) in enumerate(bounds) if j > 0]
                    best = min(best, sum(ts) + sum(cs) + (microbatches - 1) * max(ts + cs))
    return best


def random_boundary(data, num_layers):
    """Intra-node transfers up to 1.0, inter-node ones at least as slow (as links are)."""
    intra = np.array([0.0] + [data.draw(st.integers(0, 10)) / 10 for _ in range(1, num_layers)])
    inter = intra + np.array([0.0] + [data.draw(st.integers(0, 30)) / 10 for _ in range(1, num_layers)])
    return StageBoundary(intra, inter)


def boundaries_of_placement(result, sizes, num_devices, per_node, boundary):
    """The transfer into each stage under the placement `place_submeshes` gives its runs."""
    shapes = [SubmeshShape(1, sizes[s.shape]) if sizes[s.shape] <= per_node
              else SubmeshShape(sizes[s.shape] // per_node, per_node) for s in result.stages]
    placed = place_submeshes(shapes, num_devices // per_node, per_node, runs=result.runs)
    assert sorted(d for p in placed for d in p) == list(range(num_devices))
    node = [{d // per_node for d in p} for p in placed]
    return [0.0] + [boundary.intra[s.first] if len(node[j]) == 1 and node[j] == node[j - 1]
                    and sizes[result.stages[j].shape] < per_node and sizes[result.stages[j - 1].shape] < per_node
                    else boundary.inter[s.first] for j, s in enumerate(result.stages) if j > 0]


@st.composite
def tables(draw, size_sets=([1, 2], [1, 2, 4], [1, 2, 4, 8], [2, 4], [4, 8], [2]), device_counts=(1, 2, 4, 8)):
    num_layers = draw(st.integers(1, 4))
    sizes = draw(st.sampled_from(size_sets))
    num_devices = draw(st.sampled_from([d for d in device_counts if d >= min(sizes)]))
    s_max = num_layers
    cost = np.full((num_layers, num_layers, len(sizes), s_max), np.inf)
    for k in range(num_layers):
        for i in range(k, num_layers):
            for h in range(len(sizes)):
                for s in range(s_max):
                    if draw(st.integers(0, 5)) == 0:
                        continue  # infeasible entry
                    cost[k, i, h, s] = draw(st.integers(1, 20)) / 10
    return cost, sizes, num_devices, draw(st.integers(1, 8))


@pytest.mark.slow
@given(tables())
@settings(max_examples=300, deadline=None)
def test_dp_equals_brute_force(table):
    cost, sizes, num_devices, microbatches = table
    result = stage_dp(cost, sizes, num_devices, microbatches, epsilon=0.0)
    expected = brute_force(cost, sizes, num_devices, microbatches)
    if np.isinf(expected):
        assert np.isinf(result.latency_s) and result.stages == ()
        return
    assert result.latency_s == pytest.approx(expected, rel=1e-12)
    # The returned slicing is contiguous, covers every layer and every device.
    assert result.stages[0].first == 0 and result.stages[-1].last == cost.shape[0] - 1
    for a, b in zip(result.stages, result.stages[1:]):
        assert b.first == a.last + 1
    assert sum(sizes[s.shape] for s in result.stages) == num_devices
    assert result.latency_s == pytest.approx(pipeline_latency_s([s.cost_s for s in result.stages], microbatches))


@pytest.mark.slow
@given(tables(), st.data())
@settings(max_examples=300, deadline=None)
def test_dp_with_boundary_transfers_equals_brute_force(table, data):
    """Which neighbours share a node is the DP's choice (runs); brute force tries every
    placement of the one-node pieces on the nodes. Where the DP says its placement is
    exact it equals brute force; it is never below it; and the placement it returns
    tiles the cluster and costs what the DP priced (or less, never more)."""
    cost, sizes, num_devices, microbatches = table
    per_node = min(data.draw(st.sampled_from([None, 1, 2, 4])) or num_devices, num_devices)
    check_against_brute_force(cost, sizes, num_devices, microbatches, random_boundary(data, cost.shape[0]), per_node)


def check_against_brute_force(cost, sizes, num_devices, microbatches, boundary, per_node):
    """The DP with boundaries on nodes of `per_node` devices against `brute_force`."""
    result = stage_dp(cost, sizes, num_devices, microbatches, epsilon=0.0, boundary=boundary,
                      devices_per_node=per_node)
    expected = brute_force(cost, sizes, num_devices, microbatches, boundary, per_node)
    if np.isinf(expected):
        assert np.isinf(result.latency_s)
        return
    assert result.latency_s >= expected * (1 - 1e-12)
    if result.placement_exact:
        assert result.latency_s == pytest.approx(expected, rel=1e-12)
    placed = boundaries_of_placement(result, sizes, num_devices, per_node, boundary)
    for j, s in enumerate(result.stages):  # each stage carries its own boundary term
        assert s.boundary_s in (boundary.intra[s.first], boundary.inter[s.first]) if j else s.boundary_s == 0
        assert placed[j] <= s.boundary_s
        assert s.cost_s == cost[s.first, s.last, s.shape, len(result.stages) - j - 1]
    assert result.latency_s == pytest.approx(pipeline_latency_s(
        [s.cost_s for s in result.stages], microbatches, [s.boundary_s for s in result.stages]))


def test_pieces_that_cannot_sit_in_order_are_placed_by_reordering():
    """[2, 4, 2] devices on 2 nodes of 4: in order the 4 would straddle the nodes, yet
    the two 2s share node 0 and the 4 takes node 1. Three layers; the three-stage plan
    of shapes 2, 4, 2 is the only one with finite cost."""
    cost = np.full((3, 3, 2, 3), np.inf)
    cost[0, 0, 0, 2] = cost[2, 2, 0, 0] = 1.0     # shape 0: 2 devices
    cost[1, 1, 1, 1] = 1.0                         # shape 1: 4 devices
    boundary = StageBoundary(np.array([0.0, 0.1, 0.1]), np.array([0.0, 0.5, 0.5]))
    result = stage_dp(cost, [2, 4], 8, 4, epsilon=0.0, boundary=boundary, devices_per_node=4)
    assert [(s.first, s.last, s.shape) for s in result.stages] == [(0, 0, 0), (1, 1, 1), (2, 2, 0)]
    assert result.placement_exact and result.runs == ((0,), (1,), (2,))
    assert result.latency_s == pytest.approx(3.0 + 1.0 + 3 * 1.0)
    placed = place_submeshes([SubmeshShape(1, 2), SubmeshShape(1, 4), SubmeshShape(1, 2)], 2, 4, runs=result.runs)
    assert sorted(d for p in placed for d in p) == list(range(8))
    nodes = [{d // 4 for d in p} for p in placed]
    assert all(len(n) == 1 for n in nodes) and nodes[0] == nodes[2] != nodes[1]


def test_neighbours_share_a_node_when_that_is_cheaper():
    """Four one-device stages on 2 nodes of 2: the cheap intra-node boundary goes where
    the inter-node one would cost most (layer 2), so stages 1 and 2 share a node and
    stages 0 and 3 share the other."""
    cost = np.full((4, 4, 1, 4), np.inf)
    for k in range(4):
        cost[k, k, 0, 3 - k] = 1.0
    boundary = StageBoundary(np.zeros(4), np.array([0.0, 0.2, 2.0, 0.2]))
    result = stage_dp(cost, [1], 4, 2, epsilon=0.0, boundary=boundary, devices_per_node=2)
    assert result.runs == ((0,), (1, 2), (3,))
    assert result.latency_s == pytest.approx(brute_force(cost, [1], 4, 2, boundary, 2))
    assert [s.boundary_s for s in result.stages] == [0.0, 0.2, 0.0, 0.2]


def test_a_relaxation_that_does_not_pack_is_flagged():
    """Pieces of 2, 1, 2, 1, 2 devices on 2 nodes of 4, cheap intra-node boundaries only
    into layers 1 and 3: the relaxation's runs (2, 1), (2, 1), (2) do not fill two nodes.
    The best real placement joins one of the pairs (brute force). Runs closed at powers
    of two find it here, as the run (1, 2, 1) of layers 1-3 (its join into layer 2 costs
    what a node crossing does), but the DP cannot know that: it says its answer may be
    above the optimum, and its placement tiles the cluster and costs what it priced."""
    pieces = [1, 0, 1, 0, 1]                       # shape index per layer: sizes [1, 2]
    cost = np.full((5, 5, 2, 5), np.inf)
    for k, h in enumerate(pieces):
        cost[k, k, h, 4 - k] = 1.0
    boundary = StageBoundary(np.array([0.0, 0.1, 5.0, 0.1, 5.0]), np.array([0.0, 5.0, 5.0, 5.0, 5.0]))
    result = stage_dp(cost, [1, 2], 8, 2, epsilon=0.0, boundary=boundary, devices_per_node=4)
    expected = brute_force(cost, [1, 2], 8, 2, boundary, 4)
    assert expected == pytest.approx(5 + 15.1 + 5)
    assert not result.placement_exact
    assert result.latency_s == pytest.approx(expected)
    assert result.runs == ((0,), (1, 2, 3), (4,))
    assert boundaries_of_placement(result, [1, 2], 8, 4, boundary) == [0.0, 5.0, 5.0, 0.1, 5.0]


def test_pack_runs_fills_nodes_exactly_or_refuses():
    """On nodes of 4, runs of sizes 3, 3 and 2 cannot fill 2 nodes; `pack_runs` says so
    and finds the packing of 3, 1, 2, 2."""
    assert pack_runs([3, 3, 2], 2, 4) is None
    where = pack_runs([3, 1, 2, 2], 2, 4)
    assert where is not None and where[0] == where[1] and where[2] == where[3] != where[0]
    assert pack_runs([1] * 8, 2, 4) is not None and pack_runs([4, 4], 1, 4) is None


@pytest.mark.slow
@given(tables(), st.sampled_from([1e-3, 0.01, 0.05, 0.2, 1.0]), st.data())
@settings(max_examples=300, deadline=None)
def test_epsilon_windows_stay_within_one_plus_epsilon_of_brute_force(table, epsilon, data):
    """Each bottleneck window evaluates its largest candidate, so the answer is at most
    (1 + epsilon) T* (module doc of `_stage_dp`), with boundary transfers or without.
    Costs are drawn on a fine grid, so windows hold several candidates."""
    cost, sizes, num_devices, microbatches = table
    jitter = np.array(data.draw(st.lists(st.integers(0, 999), min_size=cost.size, max_size=cost.size)))
    cost = cost * (1 + jitter.reshape(cost.shape) / 1e4)
    boundary, per_node = None, None
    if data.draw(st.booleans()):
        per_node = min(data.draw(st.sampled_from([None, 2, 4])) or num_devices, num_devices)
        boundary = random_boundary(data, cost.shape[0])
    expected = brute_force(cost, sizes, num_devices, microbatches, boundary, per_node)
    result = stage_dp(cost, sizes, num_devices, microbatches, epsilon=epsilon, boundary=boundary,
                      devices_per_node=per_node)
    if np.isinf(expected):
        assert np.isinf(result.latency_s)
        return
    assert expected * (1 - 1e-12) <= result.latency_s
    if result.placement_exact:
        assert result.latency_s <= expected * (1 + epsilon) * (1 + 1e-12)


def test_epsilon_window_evaluates_its_largest_candidate():
    """The instance on which skipping to each window's smallest candidate lost 52 %:
    2 layers, 2 devices, submeshes of 1 and 2; each layer alone on one device 1.0005,
    both on two devices 1.9, layer 0 alone on two devices 1.0 (a decoy that leaves no
    device for layer 1). B = 4, epsilon = 1e-3: the optimum, two one-device stages,
    costs 2 * 1.0005 + 3 * 1.0005 = 5.0025; the old skip answered 1.9 + 3 * 1.9 = 7.6."""
    cost = np.full((2, 2, 2, 2), np.inf)
    cost[0, 0, 0, :] = cost[1, 1, 0, :] = 1.0005
    cost[0, 1, 1, :] = 1.9
    cost[0, 0, 1, :] = 1.0
    assert brute_force(cost, [1, 2], 2, 4) == pytest.approx(5.0025)
    result = stage_dp(cost, [1, 2], 2, 4, epsilon=1e-3)
    assert result.latency_s == pytest.approx(5.0025, rel=1e-12)
    assert [(s.first, s.last, s.shape) for s in result.stages] == [(0, 0, 0), (1, 1, 0)]


def test_epsilon_evaluates_fewer_candidates():
    """Six layers whose stage cost grows with its length and shrinks with its submesh
    (1, 2 or 4 devices of 8), +-10 % noise: many bottleneck windows lie between the
    first feasible one and the line the least total draws, and a 5 % window merges them."""
    rng = np.random.default_rng(13)
    k, i = np.indices((6, 6))
    cost = ((i - k + 1.0)[:, :, None, None] / np.array([1, 1.8, 3.2])[None, None, :, None]
            * rng.uniform(0.9, 1.1, size=(6, 6, 3, 6)))
    cost[np.tril_indices(6, -1)] = np.inf
    exact = stage_dp(cost, [1, 2, 4], 8, 8, epsilon=0.0)
    coarse = stage_dp(cost, [1, 2, 4], 8, 8, epsilon=0.05)
    assert exact.latency_s == pytest.approx(brute_force(cost, [1, 2, 4], 8, 8), rel=1e-12)
    assert coarse.candidates_evaluated < exact.candidates_evaluated
    assert exact.latency_s <= coarse.latency_s <= exact.latency_s * 1.05


@pytest.mark.parametrize("nodes", range(1, 17))
@pytest.mark.parametrize("per_node", [1, 2, 4, 8, 6, 12, pytest.param(72, marks=pytest.mark.slow)])
def test_coverage_theorem_all_shape_multisets(nodes, per_node):
    """Every multiset of allowed shapes whose sizes add up to N*M tiles the cluster
    (the first 3,000, where there are more)."""
    shapes = submesh_shapes(nodes, per_node)[::-1]   # largest first
    counts = [0] * len(shapes)
    checked = 0

    # The counts of each shape, largest shapes first, each at its largest count first:
    # the first multisets mix several-node pieces with part-node ones (smallest first
    # was an order of magnitude slower on 72-device nodes, its first 3,000 made of
    # a thousand one-device pieces each, and it mixed in half as many node groups).
    def multisets(i, remaining):
        nonlocal checked
        if remaining == 0:
            acc = [s for s, c in zip(shapes, counts) for _ in range(c)][::-1]    # placed smallest first
            assert covers_exactly(acc, nodes, per_node), acc
            checked += 1
            return checked < 3000
        if i == len(shapes):
            return True
        size = shapes[i].size
        for count in range(remaining // size, -1, -1):
            counts[i] = count
            if not multisets(i + 1, remaining - count * size):
                return False
        return True                      # the last count tried was 0: counts[i] is reset

    multisets(0, nodes * per_node)
    assert checked > 0


@given(st.integers(1, 16), st.sampled_from([1, 2, 4, 8, 6, 12, 72]), st.data())
@settings(max_examples=200, deadline=None)
def test_coverage_random_orders(nodes, per_node, data):
    shapes = submesh_shapes(nodes, per_node)
    remaining, picked = nodes * per_node, []
    while remaining:
        s = data.draw(st.sampled_from([s for s in shapes if s.size <= remaining]))
        picked.append(s)
        remaining -= s.size
    picked = data.draw(st.permutations(picked))
    placed = place_submeshes(picked, nodes, per_node)
    assert sorted(d for p in placed for d in p) == list(range(nodes * per_node))
    for shape, devices in zip(picked, placed):
        assert len(devices) == shape.size
        if shape.n == 1:  # a one-node piece stays inside one node
            assert len({d // per_node for d in devices}) == 1


def test_disallowed_shapes_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="cannot cover"):
        place_submeshes([SubmeshShape(1, 4)], 1, 8)
    with pytest.raises(ValueError, match="not one of the allowed"):
        place_submeshes([SubmeshShape(2, 4), SubmeshShape(1, 8)], 2, 8)


@pytest.mark.slow
@given(tables(size_sets=([1, 2, 6],), device_counts=(6, 12)), st.data())
@settings(max_examples=200, deadline=None)
def test_dp_on_nodes_of_six_places_what_it_plans(table, data):
    """Six devices a node (an NVLink domain no power of two: pieces of 1 and 2 devices,
    the powers of two dividing 6, or a whole node): the DP's runs always pack (its
    fallback closes runs at 1, 2 or a whole node), never below brute force, equal to
    it where it says so, and its placement costs what it priced."""
    cost, sizes, num_devices, microbatches = table
    check_against_brute_force(cost, sizes, num_devices, microbatches, random_boundary(data, cost.shape[0]), 6)

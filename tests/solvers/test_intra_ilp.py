"""Property tests of the intra-op ILP against a brute-force oracle.

The oracle enumerates every combination of node strategies of a built problem and
costs each with `realize`, which walks the graph and never reads the ILP's matrices.
Graphs are tiny (1-4 einsums or light ops, power-of-two shapes) so the enumeration
stays within `MAX_COMBOS`; examples are derandomised so the file's run time is stable.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from alpasim.costmodels import AnalyticCostModel, Link, get_cluster
from alpasim.graphs import GraphBuilder, OpGraph, is_heavy, training_graph
from alpasim.solvers import (IntraOpInfeasible, IntraOpProblem, LogicalMesh, build_problem,
                             enumerate_strategies, formulate, min_memory_bytes, objective_s, realize,
                             solve_ilp, solve_intra_op, weight_update_sharding)
from alpasim.units import format_bytes

MAX_COMBOS = 20_000
REL, ABS_S = 1e-6, 1e-12
MEM_RTOL = 1e-6          # the solver's feasibility tolerance, relative to the budget

COST_MODEL = AnalyticCostModel(get_cluster("aws-p3.16xlarge"))
SLOW = Link("test-slow-1GB/s", 8.0, 5e-5)
FAST = Link("test-fast-100GB/s", 800.0, 1e-5)
MESH_SHAPES = [(1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (1, 1)]  # simplest multi-device first

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------------- generators
@st.composite
def forward_graphs(draw, max_ops: int = 4) -> OpGraph:
    """x -> 1..max_ops of {einsum with a weight, unary, residual add, transpose} -> sum."""
    dim = st.sampled_from([2, 4, 8])
    b = GraphBuilder("g")
    shape = (draw(dim), draw(dim)) if draw(st.booleans()) else (draw(dim), draw(st.sampled_from([2, 4])), draw(dim))
    y = b.input("x", shape)
    seen = [y]
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["einsum", "einsum", "unary", "add", "transpose"]))
        rank = len(b.shape(y))
        if kind == "einsum":
            w = b.param("w", (b.shape(y)[-1], draw(dim)))
            y = b.einsum("ab,bc->ac" if rank == 2 else "abc,cd->abd", y, w)
        elif kind == "add" and any(b.shape(t) == b.shape(y) for t in seen[:-1]):
            other = draw(st.sampled_from([t for t in seen[:-1] if b.shape(t) == b.shape(y)]))
            y = b.ew("add", y, other)
        elif kind == "transpose":
            y = b.one("transpose", [y], perm=(1, 0) if rank == 2 else (0, 2, 1))
        else:
            y = b.ew(draw(st.sampled_from(["relu", "tanh", "gelu"])), y)
        seen.append(y)
    loss = b.one("reduce", [y], kind="sum", axes=tuple(range(len(b.shape(y)))))
    return b.build([loss])


@st.composite
def meshes(draw, shapes=MESH_SHAPES) -> LogicalMesh:
    links = draw(st.sampled_from([(SLOW, FAST), (FAST, SLOW), (FAST, FAST)]))
    return LogicalMesh.of(draw(st.sampled_from(shapes)), list(links))


@st.composite
def problems(draw, shapes=MESH_SHAPES) -> IntraOpProblem:
    """A built problem of a forward graph or (when small enough) its training graph."""
    graph = draw(forward_graphs())
    training = draw(st.booleans())
    if training:
        graph = training_graph(graph)
    problem = build_problem(graph, draw(meshes(shapes)), COST_MODEL, with_compute=draw(st.booleans()))
    assume(num_combos(problem) <= MAX_COMBOS)
    event(f"{'training' if training else 'forward'} graph, {problem.mesh} mesh")
    return problem


# ---------------------------------------------------------------------- oracle
def num_combos(problem: IntraOpProblem) -> int:
    return math.prod(node.k for node in problem.nodes)


def all_plans(problem: IntraOpProblem):
    return [realize(problem, c) for c in itertools.product(*(range(n.k) for n in problem.nodes))]


def brute_force_s(plans, with_compute: bool, budget: float | None = None) -> float:
    return min(objective_s(p, with_compute) for p in plans
               if budget is None or p.memory.total_bytes <= budget * (1 + MEM_RTOL))


# ---------------------------------------------------------------------- properties
@pytest.mark.slow
@settings(max_examples=100, **SETTINGS)
@given(problems())
def test_ilp_matches_brute_force(problem: IntraOpProblem) -> None:
    result = solve_ilp(formulate(problem))
    assert result.status == "optimal"
    best = brute_force_s(all_plans(problem), problem.with_compute)
    assert result.objective_s == pytest.approx(best, rel=REL, abs=ABS_S)


@settings(max_examples=60, **SETTINGS)
@given(problems())
def test_realized_objective_matches_solver(problem: IntraOpProblem) -> None:
    for with_compute in (False, True):
        if problem.with_compute != with_compute:
            problem = build_problem(problem.graph, problem.mesh, COST_MODEL, with_compute=with_compute)
        result = solve_ilp(formulate(problem))
        plan = realize(problem, result.choice)
        assert objective_s(plan, with_compute) == pytest.approx(result.objective_s, rel=REL, abs=ABS_S)


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(problems(shapes=MESH_SHAPES[:-1]), st.floats(0.0, 1.0))
def test_memory_budget(problem: IntraOpProblem, where: float) -> None:
    free = solve_ilp(formulate(problem))
    free_plan = realize(problem, free.choice)
    low = min_memory_bytes(problem)
    high = free_plan.memory.total_bytes
    assert low <= high * (1 + MEM_RTOL)
    budget = low + where * (high - low)
    bound = solve_ilp(formulate(problem, budget))
    assert bound.status == "optimal"
    plan = realize(problem, bound.choice)
    assert plan.memory.total_bytes <= budget * (1 + MEM_RTOL)
    assert bound.objective_s >= free.objective_s * (1 - REL) - ABS_S
    assert objective_s(plan, problem.with_compute) == pytest.approx(bound.objective_s, rel=REL, abs=ABS_S)
    plans = all_plans(problem)
    assert min(p.memory.total_bytes for p in plans) == pytest.approx(low, rel=1e-6)
    assert bound.objective_s == pytest.approx(brute_force_s(plans, problem.with_compute, budget),
                                              rel=REL, abs=ABS_S)


def test_memory_budget_optimum_is_proven() -> None:
    """A case HiGHS once closed at its default 1e-4 relative gap, 5.5e-5 above the optimum."""
    b = GraphBuilder("g")
    xt = b.one("transpose", [b.input("x", (4, 2))], perm=(1, 0))
    y = b.ew("add", b.einsum("ab,bc->ac", xt, b.param("w", (4, 4))), xt)
    graph = b.build([b.one("reduce", [y], kind="sum", axes=(0, 1))])
    problem = build_problem(graph, LogicalMesh.of((2, 2), [SLOW, FAST]), COST_MODEL, with_compute=True)
    plans = all_plans(problem)
    low = min(p.memory.total_bytes for p in plans)
    budget = low + 0.12890625 * (realize(problem, solve_ilp(formulate(problem)).choice).memory.total_bytes - low)
    for solver in ("highs", "cbc"):
        result = solve_ilp(formulate(problem, budget), solver)
        assert result.objective_s == pytest.approx(brute_force_s(plans, True, budget), rel=1e-12)


@settings(max_examples=15, **SETTINGS)
@given(problems(shapes=[(1, 2), (2, 2), (1, 4), (2, 4)]))
def test_budget_below_min_memory_raises(problem: IntraOpProblem) -> None:
    low = min_memory_bytes(problem)
    assume(low > 0)
    with pytest.raises(IntraOpInfeasible, match="does not fit") as info:
        solve_intra_op(problem.graph, problem.mesh, COST_MODEL, memory_budget_bytes=0.9 * low,
                       with_compute=problem.with_compute)
    assert info.value.min_memory_bytes == pytest.approx(low, rel=1e-6)
    assert f"needs at least {format_bytes(info.value.min_memory_bytes)} per device" in str(info.value)


@settings(max_examples=20, **SETTINGS)
@given(forward_graphs(), st.booleans())
def test_single_device_has_no_communication(graph: OpGraph, train: bool) -> None:
    graph = training_graph(graph) if train else graph
    mesh = LogicalMesh.of((1, 1), [SLOW, FAST])
    problem = build_problem(graph, mesh, COST_MODEL, with_compute=True)
    assert all(node.k == 1 for node in problem.nodes)
    assert all(s.comm_s == 0 for ss in problem.strategies.values() for s in ss)
    result = solve_ilp(formulate(problem))
    plan = realize(problem, result.choice)
    assert plan.communication_s == 0 and not plan.collectives
    assert result.objective_s == pytest.approx(plan.compute_s + plan.update_s, rel=REL)


@settings(max_examples=30, **SETTINGS)
@given(forward_graphs(), meshes(shapes=MESH_SHAPES[:-1]), st.booleans())
def test_heavy_ops_never_replicate(graph: OpGraph, mesh: LogicalMesh, train: bool) -> None:
    graph = training_graph(graph) if train else graph
    live = {a for a in (0, 1) if mesh.shape[a] > 1}
    problem = build_problem(graph, mesh, COST_MODEL)
    for op in graph.ops:
        if not is_heavy(op):
            continue
        strict = enumerate_strategies(op, graph.tensors, mesh, COST_MODEL)
        for s in strict:
            assert {a for _, axes in s.loops for a in axes} == live, (op.name, s.name)
        if strict:
            assert problem.strategies[op.name] == strict
        else:  # no even split uses every axis: the problem lets it replicate, and says so
            assert any(n.startswith(f"{op.name}:") for n in problem.notes)
        loose = enumerate_strategies(op, graph.tensors, mesh, COST_MODEL, allow_replicated_heavy=True)
        assert any(not s.loops for s in loose)
        assert set(strict) <= set(loose)


@settings(max_examples=8, **SETTINGS)
@given(problems(shapes=[(1, 2), (2, 2), (1, 4), (2, 4)]))
def test_cbc_and_highs_agree(problem: IntraOpProblem) -> None:
    highs = solve_ilp(formulate(problem), "highs")
    cbc = solve_ilp(formulate(problem), "cbc")
    assert highs.status == cbc.status == "optimal"
    assert cbc.objective_s == pytest.approx(highs.objective_s, rel=REL, abs=ABS_S)


@settings(max_examples=30, **SETTINGS)
@given(forward_graphs(max_ops=3), meshes(shapes=MESH_SHAPES[:-1]), st.booleans())
def test_weight_update_sharding_never_hurts(graph: OpGraph, mesh: LogicalMesh, with_compute: bool) -> None:
    graph = training_graph(graph)
    plain = solve_intra_op(graph, mesh, COST_MODEL, with_compute=with_compute, rewrite=False)
    sharded = solve_intra_op(graph, mesh, COST_MODEL, with_compute=with_compute, rewrite=True)
    cost = objective_s(plain.plan, with_compute)
    assert objective_s(sharded.plan, with_compute) <= cost * (1 + 1e-9) + ABS_S
    assert sharded.plan.memory.total_bytes <= plain.plan.memory.total_bytes
    assert (sharded.rewritten == 0) == (sharded.plan.choice == plain.plan.choice)


def mlp(batch: int, seq: int, width: int, layers: int) -> OpGraph:
    b = GraphBuilder("mlp")
    y = b.input("x", (batch, seq, width))  # (B, T, C)
    for _ in range(layers):
        y = b.ew("relu", b.einsum("abc,cd->abd", y, b.param("w", (width, width))))
    return training_graph(b.build([b.one("reduce", [y], kind="sum", axes=(0, 1, 2))]))


def all_reduced_updates(problem: IntraOpProblem, choice: tuple[int, ...]) -> tuple[int, ...]:
    """A plan as costly as `choice` whose updates all all-reduce gradients and run replicated.

    The ILP's objective ignores memory, so it may already pick the reduce-scatter form
    (a tie); this searches the update groups and parameter leaves, other nodes fixed,
    for the plan the rewrite exists to improve."""
    graph = problem.graph
    free = [v for v, node in enumerate(problem.nodes)
            if (node.leaf is not None and graph.tensors[node.leaf].role == "param")
            or any(graph.op_by_name[o].prim == "adam" for o in node.ops)]
    updates = [v for v in free if problem.nodes[v].leaf is None]
    target = objective_s(realize(problem, choice), problem.with_compute)
    best = None
    for picks in itertools.product(*(range(problem.nodes[v].k) for v in free)):
        trial = list(choice)
        for v, i in zip(free, picks):
            trial[v] = i
        kinds = [{c.kind for s in problem.nodes[v].choices[trial[v]].values() for c in s.collectives}
                 for v in updates]
        if not all(k == {"all_reduce"} for k in kinds):
            continue
        plan = realize(problem, tuple(trial))
        if objective_s(plan, problem.with_compute) > target * (1 + 1e-9):
            continue
        if best is None or plan.memory.optimizer_bytes > best[1].memory.optimizer_bytes:
            best = (tuple(trial), plan)
    assert best is not None, "no plan with all-reduced gradients costs as little as the optimum"
    return best[0]


def test_weight_update_sharding_on_data_parallel_mlp() -> None:
    """Data parallelism on 4 devices: reduce-scatter + sharded Adam + all-gather costs what
    all-reduce + replicated Adam costs, and holds a quarter of the optimizer states."""
    graph = mlp(batch=8, seq=16, width=8, layers=2)
    bandwidth_only = Link("test-no-latency", 800.0, 1e-9)  # so data parallelism wins
    mesh = LogicalMesh.of((1, 4), [bandwidth_only, bandwidth_only])
    plain = solve_intra_op(graph, mesh, COST_MODEL, rewrite=False)
    # Data parallel over the tokens: the batch loop or the sequence loop (they tie).
    token_loops = [dict(s.loops) for o, s in plain.plan.strategies.items()
                   if is_heavy(graph.op_by_name[o]) and graph.op_by_name[o].phase == "forward"]
    assert token_loops and all(loops in ({"a": (1,)}, {"b": (1,)}) for loops in token_loops)
    problem = plain.problem
    replicated = all_reduced_updates(problem, plain.plan.choice)
    before = realize(problem, replicated)
    choice, changed = weight_update_sharding(problem, replicated)
    after = realize(problem, choice)
    assert changed == 2
    assert after.memory.optimizer_bytes == pytest.approx(before.memory.optimizer_bytes / 4)
    assert after.memory.total_bytes < before.memory.total_bytes
    assert after.communication_s == pytest.approx(before.communication_s, rel=1e-9)
    assert {p.collective.kind for p in after.collectives} >= {"reduce_scatter", "all_gather"}
    # The whole pass: never costlier, never larger than the plan it starts from.
    sharded = solve_intra_op(graph, mesh, COST_MODEL, rewrite=True)
    assert sharded.plan.communication_s == pytest.approx(plain.plan.communication_s, rel=1e-9)
    assert sharded.plan.memory.optimizer_bytes <= plain.plan.memory.optimizer_bytes
    assert sharded.plan.memory.optimizer_bytes == pytest.approx(after.memory.optimizer_bytes)


@pytest.mark.serial
def test_watchdog_cancels_a_solve_that_outruns_its_time_limit(monkeypatch):
    """HiGHS does not check its own time limit everywhere; the watchdog interrupts it.
    Here the watchdog is set far below HiGHS's own limit, on a knapsack MIP that takes
    HiGHS many seconds to prove: the solve stops at the watchdog with an incumbent."""
    import random
    import time

    import scipy.sparse as sp

    from alpasim.solvers import _intra_ilp

    monkeypatch.setattr(_intra_ilp, "hard_limit_s", lambda limit: 0.5)
    rng = random.Random(1)
    n, m = 120, 30
    weights = np.array([[rng.randint(1000, 100000) for _ in range(n)] for _ in range(m)], float)
    value = -np.array([rng.randint(1000, 100000) for _ in range(n)], float)   # maximise
    form = _intra_ilp.Formulation(value, np.zeros(n), np.ones(n), np.ones(n, bool), sp.csc_matrix(weights),
                                  np.full(m, -np.inf), np.full(m, 2_500_000.0),
                                  tuple(np.array([j]) for j in range(n)), 1.0)
    t0 = time.perf_counter()
    result = _intra_ilp.solve_ilp(form, "highs", time_limit_s=60.0)
    assert time.perf_counter() - t0 < 10.0
    assert result.status == "time_limit"          # stopped with an incumbent, not proven
    assert result.choice is not None and result.objective < 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt3:hidden=128,layers=2,heads=4,seq=32,vocab=256,batch=8",
                                   "moe:hidden=128,layers=2,heads=4,seq=32,vocab=256,batch=8,experts=8",
                                   "wresnet:depth=50,width=2,channels=32,image=32,batch=8"])
@pytest.mark.parametrize("view", [(1, 8), (1, 4), (2, 4)])
def test_swapping_a_1d_meshs_axes_gives_the_same_optimum(model, view):
    """Why the stage cost table solves (1, n) and not its twin (n, 1)
    (`_stage_costs.mirrored_views`): the proven optimum (mip_gap 0) of every layer's
    ILP is the same. A two-axis view is not so: S01 nests differently in (2, 4) and
    (4, 2), and some layer's optimum differs, so both are kept."""
    from alpasim.graphs import build_training_graph, forward_graph, stage_graph
    from alpasim.solvers import solve_intra_op
    from alpasim.solvers._stage_costs import mirrored_views

    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    meshes = [LogicalMesh.on_cluster(cluster, view), LogicalMesh.on_cluster(cluster, view[::-1])]
    one_d = view[0] == 1
    assert mirrored_views(meshes) == ({1} if one_d else set())
    graph = build_training_graph(forward_graph(model)).graph
    cost_model = AnalyticCostModel(cluster)
    same = []
    for layer in range(graph.num_layers):
        stage = stage_graph(graph, layer, layer)
        a, b = (solve_intra_op(stage, m, cost_model, with_compute=True, microbatches=4, mip_gap=0.0)
                for m in meshes)
        same.append(a.objective_s == pytest.approx(b.objective_s, rel=1e-9, abs=1e-15))
    assert all(same) if one_d else not all(same)

"""The intra-op pass for one stage on one mesh: build -> formulate -> solve -> decode -> rewrite.

`solve_intra_op` is the recipe the inter-op pass and the CLI call. After the ILP, the
weight-update-sharding rewrite (seed 3.4.5, post-ILP): where the plan all-reduces a
gradient and then runs a replicated update, a strategy of the same group that
reduce-scatters the gradient, updates a shard and all-gathers the new weights costs the
same in the alpha-beta model (reduce-scatter + all-gather = all-reduce) but holds
gradients and optimizer states sharded. The rewrite takes such an alternative whenever
the whole plan's cost does not rise and its memory falls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from alpasim.costmodels import CostModel
from alpasim.graphs import OpGraph
from alpasim.units import format_bytes

from ._intra_ilp import GIB, formulate, formulate_min_memory, solve_ilp
from ._intra_plan import IntraOpPlan, objective_s, realize
from ._intra_problem import IntraOpProblem, build_problem
from ._mesh import LogicalMesh
from ._spec import ShardingSpec
from ._strategies import Strategy

# Relative slack under which a rewritten plan counts as costing the same.
REWRITE_RTOL = 1e-9


class IntraOpInfeasible(ValueError):
    """No plan fits the memory budget; the message says how much would be needed."""

    def __init__(self, message: str, min_memory_bytes: float) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True)
class IntraOpResult:
    """Status, objective, timings and the decoded plan of one intra-op solve."""

    status: str                 # optimal | time_limit
    objective_s: float          # the solver's objective (seconds)
    plan: IntraOpPlan
    solve_s: float
    build_s: float
    solver: str
    num_nodes: int
    num_edges: int
    rewritten: int              # groups changed by the weight-update-sharding rewrite
    problem: IntraOpProblem

    @property
    def time_limited(self) -> bool:
        return self.status != "optimal"


def solve_intra_op(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, *,
                   memory_budget_bytes: float | None = None, with_compute: bool = False,
                   microbatches: int = 1, activation_multiplier: float = 1.0, solver: str = "highs",
                   time_limit_s: float | None = None, mip_gap: float | None = None,
                   allow_replicated_heavy: bool = False, rewrite: bool = True,
                   restrict: Mapping[str, Sequence[Strategy]] | None = None,
                   leaf_specs: Mapping[str, Sequence[ShardingSpec]] | None = None) -> IntraOpResult:
    t0 = time.perf_counter()
    problem = build_problem(graph, mesh, cost_model, with_compute=with_compute, microbatches=microbatches,
                            allow_replicated_heavy=allow_replicated_heavy, restrict=restrict, leaf_specs=leaf_specs)
    return solve_problem(problem, memory_budget_bytes=memory_budget_bytes,
                         activation_multiplier=activation_multiplier, solver=solver, time_limit_s=time_limit_s,
                         mip_gap=mip_gap, rewrite=rewrite, build_s=time.perf_counter() - t0)


def solve_problem(problem: IntraOpProblem, *, memory_budget_bytes: float | None = None,
                  activation_multiplier: float = 1.0, solver: str = "highs", time_limit_s: float | None = None,
                  mip_gap: float | None = None, rewrite: bool = True, build_s: float = 0.0,
                  presolve: bool = True, start: Sequence[int] | None = None, sample: bool = False) -> IntraOpResult:
    """Formulate, solve and decode an already built problem (reused across budgets);
    `start` (a strategy index per node) is a plan the MIP may begin from; `sample`
    accepts a relax-and-fix plan unproven (`_intra_ilp._solve_highs`)."""
    t0 = time.perf_counter()
    graph, mesh = problem.graph, problem.mesh
    form = formulate(problem, memory_budget_bytes, activation_multiplier)
    build_s += time.perf_counter() - t0
    result = solve_ilp(form, solver, time_limit_s, mip_gap, presolve, start, sample)
    if result.status == "infeasible":
        need = min_memory_bytes(problem, solver, activation_multiplier)
        raise IntraOpInfeasible(
            f"does not fit: {graph.name} on a {mesh} mesh needs at least {format_bytes(need)} per device, "
            f"the budget is {format_bytes(memory_budget_bytes)}", need)
    if result.choice is None:
        raise RuntimeError(f"intra-op solve on {graph.name} ({mesh}) returned no plan: {result.solver} "
                           f"{result.status} after {result.wall_s:.1f} s")
    choice = shard_stash(problem, result.choice)
    rewritten = 0
    if rewrite:
        choice, rewritten = weight_update_sharding(problem, choice)
    plan = realize(problem, choice)
    return IntraOpResult(result.status, result.objective_s, plan, result.wall_s, build_s, result.solver,
                         len(problem.nodes), len(problem.edges), rewritten, problem)


def shard_stash(problem: IntraOpProblem, choice: tuple[int, ...]) -> tuple[int, ...]:
    """Store each stashed activation and each received activation or cotangent in its
    smallest layout among those that cost nothing more. The time objective is
    indifferent to how a tensor that only waits (for the backward, or for its first
    reader) is laid out, since slicing is free, so the solver may leave a layer input
    replicated over the data-parallel axis, where each microbatch in flight would hold
    it dp times. Node by node, with the rest of the plan fixed: the objective never
    rises."""
    graph = problem.graph
    waiting = set(problem.stash) | {t for t in graph.inputs if graph.tensors[t].role in ("activation", "input")}
    if not waiting:
        return choice
    incident: dict[int, set[int]] = {}
    for k, e in enumerate(problem.edges):
        group = problem.shares[e.share] if e.share >= 0 else [k]    # a share group is priced whole
        incident.setdefault(e.src, set()).update(group)
        incident.setdefault(e.dst, set()).update(group)
    owners = sorted({problem.node_of_tensor[t] for t in waiting if t in problem.node_of_tensor})
    choice = list(choice)

    def local_cost(v: int, i: int) -> float:
        held, choice[v] = choice[v], i
        cost = float(problem.nodes[v].cost[i]) + problem.edge_cost_s(choice, incident.get(v, ()))
        choice[v] = held
        return cost

    for v in owners:
        node = problem.nodes[v]
        mine = [t for t in node.specs[0] if t in waiting]

        def held_bytes(i: int) -> float:
            return sum(graph.tensors[t].nbytes / node.specs[i][t].num_shards(problem.mesh) for t in mine)

        base, held = local_cost(v, choice[v]), held_bytes(choice[v])
        best = choice[v]
        for i in range(node.k):
            b = held_bytes(i)
            if b < held and local_cost(v, i) <= base * (1 + REWRITE_RTOL) + 1e-15:
                best, held = i, b
        choice[v] = best
    return tuple(choice)


def weight_update_sharding(problem: IntraOpProblem, choice: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Switch update groups to reduce-scatter forms that cost no more and hold less."""
    current = realize(problem, choice)
    cost = objective_s(current, problem.with_compute, problem.microbatches)
    changed = 0
    for v, node in enumerate(problem.nodes):
        if not any(problem.graph.op_by_name[o].prim == "adam" for o in node.ops):
            continue
        if not any(c.kind == "all_reduce" for s in node.choices[choice[v]].values() for c in s.collectives):
            continue
        best = None
        root = node.ops[0]
        loops = node.choices[choice[v]][root].loops
        for j in range(node.k):
            # Only the same loop mapping with another way to finish the partial sums.
            if j == choice[v] or node.choices[j][root].loops != loops:
                continue
            trial = choice[:v] + (j,) + choice[v + 1:]
            plan = realize(problem, trial)
            if objective_s(plan, problem.with_compute, problem.microbatches) > cost * (1 + REWRITE_RTOL) + 1e-15:
                continue
            if plan.memory.total_bytes >= current.memory.total_bytes:
                continue
            if best is None or plan.memory.total_bytes < best[1].memory.total_bytes:
                best = (trial, plan)
        if best is not None:
            choice, current = best
            changed += 1
    return choice, changed


def min_memory_bytes(problem: IntraOpProblem, solver: str = "highs", activation_multiplier: float = 1.0) -> float:
    """The least per-device memory any plan of `problem` needs (an ILP of its own)."""
    return _min_memory(problem, solver, activation_multiplier)[0]


def min_memory_choice(problem: IntraOpProblem, solver: str = "highs", activation_multiplier: float = 1.0,
                      slack: float = 1e-3, mip_gap: float | None = None,
                      time_limit_s: float | None = None, presolve: bool = True,
                      refine_time_limit_s: float | None = None) -> tuple[float, IntraOpResult | None]:
    """(least memory, the fastest plan within `slack` of it): two solves, memory first;
    `refine_time_limit_s` bounds the second (default `time_limit_s`).

    One weighted objective (memory + tiny x time) would be the textbook lexicographic
    trick, but proving its optimum takes HiGHS minutes; two small solves take seconds.
    If the second solve finds nothing in its time limit, the first solve's own plan
    (least memory, time not optimised) comes back, flagged `time_limit`: a layer must not
    look out of memory only because the machine was busy.
    """
    t0 = time.perf_counter()
    least, choice = _min_memory(problem, solver, activation_multiplier, time_limit_s, mip_gap, presolve)
    try:
        fast = solve_problem(problem, memory_budget_bytes=least * (1 + slack) + 1.0,
                             activation_multiplier=activation_multiplier, solver=solver, mip_gap=mip_gap,
                             time_limit_s=time_limit_s if refine_time_limit_s is None else refine_time_limit_s,
                             presolve=presolve, start=choice, sample=True)
    except (IntraOpInfeasible, RuntimeError):
        if choice is None:
            return least, None
        plan = realize(problem, choice)
        return least, IntraOpResult("time_limit", objective_s(plan, problem.with_compute, problem.microbatches),
                                    plan, time.perf_counter() - t0, 0.0, solver, len(problem.nodes),
                                    len(problem.edges), 0, problem)
    return least, fast


def _min_memory(problem: IntraOpProblem, solver: str, multiplier: float, time_limit_s: float | None = None,
                mip_gap: float | None = None, presolve: bool = True):
    """Minimise the peak bytes. With a time limit or gap the incumbent's peak comes
    back: an achievable memory, perhaps a little above the least."""
    result = solve_ilp(formulate_min_memory(problem, multiplier), solver, time_limit_s, mip_gap, presolve)
    return float(result.objective or 0.0), result.choice

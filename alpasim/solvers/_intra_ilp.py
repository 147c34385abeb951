"""The ILP of seed eq. 1: formulate -> solve -> decode, each a separate step.

    min  sum_v s_v . (c_v + d_v)  +  sum_(v,u) e_vu . vec(R_vu)
    s.t. s_v one-hot,  e_vu = s_v (x) s_u  (linearised),  memory(p) <= budget for all p

Linearisation: for an edge, the resharding cost depends only on the pair (spec the
producer stores, spec the consumer needs), so e is indexed by distinct *spec* pairs,
not strategy pairs (a GPT einsum has ~30 strategies but a weight ~10 specs). With
a_p = sum of s_v over strategies storing spec p and b_q likewise for the consumer, the
transport constraints sum_q e_pq = a_p, sum_p e_pq = b_q force e_pq = a_p b_q for
one-hot a, b, so e can be continuous. Costs enter in microseconds so the solver's
tolerances see numbers near one.

Memory (optional): M_t = sum_i s_owner(t)^i * bytes_t / shards_i(t) for every tensor;
persistent tensors, the stash of the other microbatches in flight and the activations
live at each candidate peak must fit. Memory
enters in units of the budget (the right-hand side is 1): the solver's absolute
feasibility tolerance (~1e-7) is then a relative one, whether the stage holds 40 GiB
or, in a test, 40 bytes (in GiB units a 100-byte overshoot would count as fitting).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pulp

from ._intra_problem import IntraOpProblem

US = 1e6          # objective unit: microseconds
GIB = float(2 ** 30)
SOLVERS = ("highs", "cbc")
# Stop only when the optimum is proven (up to the solvers' absolute gap, 1e-6 us in
# HiGHS): HiGHS's default relative gap, 1e-4, let it return plans up to 0.01% worse
# than the optimum with status "optimal".
MIP_REL_GAP = 0.0


@dataclass
class Formulation:
    """The PuLP model and handles to its variables."""

    model: pulp.LpProblem
    s: list[list[pulp.LpVariable]]
    memory_budget_bytes: float | None


@dataclass(frozen=True, slots=True)
class SolveResult:
    status: str            # optimal | time_limit | infeasible | error
    objective_s: float | None
    wall_s: float
    choice: tuple[int, ...] | None
    solver: str


def formulate(problem: IntraOpProblem, memory_budget_bytes: float | None = None,
              activation_multiplier: float = 1.0) -> Formulation:
    """The ILP of `problem`; with a budget, persistent + multiplier x live activations must
    fit at every candidate peak (the multiplier is how many microbatches 1F1B keeps in
    flight on the stage, seed eq. 5)."""
    model = pulp.LpProblem("intra_op", pulp.LpMinimize)
    s = [[pulp.LpVariable(f"s{v}_{i}", cat="Binary") for i in range(node.k)] for v, node in enumerate(problem.nodes)]
    # Expressions are built from (variable, coefficient) lists: PuLP's operator
    # overloading allocates an object per term and dominated formulation time.
    objective: list[tuple[pulp.LpVariable, float]] = []
    for v, node in enumerate(problem.nodes):
        model += _expr((x, 1.0) for x in s[v]) == 1, f"one_hot_{v}"
        objective += [(x, float(c) * US) for c, x in zip(node.cost, s[v]) if c]
    for n, edge in enumerate(problem.edges):
        if not edge.cost.any():
            continue
        p_count = len(edge.specs)
        src_of = [np.flatnonzero(edge.src_spec == p) for p in range(p_count)]
        dst_of = [np.flatnonzero(edge.dst_spec == q) for q in range(p_count)]
        used_p = [p for p in range(p_count) if len(src_of[p])]
        used_q = [q for q in range(p_count) if len(dst_of[q])]
        e = {(p, q): pulp.LpVariable(f"e{n}_{p}_{q}", lowBound=0) for p in used_p for q in used_q}
        for p in used_p:
            terms = [(e[p, q], 1.0) for q in used_q] + [(s[edge.src][i], -1.0) for i in src_of[p]]
            model += _expr(terms) == 0, f"edge{n}_src{p}"
        for q in used_q:
            terms = [(e[p, q], 1.0) for p in used_p] + [(s[edge.dst][j], -1.0) for j in dst_of[q]]
            model += _expr(terms) == 0, f"edge{n}_dst{q}"
        objective += [(x, float(edge.cost[p, q]) * US) for (p, q), x in e.items() if edge.cost[p, q]]
    model += _expr(objective)
    if memory_budget_bytes is not None:
        _add_memory(model, problem, s, memory_budget_bytes, activation_multiplier)
    return Formulation(model, s, memory_budget_bytes)


def _expr(terms) -> pulp.LpAffineExpression:
    """An affine expression from (variable, coefficient) pairs, summing repeats."""
    out: dict = {}
    for x, c in terms:
        out[x] = out.get(x, 0.0) + c
    return pulp.LpAffineExpression(list(out.items()))


def memory_expression(problem: IntraOpProblem, s, tensor: str, unit_bytes: float = GIB):
    """Per-device memory of `tensor` in units of `unit_bytes`, linear in its owner's s."""
    return _expr(_memory_terms(problem, s, tensor, unit_bytes))


def _memory_terms(problem: IntraOpProblem, s, tensor: str, unit_bytes: float):
    v = problem.node_of_tensor[tensor]
    return [(x, float(b) / unit_bytes) for b, x in zip(problem.tensor_bytes(v, tensor), s[v]) if b]


def _add_memory(model: pulp.LpProblem, problem: IntraOpProblem, s, budget: float, multiplier: float = 1.0) -> None:
    """persistent + live(p) + (multiplier - 1) x stash <= budget at every candidate peak p:
    one microbatch at its peak, the others in flight holding their stash (the stage-memory
    rule of `costmodels.stage_memory`), so the stash's layout is priced."""
    unit = budget if budget > 0 else GIB
    persistent = [term for t in problem.persistent for term in _memory_terms(problem, s, t, unit)]
    persistent += [(x, c * max(multiplier - 1.0, 0.0)) for t in problem.stash
                   for x, c in _memory_terms(problem, s, t, unit)]
    acts = {t for live in problem.live_sets for t in live}
    m = {}
    for t in acts:
        m[t] = pulp.LpVariable(f"mem_{len(m)}", lowBound=0)
        terms = [(m[t], 1.0)] + [(x, -c) for x, c in _memory_terms(problem, s, t, unit)]
        model += _expr(terms) == 0, f"mem_def_{len(m)}"
    if not problem.live_sets:
        model += _expr(persistent) <= budget / unit, "memory"
    for i, live in enumerate(problem.live_sets):
        model += _expr(persistent + [(m[t], 1.0) for t in live]) <= budget / unit, f"memory_{i}"


def solve_ilp(form: Formulation, solver: str = "highs", time_limit_s: float | None = None,
              mip_gap: float | None = None, presolve: bool = True) -> SolveResult:
    """Solve to proven optimality (or `mip_gap`, relative, when the caller accepts one).

    `presolve=False` skips HiGHS's presolve: on some memory-bounded problems HiGHS 1.16's
    presolve loops without checking its time limit, while the same model without
    presolve solves in a second (CBC ignores the flag).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ILP solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    gap = MIP_REL_GAP if mip_gap is None else mip_gap
    options = {} if presolve else {"presolve": "off"}
    backend = (_GuardedHiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap, **options) if solver == "highs"
               else pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap))
    t0 = time.perf_counter()
    try:
        with _native_stdout_silenced():
            form.model.solve(backend)
    except pulp.PulpSolverError as e:
        return SolveResult("error", None, time.perf_counter() - t0, None, f"{solver}: {e}")
    finally:
        if isinstance(backend, _GuardedHiGHS):
            backend.disarm()
    wall = time.perf_counter() - t0
    status = pulp.LpStatus.get(form.model.status, "Undefined")
    sol = form.model.sol_status
    if status == "Infeasible" or sol == pulp.LpSolutionInfeasible:
        return SolveResult("infeasible", None, wall, None, solver)
    choice = decode(form)
    if choice is None:
        kind = "time_limit" if time_limit_s is not None else "error"
        return SolveResult(kind, None, wall, None, solver)
    optimal = status == "Optimal" and sol in (pulp.LpSolutionOptimal, None)
    objective = pulp.value(form.model.objective)
    return SolveResult("optimal" if optimal else "time_limit", (objective or 0.0) / US, wall, choice, solver)


def hard_limit_s(time_limit_s: float) -> float:
    """When the watchdog cancels a solve that has outrun its own time limit."""
    return 2.0 * time_limit_s + 5.0


class _GuardedHiGHS(pulp.HiGHS):
    """PuLP's HiGHS with a watchdog: HiGHS 1.16 does not check its time limit
    everywhere (a memory-bounded layer MIP of gpt3-2.6b on 8 GPUs ran for 35 minutes
    against a 15 s limit inside `reproduce table5`, presolve off). Past
    `hard_limit_s(timeLimit)` a timer thread cancels the solve through highspy's user
    interrupt, which HiGHS polls in its simplex, IPM and MIP loops; the incumbent, if
    any, comes back as a time-limited result."""

    def createAndConfigureSolver(self, lp):
        super().createAndConfigureSolver(lp)
        self._timer = None
        if self.timeLimit is not None:
            highs = lp.solverModel
            highs.HandleUserInterrupt = True
            self._timer = threading.Timer(hard_limit_s(self.timeLimit), highs.cancelSolve)
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """Silence C-level stdout: HiGHS prints a banner when created, before any option
    can turn it off, and `--json` promises one JSON object on stdout."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured by pytest or similar
        yield
        return
    saved = os.dup(fd)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def decode(form: Formulation) -> tuple[int, ...] | None:
    """The chosen strategy index of every node, or None when the solver found none."""
    out = []
    for xs in form.s:
        vals = [x.value() for x in xs]
        if any(v is None for v in vals):
            return None
        out.append(int(np.argmax(vals)))
    return tuple(out)

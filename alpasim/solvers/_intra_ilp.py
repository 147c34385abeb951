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
live at each candidate peak must fit. Memory enters in units of the budget (the
right-hand side is 1): the solver's absolute feasibility tolerance (~1e-7) is then a
relative one, whether the stage holds 40 GiB or, in a test, 40 bytes (in GiB units a
100-byte overshoot would count as fitting).

The program is built as sparse matrices (numpy triplets, one block per node, edge or
memory point) and handed to HiGHS whole through highspy. PuLP built one Python object
per variable and per term, and its HiGHS layer added them one at a time: on a GPT
layer's 24,000-column program that Python work took longer than the solve itself.
CBC stays available through PuLP (`solver="cbc"`), fed the same matrices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse as sp

from ._intra_problem import IntraOpProblem

US = 1e6          # objective unit of the time formulation: microseconds
GIB = float(2 ** 30)
SOLVERS = ("highs", "cbc")
# Stop only when the optimum is proven (up to the solvers' absolute gap, 1e-6 us in
# HiGHS): HiGHS's default relative gap, 1e-4, let it return plans up to 0.01% worse
# than the optimum with status "optimal".
MIP_REL_GAP = 0.0
# A relaxation's strategy column counts as integral within this (HiGHS's own MIP
# feasibility tolerance is 1e-6).
INTEGRAL_TOL = 1e-9
# Relax-and-fix (`_solve_highs`): with a relative gap allowed and at most this many
# nodes fractional in the relaxation, the rest are fixed and the small MIP left is
# solved; its plan is kept when within the gap of the relaxation's bound.
FIX_MAX_FRACTIONAL = 16


@dataclass(frozen=True)
class Formulation:
    """A mixed-integer program in column form, ready for any solver:

        min c.x   s.t.  row_lower <= A x <= row_upper,  col_lower <= x <= col_upper,
                        x_j integral where integer[j]

    `s[v]` holds the column of each strategy of node v; one objective unit is `scale`
    SI units (seconds for the time program, bytes for the memory one)."""

    c: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray            # bool per column
    A: sp.csc_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    s: tuple[np.ndarray, ...]
    scale: float
    memory_budget_bytes: float | None = None

    @property
    def num_cols(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    @property
    def num_integer(self) -> int:
        return int(self.integer.sum())


@dataclass(frozen=True, slots=True)
class SolveResult:
    status: str            # optimal | time_limit | infeasible | error
    objective: float | None   # in SI units: seconds (time program) or bytes (memory program)
    wall_s: float
    choice: tuple[int, ...] | None
    solver: str

    @property
    def objective_s(self) -> float | None:
        """The time program's objective, in seconds."""
        return self.objective


class _Builder:
    """Columns and rows accumulated as numpy blocks, assembled once."""

    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.n_cols = 0
        self.row_lo: list[np.ndarray] = []
        self.row_hi: list[np.ndarray] = []
        self.n_rows = 0
        self.ti: list[np.ndarray] = []   # triplets: row, column, value
        self.tj: list[np.ndarray] = []
        self.tv: list[np.ndarray] = []

    def columns(self, n: int, *, cost=0.0, upper=np.inf, integer: bool = False) -> np.ndarray:
        idx = np.arange(self.n_cols, self.n_cols + n)
        self.cost.append(np.broadcast_to(np.asarray(cost, float), (n,)))
        self.lower.append(np.zeros(n))
        self.upper.append(np.full(n, upper, float))
        self.integer.append(np.full(n, integer))
        self.n_cols += n
        return idx

    def rows(self, n: int, lower, upper, rows, cols, vals) -> None:
        """`n` rows whose entries are (rows[k] local to this block, cols[k], vals[k])."""
        self.row_lo.append(np.broadcast_to(np.asarray(lower, float), (n,)))
        self.row_hi.append(np.broadcast_to(np.asarray(upper, float), (n,)))
        self.ti.append(np.asarray(rows, np.int64) + self.n_rows)
        self.tj.append(np.asarray(cols, np.int64))
        self.tv.append(np.asarray(vals, float))
        self.n_rows += n

    def build(self, s, scale: float, budget: float | None) -> Formulation:
        import scipy.sparse as sp   # imported where an ILP is built: 0.07 s that a refusal or a report need not pay

        cat = lambda xs, dtype=float: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)  # noqa: E731
        A = sp.coo_matrix((cat(self.tv), (cat(self.ti, np.int64), cat(self.tj, np.int64))),
                          shape=(self.n_rows, self.n_cols)).tocsc()   # sums repeated entries
        A.eliminate_zeros()
        return Formulation(cat(self.cost), cat(self.lower), cat(self.upper), cat(self.integer, bool), A,
                           cat(self.row_lo), cat(self.row_hi), tuple(s), scale, budget)


def dominated(problem: IntraOpProblem) -> list[np.ndarray]:
    """Per node, which strategies no optimum needs: strategy i is dropped when another
    strategy j of the same node is no worse in every coefficient the program gives i -
    its own cost, its resharding cost against every spec of every neighbour, the bytes
    of every tensor whose layout it fixes - and better in one of them (or, all equal,
    earlier). Swapping i for j in any plan then raises neither the objective nor any
    memory row, so the optimum survives; the relation is a strict partial order, so
    every dropped strategy has a kept one that dominates it. Computed once per problem
    (every budget's formulation asks)."""
    if problem._dominated is not None:
        return problem._dominated
    features: list[list[np.ndarray]] = [[node.cost[:, None]] for node in problem.nodes]
    for edge in problem.edges:
        if not edge.cost.any():
            continue
        features[edge.src].append(edge.cost[edge.src_spec])                 # (k_src, specs)
        features[edge.dst].append(edge.cost[:, edge.dst_spec].T)            # (k_dst, specs)
        if edge.share >= 0:
            # A shared resharding (`_edge_blocks`): a consumer's cheaper target spec can
            # cost more when another reader already pays for its present one, so only
            # strategies that need the same spec (or reshard for free) compare.
            free = ~edge.cost[:, edge.dst_spec].any(0)
            spec = np.where(free, -np.inf, edge.dst_spec.astype(float))
            features[edge.dst].append(np.stack([spec, np.where(free, -np.inf, -spec)], axis=1))
    owned: dict[int, set[str]] = {}
    for t in set(problem.persistent) | set(problem.stash) | {t for live in problem.live_sets for t in live}:
        owned.setdefault(problem.node_of_tensor[t], set()).add(t)
    for v, ts in owned.items():
        features[v] += [problem.tensor_bytes(v, t)[:, None] for t in sorted(ts)]
    out = []
    for node, fs in zip(problem.nodes, features):
        F = np.concatenate(fs, axis=1)                                       # (k, d), lower is better
        le = (F[:, None, :] <= F[None, :, :]).all(-1)                        # le[j, i]: j no worse than i
        lt = (F[:, None, :] < F[None, :, :]).any(-1)
        earlier = np.arange(node.k)[:, None] < np.arange(node.k)[None, :]
        out.append((le & (lt | earlier)).any(0))
    problem._dominated = out
    return out


def _strategy_columns(b: _Builder, problem: IntraOpProblem, costs: bool,
                      drop: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """One binary column per strategy, with the one-hot row of each node; a dropped
    strategy's column is fixed at zero (kept, so columns still index strategies)."""
    nodes = problem.nodes
    k = np.array([node.k for node in nodes], dtype=np.int64)
    cost = np.concatenate([node.cost for node in nodes]) * US if costs and nodes else 0.0
    upper = 1.0 if drop is None or not nodes else np.where(np.concatenate(drop), 0.0, 1.0)
    cols = b.columns(int(k.sum()), cost=cost, upper=upper, integer=True)       # node by node, in order
    b.rows(len(nodes), 1.0, 1.0, np.repeat(np.arange(len(nodes)), k), cols, np.ones(len(cols)))
    return np.split(cols, np.cumsum(k)[:-1]) if nodes else []


def _edge_blocks(b: _Builder, problem: IntraOpProblem, s: list[np.ndarray],
                 drop: list[np.ndarray]) -> None:
    """Each edge's spec-pair columns e_pq and their transport rows (module doc), for the
    spec pairs that kept strategies can meet.

    Edges of one share group (readers of one tensor in one phase, `reshard_key`) pay a
    resharding once: their e columns cost nothing, and one column r per distinct
    (stored, needed) spec pair carries the cost with r >= e for every member's e of
    that pair, so r is the pair's use by any member (exact for one-hot strategies)."""
    shared: dict[int, dict[tuple, tuple[float, list[int]]]] = {}
    for edge in problem.edges:
        if not edge.cost.any():
            continue
        used_p = np.unique(edge.src_spec[~drop[edge.src]])
        used_q = np.unique(edge.dst_spec[~drop[edge.dst]])
        P, Q = len(used_p), len(used_q)
        pair_cost = edge.cost[np.ix_(used_p, used_q)].ravel()
        e = b.columns(P * Q, cost=0.0 if edge.share >= 0 else pair_cost * US)
        if edge.share >= 0:
            pairs = shared.setdefault(edge.share, {})
            for i in np.flatnonzero(pair_cost > 0).tolist():       # pair i is (used_p[i // Q], used_q[i % Q])
                key = (edge.specs[used_p[i // Q]], edge.specs[used_q[i % Q]])
                pairs.setdefault(key, (float(pair_cost[i]), []))[1].append(int(e[i]))
        keep_src, keep_dst = np.flatnonzero(~drop[edge.src]), np.flatnonzero(~drop[edge.dst])
        p_row = np.searchsorted(used_p, edge.src_spec[keep_src])    # row of each kept producer strategy
        q_row = np.searchsorted(used_q, edge.dst_spec[keep_dst])
        # sum_q e_pq - sum_{i stores p} s_src,i = 0, then sum_p e_pq - sum_{j needs q} s_dst,j = 0
        rows = np.concatenate([np.repeat(np.arange(P), Q), p_row, P + np.tile(np.arange(Q), P), P + q_row])
        cols = np.concatenate([e, s[edge.src][keep_src], e, s[edge.dst][keep_dst]])
        vals = np.concatenate([np.ones(P * Q), -np.ones(len(keep_src)), np.ones(P * Q), -np.ones(len(keep_dst))])
        b.rows(P + Q, 0.0, 0.0, rows, cols, vals)
    _shared_columns(b, [pair for pairs in shared.values() for pair in pairs.values()])


def _shared_columns(b: _Builder, pairs: list[tuple[float, list[int]]]) -> None:
    """One column r per shared (stored, needed) spec pair, costing the resharding, and a
    row r - e >= 0 for each member edge's column e of that pair: all pairs in one block
    (a problem has tens of thousands; one block each cost most of the formulation)."""
    if not pairs:
        return
    r = b.columns(len(pairs), cost=np.array([cost for cost, _ in pairs]) * US, upper=1.0)
    members = np.fromiter((col for _, cols in pairs for col in cols), np.int64)
    owner = np.repeat(r, [len(cols) for _, cols in pairs])
    n = len(members)
    b.rows(n, 0.0, np.inf, np.repeat(np.arange(n), 2), np.column_stack([owner, members]).ravel(),
           np.tile([1.0, -1.0], n))


def _memory_terms(problem: IntraOpProblem, s, tensor: str, unit_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """Columns and coefficients of `tensor`'s per-device memory in units of `unit_bytes`."""
    v = problem.node_of_tensor[tensor]
    return s[v], problem.tensor_bytes(v, tensor) / unit_bytes


def _memory_rows(b: _Builder, problem: IntraOpProblem, s, unit: float, multiplier: float,
                 rhs: float, peak: np.ndarray | None = None) -> None:
    """persistent + live(p) + (multiplier - 1) x stash <= rhs (or <= peak) at every
    candidate peak p: one microbatch at its peak, the others in flight holding their
    stash (the stage-memory rule of `costmodels.stage_memory`), so the stash's layout is
    priced. Each live activation gets a column m_t = its memory, so a tensor live at many
    points enters the matrix once."""
    extra = max(multiplier - 1.0, 0.0)
    pc, pv = [], []
    for t in problem.persistent:
        c, v = _memory_terms(problem, s, t, unit)
        pc.append(c), pv.append(v)
    if extra:
        for t in problem.stash:
            c, v = _memory_terms(problem, s, t, unit)
            pc.append(c), pv.append(v * extra)
    pc_all = np.concatenate(pc) if pc else np.zeros(0, np.int64)
    pv_all = np.concatenate(pv) if pv else np.zeros(0)
    if len(pc_all):
        # The persistent bytes (and the stash of the other microbatches in flight) are
        # one column, defined once, rather than repeated in every peak's row: the same
        # program with far fewer nonzeros, which the relaxations are faster for.
        (persist,) = b.columns(1)
        b.rows(1, 0.0, 0.0, np.zeros(len(pc_all) + 1), np.concatenate([[persist], pc_all]),
               np.concatenate([[1.0], -pv_all]))
        pc_all, pv_all = np.array([persist]), np.array([1.0])
    acts = list(dict.fromkeys(t for live in problem.live_sets for t in live))
    m = dict(zip(acts, b.columns(len(acts))))
    for t in acts:
        c, v = _memory_terms(problem, s, t, unit)
        b.rows(1, 0.0, 0.0, np.zeros(len(c) + 1), np.concatenate([[m[t]], c]), np.concatenate([[1.0], -v]))
    points = problem.live_sets or [[]]
    for live in points:
        cols = np.concatenate([pc_all, [m[t] for t in live]]).astype(np.int64)
        vals = np.concatenate([pv_all, np.ones(len(live))])
        if peak is not None:
            cols, vals = np.append(cols, peak), np.append(vals, -1.0)
        b.rows(1, -np.inf, rhs, np.zeros(len(cols)), cols, vals)


def formulate(problem: IntraOpProblem, memory_budget_bytes: float | None = None,
              activation_multiplier: float = 1.0) -> Formulation:
    """The time program of `problem`; with a budget, persistent + multiplier x live
    activations must fit at every candidate peak (the multiplier is how many
    microbatches 1F1B keeps in flight on the stage, seed eq. 5)."""
    b = _Builder()
    drop = dominated(problem)
    s = _strategy_columns(b, problem, costs=True, drop=drop)
    _edge_blocks(b, problem, s, drop)
    if memory_budget_bytes is not None:
        unit = memory_budget_bytes if memory_budget_bytes > 0 else GIB
        _memory_rows(b, problem, s, unit, activation_multiplier, memory_budget_bytes / unit)
    return b.build(s, 1.0 / US, memory_budget_bytes)


def formulate_min_memory(problem: IntraOpProblem, activation_multiplier: float = 1.0) -> Formulation:
    """The memory program: minimise the stage's peak bytes per device over all plans.
    Measured in units of the fully replicated footprint, so the peak is near one
    whatever the stage's size (see the module doc on memory units)."""
    tensors = problem.graph.tensors
    extra = max(activation_multiplier - 1.0, 0.0)
    unit = (sum(tensors[t].nbytes for t in problem.persistent)
            + extra * sum(tensors[t].nbytes for t in problem.stash)
            + max((sum(problem.full_bytes(t) for t in live) for live in problem.live_sets), default=0)) or GIB
    b = _Builder()
    s = _strategy_columns(b, problem, costs=False)
    peak = b.columns(1, cost=1.0)
    _memory_rows(b, problem, s, unit, activation_multiplier, 0.0, peak=peak)
    return b.build(s, float(unit), None)


def solve_ilp(form: Formulation, solver: str = "highs", time_limit_s: float | None = None,
              mip_gap: float | None = None, presolve: bool = True,
              start: Sequence[int] | None = None, sample: bool = False) -> SolveResult:
    """Solve to proven optimality (or `mip_gap`, relative, when the caller accepts one).

    `presolve=False` skips HiGHS's presolve: on some memory-bounded problems HiGHS 1.16's
    presolve loops without checking its time limit, while the same model without
    presolve solves in a second (CBC ignores the flag).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ILP solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    gap = MIP_REL_GAP if mip_gap is None else mip_gap
    t0 = time.perf_counter()
    if solver == "highs":
        status, x, objective = _solve_highs(form, time_limit_s, gap, presolve, start, sample)
    else:
        status, x, objective = _solve_cbc(form, time_limit_s, gap)
    wall = time.perf_counter() - t0
    if status in ("infeasible", "error"):
        return SolveResult(status, None, wall, None, solver)
    choice = None if x is None else decode(form, x)
    if choice is None:
        return SolveResult("time_limit" if time_limit_s is not None else "error", None, wall, None, solver)
    return SolveResult(status, objective * form.scale, wall, choice, solver)


def hard_limit_s(time_limit_s: float) -> float:
    """When the watchdog cancels a solve that has outrun its own time limit."""
    return 2.0 * time_limit_s + 5.0


def _solve_highs(form: Formulation, time_limit_s: float | None, gap: float, presolve: bool,
                 start: Sequence[int] | None = None, sample: bool = False
                 ) -> tuple[str, np.ndarray | None, float | None]:
    """HiGHS through highspy, the whole matrix in one call, relaxation first.

    The LP relaxation of the time program is usually integral (the transport rows are
    tight): a GPT layer on a 2x4 mesh solves as an LP in 0.3 s where the branch-and-
    bound machinery (presolve, heuristics, the same LP) takes 1.3-1.8 s (one-off
    measurements, as are the Llama figures below). An integral
    optimum of the relaxation is optimal for the program, an infeasible relaxation means
    an infeasible program. When the caller accepts a relative gap and only a few nodes
    are fractional (`FIX_MAX_FRACTIONAL`), relax-and-fix: those nodes' small MIP, with the
    rest fixed, is kept if within the gap of the relaxation's bound (so within the gap
    of the optimum; an imported Llama layer's budgeted MIP: 2.3 s against 8.4 s).
    Anything else goes on to the full MIP (a tight memory budget makes the relaxation
    fractional more often than not: then the relaxation's time, a fraction of the
    MIP's, is spent in vain); with more fractional nodes than that, the MIP over the
    strategies the relaxation uses (`_fix_support`) is tried first, kept on the same
    terms (the least-memory MIP of a MoE layer: about 5x faster in a one-off check).

    `sample=True` is for the memory-budgeted Pareto points, which sample a trade-off
    curve rather than prove one plan: whatever the number of fractional nodes, those
    nodes' small MIP over the strategies the relaxation uses (`_fix_support`, with
    presolve, which removes the fixed columns) is solved first, and its plan is kept
    even when it is not proven within the gap (status "relax_and_fix"); the full MIP
    runs only when that MIP finds nothing. On a GPT-3 6.7B block on 2x4 under a budget:
    0.05 s for the plan the full MIP proves in 4 s (one-off measurement)."""
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s

    def left() -> float | None:         # the three runs share the caller's time limit
        return None if deadline is None else max(deadline - time.perf_counter(), 1e-3)

    status, x, objective = _run_highs(form, left(), gap, presolve=False, relax=True)
    if status == "infeasible":
        return status, None, None
    if status == "optimal":
        integral = [np.abs(x[cols] - np.round(x[cols])).max() <= INTEGRAL_TOL for cols in form.s]
        if all(integral):
            return status, x, objective
        bound = objective * (1 + gap) + abs(objective) * 1e-12
        if gap > 0 and not sample and integral.count(False) <= FIX_MAX_FRACTIONAL:
            status, xf, of = _run_highs(_fix_integral(form, x, integral), left(), gap / 2, presolve, relax=False)
            if status == "optimal" and of <= bound:
                return status, xf, of
        elif gap > 0:
            # The relaxation's support: a MIP over a few choices per fractional node,
            # kept when within the gap of the bound (then optimal to the gap) and, for
            # a sampled Pareto point, kept anyway.
            status, xf, of = _run_highs(_fix_support(form, x, integral), left(), gap / 2, True, relax=False)
            within = xf is not None and status == "optimal" and of <= bound
            if within or (sample and xf is not None):
                return ("optimal" if within else "relax_and_fix"), xf, of
    return _run_highs(form, left(), gap, presolve, relax=False, start=start)


def _fix_integral(form: Formulation, x: np.ndarray, integral: Sequence[bool]) -> Formulation:
    """`form` with every node whose relaxed strategy columns are integral fixed to that
    strategy: a small MIP over the fractional nodes only. Its optimum is a plan of the
    whole program, and the relaxation's optimum bounds how far it can be from the best."""
    lower, upper = form.col_lower.copy(), form.col_upper.copy()
    for cols, fix in zip(form.s, integral):
        if fix:
            r = np.round(x[cols])
            lower[cols] = r
            upper[cols] = np.minimum(r, upper[cols])
    return dataclasses.replace(form, col_lower=lower, col_upper=upper)


def _fix_support(form: Formulation, x: np.ndarray, integral: Sequence[bool]) -> Formulation:
    """`_fix_integral`, and each fractional node limited to the strategies its relaxed
    columns use: a MIP over a few choices per node."""
    fixed = _fix_integral(form, x, integral)
    upper = fixed.col_upper.copy()
    for cols, fix in zip(form.s, integral):
        if not fix:
            upper[cols[x[cols] <= INTEGRAL_TOL]] = 0.0
    return dataclasses.replace(fixed, col_upper=upper)


def _run_highs(form: Formulation, time_limit_s: float | None, gap: float, presolve: bool,
               relax: bool, start: Sequence[int] | None = None) -> tuple[str, np.ndarray | None, float | None]:
    """One HiGHS run under a watchdog: HiGHS 1.16 does not check its time limit
    everywhere (a memory-bounded layer MIP of gpt3-2.6b on 8 GPUs ran for 35 minutes
    against a 15 s limit inside `reproduce table5`, presolve off). Past
    `hard_limit_s(time_limit_s)` a timer thread cancels the solve through highspy's user
    interrupt, which HiGHS polls in its simplex, IPM and MIP loops; the incumbent, if
    any, comes back as a time-limited result."""
    import highspy

    with _native_stdout_silenced():
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", float(gap))
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if not presolve:
            h.setOptionValue("presolve", "off")
        A = form.A
        integrality = np.zeros(form.num_cols, np.int32) if relax else form.integer.astype(np.int32)
        h.passModel(form.num_cols, form.num_rows, A.nnz, int(highspy.MatrixFormat.kColwise),
                    int(highspy.ObjSense.kMinimize), 0.0, form.c, form.col_lower, form.col_upper,
                    form.row_lower, form.row_upper, A.indptr.astype(np.int32), A.indices.astype(np.int32),
                    A.data, integrality)
        if start is not None and not relax:
            # A known plan (one strategy per node) as the MIP's first incumbent: HiGHS
            # completes the continuous columns; an infeasible start is ignored.
            cols = np.concatenate(form.s).astype(np.int32)
            vals = np.concatenate([(np.arange(len(c)) == k).astype(float) for c, k in zip(form.s, start)])
            h.setSolution(len(cols), cols, vals)
        timer = None
        if time_limit_s is not None:
            h.HandleUserInterrupt = True
            timer = threading.Timer(hard_limit_s(time_limit_s), h.cancelSolve)
            timer.daemon = True
            timer.start()
        try:
            h.solve()
        finally:
            if timer is not None:
                timer.cancel()
    ms = highspy.HighsModelStatus
    model_status = h.getModelStatus()
    if model_status == ms.kInfeasible:
        return "infeasible", None, None
    info = h.getInfo()
    feasible = info.primal_solution_status == 2       # kSolutionStatusFeasible
    if model_status == ms.kOptimal and feasible:
        return "optimal", np.asarray(h.getSolution().col_value), info.objective_function_value
    if model_status in (ms.kTimeLimit, ms.kInterrupt, ms.kIterationLimit, ms.kSolutionLimit):
        if feasible and not relax:
            return "time_limit", np.asarray(h.getSolution().col_value), info.objective_function_value
        return "time_limit", None, None
    return "error", None, None


def _solve_cbc(form: Formulation, time_limit_s: float | None, gap: float
               ) -> tuple[str, np.ndarray | None, float | None]:
    """CBC through PuLP, given the same matrices (the independent second solver)."""
    import pulp

    model = pulp.LpProblem("intra_op", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{j}", lowBound=float(lo), upBound=None if np.isinf(hi) else float(hi),
                         cat="Integer" if integral else "Continuous")
         for j, (lo, hi, integral) in enumerate(zip(form.col_lower, form.col_upper, form.integer))]
    model += pulp.LpAffineExpression([(x[j], float(form.c[j])) for j in np.flatnonzero(form.c)])
    rows = form.A.tocsr()
    for r in range(form.num_rows):
        lo, hi = form.row_lower[r], form.row_upper[r]
        start, end = rows.indptr[r], rows.indptr[r + 1]
        expr = pulp.LpAffineExpression([(x[j], float(v)) for j, v in zip(rows.indices[start:end], rows.data[start:end])])
        if lo == hi:
            model += expr == float(lo), f"r{r}"
        else:
            if np.isfinite(lo):
                model += expr >= float(lo), f"r{r}_lo"
            if np.isfinite(hi):
                model += expr <= float(hi), f"r{r}_hi"
    try:
        model.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap))
    except pulp.PulpSolverError:
        return "error", None, None
    status = pulp.LpStatus.get(model.status, "Undefined")
    if status == "Infeasible" or model.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", None, None
    values = [v.value() for v in x]
    if any(v is None for v in values):
        return "time_limit", None, None
    optimal = status == "Optimal" and model.sol_status in (pulp.LpSolutionOptimal, None)
    return ("optimal" if optimal else "time_limit"), np.array(values, float), pulp.value(model.objective) or 0.0


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


def decode(form: Formulation, x: np.ndarray) -> tuple[int, ...]:
    """The chosen strategy index of every node from a solution vector."""
    return tuple(int(np.argmax(x[cols])) for cols in form.s)

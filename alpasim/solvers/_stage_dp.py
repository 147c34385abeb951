"""The stage-mesh DP of seed eqs. 2-4, over a precomputed stage cost table.

    T* = min over slicings and submeshes of  sum_i t_i + (B - 1) * max_j t_j       (eq. 2)

For a fixed bottleneck t_max, F(s, k, d) is the least sum of stage latencies slicing
layers k..L-1 into s stages on exactly d devices with every stage <= t_max (eq. 3):

    F(s, k, d) = min_{k <= i, shape: size <= d}  t(k..i, shape, s) + F(s-1, i+1, d - size)

and T*(t_max) = min_s F(s, 0, D) + (B - 1) t_max (eq. 4). Candidate bottlenecks are the
table's finite costs in increasing order, taken in windows (the paper's epsilon, made
relative so it is unit-free): a window starts at the smallest candidate c not yet
covered and evaluates the largest candidate at most c (1 + epsilon). Every candidate
t then has an evaluated t_max in [t, t (1 + epsilon)]; at the optimum's bottleneck t*
the DP finds a sum no larger than the optimum's with a bottleneck at most
t* (1 + epsilon), so the answer is within a factor (1 + epsilon) of T*. (Evaluating
each window's smallest candidate, as a plain skip does, can miss that: a plan whose
bottleneck lies inside the window is only seen at the next window's start, where the
sum alone is minimised.) The enumeration starts at the first window any plan fits
(found by bisection: feasibility grows with t_max) and stops once B * c, or F_min +
(B - 1) c with F_min the least total of any plan, reaches the best T so far (no
bottleneck of c or more can win). `t(k..i, shape, s)` depends on s, the number of
stages from this one to the end, because 1F1B keeps min(s, B) microbatches of this
stage's activations in flight (eq. 5).

Optionally the boundaries between stages are priced too (`StageBoundary`: seconds
per microbatch to move the activations into a stage that starts at layer k, and their
gradients back, from a predecessor on the same node or on another). A boundary acts as
a pipeline stage of its own that only communicates: eq. 2 becomes

    T = sum_i (t_i + c_i) + (B - 1) * max(max_i t_i, max_i c_i)

so a transfer lengthens the pipeline's fill and drain, and bounds its rate only when
it is slower than every stage (it overlaps the next microbatch's compute otherwise).

Which neighbours share a node is the DP's choice, not a consequence of placing stages
in order. A *run* is a maximal group of consecutive one-node pieces (fewer than M
devices) on one node; a piece of a whole node or more is alone. The state gains q, the
size of the run the stage at k opens, counting the stages after it in the run (q = M:
nothing may join it):

    F(s, k, d, q) = min over stages k..i of shape h (size m):
        t + c_inter(i+1) + min_q' F(s-1, i+1, d-m, q')   -> q = min(m, M)   (apart)
        t + c_intra(i+1) + F(s-1, i+1, d-m, q - m)          if m < M       (joined)

Powers of two that add up to a multiple of M always fill whole nodes (`_submesh`),
but runs need not be powers of two: runs of 3, 3 and 2 devices do not fill two nodes
of 4. The DP is therefore a relaxation (every real placement is one of its solutions,
at its true cost); when the optimum's runs pack (`_submesh.pack_runs`, exact) it is
the optimum, placed so (`place_submeshes(..., runs=)`). When they do not, that pass
is solved again closing runs only at powers of two, which always pack, and the result
says whether that could have cost anything (`placement_exact`). This places any
multiset of allowed shapes, e.g. [2, 4, 2] on 2 nodes of 4 (the two 2s share a node),
which placing in order cannot. On one node every neighbour shares it: one state.
With runs, each pass first solves its one-state relaxation (every boundary at its
cheaper link) and is skipped when that bound cannot beat the best plan so far.

Each stage count s is one (min, +) step over the table entries at most t_max (a
gather and `reduceat`s, `_solve_fixed`): O(S * entries * D * M) per bottleneck, with
no Python loop over layers, devices or run states (`benchmarks/bench_stage_dp.py` times a
pass against a loop reference).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ._submesh import node_block, pack_node_groups

INF = np.inf


@dataclass(frozen=True, slots=True)
class StageChoice:
    first: int      # first layer (inclusive)
    last: int       # last layer (inclusive)
    shape: int      # index into the submesh shapes
    cost_s: float   # t for this stage
    boundary_s: float = 0.0  # c: moving its inputs in and their gradients back, per microbatch


@dataclass(frozen=True, slots=True)
class StageBoundary:
    """Seconds per microbatch to move the activations into a stage that starts at layer
    k, and their gradients back, from a predecessor on the same node (`intra[k]`) or
    on another (`inter[k]`); zero at k = 0."""

    intra: np.ndarray   # (L,)
    inter: np.ndarray   # (L,)


@dataclass(frozen=True, slots=True)
class DPResult:
    latency_s: float                  # T* (eq. 2), inf when nothing is feasible
    stages: tuple[StageChoice, ...]
    t_max_s: float
    candidates_evaluated: int         # windows passed over (not the bisection's or F_min's passes)
    # Stage indices that share a node, in pipeline order (with boundaries priced; one
    # run per stage otherwise): `_submesh.place_submeshes(..., runs=)` places them.
    runs: tuple[tuple[int, ...], ...] = ()
    # False when the relaxation's runs did not pack and the power-of-two runs that
    # replaced them cost more: the plan may then be above the optimum (module doc).
    placement_exact: bool = True


def pipeline_latency_s(costs: Sequence[float], microbatches: int, boundaries: Sequence[float] = ()) -> float:
    """Eq. 2 for given stage latencies, with boundary transfers as stages of their own."""
    return float(sum(costs) + sum(boundaries) + (microbatches - 1) * max(max(costs), max(boundaries, default=0.0)))


def bubble_fraction(costs: Sequence[float], microbatches: int) -> float:
    """Idle share of the pipeline: 1 - (work done) / (stages x iteration time), eq. 2."""
    if not costs:
        return 0.0
    busy = microbatches * sum(costs)
    return 1.0 - busy / (len(costs) * pipeline_latency_s(costs, microbatches))


def stage_dp(cost: np.ndarray, sizes: Sequence[int], num_devices: int, microbatches: int,
             epsilon: float = 1e-6, max_stages: int | None = None, boundary: StageBoundary | None = None,
             devices_per_node: int | None = None) -> DPResult:
    """Solve eq. 2 over `cost[k, i, shape, s-1]` = t(layers k..i, shape, s stages from here).

    `cost` has shape (L, L, num_shapes, S_max); entries with i < k or infeasible are inf.
    `boundary` (optional) prices the transfer into each stage by whether its
    predecessor shares its node; `devices_per_node` (default: one node of every
    device) is the node size the stages' runs pack into (see the module doc).
    """
    unit = device_unit(sizes, num_devices, devices_per_node or num_devices, boundary is not None)
    if unit > 1:
        return stage_dp(cost, [int(m) // unit for m in sizes], num_devices // unit, microbatches, epsilon, max_stages,
                        boundary, max(1, (devices_per_node or num_devices) // unit))
    num_layers, _, num_shapes, s_max = cost.shape
    s_max = min(s_max, num_layers, num_devices, max_stages or s_max)
    sizes = np.asarray(sizes, dtype=int)
    finite = _bottleneck_candidates(cost, boundary)
    per_node = devices_per_node or num_devices
    best = DPResult(INF, (), INF, 0)
    evaluated = 0
    unsure = INF   # the least latency a pass whose fallback cost something could have missed
    # With runs to track, each pass first solves its one-state relaxation (every
    # boundary at its cheaper link): a pass whose bound cannot beat the best is skipped.
    bound_first = boundary is not None and per_node < num_devices
    if bound_first:
        cheap = np.minimum(boundary.intra, boundary.inter)
        relaxation = StageBoundary(cheap, cheap)
    # Two bounds that only skip passes which cannot win. Feasibility grows with t_max,
    # so the first window worth a pass is found by bisection (the relaxation, when there
    # are runs, is feasible wherever the real pass is). And the least total of any plan,
    # F(t_max = the largest candidate), bounds every window from below together with
    # its bottleneck: the scan ends once floor + (B - 1) x low cannot beat the best
    # (Llama-3 70B on 256 H100s: most of the ~270 passes a plan made were below the
    # first feasible window or above that line).
    loose = (relaxation, num_devices) if bound_first else (boundary, per_node)

    def floor_at(t: float) -> float:
        return _solve_fixed(cost, sizes, num_devices, s_max, t, *loose)[0]

    floor = floor_at(finite[-1]) if len(finite) else INF
    if not math.isfinite(floor):
        return DPResult(INF, (), INF, 0, (), True)
    lo, hi = 0, len(finite) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if math.isfinite(floor_at(finite[mid])):
            hi = mid
        else:
            lo = mid + 1
    for low, t_max in bottleneck_windows(finite, epsilon, lo):
        # A plan whose bottleneck is at least `low` has a total of at least low and floor.
        if max(floor, low) + (microbatches - 1) * low >= best.latency_s:
            break
        evaluated += 1
        if bound_first:
            lower, _, _ = _solve_fixed(cost, sizes, num_devices, s_max, t_max, relaxation, num_devices)
            if lower + (microbatches - 1) * low >= best.latency_s:
                continue  # every plan whose bottleneck lies in this window is slower than the best
        total, stages, runs = _solve_fixed(cost, sizes, num_devices, s_max, t_max, boundary, per_node)
        if stages is not None and boundary is not None and not _runs_pack(stages, runs, sizes, num_devices, per_node):
            # The relaxation's node groups do not fit the nodes: close runs at powers of
            # two only, which always pack (`_submesh.pack_runs`), and say whether that cost anything.
            relaxed = total
            total, stages, runs = _solve_fixed(cost, sizes, num_devices, s_max, t_max, boundary, per_node,
                                               pow2_runs=True)
            if not (stages is not None and total <= relaxed * (1 + 1e-12)):
                unsure = min(unsure, relaxed + (microbatches - 1) * low)
        if stages is None:
            continue
        # Eq. 4 with the bottleneck actually reached (never above t_max).
        latency = pipeline_latency_s([c.cost_s for c in stages], microbatches, [c.boundary_s for c in stages])
        if latency < best.latency_s:
            reached = max(max(c.cost_s for c in stages), max(c.boundary_s for c in stages))
            best = DPResult(latency, tuple(stages), reached, evaluated, runs)
    exact = unsure >= best.latency_s * (1 - 1e-12)
    return DPResult(best.latency_s, best.stages, best.t_max_s, evaluated, best.runs, bool(exact))


def bottleneck_windows(finite: np.ndarray, epsilon: float, start: int = 0) -> Iterator[tuple[float, float]]:
    """(low, t_max) of each bottleneck window of the sorted candidates `finite` from
    index `start` (module doc): `low` its smallest candidate, `t_max` the largest
    within low (1 + epsilon), which the window evaluates."""
    while start < len(finite):
        end = max(start, int(np.searchsorted(finite, finite[start] * (1 + epsilon), side="right")) - 1)
        yield float(finite[start]), float(finite[end])
        start = end + 1


def device_unit(sizes: Sequence[int], num_devices: int, per_node: int, runs: bool) -> int:
    """The device count every stage size and the cluster are whole multiples of, when
    the DP may count in it instead of devices: the states F(s, k, d) then number
    D / unit, not D (a Megatron layout's one stage size of 1,024 devices on 16,384:
    17, not 16,385). Exact where the nodes are whole units or the units whole nodes:
    a run's devices on its node, a piece's being a whole node, and (with runs) a
    power-of-two size dividing the node are the same facts counted in units; so the
    unit must be a power of two when it divides the node. 1: count devices."""
    unit = math.gcd(num_devices, *(int(m) for m in sizes))
    if unit <= 1:
        return 1
    if unit % per_node == 0:
        return unit
    if per_node % unit == 0 and (not runs or unit & (unit - 1) == 0):
        return unit
    return 1


def _bottleneck_candidates(cost: np.ndarray, boundary: StageBoundary | None) -> np.ndarray:
    """Every value the bottleneck can take: a stage latency or a boundary transfer."""
    finite = cost[np.isfinite(cost)]
    if boundary is not None:
        both = np.r_[boundary.intra, boundary.inter]
        finite = np.concatenate([finite, both[(both > 0) & np.isfinite(both)]])
    return np.unique(finite)


def _solve_fixed(cost: np.ndarray, sizes: np.ndarray, num_devices: int, s_max: int, t_max: float,
                 boundary: StageBoundary | None = None, devices_per_node: int | None = None,
                 pow2_runs: bool = False):
    """One bottleneck pass: F(s, k, d, q) for s = 1.. (module doc), as one gather over
    the table entries that are at most t_max per stage count, then a min per first layer k.

    Only entries with cost <= t_max take part (sorted by k, then shape, then i, so that
    ties go to the smallest shape and then the shortest stage); each contributes its
    cost, the boundary into its successor and the best rest F(s-1, i+1, d - size, q')
    for every d and run state at once, and `minimum.reduceat` over each k's run of
    entries gives F(s, k, d, q). The entry that attains a state is found again only
    for the states the optimum passes through (`_backtrack`). Without boundaries, or on
    one node (every neighbour then shares the node), there is one run state.
    `pow2_runs` closes only runs whose size is a power of two dividing M, or a whole
    node (they always pack, `_submesh.pack_runs`). Returns (total, stages, runs) or (inf, None, None)."""
    num_layers = cost.shape[0]
    d_count = num_devices + 1
    sizes = np.asarray(sizes, dtype=int)
    rules = _run_rules(sizes, num_layers, num_devices, t_max, boundary, devices_per_node or num_devices, pow2_runs)
    q_count = rules.q_count
    by_khi = cost.transpose(0, 2, 1, 3)
    prev = np.full((num_layers + 1, d_count, q_count), INF)
    prev[num_layers, 0, q_count - 1] = 0.0
    levels, entries = [prev], [None]
    best_total, best_s, best_q = INF, 0, 0
    rest = np.full((len(sizes), num_layers + 1, d_count), INF)   # [h, j, d] = closed prev[j, d - size_h]
    shifted = np.full((num_layers + 1, d_count, q_count), INF)    # [j, d, q] = prev[j, d - size, q], per join
    for s in range(1, s_max + 1):
        if not np.isfinite(prev).any():
            break  # no way to fill the rest with s-1 stages, so none with more
        rest_ok = np.isfinite(prev).any(axis=(1, 2))[1:]              # by i
        k, h, i = np.nonzero((by_khi[:, :, :, s - 1] <= t_max) & rest_ok[None, None, :])
        if len(k) == 0:
            break
        # The successor on another node (its run closed): its best closable state.
        closed = np.where(rules.closable, prev, INF).min(axis=2) if q_count > 1 else prev[:, :, 0]
        for hh, size in enumerate(sizes):
            if size < d_count:
                rest[hh, :, size:] = closed[:, :d_count - size]
        base = cost[k, i, h, s - 1]
        fs = np.full((num_layers + 1, d_count, q_count), INF)
        # Groups of entries with one first layer and shape (the pass's sort keeps them together).
        starts = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (h[1:] != h[:-1])])
        gk, gh = k[starts], h[starts]
        apart = np.minimum.reduceat((base + rules.inter[i + 1])[:, None] + rest[h, i + 1], starts, axis=0)
        for hh in np.unique(gh):   # each shape's first layers are distinct
            g = np.flatnonzero(gh == hh)
            q_new = rules.new_q[hh]
            fs[gk[g], :, q_new] = np.minimum(fs[gk[g], :, q_new], apart[g])
        for hh in rules.small:  # the successor on this stage's node: run state q' -> q' + size
            m = int(sizes[hh])
            e = np.flatnonzero((h == hh) & (i + 1 < num_layers))
            if len(e) == 0:
                continue
            ke = k[e]
            first = np.flatnonzero(np.r_[True, ke[1:] != ke[:-1]])
            shifted[:, :m], shifted[:, m:] = INF, prev[:, :d_count - m]
            joined = np.minimum.reduceat((base[e] + rules.intra[i[e] + 1])[:, None, None] +
                                         shifted[i[e] + 1, :, 1:q_count - m], first, axis=0)
            fs[ke[first], :, m + 1:] = np.minimum(fs[ke[first], :, m + 1:], joined)
        levels.append(fs)
        entries.append((k, h, i))
        prev = fs
        top = np.where(rules.closable, fs[0, num_devices], INF)
        if top.min() < best_total:
            best_total, best_s, best_q = float(top.min()), s, int(np.argmin(top))
    if not np.isfinite(best_total):
        return INF, None, None
    stages, runs = _backtrack(cost, rules, levels, entries, best_s, best_q, num_devices)
    return best_total, stages, runs


def _run_rules(sizes: np.ndarray, num_layers: int, num_devices: int, t_max: float, boundary: StageBoundary | None,
               per_node: int, pow2_runs: bool) -> _RunRules:
    """The run states of one bottleneck pass (`_solve_fixed`): one state without
    boundaries or on one node; else a run's devices on its node so far, with the
    boundary into each layer over t_max excluded."""
    pad = np.zeros(1)
    if boundary is None:
        intra = inter = np.zeros(num_layers + 1)
    else:
        intra = np.r_[np.where(boundary.intra <= t_max, boundary.intra, INF), pad]   # into layer j; j = L: none
        inter = np.r_[np.where(boundary.inter <= t_max, boundary.inter, INF), pad]
    if boundary is None or per_node >= num_devices:
        return _RunRules(sizes, np.zeros(len(sizes), int), np.ones(1, bool), intra, intra, (),
                         priced=boundary is not None)
    q = np.arange(per_node + 1)
    block = node_block(per_node)
    closable = ((q >= 1) & ((q & (q - 1)) == 0) & (q <= block)) | (q == per_node) if pow2_runs else q >= 1
    # The run state a stage of each shape starts: its own size, or "full" (q = M) for a
    # piece of a whole node or more, which nothing joins.
    return _RunRules(sizes, np.minimum(sizes, per_node), closable, intra, inter,
                     tuple(hh for hh, m in enumerate(sizes) if m < per_node), priced=True)


@dataclass(frozen=True, slots=True)
class _RunRules:
    """How one bottleneck pass moves between run states (`_solve_fixed`)."""

    sizes: np.ndarray
    new_q: np.ndarray       # by shape: the state a stage that does not join its successor opens
    closable: np.ndarray    # by state: whether a run of that size may be closed
    intra: np.ndarray       # (L + 1,): into layer j from the same node, inf above t_max
    inter: np.ndarray       # ... from another node
    small: tuple[int, ...]  # shapes that may join their successor's node
    priced: bool            # boundaries are priced (the plan then places by runs)

    @property
    def q_count(self) -> int:
        """Run states: 1 (no runs), or 0..M with 0 unused."""
        return len(self.closable)


def _backtrack(cost, rules: _RunRules, levels, entries, s_top: int, q_top: int, num_devices: int):
    """The optimum's stages and runs, from the stored F levels: at each visited state the
    first entry (in the pass's tie order) whose value attains it."""
    num_layers = cost.shape[0]
    stages, runs, k, d, q, joined = [], [], 0, num_devices, q_top, False
    for s in range(s_top, 0, -1):
        ks, hs, is_ = entries[s]
        prev, want = levels[s - 1], levels[s][k, d, q]
        for e in np.flatnonzero(ks == k):
            h, i = int(hs[e]), int(is_[e])
            m = int(rules.sizes[h])
            if m > d:
                continue
            base = float(cost[k, i, h, s - 1])
            if q == rules.new_q[h]:
                closed = np.where(rules.closable, prev[i + 1, d - m], INF)
                nxt = int(np.argmin(closed))
                if base + rules.inter[i + 1] + closed[nxt] == want:
                    break
            elif h in rules.small and q > m and i + 1 < num_layers:
                nxt = q - m
                if base + rules.intra[i + 1] + prev[i + 1, d - m, nxt] == want:
                    break
        else:  # unreachable: `want` was computed from these same entries
            raise AssertionError(f"no entry attains F({s}, {k}, {d}, {q}) = {want}")
        into = 0.0 if k == 0 else float((rules.intra if joined else rules.inter)[k])
        stages.append(StageChoice(k, i, h, base, into))
        if joined:
            runs[-1].append(len(stages) - 1)
        else:
            runs.append([len(stages) - 1])
        joined = q != rules.new_q[h] or rules.q_count == 1   # the next stage shares this one's node
        k, d, q = i + 1, d - m, nxt
    if rules.q_count == 1:   # one node holds them all, or nothing is priced
        runs = [list(range(len(stages)))] if rules.priced else []
    return stages, tuple(tuple(r) for r in runs)


def _runs_pack(stages: Sequence[StageChoice], runs: Sequence[Sequence[int]], sizes: np.ndarray,
               num_devices: int, per_node: int) -> bool:
    """Whether the one-node runs fill the nodes the several-node pieces leave."""
    pieces = [int(sizes[st.shape]) for st in stages]
    return pack_node_groups(pieces, runs, num_devices // per_node, per_node) is not None


def equal_layer_dp(cost: np.ndarray, sizes: Sequence[int], num_devices: int, microbatches: int,
                   epsilon: float = 1e-6, max_stages: int | None = None, stages: int | None = None,
                   boundary: StageBoundary | None = None, devices_per_node: int | None = None) -> DPResult:
    """The paper's "equal layer" ablation: every stage holds the same number of layers
    (L/S, or its floor and ceiling when S does not divide L); the DP still picks the
    submeshes. The best S wins, or S = `stages` when given."""
    num_layers = cost.shape[0]
    k, i = np.indices((num_layers, num_layers))
    length = i - k + 1
    best = DPResult(INF, (), INF, 0)
    evaluated = 0
    s_top = min(cost.shape[3], num_layers, num_devices, max_stages or num_layers)
    for s in ([stages] if stages else range(1, s_top + 1)):
        ok = (length == num_layers // s) | (length == -(-num_layers // s))
        masked = np.where(ok[:, :, None, None], cost, INF)
        r = stage_dp(masked, sizes, num_devices, microbatches, epsilon, max_stages=s, boundary=boundary,
                     devices_per_node=devices_per_node)
        evaluated += r.candidates_evaluated
        if r.latency_s < best.latency_s:
            best = r
    return DPResult(best.latency_s, best.stages, best.t_max_s, evaluated, best.runs, best.placement_exact)

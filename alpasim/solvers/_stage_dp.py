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
sum alone is minimised.) The enumeration stops once B * c >= the best T so far (no
bottleneck of c or more can win). `t(k..i, shape, s)` depends on s, the number of
stages from this one to the end, because 1F1B keeps min(s, B) microbatches of this
stage's activations in flight (eq. 5).

Optionally the boundaries between stages are priced too (`boundary[k, d]`: seconds
per microbatch to move the activations into a stage that starts at layer k with d
devices left for it and its successors, and their gradients back). A boundary acts as
a pipeline stage of its own that only communicates: eq. 2 becomes

    T = sum_i (t_i + c_i) + (B - 1) * max(max_i t_i, max_i c_i)

so a transfer lengthens the pipeline's fill and drain, and bounds its rate only when
it is slower than every stage (it overlaps the next microbatch's compute otherwise).
Stages are then placed on devices in order (`_submesh.place_submeshes`): a stage
starting at layer k on d remaining devices starts at device D - d, which fixes whether
its boundary crosses nodes, and a stage that would straddle a node boundary is not
allowed (`devices_per_node`).

Each stage count s is one (min, +) step over the table entries at most t_max (a
gather and two `reduceat`s, `_solve_fixed`): O(S * entries * D) per bottleneck, with
no Python loop over layers, shapes or devices (`benchmarks/bench_stage_dp.py` times a
pass against a loop reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._submesh import starts_cleanly

INF = np.inf


@dataclass(frozen=True, slots=True)
class StageChoice:
    first: int      # first layer (inclusive)
    last: int       # last layer (inclusive)
    shape: int      # index into the submesh shapes
    cost_s: float   # t for this stage
    boundary_s: float = 0.0  # c: moving its inputs in and their gradients back, per microbatch


@dataclass(frozen=True, slots=True)
class DPResult:
    latency_s: float                  # T* (eq. 2), inf when nothing is feasible
    stages: tuple[StageChoice, ...]
    t_max_s: float
    candidates_evaluated: int


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
             epsilon: float = 1e-6, max_stages: int | None = None, boundary: np.ndarray | None = None,
             devices_per_node: int | None = None) -> DPResult:
    """Solve eq. 2 over `cost[k, i, shape, s-1]` = t(layers k..i, shape, s stages from here).

    `cost` has shape (L, L, num_shapes, S_max); entries with i < k or infeasible are inf.
    `boundary` (shape (L, D + 1), optional) prices the transfer into a stage starting
    at layer k with d devices remaining; `devices_per_node` places stages in order
    without straddling nodes (see the module doc).
    """
    num_layers, _, num_shapes, s_max = cost.shape
    s_max = min(s_max, num_layers, num_devices, max_stages or s_max)
    sizes = np.asarray(sizes, dtype=int)
    finite = _bottleneck_candidates(cost, boundary)
    best = DPResult(INF, (), INF, 0)
    evaluated = 0
    start = 0
    while start < len(finite):
        if microbatches * finite[start] >= best.latency_s:
            break
        # The window's last candidate: every candidate of the window is within (1 + eps) below it.
        end = max(start, int(np.searchsorted(finite, finite[start] * (1 + epsilon), side="right")) - 1)
        t_max, start = finite[end], end + 1
        evaluated += 1
        total, stages = _solve_fixed(cost, sizes, num_devices, s_max, t_max, boundary, devices_per_node)
        if stages is None:
            continue
        # Eq. 4 with the bottleneck actually reached (never above t_max).
        latency = pipeline_latency_s([c.cost_s for c in stages], microbatches, [c.boundary_s for c in stages])
        if latency < best.latency_s:
            reached = max(max(c.cost_s for c in stages), max(c.boundary_s for c in stages))
            best = DPResult(latency, tuple(stages), reached, evaluated)
    return DPResult(best.latency_s, best.stages, best.t_max_s, evaluated)


def _bottleneck_candidates(cost: np.ndarray, boundary: np.ndarray | None) -> np.ndarray:
    """Every value the bottleneck can take: a stage latency or a boundary transfer."""
    finite = cost[np.isfinite(cost)]
    if boundary is not None:
        finite = np.concatenate([finite, boundary[boundary > 0]])
    return np.unique(finite)


def _placeable(sizes: np.ndarray, num_devices: int, devices_per_node: int | None) -> np.ndarray:
    """ok[h, d]: a piece of sizes[h] may start at device D - d (`starts_cleanly`)."""
    if devices_per_node is None:
        return np.ones((len(sizes), num_devices + 1), dtype=bool)
    return np.array([[starts_cleanly(int(size), num_devices - d, devices_per_node) for d in range(num_devices + 1)]
                     for size in sizes])


def _solve_fixed(cost: np.ndarray, sizes: np.ndarray, num_devices: int, s_max: int, t_max: float,
                 boundary: np.ndarray | None = None, devices_per_node: int | None = None):
    """One bottleneck pass: F(s, k, d) for s = 1.. (module doc), as one gather over the
    table entries that are at most t_max per stage count, then a min per first layer k.

    Only entries with cost <= t_max take part (sorted by k, then shape, then i, so that
    ties go to the smallest shape and then the shortest stage); each contributes its
    cost, the boundary into it and the best rest F(s-1, i+1, d - size) for every d at
    once, and `minimum.reduceat` over each k's run of entries gives F(s, k, d) and, by
    a second reduceat over the positions attaining it, the entry that did."""
    num_layers = cost.shape[0]
    d_count = num_devices + 1
    sizes = np.asarray(sizes, dtype=int)
    if boundary is None:
        boundary = np.zeros((num_layers, d_count))
    link = np.where(boundary <= t_max, boundary, INF)              # (k, d): a boundary above t_max is out
    placeable = _placeable(sizes, num_devices, devices_per_node)   # (h, d)
    entry = link[None, :, :] + np.where(placeable, 0.0, INF)[:, None, :]      # (h, k, d)
    # by_khi[k, h, i, s]: the table with shapes before layers ends, in the order ties break.
    by_khi = cost.transpose(0, 2, 1, 3)
    prev = np.full((num_layers + 1, d_count), INF)
    prev[num_layers, 0] = 0.0
    choices: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, int), np.zeros(0, int))]
    best_total, best_s = INF, 0
    shifted = np.full((len(sizes), num_layers + 1, d_count), INF)   # [h, j, d] = prev[j, d - size_h]
    for s in range(1, s_max + 1):
        if not np.isfinite(prev).any():
            break  # no way to fill the rest with s-1 stages, so none with more
        # Entries whose rest (layers i+1.. in s-1 stages) is possible on some device count.
        rest_ok = np.isfinite(prev).any(axis=1)[1:]                  # by i
        k, h, i = np.nonzero((by_khi[:, :, :, s - 1] <= t_max) & rest_ok[None, None, :])
        if len(k) == 0:
            break
        for hh, size in enumerate(sizes):
            if size < d_count:
                shifted[hh, :, size:] = prev[:, :d_count - size]
        vals = cost[k, i, h, s - 1][:, None] + entry[h, k] + shifted[h, i + 1]        # (E, d)
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        firsts = k[starts]
        mins = np.minimum.reduceat(vals, starts, axis=0)                            # (G, d)
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(k)]))
        position = np.where(vals == mins[group], np.arange(len(k))[:, None], len(k))
        winner = np.minimum.reduceat(position, starts, axis=0)                      # (G, d) entry index
        winner = np.where(np.isfinite(mins), winner, 0)
        fs = np.full((num_layers + 1, d_count), INF)
        fs[firsts] = mins
        arg_i = np.full((num_layers + 1, d_count), -1)
        arg_h = np.full((num_layers + 1, d_count), -1)
        arg_i[firsts] = i[winner]
        arg_h[firsts] = h[winner]
        choices.append((arg_i, arg_h))
        prev = fs
        if fs[0, num_devices] < best_total:
            best_total, best_s = fs[0, num_devices], s
    if not np.isfinite(best_total):
        return INF, None
    stages, k, d = [], 0, num_devices
    for s in range(best_s, 0, -1):
        i, h = choices[s][0][k, d], choices[s][1][k, d]
        stages.append(StageChoice(int(k), int(i), int(h), float(cost[k, i, h, s - 1]), float(boundary[k, d])))
        k, d = i + 1, d - int(sizes[h])
    return best_total, stages


def equal_layer_dp(cost: np.ndarray, sizes: Sequence[int], num_devices: int, microbatches: int,
                   epsilon: float = 1e-6, max_stages: int | None = None, stages: int | None = None,
                   boundary: np.ndarray | None = None, devices_per_node: int | None = None) -> DPResult:
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
    return DPResult(best.latency_s, best.stages, best.t_max_s, evaluated)

"""Operator clustering: cut the forward op sequence into L layers (seed 3.4.8, eq. 6).

The inter-op DP is polynomial in the number of layers, so the K forward operators are
first grouped into L << K contiguous layers. The dynamic program

    G(k, r) = min_{i <= k} max(G(i-1, r-1), C(i, k))
              subject to FLOP(o_i..o_k) <= (1 + delta) * FLOP_total / L

minimises the largest amount of data any layer receives from earlier operators,
C(i, k) = bytes of distinct tensors read by o_i..o_k that o_1..o_{i-1} produced, so that
stage boundaries fall where little data crosses. Among equally good cuts it prefers
the most uniform per-layer FLOPs (smallest sum of squares — the paper's variance
tie-break). If no cut satisfies the FLOP bound, delta is doubled until one does and
the delta used is reported.

C is built column by column in O(K^2) with numpy and the DP is O(K^2 L) vector work;
parameters and graph inputs are not "data from earlier operators" and do not count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._primitives import op_flops
from ._types import OpGraph

# Relative tolerance under which two communication costs count as equal (then the
# FLOP-variance tie-break decides).
COST_TIE_RTOL = 1e-9


@dataclass(frozen=True, slots=True)
class Clustering:
    """Result of the clustering DP: layer of each forward op and the costs it achieved."""

    layer_of: tuple[int, ...]
    boundaries: tuple[int, ...]  # index of the first op of each layer
    max_received_bytes: float
    layer_flops: tuple[float, ...]
    delta: float


def received_bytes_matrix(graph: OpGraph, ops=None) -> np.ndarray:
    """C[i, k]: bytes read by ops i..k that were produced by ops before i (i <= k)."""
    ops = list(graph.ops if ops is None else ops)
    k_total = len(ops)
    pos = {t: j for j, op in enumerate(ops) for t in op.outputs}
    last_seen: dict[str, int] = {}
    c = np.zeros((k_total, k_total))
    col = np.zeros(k_total)
    for k, op in enumerate(ops):
        for t in dict.fromkeys(op.inputs):
            p = pos.get(t)
            if p is None:
                continue
            # t counts for clusters starting at i in (previous reader or producer, k].
            lo = max(p, last_seen.get(t, p)) + 1
            col[lo:k + 1] += graph.tensors[t].nbytes
            last_seen[t] = k
        c[:k + 1, k] = col[:k + 1]
    return c


def cluster_ops(graph: OpGraph, num_layers: int, delta: float = 0.25) -> Clustering:
    """Run the eq. 6 DP over the forward ops of `graph`."""
    ops = [op for op in graph.ops if op.phase == "forward"]
    k_total = len(ops)
    if not 1 <= num_layers <= k_total:
        raise ValueError(f"cannot cluster {k_total} forward ops into {num_layers} layers "
                         f"(choose 1..{k_total})")
    flops = np.array([op_flops(op, graph.tensors) for op in ops])
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    c = received_bytes_matrix(graph, ops)
    while True:
        result = _solve(c, prefix, num_layers, delta)
        if result is not None:
            break
        delta = delta * 2 if delta > 0 else 0.25
    boundaries, max_cost = result
    layer_of = np.zeros(k_total, dtype=int)
    for r, start in enumerate(boundaries):
        layer_of[start:] = r
    layer_flops = tuple(float(prefix[e] - prefix[s]) for s, e in zip(boundaries, list(boundaries[1:]) + [k_total]))
    return Clustering(tuple(int(x) for x in layer_of), tuple(boundaries), float(max_cost), layer_flops, delta)


def _solve(c: np.ndarray, prefix: np.ndarray, num_layers: int, delta: float):
    """Two passes: the bottleneck DP for G*, then the most uniform cut under G*.

    Minimising (max received, sum of squared FLOPs) lexicographically is not
    decomposable in one pass (a prefix with a worse bottleneck may still be under the
    final one), but each pass alone is: first the eq. 6 recursion, then a min-sum DP
    over the layers whose received bytes stay within G*.
    """
    bottleneck = _pass(c, prefix, num_layers, delta, limit=None)
    if bottleneck is None:
        return None
    best_cost = bottleneck[1]
    return _pass(c, prefix, num_layers, delta, limit=best_cost * (1 + COST_TIE_RTOL) + 1e-12)


def _pass(c: np.ndarray, prefix: np.ndarray, num_layers: int, delta: float, limit: float | None):
    k_total = c.shape[0]
    cap = (1 + delta) * prefix[-1] / num_layers * (1 + 1e-12)
    inf = np.inf
    # best[r][k]: objective for ops 0..k-1 in r layers (max received, or with a
    # `limit` on received bytes, the sum of squared layer FLOPs); worst[r][k] the
    # largest received bytes of that solution.
    best = np.full((num_layers + 1, k_total + 1), inf)
    worst = np.full((num_layers + 1, k_total + 1), inf)
    choice = np.zeros((num_layers + 1, k_total + 1), dtype=int)
    best[0, 0] = 0.0
    worst[0, 0] = 0.0
    for r in range(1, num_layers + 1):
        for k in range(r, k_total - (num_layers - r) + 1):
            # The last layer is ops i..k-1 (0-based).
            lo = max(r - 1, int(np.searchsorted(prefix, prefix[k] - cap, "left")))
            if lo >= k:
                continue
            i = np.arange(lo, k)
            seg = prefix[k] - prefix[i]
            recv = c[i, k - 1]
            ok = (seg <= cap) & np.isfinite(best[r - 1, i])
            if limit is None:
                value = np.where(ok, np.maximum(best[r - 1, i], recv), inf)
            else:
                value = np.where(ok & (recv <= limit), best[r - 1, i] + seg ** 2, inf)
            j = int(np.argmin(value))
            if not np.isfinite(value[j]):
                continue
            best[r, k] = value[j]
            worst[r, k] = max(worst[r - 1, i[j]], recv[j])
            choice[r, k] = i[j]
    if not np.isfinite(best[num_layers, k_total]):
        return None
    bounds = []
    k = k_total
    for r in range(num_layers, 0, -1):
        i = choice[r, k]
        bounds.append(int(i))
        k = i
    return bounds[::-1], worst[num_layers, k_total]


def assign_layers(graph: OpGraph, num_layers: int, delta: float = 0.25) -> tuple[OpGraph, Clustering]:
    """A copy of a forward graph with each op's `layer` set by the clustering DP."""
    if any(op.phase != "forward" for op in graph.ops):
        raise ValueError("cluster the forward graph before deriving backward and update ops")
    result = cluster_ops(graph, num_layers, delta)
    ops = [op.replace(layer=layer) for op, layer in zip(graph.ops, result.layer_of)]
    return graph.replace(ops=ops), result

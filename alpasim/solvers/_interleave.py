"""Interleaved 1F1B in the planner: the model cut into S x v chunks, chunk j on mesh j mod S.

The paper's DP prices one linear 1F1B pipeline (seed 6.1). Megatron-LM's interleaving
(Narayanan et al., SC'21, sec. 2.2) deals S x v contiguous model chunks round-robin to S
meshes, so each mesh runs v chunks and the pipeline's fill and drain shrink v-fold, at
the price of v times as many boundary messages and of the warm-up microbatches every
mesh then holds. Megatron-core, like this search, gives every mesh the same shape.

For a submesh shape h whose size divides the cluster (S meshes) and a chunk count v,
the search is the stage DP's (`_stage_dp._solve_fixed`) with every slice counted as one
"device" of S x v: it slices the layers into exactly S x v chunks, each at most a
bottleneck t_max, with the least sum. Each chunk is priced at the table depth of its
memory: the most microbatches of that chunk its mesh's order holds (`most_live` on
`interleaved_order`), so a chunk runs the fastest option that fits with that many in
flight. A mesh holds all of its chunks, so every solution is then checked against the
order's own liveness (`order_peak_bytes`: the simulator's rule) plus the chunks'
states; solutions that do not fit are dropped. What remains is ranked by the iteration
its orders take with free compute placement (`order_makespan`: every pass as soon as
its mesh is free and its input has arrived, each boundary crossing costing the stage
DP's boundary price), which equals the simulator's with free communication when the
boundary prices are zero.

Windows are ranked first by a proxy, Σ t / v + (B - 1/v) max over meshes of their
chunks' sum (eq. 2 at v = 1, Megatron's B v t + (S - 1) t for balanced chunks), and the
`CHECKED_SOLUTIONS` best are checked exactly. The scan stops once a window's bound,
F / v + (B - 1/v) max(F / S, its smallest bottleneck) with F the least sum of any
slicing, cannot enter them: a heuristic bound (a window's answer may lie below its
smallest candidate), so the search is not exact the way the 1F1B DP is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from alpasim.costmodels import Cluster, StageMemory

from ._pipeline_orders import Order, interleaved_order, most_live, order_peak_bytes
from ._stage_dp import INF, StageChoice, _bottleneck_candidates, _solve_fixed, bottleneck_windows

# Chunks per mesh the planner tries. Megatron-LM's runs use 2-4 (more chunks cut the
# bubble further but multiply the boundary messages).
DEFAULT_CHUNK_OPTIONS = (2, 3, 4)
# Solutions per (shape, chunks) checked exactly (memory, makespan), best proxy first.
CHECKED_SOLUTIONS = 8


@dataclass(frozen=True, slots=True)
class InterleavedChoice:
    """The best interleaved slicing found for one submesh shape and chunk count."""

    chunks: int
    shape: int                          # index into the cost table's shapes
    stages: tuple[StageChoice, ...]     # S x v chunks in pipeline order (chunk j on mesh j mod S)
    depths: tuple[int, ...]             # the table depth (stages from here) each chunk's option is read at
    inflight: tuple[int, ...]           # per chunk: most of its microbatches in flight
    latency_s: float                    # `order_makespan` of the plan
    mesh_bytes: tuple[float, ...]       # per mesh: states plus the order's peak activations


def interleaved_proxy_s(costs: Sequence[float], meshes: int, chunks: int, microbatches: int) -> float:
    """Σ t / v + (B - 1/v) max_k Σ_c t(c S + k): eq. 2 at v = 1, Megatron's
    B v t + (S - 1) t for balanced chunks (module doc)."""
    per_mesh = [sum(costs[k::meshes]) for k in range(meshes)]
    return sum(costs) / chunks + (microbatches - 1 / chunks) * max(per_mesh)


def order_makespan(orders: Sequence[Order], forward: Sequence[float], backward: Sequence[float],
                   edge: Sequence[float] = ()) -> float:
    """When the last pass of `orders` (mesh k runs orders[k]; chunk c of mesh k is
    virtual stage c S + k) ends, each pass starting once its mesh is free and its input
    is there: forward j after forward j - 1 of the same microbatch, backward j after
    backward j + 1 (the last after its own forward). `forward[j]`/`backward[j]` are
    virtual stage j's pass times; `edge[j]` delays the activations into j and, as much
    again, the gradients out of it (half the stage DP's boundary price each way)."""
    S = len(orders)
    n = len(forward)
    edge = list(edge) or [0.0] * n
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * S
    pc = [0] * S
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for k, order in enumerate(orders):
            while pc[k] < len(order):
                phase, m, c = order[pc[k]]
                j = c * S + k
                if phase == "forward":
                    dep = ("forward", m, j - 1) if j > 0 else None
                    after = edge[j]
                else:
                    dep = ("backward", m, j + 1) if j + 1 < n else ("forward", m, j)
                    after = edge[j + 1] if j + 1 < n else 0.0
                if dep is not None and dep not in done:
                    break
                start = max(free[k], done[dep] + after if dep is not None else 0.0)
                free[k] = done[phase, m, j] = start + (forward[j] if phase == "forward" else backward[j])
                pc[k] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError("interleaved order deadlocked")
    return max(free)


def interleaved_dp(cost: np.ndarray, shape: int, meshes: int, chunks: int, microbatches: int, *,
                   chunk_memory: Callable[[StageChoice, int], StageMemory], memory_limit: float,
                   boundary: Callable[[int, int], float] | None = None,
                   epsilon: float = 1e-3) -> InterleavedChoice | None:
    """The fastest interleaved slicing of `cost[k, i, h, s-1]` (the stage cost table) on
    `meshes` meshes of shape `shape` with `chunks` chunks each, whose meshes fit
    `memory_limit` (module doc); None when none does.

    `chunk_memory(choice, depth)` is the `StageMemory` of one chunk running the option
    the table holds at `depth`; `boundary(j, layer)` is the seconds per microbatch of
    moving the activations into chunk j starting at `layer` and their gradients back."""
    num_layers = cost.shape[0]
    S, v, B = meshes, chunks, microbatches
    n = S * v
    if n > num_layers or S < 2:
        return None
    s_max = cost.shape[3]
    orders = [interleaved_order(S, B, k, v) for k in range(S)]
    live = [most_live(o, v) for o in orders]
    inflight = [live[j % S][j // S] for j in range(n)]
    depths = [max(1, min(x, s_max)) for x in inflight]
    # Slice s from the end is chunk j = n - s: its entries read at that chunk's depth.
    table = np.stack([cost[:, :, shape, depths[n - s] - 1] for s in range(1, n + 1)], axis=-1)[:, :, None, :]
    finite = _bottleneck_candidates(table, None)
    if not len(finite):
        return None
    floor, loosest, _ = _solve_fixed(table, np.ones(1, int), n, n, finite[-1])
    if not math.isfinite(floor):
        return None
    found: dict[tuple[StageChoice, ...], float] = {}     # solution -> proxy, the best few
    if n == num_layers:        # a chunk a layer (Llama 3's): one slicing, no windows to scan
        only = _on_shape(loosest, shape)
        found[only] = interleaved_proxy_s([c.cost_s for c in only], S, v, B)
        windows = ()
    else:
        windows = bottleneck_windows(finite, epsilon)
    for low, t_max in windows:
        worst = max(found.values()) if len(found) >= CHECKED_SOLUTIONS else INF
        if floor / v + (B - 1 / v) * max(floor / S, low) >= worst:
            break
        _, stages, _ = _solve_fixed(table, np.ones(1, int), n, n, t_max)
        if stages is None:
            continue
        stages = _on_shape(stages, shape)
        if stages in found:
            continue
        found[stages] = interleaved_proxy_s([c.cost_s for c in stages], S, v, B)
        if len(found) > CHECKED_SOLUTIONS:
            del found[max(found, key=found.get)]
    best_choice = None
    for stages in sorted(found, key=found.get):
        by_mesh = mesh_memory_bytes(orders, [chunk_memory(c, d) for c, d in zip(stages, depths, strict=True)])
        if max(by_mesh) > memory_limit:
            continue
        t = [c.cost_s for c in stages]
        edge = [0.0] + [boundary(j, stages[j].first) if boundary else 0.0 for j in range(1, n)]
        latency = order_makespan(orders, [x / 3 for x in t], [2 * x / 3 for x in t], [e / 2 for e in edge])
        if best_choice is None or latency < best_choice.latency_s:
            best_choice = InterleavedChoice(v, shape, stages, tuple(depths), tuple(inflight), latency,
                                            tuple(by_mesh))
    return best_choice


def _on_shape(stages: Sequence[StageChoice], shape: int) -> tuple[StageChoice, ...]:
    """A slicing of the one-shape table as choices on submesh shape `shape` (the table's
    one shape is `shape`)."""
    return tuple(StageChoice(c.first, c.last, shape, c.cost_s) for c in stages)


def mesh_memory_bytes(orders: Sequence[Order], chunks: Sequence[StageMemory]) -> list[float]:
    """Per mesh (chunk c of mesh k is `chunks[c S + k]`): its chunks' states, the largest
    buffer, and the larger of its order's peak activations (`order_peak_bytes`) and the
    largest optimizer step's working set (no activations are live then)."""
    return [sum(terms.values()) for terms in mesh_memory_terms(orders, chunks)]


def mesh_memory_terms(orders: Sequence[Order], chunks: Sequence[StageMemory]) -> list[dict[str, float]]:
    """`mesh_memory_bytes` by term, per mesh: "states" (parameters, gradients and
    optimizer states of its chunks), "buffers", and "activations" (the order's peak, or
    the optimizer step's working set where that is larger)."""
    S = len(orders)
    out = []
    for k, order in enumerate(orders):
        own = chunks[k::S]
        peak = order_peak_bytes(order, [m.stash_bytes for m in own], [m.activation_bytes for m in own])
        out.append({"states": sum(m.persistent_bytes for m in own), "buffers": max(m.buffer_bytes for m in own),
                    "activations": max(peak, max(m.update_bytes for m in own))})
    return out


def mesh_shapes(shapes, cluster: Cluster, max_stages: int):
    """(shape index, shape, S) of every submesh shape of `shapes` that tiles `cluster`
    into S equal meshes, 2 <= S <= max_stages: the meshes an interleaved plan may run on."""
    for h, shape in enumerate(shapes):
        meshes = cluster.num_devices // shape.size
        if cluster.num_devices % shape.size == 0 and 2 <= meshes <= max_stages:
            yield h, shape, meshes


def interleaved_cannot_exist(layers: int, shapes, cluster: Cluster, max_stages: int,
                             chunk_options: Sequence[int]) -> str | None:
    """Why no interleaved plan of `layers` layers can exist on `cluster` (None if one
    can): it needs S >= 2 meshes of one submesh shape of `shapes` (`mesh_shapes`) and
    S x v <= layers for some v of `chunk_options`. Known before any stage is priced."""
    if any(meshes * v <= layers for _, _, meshes in mesh_shapes(shapes, cluster, max_stages) for v in chunk_options):
        return None
    n = cluster.num_devices
    return (f"it needs S >= 2 meshes of one submesh shape (at most --max-stages {max_stages}) and S x chunks <= "
            f"its {layers} layers, on {n:,} device{'s' if n > 1 else ''}")

"""The stage cost table t_intra(layers k..i, submesh, stages after) from the intra-op ILP.

Solving one ILP per (layer range, submesh, logical view, stages-after) is what made
Alpa's compilation take 40 minutes. We solve per *layer kind* instead and compose:
each distinct layer (`_layer_options.canonical_key`) is solved once per logical mesh,
in memory and on disk (`_cache.DiskCache`), across runs, into a few options
(`_layer_options`); every stage of the table is then composed from its layers'
options (`_stage_compose`). `build_stage_costs` drives it: the submeshes and views,
the jobs for a worker pool, the cache, and the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from alpasim.costmodels import DEFAULT_BUCKET_BYTES, AnalyticCostModel, Cluster, CostModel
from alpasim.graphs import OpGraph, get_recipe, layer_stage_graphs

from ._cache import CACHE_VERSION, DiskCache, digest
from ._context_parallel import cp_cache_key
from ._intra_baselines import DISTRIBUTED_OPTIMIZER
from ._layer_options import INF, LayerOption, canonical_key, layer_options, mesh_key, read_options
from ._mesh import LogicalMesh
from ._stage_compose import TiedCopy, assemble, tied_owners
from ._submesh import SubmeshShape, logical_mesh, logical_shapes, submesh_shapes


def job_weight(layer: OpGraph, mesh: LogicalMesh) -> float:
    """A rough relative cost of one layer job, for ordering a pool's work: the ILP grows
    with the ops and with the strategies per op, which a second live mesh axis
    multiplies (measured: a GPT block on 2x4 takes several times its time on 1x8)."""
    live = sum(1 for n in mesh.shape if n > 1)
    return len(layer.ops) * (1, 2, 8)[live]


def layer_graphs(graph: OpGraph) -> list[OpGraph]:
    """`stage_graph(graph, l, l)` of every layer, memoised on the graph (graphs are not
    changed once built; a baseline's grid slices one graph many times)."""
    memo = graph.__dict__.get("_solvers_layer_graphs")
    if memo is None:
        memo = graph.__dict__["_solvers_layer_graphs"] = layer_stage_graphs(graph)
    return memo


def mirrored_views(meshes: Sequence[LogicalMesh]) -> set[int]:
    """Indices of the views to leave out because another view is the same 1-D mesh
    with its axes swapped: (n, 1) beside (1, n), the same n devices on the same link.
    The unrestricted ILP then solves the same problem with the axis renamed, so the
    (n, 1) twin would cost an ILP per layer kind for nothing; (1, n) stays (model
    parallelism on the inner axis, as Megatron-LM lays it out). Two-axis views such as
    (2, 4) and (4, 2) are both kept: a dimension split over both axes is S01 (axis 0
    major) on each, which nests inside different one-axis splits, so their optima
    differ (by 0.3-1.3 % on the layers of `test_intra_ilp`). A baseline may give each
    axis a role, so restricted searches keep every view."""
    drop = set()
    for m, mesh in enumerate(meshes):
        if mesh.shape[1] != 1 or mesh.shape[0] == 1:
            continue
        swapped = (mesh.axes[1], mesh.axes[0])
        if any(t != m and other.axes == swapped for t, other in enumerate(meshes)):
            drop.add(m)
    return drop


def _options_job(job: tuple) -> list[dict]:
    """Top-level (picklable) unit of work for a process pool or a Ray task."""
    layer, mesh, cluster, microbatches, restriction, pareto, cost_model = job
    return [o.to_json() for o in layer_options(layer, mesh, cluster, microbatches, restriction, pareto, cost_model)]


def cost_model_key(cost_model: CostModel | None) -> str | None:
    """What a cache key records of the cost model: None for the analytic one (so keys
    made before profiled models existed stay valid), else the model's `digest`."""
    if cost_model is None or isinstance(cost_model, AnalyticCostModel):
        return None
    key = getattr(cost_model, "digest", None)
    if not isinstance(key, str):
        raise TypeError(f"cost model {type(cost_model).__name__} has no `digest` to key the stage-cost cache")
    return key


@dataclass
class StageCosts:
    """t(k..i, shape, s) with what realises each entry."""

    cost: np.ndarray                    # (L, L, shapes, S) seconds per microbatch (sync amortised), inf if none
    view: np.ndarray                    # (L, L, shapes, S) index into `meshes` of the winning view
    option: np.ndarray                  # (L, L, shapes, S) option index used
    memory: np.ndarray                  # (L, L, shapes, S) per-device bytes of the winner
    least: np.ndarray                   # (L, L, shapes, S) least per-device bytes of any view and option
    shapes: list[SubmeshShape]
    meshes: list[tuple[SubmeshShape, tuple[int, int], LogicalMesh]]
    layer_kind: list[str]               # kind key of each layer
    layer_graphs: list[OpGraph]         # each layer's own graph (forward, backward, update)
    options: dict[tuple[str, int], list[LayerOption]]   # (kind, mesh index) -> options
    ilp_jobs: int
    cache_hits: int
    min_memory_bytes: float             # least per-device memory any stage of one layer needs
    tied_owner: list[TiedCopy | None] = None  # per layer: a tied copy of another layer's parameter
    bucket_bytes: float | None = None   # gradient buckets overlapping the backward (None: no overlap)
    tp_overlap: bool = False            # tensor-parallel collectives overlapped with GEMMs (`LayerOption.busy_s`)
    gather_overlap: bool = False        # buckets' parameter all-gathers in the next forward (`costmodels._overlap`)
    microbatches: int = 1               # the iteration's (a gradient-scatter stream's tail, `scatter_tail_s`)


def build_stage_costs(graph: OpGraph, cluster: Cluster, microbatches: int, *, max_stages: int | None = None,
                      map_fn: Callable[[Callable, Iterable], Iterable] = map, cache: DiskCache | None = None,
                      progress: Callable[[int, int], None] | None = None, restriction: str | None = None,
                      shape_ok: Callable[[SubmeshShape], bool] | None = None,
                      views_of: Callable[[SubmeshShape], Sequence[tuple[int, int]]] | None = None,
                      pareto: bool = True, cost_model: CostModel | None = None,
                      bucket_bytes: float | None = DEFAULT_BUCKET_BYTES, tp_overlap: bool = False,
                      gather_overlap: bool = False) -> StageCosts:
    """The table for `graph`; `restriction` names an intra-op baseline every layer is
    solved under, `shape_ok` narrows the submesh shapes and `views_of` replaces the
    logical views of a shape (baselines that only pipeline, or fix their mesh layout).
    A `cost_model` prices the ops, and its cluster replaces `cluster`: a profiled
    model's cluster carries the measured link, which the meshes then price with.
    `bucket_bytes`: the weight gradients are reduced in buckets of this size that
    overlap the last backward (`costmodels._overlap`); None: one collective per
    gradient after the backward (the paper's accounting). `tp_overlap`: tensor-parallel
    collectives run beside their GEMMs (`_tp_overlap`), as Megatron-core's
    `--tp-comm-overlap` runs them. `gather_overlap` (under the distributed optimizer's
    restrictions, with `bucket_bytes`): each bucket is a reduce-scatter in the backward
    and an all-gather in the next forward, as Megatron-core's distributed optimizer runs
    them with `--overlap-param-gather`."""
    gather_overlap = gather_overlap and bucket_bytes is not None and restriction in DISTRIBUTED_OPTIMIZER
    if cost_model is not None:
        cluster = cost_model.cluster
    cache = cache or DiskCache(enabled=False)
    num_layers = graph.num_layers
    shapes = [sh for sh in submesh_shapes(cluster.nodes, cluster.devices_per_node) if shape_ok is None or shape_ok(sh)]
    meshes = []
    for shape in shapes:
        devices = list(range(shape.size))
        views = logical_shapes(shape, cluster.devices_per_node) if views_of is None else views_of(shape)
        of_shape = [logical_mesh(cluster, devices, view) for view in views]
        drop = mirrored_views(of_shape) if restriction is None else set()
        for k, (view, mesh) in enumerate(zip(views, of_shape)):
            if k not in drop:
                meshes.append((shape, tuple(view), mesh))
    layers = layer_graphs(graph)
    kinds = [canonical_key(g) for g in layers]
    first_of_kind = {k: layers[i] for i, k in reversed(list(enumerate(kinds)))}
    memory = float(cluster.device.memory_bytes)
    device_key = [cluster.device.name, sorted(cluster.device.to_json().items())]
    model_key = cost_model_key(cost_model)

    options: dict[tuple[str, int], list[LayerOption]] = {}
    pending, solved = [], []
    for kind, layer in first_of_kind.items():
        for m, (_, _, mesh) in enumerate(meshes):
            parts = [CACHE_VERSION, kind, mesh_key(mesh), microbatches, device_key, restriction, pareto,
                     get_recipe(layer.meta.get("precision")).to_json(), *cp_cache_key(layer, mesh, cluster)]
            key = digest(parts if model_key is None else parts + [model_key])
            hit = cache.get(key, read=read_options)
            if hit is not None:
                options[(kind, m)] = hit
                continue
            pending.append((layer, mesh, cluster, microbatches, restriction, pareto, cost_model))
            solved.append((kind, m, key))
    # Longest jobs first (a layer's ops on a mesh with two live axes are the hard ILPs),
    # so that a pool ends on short jobs instead of one worker finishing a long one alone.
    order = sorted(range(len(pending)), key=lambda j: -job_weight(pending[j][0], pending[j][1]))
    pending, solved = [pending[j] for j in order], [solved[j] for j in order]
    total = len(pending)
    for n, (result, (kind, m, key)) in enumerate(zip(map_fn(_options_job, pending), solved), 1):
        options[(kind, m)] = read_options(result)
        cache.put(key, result)
        if progress is not None:
            progress(n, total)
    owners = tied_owners(graph, layers)
    costs = assemble(kinds, options, meshes, shapes, memory, microbatches, num_layers,
                      max_stages or min(num_layers, cluster.num_devices), owners, layers, bucket_bytes, tp_overlap,
                      gather_overlap)
    least = min((o.persistent_bytes + o.activation_bytes for opts in options.values() for o in opts), default=INF)
    return StageCosts(*costs, shapes, meshes, kinds, layers, options, total, cache.hits, least, owners,
                      bucket_bytes, tp_overlap, gather_overlap, microbatches)

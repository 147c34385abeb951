"""The stage cost table t_intra(layers k..i, submesh, stages after) from the intra-op ILP.

Solving one ILP per (layer range, submesh, logical view, stages-after) is what made
Alpa's compilation take 40 minutes. We solve per *layer kind* instead and compose:

1. Layers are keyed by their canonical structure (ops, shapes, dtypes, roles; names
   dropped), so the 46 middle layers of GPT-3 39B are one kind, solved once per
   logical mesh — in memory and on disk (`_cache.DiskCache`), across runs.
2. For each (kind, logical mesh) the ILP gives a small Pareto set of plans: the fastest,
   the smallest (memory first, time as tie-break) and one in between. Each option
   records time per microbatch, once-per-iteration sync/update time, persistent bytes
   (params, grads, optimizer states) and activation bytes of one microbatch.
3. A stage k..i on a view sums its layers' options (prefix sums; one option index for
   the whole stage), its memory is persistent + min(s, B) x activations (seed eq. 5,
   s = stages from this one to the end) and it takes the fastest option that fits the
   device; a submesh takes its fastest logical view. Infeasible = inf.

What the composition ignores, and why it is acceptable: resharding between two layers
of a stage whose plans disagree on the boundary layout (layers of one kind share a
plan, and the boundary is the residual stream, batch-sharded in practice) and mixing
options inside a stage (a finer knapsack could fit a little more in memory).
`exact_stage_plan` re-solves a chosen stage as one ILP when that matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from alpasim.costmodels import AnalyticCostModel, Cluster, CostModel
from alpasim.graphs import OpGraph, is_heavy, op_flops, stage_graph

from ._cache import CACHE_VERSION, DiskCache, digest
from ._intra_baselines import BASELINES, REWRITE_ALLOWED
from ._intra_op import IntraOpInfeasible, min_memory_choice, solve_intra_op, solve_problem
from ._mesh import LogicalMesh
from ._submesh import SubmeshShape, check_cluster_grid, logical_mesh, logical_shapes, submesh_shapes

INF = math.inf
# Memory-first ILP keeps this many microbatches of activations in flight when it looks
# for the smallest plan (a typical 1F1B depth; the table then applies the real one).
REFERENCE_INFLIGHT = 4
# Only look for an in-between option when the fastest plan is this much bigger.
PARETO_GAP = 1.5
TOP_HEAVY = 6
# Stage costs are estimates: a plan within 0.1% of the best is good enough, and proving
# the last 0.1% is most of HiGHS's time on two-axis meshes.
PLANNING_MIP_GAP = 1e-3
# A planning ILP that has not proven its optimum by then returns its incumbent (flagged
# in the option's `ilp_status`): one hard layer must not stall the whole table.
PLANNING_TIME_LIMIT_S = 15.0
# The memory-bounded Pareto points are the hardest MIPs (the budget binds); 1% of slack
# on them halves their time and only moves a point along a curve we sample coarsely.
PARETO_MIP_GAP = 1e-2
# HiGHS's presolve can loop past its time limit on memory-bounded layer problems (seen
# on MoE expert layers); these solves run without it (see `solve_ilp`).
PARETO_PRESOLVE = False


@dataclass(frozen=True, slots=True)
class LayerOption:
    """One intra-op plan of one layer kind on one logical mesh, summarised."""

    time_s: float               # forward + backward per microbatch (compute + communication)
    sync_s: float               # gradient sync + optimizer, once per iteration
    persistent_bytes: float
    activation_bytes: float
    param_specs: tuple[str, ...]                 # in the layer's canonical parameter order
    heavy: tuple[tuple[int, str, str], ...]      # (op index, strategy, output spec) of the heaviest ops
    ilp_status: str = "optimal"
    forward_s: float = 0.0                       # the forward share of time_s
    input_specs: tuple[str, ...] = ()            # layout of each layer-graph input, in `graph.inputs` order
    output_specs: tuple[str, ...] = ()           # layout of each layer-graph output, in `graph.outputs` order
    stash_bytes: float | None = None             # kept from forward to backward (None: = activation_bytes)

    @property
    def inflight_bytes(self) -> float:
        """What each further microbatch in flight adds (seed eq. 5's mem_act)."""
        return self.activation_bytes if self.stash_bytes is None else min(self.stash_bytes, self.activation_bytes)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LayerOption:
        return cls(d["time_s"], d["sync_s"], d["persistent_bytes"], d["activation_bytes"], tuple(d["param_specs"]),
                   tuple(tuple(h) for h in d["heavy"]), d.get("ilp_status", "optimal"), d.get("forward_s", 0.0),
                   tuple(d.get("input_specs", ())), tuple(d.get("output_specs", ())), d.get("stash_bytes"))


def canonical_key(graph: OpGraph) -> str:
    """A digest of a layer's structure with names replaced by first-appearance indices."""
    index: dict[str, int] = {}

    def ref(t: str) -> int:
        return index.setdefault(t, len(index))

    ops = []
    for op in graph.ops:
        ops.append([op.prim, op.phase, [[k, v] for k, v in op.params],
                    [[ref(t), list(graph.tensors[t].shape), graph.tensors[t].dtype, graph.tensors[t].role]
                     for t in op.inputs],
                    [[ref(t), list(graph.tensors[t].shape), graph.tensors[t].dtype, graph.tensors[t].role]
                     for t in op.outputs]])
    outputs = sorted(index[t] for t in graph.outputs if t in index)
    return digest({"ops": ops, "outputs": outputs})


def canonical_params(graph: OpGraph) -> list[str]:
    seen = dict.fromkeys(t for op in graph.ops for t in op.inputs if t in {p.name for p in graph.params})
    return list(seen)


def mesh_key(mesh: LogicalMesh) -> list:
    return [[a.size, a.link.bandwidth_gbps, a.link.latency_s] for a in mesh.axes]


def layer_options(layer: OpGraph, mesh: LogicalMesh, cluster: Cluster, microbatches: int,
                  restriction: str | None = None, pareto: bool = True,
                  cost_model: CostModel | None = None) -> list[LayerOption]:
    """The Pareto set of plans of one layer on one mesh (see the module doc).

    With a `restriction` (a baseline of `_intra_baselines.BASELINES`: data parallel,
    Megatron-LM, ZeRO, ...) the layer gets that baseline's single plan instead: a
    hand-designed system has one layout per configuration, not a memory trade-off.
    `pareto=False` keeps only the fastest plan (for graphs with many distinct layers).
    `cost_model` prices ops (None: `AnalyticCostModel(cluster)`)."""
    model = AnalyticCostModel(cluster) if cost_model is None else cost_model
    params = canonical_params(layer)
    heavy = sorted((i for i, op in enumerate(layer.ops) if is_heavy(op)),
                   key=lambda i: -op_flops(layer.ops[i], layer.tensors))[:TOP_HEAVY]

    def summarise(plan, status: str) -> LayerOption:
        return LayerOption(plan.time_s, plan.sync_s + plan.update_s, plan.memory.persistent_bytes,
                           plan.memory.activations_peak_bytes, tuple(str(plan.specs[p]) for p in params),
                           tuple((i, plan.strategies[layer.ops[i].name].name,
                                  "/".join(map(str, plan.strategies[layer.ops[i].name].out_specs))) for i in heavy),
                           status, plan.forward_s, tuple(str(plan.specs[t]) for t in layer.inputs),
                           tuple(str(plan.specs[t]) for t in layer.outputs), plan.memory.stash_bytes)

    kw = restricted_solve_kwargs(restriction, layer, mesh, model)
    fast = solve_intra_op(layer, mesh, model, with_compute=True, microbatches=microbatches, mip_gap=PLANNING_MIP_GAP,
                          time_limit_s=PLANNING_TIME_LIMIT_S, **kw)
    options = [summarise(fast.plan, fast.status)]
    if restriction is not None or not pareto:
        return options
    least, small = min_memory_choice(fast.problem, activation_multiplier=REFERENCE_INFLIGHT,
                                     mip_gap=PARETO_MIP_GAP, time_limit_s=PLANNING_TIME_LIMIT_S,
                                     presolve=PARETO_PRESOLVE)
    if small is not None:
        options.append(summarise(small.plan, small.status))
        big = fast.plan.memory.with_inflight(REFERENCE_INFLIGHT)
        if big > PARETO_GAP * least and least > 0:
            try:
                mid = solve_problem(fast.problem, memory_budget_bytes=math.sqrt(big * least),
                                    activation_multiplier=REFERENCE_INFLIGHT, mip_gap=PARETO_MIP_GAP,
                                    time_limit_s=PLANNING_TIME_LIMIT_S, presolve=PARETO_PRESOLVE)
                options.append(summarise(mid.plan, mid.status))
            except (IntraOpInfeasible, RuntimeError):
                pass
    options.sort(key=lambda o: (o.time_s + o.sync_s / microbatches, o.persistent_bytes))
    front: list[LayerOption] = []
    for o in options:  # keep only options that save memory for the time they cost
        if all(_reference_bytes(o) < _reference_bytes(p) for p in front):
            front.append(o)
    return front


def restricted_solve_kwargs(restriction: str | None, layer: OpGraph, mesh: LogicalMesh, model) -> dict:
    """`solve_intra_op` keywords that turn the ILP into the named baseline."""
    if restriction is None:
        return {}
    if restriction not in BASELINES:
        raise ValueError(f"unknown intra-op restriction {restriction!r}; choose one of {', '.join(BASELINES)}")
    restrict, leaf_specs = BASELINES[restriction](layer, mesh, model)
    return {"restrict": restrict, "leaf_specs": leaf_specs, "rewrite": REWRITE_ALLOWED.get(restriction, False),
            "allow_replicated_heavy": True}


def _reference_bytes(o: LayerOption) -> float:
    """An option's memory with `REFERENCE_INFLIGHT` microbatches in flight (eq. 5)."""
    return o.persistent_bytes + o.activation_bytes + (REFERENCE_INFLIGHT - 1) * o.inflight_bytes


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
    shapes: list[SubmeshShape]
    meshes: list[tuple[SubmeshShape, tuple[int, int], LogicalMesh]]
    layer_kind: list[str]               # kind key of each layer
    layer_graphs: list[OpGraph]         # each layer's own graph (forward, backward, update)
    options: dict[tuple[str, int], list[LayerOption]]   # (kind, mesh index) -> options
    ilp_jobs: int
    cache_hits: int
    min_memory_bytes: float             # least per-device memory any stage of one layer needs


def build_stage_costs(graph: OpGraph, cluster: Cluster, microbatches: int, *, max_stages: int | None = None,
                      map_fn: Callable[[Callable, Iterable], Iterable] = map, cache: DiskCache | None = None,
                      progress: Callable[[int, int], None] | None = None, restriction: str | None = None,
                      shape_ok: Callable[[SubmeshShape], bool] | None = None,
                      views_of: Callable[[SubmeshShape], Sequence[tuple[int, int]]] | None = None,
                      pareto: bool = True, cost_model: CostModel | None = None) -> StageCosts:
    """The table for `graph`; `restriction` names an intra-op baseline every layer is
    solved under, `shape_ok` narrows the submesh shapes and `views_of` replaces the
    logical views of a shape (baselines that only pipeline, or fix their mesh layout).
    A `cost_model` prices the ops, and its cluster replaces `cluster`: a profiled
    model's cluster carries the measured link, which the meshes then price with."""
    if cost_model is not None:
        cluster = cost_model.cluster
    check_cluster_grid(cluster)
    cache = cache or DiskCache(enabled=False)
    num_layers = graph.num_layers
    shapes = [sh for sh in submesh_shapes(cluster.nodes, cluster.devices_per_node) if shape_ok is None or shape_ok(sh)]
    meshes = []
    for shape in shapes:
        devices = list(range(shape.size))
        views = logical_shapes(shape, cluster.devices_per_node) if views_of is None else views_of(shape)
        for view in views:
            meshes.append((shape, tuple(view), logical_mesh(cluster, devices, view)))
    layers = [stage_graph(graph, l, l) for l in range(num_layers)]
    kinds = [canonical_key(g) for g in layers]
    first_of_kind = {k: layers[i] for i, k in reversed(list(enumerate(kinds)))}
    memory = float(cluster.device.memory_bytes)
    device_key = [cluster.device.name, sorted(cluster.device.to_json().items())]
    model_key = cost_model_key(cost_model)

    options: dict[tuple[str, int], list[LayerOption]] = {}
    pending, solved = [], []
    for kind, layer in first_of_kind.items():
        for m, (_, _, mesh) in enumerate(meshes):
            parts = [CACHE_VERSION, kind, mesh_key(mesh), microbatches, device_key, restriction, pareto]
            key = digest(parts if model_key is None else parts + [model_key])
            hit = cache.get(key)
            if hit is not None:
                options[(kind, m)] = [LayerOption.from_json(d) for d in hit]
                continue
            pending.append((layer, mesh, cluster, microbatches, restriction, pareto, cost_model))
            solved.append((kind, m, key))
    total = len(pending)
    for n, (result, (kind, m, key)) in enumerate(zip(map_fn(_options_job, pending), solved), 1):
        options[(kind, m)] = [LayerOption.from_json(d) for d in result]
        cache.put(key, result)
        if progress is not None:
            progress(n, total)
    costs = _assemble(kinds, options, meshes, shapes, memory, microbatches, num_layers,
                      max_stages or min(num_layers, cluster.num_devices))
    least = min((o.persistent_bytes + o.activation_bytes for opts in options.values() for o in opts), default=INF)
    return StageCosts(*costs, shapes, meshes, kinds, layers, options, total, cache.hits, least)


def _assemble(kinds: Sequence[str], options, meshes, shapes, memory: float, microbatches: int, num_layers: int,
              s_max: int):
    n_mesh = len(meshes)
    n_opt = max((len(v) for v in options.values()), default=1)
    time = np.full((num_layers, n_mesh, n_opt), INF)
    pers = np.full((num_layers, n_mesh, n_opt), INF)
    act = np.full((num_layers, n_mesh, n_opt), INF)
    stash = np.full((num_layers, n_mesh, n_opt), INF)
    for l, kind in enumerate(kinds):
        for m in range(n_mesh):
            opts = options.get((kind, m), [])
            for j in range(n_opt):
                if not opts:
                    continue
                o = opts[min(j, len(opts) - 1)]
                time[l, m, j] = o.time_s + o.sync_s / microbatches
                pers[l, m, j] = o.persistent_bytes
                act[l, m, j] = o.activation_bytes
                stash[l, m, j] = o.inflight_bytes

    def ranges(x: np.ndarray) -> np.ndarray:  # (L, ...) -> (L, L, ...) sums over k..i
        prefix = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, axis=0)])
        out = prefix[None, 1:] - prefix[:-1, None]
        k, i = np.indices((num_layers, num_layers))
        out[k > i] = INF
        return out

    t_range, p_range, a_range, s_range = ranges(time), ranges(pers), ranges(act), ranges(stash)
    shape_of_mesh = np.array([shapes.index(s) for s, _, _ in meshes])
    cost = np.full((num_layers, num_layers, len(shapes), s_max), INF)
    view = np.zeros(cost.shape, dtype=int)
    opt = np.zeros(cost.shape, dtype=int)
    mem = np.full(cost.shape, INF)
    for s in range(1, s_max + 1):
        inflight = min(s, microbatches)
        # One microbatch at its peak (every layer's, a safe bound), the others stashed.
        need = p_range + a_range                                    # (L, L, M, J)
        if inflight > 1:
            need = need + (inflight - 1) * s_range
        t = np.where(need <= memory, t_range, INF)
        j_best = np.argmin(t, axis=3)                               # (L, L, M)
        t_best = np.take_along_axis(t, j_best[..., None], axis=3)[..., 0]
        m_need = np.take_along_axis(need, j_best[..., None], axis=3)[..., 0]
        for h in range(len(shapes)):
            cols = np.flatnonzero(shape_of_mesh == h)
            if not len(cols):
                continue
            sub = t_best[:, :, cols]
            pick = np.argmin(sub, axis=2)
            cost[:, :, h, s - 1] = np.take_along_axis(sub, pick[..., None], axis=2)[..., 0]
            view[:, :, h, s - 1] = cols[pick]
            opt[:, :, h, s - 1] = np.take_along_axis(j_best[:, :, cols], pick[..., None], axis=2)[..., 0]
            mem[:, :, h, s - 1] = np.take_along_axis(m_need[:, :, cols], pick[..., None], axis=2)[..., 0]
    return cost, view, opt, mem

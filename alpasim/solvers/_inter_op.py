"""The inter-op pass (seed Algorithm 1): model + cluster -> `PipelinePlan`.

For each candidate number of microbatches B (beyond Alpa: searched jointly, each a
divisor of the global batch, by a hill climb): take the microbatch's training graph in
planning units (`_planning_graph`), fill the stage cost table from the intra-op ILP
(`_stage_costs`), run the stage-mesh DP (`_stage_dp`), and, where the schedule asks,
the interleaved search (`_interleave`); the best is assembled into the plan
(`_plan_assembly`), the other counts reported as runner-ups with their predicted
times. What no plan can fit is said here too (`memory_bound`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from alpasim.costmodels import Cluster, CostModel
from alpasim.graphs import ModelSource, get_recipe, model_source
from alpasim.units import format_bytes

from ._boundary import stage_boundary_s, whole_nodes
from ._cache import DiskCache
from ._interleave import InterleavedChoice, interleaved_cannot_exist, interleaved_dp, mesh_memory_terms, mesh_shapes
from ._pipeline_orders import interleaved_order
from ._pipeline_plan import CostModelRef, PipelinePlan, SearchStats
from ._plan_assembly import Candidate, assemble_plan, chunk_memory, stage_memory_of
from ._plan_inputs import PlanOptions, RunOptions, SearchSpace
from ._planning_graph import default_graph_layers, planning_training_graph
from ._stage_costs import StageCosts, build_stage_costs, cost_model_key
from ._stage_dp import StageBoundary, equal_layer_dp, stage_dp
from ._submesh import place_submeshes
from ._systems import GradBuckets


GIB = 2 ** 30
INF = math.inf
# The B search starts at this microbatch size (a GPU-efficient size for the paper's
# models) and climbs towards better predicted iteration times.
START_MICROBATCH_SIZE = 4
# Microbatch sizes tried by `--microbatches auto`, largest first.
AUTO_MICROBATCH_SIZES = (32, 16, 8, 4, 2, 1)

class PlanInfeasible(ValueError):
    """No plan fits the cluster; the message names the memory a device would need.
    `capped` is (the depth searched, the deepest a plan could be) when the search stopped
    short of the deepest pipelines (`max_stages`), so a method whose users set that
    option can say to raise it (`_methods.plan_model`)."""

    def __init__(self, message: str, min_memory_bytes: float, capped: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.capped = capped


def microbatch_candidates(global_batch: int, requested: int | str, multiple: int = 1) -> list[int]:
    """Microbatch counts to try. "auto": microbatches of `AUTO_MICROBATCH_SIZES` samples
    that divide the global batch. With `multiple` (a data-parallel system, whose every
    device takes whole samples) only microbatches whose size it divides: "auto" keeps
    the same largest size, or goes to one sample per device where there are more
    devices than that; a requested count that does not split gives none."""
    if requested != "auto":
        b = int(requested)
        if b < 1 or global_batch % b:
            raise ValueError(f"--microbatches {b} must divide the global batch {global_batch}")
        return [b] if (global_batch // b) % multiple == 0 else []
    ceiling = max(max(AUTO_MICROBATCH_SIZES), multiple)
    sizes = [m * multiple for m in AUTO_MICROBATCH_SIZES if m * multiple <= ceiling]
    out = [global_batch // m for m in sizes if m <= global_batch and global_batch % m == 0]
    return list(dict.fromkeys(out)) or ([1] if multiple == 1 else [])


def plan_pipeline(model: str | ModelSource, cluster: Cluster, space: SearchSpace = SearchSpace(),
                  options: PlanOptions = PlanOptions(), run: RunOptions = RunOptions()) -> PipelinePlan:
    """Plan `model` on `cluster` over the method's search `space`, priced with the
    user's `options`, the work run as `run` says (`_plan_inputs`).

    Alpa's search is the default space; the baselines of `_methods` are the same search
    with part of the space taken away. `options.cost_model` (None: analytic) prices
    every stage; its cluster replaces `cluster` (`build_stage_costs`), and
    `search.cost_model` records its name and digest. `options.schedule` "interleaved"
    searches the fastest interleaved plan (`_interleave`, a chunk count from
    `options.chunk_options`) at any microbatch count the 1F1B search evaluated, and
    "auto" whichever of the two predicts less."""
    if isinstance(options.bucket_bytes, GradBuckets):
        raise ValueError("a system's gradient buckets are sized for a data-parallel degree first "
                         "(PlanOptions.at_data_parallel)")
    t0 = time.perf_counter()
    if options.cost_model is not None:
        cluster = options.cost_model.cluster
    recipe = get_recipe(options.precision)
    source = model_source(model)
    name, dtype = source.name, recipe.weight_dtype(source.dtype)
    global_batch = source.global_batch
    if space.layers is None and space.relabel is None and source.graph is not None \
            and source.graph.num_layers <= 1:   # an imported graph is one layer until clustered
        space = dataclasses.replace(space, layers=default_graph_layers(source.graph))
    counts = _microbatch_options(source, space.microbatches, space.microbatch_multiple)
    evaluate = _Evaluator(source, cluster, dtype, recipe.name, space, options, run)
    best = _hill_climb(counts, evaluate, global_batch)
    candidates = evaluate.candidates
    search = SearchStats(time.perf_counter() - t0, evaluate.jobs, evaluate.hits,
                         tuple(sorted(c.microbatches for c in candidates)), int(best.dp.candidates_evaluated),
                         _priced_by(options.cost_model))
    auto_note = None
    if options.schedule != "1f1b":
        interleaved = _best_interleaved(candidates, cluster, name, space, options)
        said = _schedule_said(interleaved, best)
        if interleaved is not None and (options.schedule == "interleaved" or not best.dp.stages
                                        or interleaved[1].latency_s < best.dp.latency_s):
            plan = assemble_plan(source, dtype, cluster, interleaved[0], candidates,
                                  dataclasses.replace(search, seconds=time.perf_counter() - t0), space.method,
                                  options, interleaved[1])
            return dataclasses.replace(plan, notes=(*plan.notes, f"schedule interleaved: {said}"))
        auto_note = f"schedule 1f1b: {said}"
    if not best.dp.stages:
        raise _nothing_fits(name, cluster, candidates, best.graph.num_layers, space.max_stages,
                            capped=space.num_stages is None)
    plan = assemble_plan(source, dtype, cluster, best, candidates, search, space.method, options)
    return dataclasses.replace(plan, notes=(*plan.notes, auto_note)) if options.schedule != "1f1b" else plan


def _priced_by(cost_model: CostModel | None) -> CostModelRef | None:
    """The search's record of a cost model other than the analytic one: name and digest."""
    return None if cost_model is None else CostModelRef(getattr(cost_model, "name", type(cost_model).__name__),
                                                         cost_model_key(cost_model))


def _microbatch_options(source: ModelSource, microbatches: int | str, multiple: int) -> list[int]:
    """The microbatch counts the search may try, ordered by microbatch size; refused
    (`PlanInfeasible`) where none gives each of `multiple` devices whole samples."""
    global_batch = source.global_batch
    options = microbatch_candidates(global_batch, microbatches, multiple)
    if not source.resizable and microbatches == "auto":
        options = [1]    # an unmarked graph is one microbatch of its own batch (`resize_batch` refuses others)
    if not options:
        asked = "" if microbatches == "auto" else \
            f" ({microbatches} microbatches of {global_batch // int(microbatches)})"
        raise PlanInfeasible(f"no microbatch of {source.name}'s batch of {global_batch} gives each of "
                             f"{multiple} data-parallel devices whole samples{asked}", float("nan"))
    return options


class _Evaluator:
    """The stage table and stage DP of one microbatch count, each count once: what the
    hill climb over B asks for (`_hill_climb`), with the ILP jobs and cache hits so far."""

    def __init__(self, source: ModelSource, cluster: Cluster, dtype: str, recipe: str, space: SearchSpace,
                 options: PlanOptions, run: RunOptions) -> None:
        self.source, self.cluster, self.dtype, self.recipe = source, cluster, dtype, recipe
        self.space, self.options, self.run = space, options, run
        self.evaluated: dict[int, Candidate] = {}
        self.candidates: list[Candidate] = []
        self.jobs = self.hits = 0

    def __call__(self, b: int) -> Candidate:
        if b in self.evaluated:
            return self.evaluated[b]
        space, options, run, cluster = self.space, self.options, self.run, self.cluster
        graph = planning_training_graph(self.source, self.source.global_batch // b, self.dtype, space.relabel,
                                        space.layers, options.remat, self.recipe, options.recompute,
                                        options.loss_kernel, options.kernels)
        report = (lambda done, total: run.progress(f"B={b}", done, total)) if run.progress else None
        costs = build_stage_costs(graph, cluster, b, max_stages=min(space.max_stages, graph.num_layers,
                                                                    cluster.num_devices),
                                  map_fn=run.map_fn, cache=run.cache or DiskCache(enabled=False), progress=report,
                                  restriction=space.restriction, shape_ok=space.shape_ok, views_of=space.views_of,
                                  pareto=space.pareto, cost_model=options.cost_model,
                                  bucket_bytes=options.bucket_bytes, tp_overlap=options.tp_overlap,
                                  gather_overlap=options.gather_overlap)
        self.jobs += costs.ilp_jobs
        self.hits += costs.cache_hits
        sizes = [sh.size for sh in costs.shapes]
        # Every stage spans at least the smallest mesh's whole nodes (all of a Megatron
        # layout's meshes the same; a search with meshes inside a node prices one node's cards).
        boundary = stage_boundary_s(graph, cluster, nodes=whole_nodes(min(sizes), cluster)) \
            if options.price_boundaries else None
        per_node = cluster.devices_per_node if options.price_boundaries else None
        if space.equal_layers:
            dp = equal_layer_dp(costs.cost, sizes, cluster.num_devices, b, epsilon=options.epsilon,
                                stages=space.num_stages, boundary=boundary, devices_per_node=per_node)
        else:
            dp = stage_dp(costs.cost, sizes, cluster.num_devices, b, epsilon=options.epsilon, boundary=boundary,
                          devices_per_node=per_node)
        self.evaluated[b] = Candidate(b, graph, costs, dp)
        self.candidates.append(self.evaluated[b])
        return self.evaluated[b]


def _hill_climb(options: Sequence[int], evaluate: Callable[[int], Candidate], global_batch: int) -> Candidate:
    """The best candidate of a hill climb over B (`options` ordered by microbatch size),
    from the count nearest START_MICROBATCH_SIZE, up, then down only where up gained nothing."""
    start = min(range(len(options)), key=lambda i: abs(global_batch // options[i] - START_MICROBATCH_SIZE))
    i = start
    best = evaluate(options[i])
    for step in (1, -1):
        j = i + step
        while 0 <= j < len(options):
            c = evaluate(options[j])
            if c.dp.latency_s < best.dp.latency_s or (not best.dp.stages and c.dp.stages):
                best, i = c, j
                j += step
            elif not best.dp.stages:
                j += step  # nothing feasible yet: keep looking this way
            else:
                break
        if best.microbatches != options[start]:
            break  # improved going up: no need to look down
        if not best.dp.stages:
            # Going up made microbatches only smaller, and nothing fit even at the
            # smallest: larger microbatches need more memory, so none fits.
            break
    return best


def _schedule_said(interleaved, best: Candidate) -> str:
    """What the schedule choice compared: the interleaved plan's and 1F1B's predictions."""
    if interleaved is None:
        said = "no interleaved plan fits"
    else:
        c, r = interleaved
        said = (f"interleaved ({r.chunks} chunks on {len(r.stages) // r.chunks} meshes, B={c.microbatches}) "
                f"predicts {r.latency_s:.4g} s")
    return said + (f", 1F1B (B={best.microbatches}) {best.dp.latency_s:.4g} s" if best.dp.stages
                   else ", no 1F1B plan fits")


def _nothing_fits(name: str, cluster: Cluster, candidates: Sequence[Candidate], layers: int, max_stages: int,
                  capped: bool) -> PlanInfeasible:
    """Why no plan of any candidate fits: the least memory any plan of at most
    `max_stages` stages needs per device and what it is made of (`memory_bound`); with
    `capped` (the depth was the search's limit, not the method's), the deepest a plan
    could have been."""
    need, why = min((memory_bound(c, cluster.num_devices) for c in candidates), key=lambda x: x[0])
    deepest = min(layers, cluster.num_devices)
    depth = min(max_stages, deepest)
    return PlanInfeasible(
        f"does not fit: no plan of {name} on {cluster.num_devices} x {cluster.device.name} fits in "
        f"{format_bytes(cluster.device.memory_bytes)} per device; every plan of at most {depth} "
        f"stage{'s' if depth > 1 else ''} needs at least {format_bytes(need)} per device: {why}", need,
        capped=(max_stages, deepest) if capped and max_stages < deepest else None)


def memory_bound(c: Candidate, num_devices: int) -> tuple[float, str]:
    """A true lower bound on the per-device memory of any plan of candidate `c`, and
    what it is made of. Every plan has a first stage: layers 0..i on some submesh and
    view, with one option, as deep as the pipeline (`costs.least` holds the least such
    entry); and no plan holds less than the model's least total states (each layer on
    the mesh and option that store the fewest bytes across their devices) spread over
    every device. The larger of the two, with the first stage's terms named."""
    costs = c.costs
    first = costs.least[0]                                            # (L, shapes, S)
    i, h, s = np.unravel_index(np.argmin(first), first.shape)
    stage_bound = float(first[i, h, s])
    states = 0.0
    for kind in costs.layer_kind:
        states += min((o.persistent_bytes * costs.meshes[m][0].size for (k, m), opts in costs.options.items()
                       if k == kind for o in opts), default=INF)
    states_bound = states / num_devices
    breakdown = _least_first_stage(costs, int(i), int(h), int(s) + 1, c.microbatches)
    if breakdown is not None and stage_bound >= states_bound:
        terms = breakdown.terms()
        largest = max(terms, key=terms.get)
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in terms.items() if v > 0)
        return stage_bound, (f"the smallest first stage (layers 0-{i} on {costs.shapes[h].size} devices, "
                             f"{s + 1} stages deep) holds {parts}; the largest term is {largest}")
    return states_bound, (f"the model's parameters, gradients and optimizer states alone take "
                          f"{format_bytes(states)}, spread over all {num_devices} devices")


def _least_first_stage(costs: StageCosts, last: int, shape: int, depth: int, microbatches: int):
    """`StageMemory` of the smallest stage 0..last on submesh shape `shape` at `depth`."""
    best = None
    for m, (sh, _, _) in enumerate(costs.meshes):
        if costs.shapes.index(sh) != shape:
            continue
        opts = [costs.options.get((costs.layer_kind[l], m), []) for l in range(last + 1)]
        if not all(opts):
            continue
        for j in range(max(len(o) for o in opts)):
            chosen = [o[min(j, len(o) - 1)] for o in opts]
            mem = stage_memory_of(costs, 0, last, m, chosen, min(depth, microbatches))
            if best is None or mem.total_bytes < best.total_bytes:
                best = mem
    return best


def _best_interleaved(candidates: Sequence[Candidate], cluster: Cluster, name: str, space: SearchSpace,
                      options: PlanOptions):
    """(candidate, `InterleavedChoice`) of the fastest interleaved plan at any microbatch
    count searched, or None; when the schedule asked is "interleaved", none is a
    `PlanInfeasible` saying whether no such plan can exist or none fits, and then what
    the slicing that comes closest needs (`_shortfall`)."""
    chunk_options, max_stages, epsilon = options.chunk_options, space.max_stages, options.epsilon
    # Each microbatch count's graph has its own cut sizes, priced once per node count for
    # both passes below.
    searched = [(c, functools.cache(functools.partial(stage_boundary_s, c.graph, cluster)) if options.price_boundaries
                 else None) for c in candidates]
    fits = [(c, r) for c, boundary in searched
            for r in interleaved_choices(c, cluster, chunk_options, max_stages=max_stages, epsilon=epsilon,
                                         boundary=boundary, memory_limit=cluster.device.memory_bytes)]
    best = min(fits, key=lambda x: x[1].latency_s, default=None)
    if best is not None or options.schedule != "interleaved":
        return best
    why = interleaved_cannot_exist(candidates[0].graph.num_layers, candidates[0].costs.shapes, cluster, max_stages,
                                   chunk_options)
    asked = f"no interleaved plan of {name} with {', '.join(map(str, chunk_options))} chunks per mesh"
    if why:
        raise PlanInfeasible(f"{asked} can exist: {why}", float("nan"))
    unlimited = [(c, r) for c, boundary in searched
                 for r in interleaved_choices(c, cluster, chunk_options, max_stages=max_stages, epsilon=epsilon,
                                              boundary=boundary, memory_limit=math.inf)]
    said, need = _shortfall(*min(unlimited, key=lambda x: max(x[1].mesh_bytes))) if unlimited else ("", math.nan)
    raise PlanInfeasible(f"{asked} fits {cluster.num_devices} x {cluster.device.name} "
                         f"({format_bytes(cluster.device.memory_bytes)} per device){said}", need)


def _shortfall(c: Candidate, r: InterleavedChoice) -> tuple[str, float]:
    """What breaks the budget in interleaved slicing `r` of candidate `c` (priced with
    no memory limit): its fullest mesh's bytes, by term, as a clause of a refusal, and
    those bytes."""
    meshes = len(r.stages) // r.chunks
    orders = [interleaved_order(meshes, c.microbatches, k, r.chunks) for k in range(meshes)]
    k = max(range(meshes), key=r.mesh_bytes.__getitem__)
    terms = mesh_memory_terms(orders, [chunk_memory(c.costs, st, d) for st, d in zip(r.stages, r.depths)])[k]
    said = ", ".join(f"{format_bytes(v)} of {term}" for term, v in terms.items() if v > 0)
    return (f"; the fastest slicing that comes closest ({r.chunks} chunks on {meshes} meshes of "
            f"{c.costs.shapes[r.shape].size} devices, B={c.microbatches}) needs {format_bytes(r.mesh_bytes[k])} "
            f"on mesh {k}: {said}"), r.mesh_bytes[k]


def interleaved_choices(c: Candidate, cluster: Cluster, chunk_options: Sequence[int], *, max_stages: int,
                        epsilon: float, boundary: Callable[..., StageBoundary] | None,
                        memory_limit: float) -> Iterator[InterleavedChoice]:
    """The fastest interleaved plan of candidate `c` (`_interleave`) whose meshes fit
    `memory_limit`, for every submesh shape that tiles the cluster into 2..max_stages
    meshes and every chunk count in `chunk_options` where there is one; `boundary(nodes=n)`
    prices the crossings between meshes of n nodes each (`stage_boundary_s`), or None."""
    costs = c.costs
    for h, shape, meshes in mesh_shapes(costs.shapes, cluster, max_stages):
        try:
            placed = place_submeshes([shape] * meshes, cluster.nodes, cluster.devices_per_node)
        except ValueError:
            continue
        node = [cluster.node_of(d[0]) for d in placed]
        # Meshes of whole nodes cross over all their nodes' cards.
        priced = boundary(nodes=whole_nodes(shape.size, cluster)) if boundary is not None else None

        def crossing(j: int, layer: int, node=node, meshes=meshes, priced=priced) -> float:
            same = node[j % meshes] == node[(j - 1) % meshes]
            return float((priced.intra if same else priced.inter)[layer])

        for v in chunk_options:
            r = interleaved_dp(costs.cost, h, meshes, v, c.microbatches,
                               chunk_memory=lambda st, d: chunk_memory(costs, st, d), memory_limit=memory_limit,
                               boundary=crossing if boundary is not None else None, epsilon=epsilon)
            if r is not None:
                yield r


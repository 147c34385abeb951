"""A `PipelinePlan` from the search's choice: each stage's options, memory, sync and
layouts, the transfers between stages, and the prediction.

The stage DP (or the interleaved search) picks layer ranges, submesh shapes and, per
stage, one option index of the table; this module reads those entries back into the
plan a user saves, simulates and runs (`assemble_plan`), and prices one stage's or
chunk's memory the same way the table did (`stage_memory_of`, `chunk_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster
from alpasim.graphs import ModelSource, OpGraph, flops_by_kind, get_recipe

from ._interleave import InterleavedChoice
from ._layer_options import LayerOption, canonical_params, layer_tensor_specs
from ._pipeline_plan import (PipelinePlan, PipelineStage, PlanModel, Prediction, RunnerUp, SearchStats, PlanTransfer,
                             plan_cluster_info)
from ._plan_inputs import PlanOptions
from ._schedule import SCHEDULES
from ._stage_compose import carry_bytes, compose_stage, scatter_tail_s, stage_sync
from ._stage_costs import StageCosts
from ._stage_dp import DPResult, StageChoice, bubble_fraction
from ._submesh import place_submeshes


@dataclass(frozen=True)
class Candidate:
    microbatches: int
    graph: OpGraph
    costs: StageCosts
    dp: DPResult


def assemble_plan(source: ModelSource, dtype: str, cluster: Cluster, best: Candidate,
                   candidates: Sequence[Candidate], search: SearchStats, method: str, options: PlanOptions,
                   interleaved: InterleavedChoice | None = None) -> PipelinePlan:
    """The plan of `best`'s DP result, or of `interleaved` (its chunks on S meshes of one shape)."""
    recipe = get_recipe(options.precision)
    costs, dp, b = best.costs, best.dp, best.microbatches
    if interleaved is None:
        choices = dp.stages
        shapes = [costs.shapes[st.shape] for st in choices]
        placed = place_submeshes(shapes, cluster.nodes, cluster.devices_per_node, runs=dp.runs or None)
        depths = [len(choices) - idx for idx in range(len(choices))]
        inflight = [SCHEDULES["1f1b"].inflight(len(choices), b, k, 1) for k in range(len(choices))]
        chunks = 1
    else:
        choices, chunks = interleaved.stages, interleaved.chunks
        meshes = len(choices) // chunks
        shape = costs.shapes[interleaved.shape]
        placed = place_submeshes([shape] * meshes, cluster.nodes, cluster.devices_per_node)
        placed = [placed[j % meshes] for j in range(len(choices))]
        shapes = [shape] * len(choices)
        depths, inflight = list(interleaved.depths), list(interleaved.inflight)
    stages = []
    chosen: dict[int, LayerOption] = {}      # layer -> the option its stage runs
    for idx, (st, devices) in enumerate(zip(choices, placed)):
        stages.append(_plan_stage(costs, st, depths[idx], inflight[idx], devices, shapes[idx], chosen))
    flops = flops_by_kind(best.graph)["matmul"] * b
    if interleaved is None:
        iteration = dp.latency_s
        peak = max(s.memory_bytes for s in stages)
        bubble = bubble_fraction([s.time_s for s in stages], b)
    else:
        iteration = interleaved.latency_s
        peak = max(interleaved.mesh_bytes)
        bubble = 1.0 - b * sum(s.time_s for s in stages) / (len(placed) // chunks * iteration)
    predicted = Prediction(iteration, flops / iteration / cluster.num_devices / 1e12, flops / iteration / 1e15,
                           peak, bubble)
    runner_ups = [RunnerUp(c.microbatches, c.dp.latency_s if c.dp.stages else None,
                           tuple((s.first, s.last, str(c.costs.shapes[s.shape])) for s in c.dp.stages))
                  for c in candidates if c is not best or interleaved is not None]
    batch = source.global_batch
    model = PlanModel(source.name, source.family, batch, best.graph.num_params(), flops, batch // b,
                      best.graph.num_layers, options.remat, best.graph.meta.get("recompute", "none"), recipe.name,
                      dtype, recipe.bytes_per_param(dtype), source.record(), options.loss_kernel,
                      kernels=best.graph.meta.get("kernels", "per-op"))
    cl = plan_cluster_info(cluster)
    transfers = stage_transfers(best.graph, costs.layer_graphs, chosen, [(s.first, s.last) for s in choices])
    schedule = "1f1b" if interleaved is None else "interleaved"
    return PipelinePlan(model, cl, method, True, b, tuple(stages), predicted, search, schedule, tuple(runner_ups),
                        transfers=transfers, chunks=chunks)


def _stage_options(costs: StageCosts, st: StageChoice, depth: int) -> tuple[int, int, list[LayerOption]]:
    """(view, option index, each layer's option) the table holds for stage `st` at
    `depth` (stages from here)."""
    view = int(costs.view[st.first, st.last, st.shape, depth - 1])
    j = int(costs.option[st.first, st.last, st.shape, depth - 1])
    opts = [costs.options[(costs.layer_kind[l], view)] for l in range(st.first, st.last + 1)]
    return view, j, [o[min(j, len(o) - 1)] for o in opts]


def _plan_stage(costs: StageCosts, st: StageChoice, depth: int, inflight: int, devices: Sequence[int],
                shape, chosen: dict[int, LayerOption]) -> PipelineStage:
    """One stage (or chunk) of a plan: layers st.first..st.last on `devices`, running the
    options the table holds at `depth` (stages from here), with `inflight` microbatches
    of it in flight; records each layer's option in `chosen`."""
    view, j, stage_opts = _stage_options(costs, st, depth)
    _, logical, _ = costs.meshes[view]
    compute = sync = forward = grad_sync = weight_s = weight_bytes = scatter = 0.0
    overlap = costs.bucket_bytes is not None
    param_specs: dict[str, str] = {}
    collective_bytes: dict[str, float] = {}
    strategies: list[tuple[str, ...]] = []
    heavy: list[dict] = []
    kinds_shown: set[str] = set()
    layer_specs: list[dict[str, str]] = []
    for layer, o in zip(range(st.first, st.last + 1), stage_opts, strict=True):
        kind = costs.layer_kind[layer]
        chosen[layer] = o
        compute += o.busy_s(overlap, costs.tp_overlap)
        forward += o.forward_busy_s(costs.tp_overlap)
        sync += o.sync_s
        scatter += o.grad_scatter_stream_s if overlap else 0.0
        grad_sync += o.grad_sync_s
        weight_s += o.weight_grad_s
        weight_bytes += o.weight_stash_bytes
        layer_graph = costs.layer_graphs[layer]
        layer_specs.append(layer_tensor_specs(layer_graph, o))
        strategies.append(o.strategy_names)
        for collective, nbytes in o.collective_bytes:
            collective_bytes[collective] = collective_bytes.get(collective, 0.0) + nbytes
        for p, spec in zip(canonical_params(layer_graph), o.param_specs):
            param_specs[p] = spec
        if kind not in kinds_shown:  # the heaviest ops of each distinct layer kind
            kinds_shown.add(kind)
            for i, strategy, out in o.heavy[:3]:
                op = layer_graph.ops[i]
                heavy.append({"op": op.name, "equation": op.param("equation") or op.prim,
                              "strategy": strategy, "output": out})
    mem = stage_memory_of(costs, st.first, st.last, view, stage_opts, inflight)
    buckets, exposed, gather, moved = stage_sync(stage_opts, costs.meshes[view][2], costs.bucket_bytes,
                                                 costs.tp_overlap, costs.gather_overlap)
    # A gradient-scatter stream's tail runs after the last backward (`grad_scatter_s`).
    tail = scatter_tail_s(scatter, compute, costs.microbatches)
    return PipelineStage((st.first, st.last), tuple(devices), (shape.n, shape.m), tuple(logical),
                         float(st.cost_s), mem.total_bytes, inflight, compute, sync + tail,
                         mem.persistent_bytes + mem.buffer_bytes, mem.activation_bytes, j,
                         param_specs, tuple(heavy), forward, compute - forward, mem.stash_bytes,
                         float(st.boundary_s), mem.to_json(),
                         tuple(layer_specs) if all(layer_specs) else (), grad_sync, buckets, exposed,
                         min(weight_s, compute - forward), weight_bytes, gather, moved, scatter,
                         collective_bytes, tuple(strategies) if all(strategies) else ())


def chunk_memory(costs: StageCosts, st: StageChoice, depth: int):
    """`StageMemory` of one chunk with a single microbatch in flight (its stash is per
    microbatch; the schedule's order says how many), running the table's option at `depth`."""
    view, _, opts = _stage_options(costs, st, depth)
    return stage_memory_of(costs, st.first, st.last, view, opts, 1)


def stage_memory_of(costs: StageCosts, first: int, last: int, view: int, opts: Sequence[LayerOption],
                    inflight: int):
    """`compose_stage` of layers first..last running `opts` on mesh `view`, with the tied
    copies whose owner the stage also holds counted once and their carried gradients."""
    drop, carries = False, []
    for l in range(first, last + 1):
        copy = costs.tied_owner[l]
        if copy is None or not first <= copy.owner <= last:
            continue
        drop = True
        if copy.owner < l:
            carries.append((l - first, copy.owner - first,
                            carry_bytes(costs.layer_graphs[l], opts[l - first], copy, costs.meshes[view][2])))
    return compose_stage(opts, inflight, drop_tied=drop, carries=carries)


def stage_transfers(graph: OpGraph, layer_graphs: Sequence[OpGraph], chosen: dict[int, LayerOption],
                    ranges: Sequence[tuple[int, int]]) -> tuple[PlanTransfer, ...]:
    """Every activation or cotangent one stage produces and another reads, with the
    layout the sender's plan produces it in and the layout the receiver's plan reads it
    in (what cross-mesh resharding needs). One record per (tensor, receiving stage).
    A tensor that only feeds parameter gradients or updates on the receiver (a tied
    embedding's gradient from the head) moves once per iteration: gradient
    accumulation is a sum, so the sender accumulates its part over the microbatches
    and sends the total."""
    stage_of = {layer: i for i, (first, last) in enumerate(ranges) for layer in range(first, last + 1)}
    readers: dict[str, dict[int, list]] = {}     # tensor -> receiving stage -> [(layer, feeds a gradient/update)]
    for op in graph.ops:
        # Only a sum into a gradient (or the update) may take the microbatches' total: an
        # op that also reads per-microbatch data (embedding_grad reads the ids, a weight
        # gradient reads the activations) needs each microbatch's cotangent.
        summing = op.prim == "convert" or (op.prim == "elementwise" and op.param("fn") in ("add", "identity"))
        to_grad = op.phase == "update" or (summing and all(graph.tensors[o].role == "grad" for o in op.outputs))
        for t in op.inputs:
            readers.setdefault(t, {}).setdefault(stage_of[op.layer], []).append((op.layer, to_grad))
    tied = set(graph.meta.get("tied_grads", ()))
    out = []
    for layer, lg in enumerate(layer_graphs):
        src = stage_of[layer]
        for k, t in enumerate(lg.outputs):
            tensor = graph.tensors[t]
            if tensor.role != "activation":
                continue
            for dst, reads in sorted(readers.get(t, {}).items()):
                if dst == src:
                    continue
                first = min(l for l, _ in reads)
                dst_graph = layer_graphs[first]
                out.append(PlanTransfer(
                    t, tensor.nbytes, src, dst, tuple(tensor.shape), tensor.dtype,
                    "forward" if dst > src else "backward",
                    all(to_grad for _, to_grad in reads) or t in tied,
                    chosen[layer].output_specs[k] if chosen[layer].output_specs else None,
                    chosen[first].input_specs[dst_graph.inputs.index(t)] if chosen[first].input_specs else None))
    return tuple(out)

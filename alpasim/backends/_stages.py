"""What a pipeline stage reads, writes and holds, and the intra-op plan it runs under.

A plan names stages by layer ranges of the planner's forward graph
(`alpasim.solvers.planning_graph`). `partition` cuts that graph's forward ops at the
same ranges and says, per stage, which tensors cross in (activations from earlier
stages, data inputs, parameters) and out (activations later stages read, the loss).
A parameter read by several stages (GPT's tied embedding: the token table is read by
the embedding and by the head) is *owned* by the stage that runs its Adam update —
the layer of its first use, as `alpasim.graphs.training_graph` places it — and
replicated read-only on the others.

`stage_intra_plan` gives one intra-op plan for a whole stage: the priced one, replayed
from the plan's record of each op's strategy and each tensor's layout
(`stages[i].layer_strategies`, `layer_specs`; `solvers.replay_intra_op`), which a
profiled re-pricing reads (`predict_run`). Only a plan from before those records (or
whose records do not line up with its graph) has its stage solved: its training
subgraph on its logical mesh with the plan's parameter and boundary layouts fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from alpasim.costmodels import AnalyticCostModel
from alpasim.graphs import OpGraph, Op, stage_graph
from alpasim.simulator import plan_cluster
from alpasim.solvers import (IntraOpPlan, PipelinePlan, ShardingSpec, logical_mesh, plan_restriction,
                             replay_intra_op, solve_intra_op)

from ._lowering import _index_bound

# The stage re-solve is small (one stage, parameters fixed); a bound keeps a hard
# one from stalling a run, and the incumbent is as good a prediction as the planner had.
RESOLVE_TIME_LIMIT_S = 30.0
RESOLVE_MIP_GAP = 1e-3


@dataclass(frozen=True)
class StagePart:
    """One stage's forward ops and the tensors at its edges (names of the forward graph)."""

    index: int
    layers: tuple[int, int]
    ops: tuple[Op, ...]
    params: tuple[str, ...]                 # every parameter its ops read
    owned: tuple[str, ...]                  # the parameters it updates
    data: tuple[str, ...]                   # graph inputs (tokens, labels, images)
    acts_in: dict[str, int]                 # activation -> stage producing it
    acts_out: dict[str, tuple[int, ...]]    # activation -> stages reading it
    loss: str | None                        # the loss, on the stage that computes it


def partition(graph: OpGraph, plan: PipelinePlan) -> list[StagePart]:
    """Cut `graph` (the planning forward graph) into the plan's stages."""
    ranges = [st.layers for st in plan.stages]
    stage_of = {layer: k for k, (first, last) in enumerate(ranges) for layer in range(first, last + 1)}
    missing = sorted({op.layer for op in graph.ops} - set(stage_of))
    if missing:
        raise ValueError(f"plan stages {ranges} do not cover layers {missing} of {graph.name!r}")
    producer_stage = {t: stage_of[op.layer] for op in graph.ops for t in op.outputs}
    owner = {p.name: stage_of[graph.consumers[p.name][0].layer] for p in graph.params if graph.consumers[p.name]}
    readers: dict[str, set[int]] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers.setdefault(t, set()).add(stage_of[op.layer])
    (loss,) = graph.outputs
    parts = []
    for k, layers in enumerate(ranges):
        ops = tuple(op for op in graph.ops if stage_of[op.layer] == k)
        reads = list(dict.fromkeys(t for op in ops for t in op.inputs))
        role = {t: graph.tensors[t].role for t in reads}
        params = tuple(t for t in reads if role[t] == "param")
        data = tuple(t for t in reads if role[t] == "input")
        acts_in = {t: producer_stage[t] for t in reads if t in producer_stage and producer_stage[t] != k}
        made = dict.fromkeys(t for op in ops for t in op.outputs)
        acts_out = {t: tuple(sorted(readers.get(t, set()) - {k})) for t in made if readers.get(t, set()) - {k}}
        parts.append(StagePart(k, tuple(layers), ops, params, tuple(p for p in params if owner[p] == k), data,
                               acts_in, acts_out, loss if loss in made else None))
    return parts


def microbatch_inputs(graph: OpGraph, seed: int, step: int, microbatch: int) -> dict[str, np.ndarray]:
    """The data inputs of one microbatch: images normal(0, 1), indices uniform below the
    bound their consumers imply (vocabulary, classes). A pure function of its arguments,
    so every stage and the single-device reference see the same batch."""
    rng = np.random.default_rng([seed, step, microbatch])
    out = {}
    for t in graph.inputs:
        tensor = graph.tensors[t]
        dtype = jax.dtypes.canonicalize_dtype(tensor.dtype)
        if tensor.is_float:
            out[t] = rng.normal(0.0, 1.0, tensor.shape).astype(dtype)
        else:
            out[t] = rng.integers(0, _index_bound(graph, t), tensor.shape).astype(dtype)
    return out


def stage_intra_plan(plan: PipelinePlan, train: OpGraph, k: int) -> IntraOpPlan:
    """Stage k's intra-op plan: the one its layers were priced with, rebuilt from the
    plan's record of each op's strategy and each tensor's layout with no solve
    (`solvers.replay_intra_op`); for a plan from before that record, its training
    subgraph solved on its logical mesh with the plan's parameter layouts and the
    receiving layouts of its boundary tensors fixed."""
    st = plan.stages[k]
    cluster = plan_cluster(plan)
    if cluster is None:
        raise ValueError(f"plan cluster {plan.cluster.name!r} is unknown; cannot rebuild stage {k}'s mesh")
    sub = stage_graph(train, *st.layers)
    replayed = _replayed(plan, train, k, sub, cluster) if st.layer_strategies and st.layer_specs else None
    if replayed is not None:
        return replayed
    fixed = {p: [ShardingSpec.parse(text)] for p, text in st.param_specs.items() if p in sub.tensors}
    for t in plan.transfers:
        if t.dst_stage == k and t.dst_spec and t.tensor in sub.inputs:
            fixed[t.tensor] = [ShardingSpec.parse(t.dst_spec)]
    mesh = logical_mesh(cluster, list(st.devices), tuple(st.logical_mesh))
    return solve_intra_op(sub, mesh, AnalyticCostModel(cluster), with_compute=True,
                          microbatches=plan.microbatches, leaf_specs=fixed,
                          time_limit_s=RESOLVE_TIME_LIMIT_S, mip_gap=RESOLVE_MIP_GAP).plan


def _replayed(plan: PipelinePlan, train: OpGraph, k: int, sub: OpGraph, cluster) -> IntraOpPlan | None:
    """Stage k's priced plan from its layers' records (`stage_intra_plan`); None where
    the records do not line up with the plan's graph (a relabelled method's layers)."""
    st = plan.stages[k]
    layers = [stage_graph(train, l, l) for l in range(st.layers[0], st.layers[1] + 1)]
    if [len(g.ops) for g in layers] != [len(names) for names in st.layer_strategies]:
        return None
    specs = {t: ShardingSpec.parse(text) for layout in st.layer_specs for t, text in layout.items()}
    mesh = logical_mesh(cluster, list(st.devices), tuple(st.logical_mesh))
    return replay_intra_op(sub, mesh, AnalyticCostModel(cluster), layers, st.layer_strategies, specs,
                           microbatches=plan.microbatches, restriction=plan_restriction(plan))

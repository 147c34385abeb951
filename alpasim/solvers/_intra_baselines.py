"""Hand-designed intra-op assignments, expressed as restrictions of the same problem.

A baseline is the ILP with fewer choices, so it is priced by exactly the same cost
model, resharding rules and memory accounting as Alpa's plan:

* **data parallel**: every op splits its batch loop over all live mesh axes, parameters
  and optimizer states are replicated, gradients are all-reduced (no reduce-scatter);
* **Megatron-LM**: mesh axis 0 is data parallel, axis 1 tensor parallel. Parameters
  are stored in Megatron's layout on axis 1 — column-parallel Q/K/V and first MLP
  weights, row-parallel output projection and second MLP weight, vocabulary-parallel
  embedding, expert weights split like the MLP — and every op that reads such a weight
  splits the weight's sharded loop on axis 1 (no weight is ever gathered). What is
  left (attention's head loop, activation layouts) the ILP chooses.

Batch loops are found by propagating the batch dimension (axis 0 of every stage
input) through the ops' dimension maps.
"""

from __future__ import annotations

from collections.abc import Mapping

from alpasim.costmodels import CostModel
from alpasim.graphs import OpGraph, op_dims

from ._mesh import LogicalMesh
from ._spec import ShardingSpec, spec_fits
from ._strategies import Strategy, enumerate_strategies

# Parameter name (last path component) -> dimension Megatron-LM splits on the
# tensor-parallel axis (Shoeybi et al. 2019; Narayanan et al. 2021).
MEGATRON_PARAM_DIMS: dict[str, int] = {
    "w_q": 1, "w_k": 1, "w_v": 1, "b_q": 0, "b_k": 0, "b_v": 0, "w_o": 0,
    "w_fc1": 1, "b_fc1": 0, "w_fc2": 0, "wte": 0,
    "w_expert_in": 2, "w_expert_out": 1,
}


def batch_letters(graph: OpGraph) -> dict[str, frozenset[str]]:
    """Op name -> the letters of its loops that run over the batch."""
    flagged: set[tuple[str, int]] = {(t, 0) for t in graph.inputs if graph.tensors[t].rank > 0}
    out: dict[str, frozenset[str]] = {}
    for op in graph.ops:
        dm = op_dims(op, graph.tensors)
        letters = {term[d] for t, term in zip(op.inputs, dm.inputs) for d in range(len(term)) if (t, d) in flagged}
        letters -= dm.unshardable
        out[op.name] = frozenset(letters)
        for t, term in zip(op.outputs, dm.outputs):
            flagged.update((t, d) for d, c in enumerate(term) if c in letters)
    return out


def _axes_of(s: Strategy) -> dict[int, str]:
    return {a: c for c, axes in s.loops for a in axes}


def data_parallel_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for pure data parallelism."""
    batch = batch_letters(graph)
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    restrict: dict[str, list[Strategy]] = {}
    for op in graph.ops:
        options = [s for s in enumerate_strategies(op, graph.tensors, mesh, cost_model, allow_replicated_heavy=True)
                   if not any(c.kind == "reduce_scatter" for c in s.collectives)]
        letters = batch[op.name]
        keep = [s for s in options if all(_axes_of(s).get(a) in letters for a in live)] if letters else \
            [s for s in options if not s.loops]
        restrict[op.name] = keep or [s for s in options if not s.loops]
    return restrict, _replicated_params(graph)


def megatron_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for Megatron-LM's data x tensor parallel layout."""
    batch = batch_letters(graph)
    leaf_specs = _megatron_params(graph, mesh)
    restrict: dict[str, list[Strategy]] = {}
    for op in graph.ops:
        dm = op_dims(op, graph.tensors)
        must: dict[int, set[str]] = {}
        if mesh.shape[0] > 1 and batch[op.name]:
            must[0] = set(batch[op.name])
        for t, term in zip(op.inputs, dm.inputs):
            spec = leaf_specs.get(t)
            if spec is not None and len(spec) == 1:
                for d, axes in enumerate(spec[0].dims):
                    if 1 in axes:
                        must[1] = {term[d]}
        options = [s for s in enumerate_strategies(op, graph.tensors, mesh, cost_model, allow_replicated_heavy=True)
                   if not any(c.kind == "reduce_scatter" and 0 in c.axes for c in s.collectives)]
        keep = [s for s in options if all(_axes_of(s).get(a) in letters for a, letters in must.items())]
        if 0 not in must and mesh.shape[0] > 1:
            keep = [s for s in keep if 0 not in _axes_of(s)]
        restrict[op.name] = keep or options
    return restrict, leaf_specs


def _replicated_params(graph: OpGraph) -> dict[str, list[ShardingSpec]]:
    return {t.name: [ShardingSpec.replicated(t.rank)] for t in graph.params}


def _megatron_params(graph: OpGraph, mesh: LogicalMesh) -> dict[str, list[ShardingSpec]]:
    specs: dict[str, list[ShardingSpec]] = {}
    for t in graph.params:
        dim = MEGATRON_PARAM_DIMS.get(t.name.rsplit("/", 1)[-1])
        spec = ShardingSpec.replicated(t.rank)
        if dim is not None and mesh.shape[1] > 1:
            dims = [()] * t.rank
            dims[dim] = (1,)
            candidate = ShardingSpec(tuple(dims))
            if spec_fits(candidate, t.shape, mesh):
                spec = candidate
        specs[t.name] = [spec]
    return specs


BASELINES: Mapping[str, object] = {"data_parallel": data_parallel_restriction, "megatron": megatron_restriction}

"""The graph the planner prices: a model's training graph in planning units.

Planning units give the embedding (or stem) and the head layers of their own, so the
expensive transformer or residual blocks are all alike and one solve serves them all;
an imported graph, one layer until clustered, is cut into layers by the eq. 6 DP. The
same rules rebuild a plan's graph for the executors (`planning_graph`), so a stage's
layer range names the ops the planner priced.
"""

from __future__ import annotations

from alpasim.graphs import (ModelSource, OpGraph, assign_layers, build_training_graph, get_recipe, is_heavy,
                            source_from_record, with_loss_kernel)

from ._pipeline_plan import PlanModel


# An imported graph (one layer) is clustered into this many layers at most when no
# `layers` is given (`default_graph_layers`).
DEFAULT_GRAPH_LAYERS = 8
UNIT_TAGS_FIRST = frozenset({"embedding", "stem"})
UNIT_TAGS_LAST = frozenset({"head"})


def default_graph_layers(graph: OpGraph) -> int:
    """Layers to cluster an imported graph (all one layer) into when `--layers` is not
    given: up to DEFAULT_GRAPH_LAYERS, at most one per heavy op (einsum, conv), so that
    every layer has work to balance."""
    heavy = sum(1 for op in graph.ops if is_heavy(op))
    return max(1, min(DEFAULT_GRAPH_LAYERS, heavy))


def planning_units(fwd: OpGraph) -> OpGraph:
    """Give embedding/stem ops and head ops layers of their own (block i -> i + 1)."""
    if not any(op.tags & (UNIT_TAGS_FIRST | UNIT_TAGS_LAST) for op in fwd.ops):
        return fwd
    last = max(op.layer for op in fwd.ops)
    ops = []
    for op in fwd.ops:
        if op.tags & UNIT_TAGS_FIRST:
            layer = 0
        elif op.tags & UNIT_TAGS_LAST:
            layer = last + 2
        else:
            layer = op.layer + 1
        ops.append(op.replace(layer=layer))
    return fwd.replace(ops=ops)


def planning_graph(model: PlanModel) -> OpGraph:
    """The forward graph a plan was made from, rebuilt from its `model` field: one
    microbatch (`microbatch_size`) of the model, labelled in planning units; re-clustered
    with the eq. 6 DP when the plan's layer count says `--layers` was given. Executors
    use it so that a stage's layer range names the same ops the planner costed."""
    if model.microbatch_size is None:
        raise ValueError(f"the plan of {model.name} records no microbatch size (an infeasible plan?)")
    source = source_from_record(model.source, model.name)
    recipe = get_recipe(model.precision)
    fwd = planning_units(source.forward(model.microbatch_size, recipe.weight_dtype(source.dtype)))
    layers = model.layers if model.layers is not None else fwd.num_layers
    return fwd if layers == fwd.num_layers else assign_layers(fwd, layers)[0]


# Training graphs by (zoo config, microbatch size, dtype, relabelling, layers, remat,
# recipe, recompute), for the process: a baseline's grid asks for the same microbatch
# graph at many configurations. Graphs are never changed once built.
_GRAPH_MEMO: dict[tuple, OpGraph] = {}
GRAPH_MEMO_ENTRIES = 8


def planning_training_graph(source: ModelSource, size: int, dtype: str, relabel, layers: int | None, remat: bool,
                    precision: str, recompute: str, loss_kernel: str = "fused", kernels: str = "per-op") -> OpGraph:
    """The training graph of one microbatch of `size` samples, labelled as the search
    asks (`relabel`, else `layers` clusters, else planning units); memoised for zoo
    models (a saved graph has no hashable config to key it by)."""
    key = None
    if source.config is not None:
        key = (source.name, source.config, size, dtype, relabel, layers, remat, precision, recompute, loss_kernel,
               kernels)
        try:
            if key in _GRAPH_MEMO:
                return _GRAPH_MEMO[key]
        except TypeError:                   # a config that does not hash: build it every time
            key = None
    fwd = source.forward(size, dtype)
    if relabel is not None:
        fwd = relabel(fwd)
    elif layers is None:
        fwd = planning_units(fwd)
    else:
        fwd = assign_layers(fwd, layers)[0]
    graph = with_loss_kernel(build_training_graph(fwd, remat=remat, precision=precision, recompute=recompute,
                                                  kernels=kernels).graph, loss_kernel)
    if key is not None:
        if len(_GRAPH_MEMO) >= GRAPH_MEMO_ENTRIES:
            _GRAPH_MEMO.pop(next(iter(_GRAPH_MEMO)))
        _GRAPH_MEMO[key] = graph
    return graph

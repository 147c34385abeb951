"""A plan's layouts as JAX objects: per stage, a `Mesh` and `NamedSharding`s.

`plan_shardings(plan, params)` gives, for every pipeline stage, the stage's devices as
a `jax.sharding.Mesh` with named axes ("x", "y": the plan's logical mesh) and, in the
structure of the user's own `params` pytree (the one `graphs.from_jax` read), the
`NamedSharding` of each parameter the stage holds, of its gradient accumulator and of
Adam's two moments: ready for `jax.jit(step, in_shardings=...)` with no glue. A leaf
another stage holds is None. A stacked parameter that a scan split into one per layer
(`meta["stacked_params"]`) is exported where one stage holds every slice in one layout
(its leading axis unsharded), else None and named in `split_leaves`.

For a zoo model (no pytree of the user's) the trees are dicts keyed by graph
parameter name, as `by_name` always is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.graphs import values_as_tree
from alpasim.solvers import PipelinePlan, planning_graph

from ._executable import named_sharding, plan_training_graph, stage_mesh


@dataclass(frozen=True)
class StageShardings:
    """One stage's mesh and the layouts of what it holds (module doc)."""

    mesh: Mesh
    params: Any
    grads: Any
    adam_m: Any
    adam_v: Any
    batch: Any                              # the batch pytree's layouts (None: another stage reads it)
    by_name: dict[str, NamedSharding] = field(default_factory=dict)   # graph tensor name -> layout
    split_leaves: tuple[str, ...] = ()      # stacked leaves this stage holds only part of


def plan_shardings(plan: PipelinePlan, params: Any = None, batch: Any = None,
                   devices: Sequence[jax.Device] | None = None) -> list[StageShardings]:
    """Per stage of `plan`, its `StageShardings`; `params` and `batch` are the pytrees
    `from_jax` read (None: dicts by graph name); plan device ids index `devices`
    (default `jax.devices()`)."""
    devices = list(devices if devices is not None else jax.devices())
    graph = planning_graph(plan.model)
    train = plan_training_graph(plan, graph)
    grad_of = {op.inputs[0]: op.inputs[1] for op in train.ops if op.prim == "adam"}
    names = [p.name for p in graph.params]
    out = []
    for k, st in enumerate(plan.stages):
        mesh = stage_mesh(plan, k, [devices[d] for d in st.devices])
        specs: dict[str, str] = {}
        for layer_specs in st.layer_specs or ():
            specs.update(layer_specs)
        specs.update(st.param_specs)
        named = {t: named_sharding(mesh, s) for t, s in specs.items()}
        kinds = {"params": {p: named.get(p) for p in names},
                 "grads": {p: named.get(grad_of.get(p, ""), named.get(p)) if p in named else None for p in names},
                 "adam_m": {p: named.get(f"{p}:adam_m") for p in names},
                 "adam_v": {p: named.get(f"{p}:adam_v") for p in names}}
        split: set[str] = set()
        trees = {kind: by_param if params is None else values_as_tree(graph, params, by_param,
                                                                      combine=_stacked_layout(split))
                 for kind, by_param in kinds.items()}
        inputs = {t: named.get(t) for t in graph.inputs}
        if batch is not None:
            inputs = values_as_tree(graph, batch, inputs, "batch")
        out.append(StageShardings(mesh, trees["params"], trees["grads"], trees["adam_m"], trees["adam_v"],
                                  inputs, named, tuple(sorted(split))))
    return out


def _stacked_layout(split: set[str]) -> Callable[[str, list[NamedSharding | None]], NamedSharding | None]:
    """How `values_as_tree` combines a stacked leaf's slices: their common layout with
    an unsharded leading axis; None (and the leaf named in `split`) where the stage
    holds only some slices or they disagree."""
    def combine(leaf: str, got: list[NamedSharding | None]) -> NamedSharding | None:
        if all(g is None for g in got):
            return None
        if any(g is None for g in got) or len({g.spec for g in got}) > 1:
            split.add(leaf)
            return None
        return NamedSharding(got[0].mesh, PartitionSpec(None, *got[0].spec))
    return combine

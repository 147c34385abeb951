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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.graphs import build_training_graph
from alpasim.solvers import PipelinePlan, ShardingSpec, planning_graph

from ._executable import AXIS_NAMES, stage_mesh


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
    recipe = {"precision": plan.model["precision"]} if "precision" in plan.model else {}
    train = build_training_graph(graph, remat=bool(plan.model.get("remat", True)), **recipe).graph
    grad_of = {op.inputs[0]: op.inputs[1] for op in train.ops if op.prim == "adam"}
    names = [p.name for p in graph.params]
    out = []
    for k, st in enumerate(plan.stages):
        mesh = stage_mesh(plan, k, [devices[d] for d in st.devices])
        specs: dict[str, str] = {}
        for layer_specs in st.layer_specs or ():
            specs.update(layer_specs)
        specs.update(st.param_specs)
        named = {t: _named(mesh, s) for t, s in specs.items()}
        kinds = {"params": {p: named.get(p) for p in names},
                 "grads": {p: named.get(grad_of.get(p, ""), named.get(p)) if p in named else None for p in names},
                 "adam_m": {p: named.get(f"{p}:adam_m") for p in names},
                 "adam_v": {p: named.get(f"{p}:adam_v") for p in names}}
        trees, split = {}, set()
        for kind, by_param in kinds.items():
            trees[kind] = by_param if params is None else _as_tree(graph, params, by_param, split)
        inputs = {t: named.get(t) for t in graph.inputs}
        if batch is not None:
            inputs = _as_tree(graph, batch, inputs, split, "batch_leaves")
        out.append(StageShardings(mesh, trees["params"], trees["grads"], trees["adam_m"], trees["adam_v"],
                                  inputs, named, tuple(sorted(split))))
    return out


def _named(mesh: Mesh, text: str) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*ShardingSpec.parse(text).partition_spec(AXIS_NAMES)))


def _as_tree(graph, params: Any, by_param: dict[str, NamedSharding | None], split: set[str],
             leaves: str = "param_leaves") -> Any:
    """`by_param` in the structure of the user's `params`; a stacked leaf gets the
    layout of its slices with an unsharded leading axis where they all agree."""
    values = dict(by_param)
    for leaf, parts in graph.meta.get("stacked_params", {}).items():
        got = [by_param.get(p) for p in parts]
        if all(g is None for g in got):
            values[leaf] = None
        elif any(g is None for g in got) or len({g.spec for g in got}) > 1:
            values[leaf] = None
            split.add(leaf)
        else:
            values[leaf] = NamedSharding(got[0].mesh, PartitionSpec(None, *got[0].spec))
    _, treedef = jax.tree_util.tree_flatten(params)
    order = graph.meta.get(leaves)
    if order is None or len(order) != treedef.num_leaves:
        raise ValueError(f"the tree has {treedef.num_leaves} leaves; graph {graph.name!r} was imported from "
                         f"{'an unknown number' if order is None else len(order)}")
    return jax.tree_util.tree_unflatten(treedef, [values.get(n) for n in order])

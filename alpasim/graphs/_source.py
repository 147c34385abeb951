"""Where a model comes from: a zoo name or spec string, or a saved graph (a user's own JAX model).

The planner needs a model at every microbatch size it tries, and a plan must be able
to rebuild exactly the graph it was priced on wherever it is taken. `ModelSource`
gives both: `forward(microbatch_size, dtype)` is the forward graph of one microbatch,
and `record()` is what a plan stores (`plan.model.source`) so that
`source_from_record` rebuilds the same source anywhere:

- zoo: ``{"kind": "zoo", "spec": "gpt3-2.6b"}``; the graph is rebuilt from the spec.
- graph: ``{"kind": "graph", "digest": sha256, "graph": <the graph JSON>}``. The graph
  is embedded, so a plan file needs nothing beside it; the digest names the graph and
  is checked when the plan is loaded. The graph's batch, as marked at import
  (`graphs.mark_batch`), is the global batch; a microbatch is the graph resized to it
  (`graphs.resize_batch`). An unmarked graph runs only at its own batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ._batch import batch_size, resize_batch
from ._build import read_graph_file
from ._serialize import GraphFormatError, graph_from_json, graph_to_json
from ._types import OpGraph
from ._zoo import FAMILIES, ModelConfig, ModelSpecError, forward_graph, model_from_json, model_to_json, resolve_model


@dataclass(frozen=True)
class ModelSource:
    """A model the planner can build at any microbatch size (module doc)."""

    name: str
    family: str
    global_batch: int
    dtype: str
    config: ModelConfig | None = None     # zoo models
    graph: OpGraph | None = None          # saved graphs, at their own batch

    @classmethod
    def zoo(cls, name: str, cfg: ModelConfig) -> ModelSource:
        return cls(name, cfg.family, cfg.batch, cfg.dtype, config=cfg)

    @property
    def resizable(self) -> bool:
        return self.config is not None or batch_size(self.graph) is not None

    def forward(self, microbatch_size: int, dtype: str | None = None) -> OpGraph:
        """The forward graph of one microbatch; `dtype` (a recipe's weight dtype)
        rebuilds a zoo model in it. A saved graph has its own, and refuses another."""
        if self.config is not None:
            cfg = dataclasses.replace(self.config, batch=int(microbatch_size), dtype=dtype or self.config.dtype)
            return forward_graph(cfg, name=self.name)
        if dtype is not None and dtype != self.dtype:
            raise ModelSpecError(f"{self.name}: the graph's weights are {self.dtype}; the precision recipe trains "
                                 f"{dtype} weights (import the model in {dtype}, or choose another --precision)")
        if microbatch_size == self.global_batch:
            return self.graph
        return resize_batch(self.graph, int(microbatch_size))

    def record(self) -> dict[str, Any]:
        if self.config is not None:   # the config too: a spec file's name need not resolve elsewhere
            return {"kind": "zoo", "spec": self.name, "config": model_to_json(self.config)}
        data = graph_to_json(self.graph)
        return {"kind": "graph", "digest": graph_digest(data), "graph": data}


def graph_digest(data: dict) -> str:
    """sha256 of a graph's JSON, keys sorted: the graph's name in a plan."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def graph_source(graph: OpGraph, name: str | None = None) -> ModelSource:
    """The source of a saved or imported forward graph: the zoo model it is, exactly
    (`zoo_model_of`), or a graph of its own, named `name` (default: the graph's)."""
    if any(op.phase != "forward" for op in graph.ops):
        raise GraphFormatError(f"graph {graph.name!r} is a training graph; plan the model it was built from "
                               f"(`alpasim graph MODEL --save FILE` writes a model's forward graph)")
    zoo = zoo_model_of(graph)
    if zoo is not None:
        return zoo
    batch = batch_size(graph)
    if batch is None:   # unmarked: its own batch is the only one; the first input's leading dim names it
        first = next((graph.tensors[t] for t in graph.inputs if graph.tensors[t].shape), None)
        batch = first.shape[0] if first is not None else 1
    dtype = str(graph.meta.get("dtype") or next((t.dtype for t in graph.tensors.values() if t.role == "param"),
                                                "float32"))
    return ModelSource(name or graph.name, str(graph.meta.get("family", "graph")), int(batch), dtype, graph=graph)


def zoo_model_of(graph: OpGraph) -> ModelSource | None:
    """The zoo model `graph` is, or None. `alpasim graph MODEL --save FILE` writes a zoo
    model's forward graph with its family and configuration in `meta`; when the graph
    rebuilt from that configuration is the saved one, op for op and tensor for tensor,
    the file is that model, and it plans as the zoo name does: at every microbatch
    size and by every method, Megatron-LM's included. A graph edited after it was saved
    is no longer the zoo's and plans as a graph of its own."""
    family, config = graph.meta.get("family"), graph.meta.get("config")
    if not isinstance(config, dict) or family not in FAMILIES:
        return None
    try:
        cfg = model_from_json({**config, "family": family}, f"graph {graph.name!r}'s configuration")
        rebuilt = forward_graph(cfg, name=graph.name)
    except ValueError:             # a configuration this version's zoo does not build
        return None
    # A file saved before the builders tagged their parameters for tensor parallelism
    # (`_builder.TP_SPLITS`) is the same model without the tags.
    saved, made = graph_to_json(graph), graph_to_json(rebuilt)
    if "tensor_parallel" not in saved["meta"]:
        saved = {**saved, "meta": {**saved["meta"], "tensor_parallel": made["meta"].get("tensor_parallel")}}
    if saved != made:
        return None
    return ModelSource.zoo(graph.name, cfg)


@dataclass(frozen=True)
class JaxModel:
    """A user's JAX model as the planner takes it from Python: `loss_fn(params, batch)`
    with example `params` and `batch` (pytrees of arrays or `jax.ShapeDtypeStruct`s,
    only shapes and dtypes are read); `batch_axis` is the batch axis of every batch
    leaf. It is imported with `graphs.from_jax` (traced at the batch and at twice it,
    so the graph is resized to any microbatch exactly) and planned as that graph."""

    loss_fn: Callable[[Any, Any], Any]
    params: Any
    batch: Any
    name: str = "imported"
    batch_axis: int | None = 0

    def graph(self) -> OpGraph:
        from ._jax_import import from_jax

        return from_jax(self.loss_fn, self.params, self.batch, name=self.name, batch_axis=self.batch_axis)


# What the planner accepts as a model (`model_source`).
ModelLike = Union[str, ModelConfig, OpGraph, "ModelSource", JaxModel]


def model_source(spec: ModelLike) -> ModelSource:
    """The source of a zoo name, spec string, model JSON, graph file, graph or JAX model."""
    if isinstance(spec, ModelSource):
        return spec
    if isinstance(spec, JaxModel):
        return graph_source(spec.graph(), spec.name)
    if isinstance(spec, OpGraph):
        return graph_source(spec)
    graph = read_graph_file(spec.strip()) if isinstance(spec, str) else None
    if graph is not None:
        return graph_source(graph, Path(spec.strip()).stem)
    return ModelSource.zoo(*resolve_model(spec))


def source_from_record(rec: dict | None, name: str) -> ModelSource:
    """The source a plan's `model.source` record was made from (module doc); plans from
    before `source` existed (`rec` None) name a zoo model in `name`."""
    if rec and rec.get("kind") == "zoo" and isinstance(rec.get("config"), dict):
        return ModelSource.zoo(str(rec.get("spec", name)), model_from_json(rec["config"], "the plan's model config"))
    if not rec or rec.get("kind") == "zoo":
        return model_source(str((rec or {}).get("spec", name)))
    if rec.get("kind") != "graph" or not isinstance(rec.get("graph"), dict):
        raise GraphFormatError(f"plan model source {rec.get('kind')!r}: expected 'zoo' or 'graph' with its graph")
    if graph_digest(rec["graph"]) != rec.get("digest"):
        raise GraphFormatError("the plan's embedded graph does not match its digest (edited after planning?)")
    return graph_source(graph_from_json(rec["graph"], "the plan's graph"), name)


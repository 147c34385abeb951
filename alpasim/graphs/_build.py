"""From a model name to its layered training graph, and the numbers reports quote.

The recipe, in order: forward graph (zoo, spec, JSON model or saved graph) ->
optional re-clustering into L layers (eq. 6 DP; the zoo's own labels are one layer
per block otherwise) -> reverse-mode derivation of the backward ops, with optional
full rematerialisation -> Adam update ops. Clustering must come before autodiff so
that backward and update ops inherit their forward op's layer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ._autodiff import AdamConfig, training_graph
from ._clustering import Clustering, assign_layers
from ._primitives import op_flops, op_kind
from ._jsonfile import read_json_file
from ._serialize import GraphFormatError, graph_from_json
from ._types import PHASES, OpGraph
from ._zoo import forward_graph


def read_graph_file(path: str) -> OpGraph | None:
    """The graph saved at `path`, or None when `path` is no saved graph file (a zoo
    name, a spec string, a model JSON)."""
    if not (path.endswith(".json") and Path(path).is_file()):
        return None
    try:
        data = read_json_file(path, GraphFormatError)
    except GraphFormatError:
        return None
    schema = data.get("schema", "") if isinstance(data, dict) else ""
    if not (isinstance(schema, str) and schema.startswith("alpasim.graph/")):
        return None
    return graph_from_json(data, path)


def load_forward(model: str) -> OpGraph:
    """A forward graph from a zoo name, spec string, model JSON or saved graph JSON."""
    g = read_graph_file(model)
    if g is None:
        return forward_graph(model)
    if g.meta.get("training"):
        raise ValueError(f"{model}: holds a training graph; pass its forward graph")
    return g


@dataclass(frozen=True, slots=True)
class BuiltGraph:
    """A training graph with how it was made (for reports and caches)."""

    graph: OpGraph
    forward: OpGraph
    clustering: Clustering | None


def build_training_graph(model: str | OpGraph, *, layers: int | None = None, remat: bool = False,
                         delta: float = 0.25, optimizer: AdamConfig | None = None,
                         precision: str | None = None, recompute: str = "none",
                         kernels: str = "per-op") -> BuiltGraph:
    """Forward graph -> (clustered) -> forward + backward + update graph, under the
    precision recipe `precision` (`_precision`; default mixed-fp32grad)."""
    fwd = model if isinstance(model, OpGraph) else load_forward(model)
    clustering = None
    if layers is not None:
        fwd, clustering = assign_layers(fwd, layers, delta)
    elif any(op.layer < 0 for op in fwd.ops):
        fwd = fwd.replace(ops=[op.replace(layer=0) if op.layer < 0 else op for op in fwd.ops])
    graph = training_graph(fwd, remat=remat, optimizer=optimizer, precision=precision, recompute=recompute,
                           kernels=kernels)
    graph.meta["remat"] = remat
    graph.meta["recompute"] = recompute
    return BuiltGraph(graph, fwd, clustering)


def flops_by_kind(graph: OpGraph) -> dict[str, float]:
    """FLOPs per iteration by primitive kind, plus `matmul` (einsum + conv + fused
    attention: the model's GEMMs, however a kernel runs them) and `total`."""
    out: Counter[str] = Counter()
    for op in graph.ops:
        out[op_kind(op)] += op_flops(op, graph.tensors)
    result = {k: float(v) for k, v in sorted(out.items())}
    result.setdefault("einsum", 0.0)
    result.setdefault("conv", 0.0)
    result["matmul"] = result["einsum"] + result["conv"] + result.get("attention", 0.0)
    result["total"] = float(sum(out.values()))
    return result


def ops_by_phase(graph: OpGraph) -> dict[str, int]:
    counts = Counter(op.phase for op in graph.ops)
    return {p: counts.get(p, 0) for p in PHASES}

"""Stage graphs: the ops of a contiguous layer range, with what crosses the boundary.

A pipeline stage runs the forward, backward and update ops of layers first..last.
Tensors it reads but neither produces nor stores (activations from the previous stage,
cotangents from the next) become its inputs; tensors it produces that anything outside
reads (or the step returns) become its outputs. Names are kept, so a stage's plan
speaks about the same tensors as the whole graph.
"""

from __future__ import annotations

from ._types import OpGraph, Tensor

LEAF_ROLES = ("param", "optimizer_state")


def stage_graph(graph: OpGraph, first: int, last: int, name: str | None = None) -> OpGraph:
    """The sub-graph of layers first..last (inclusive) of a layered training graph."""
    n = graph.num_layers
    if not (0 <= first <= last < max(n, 1)):
        raise ValueError(f"layer range {first}..{last} is outside the graph's layers 0..{n - 1}")
    ops = [op for op in graph.ops if first <= op.layer <= last]
    produced = {t for op in ops for t in op.outputs}
    read = {t for op in ops for t in op.inputs}
    inputs: list[str] = []
    tensors: dict[str, Tensor] = {}
    for t in dict.fromkeys(t for op in ops for t in op.inputs):
        tensor = graph.tensors[t]
        if t in produced:
            continue
        if tensor.role in LEAF_ROLES and t not in graph.producer:
            continue
        inputs.append(t)
        if tensor.role != "input":
            tensors[t] = Tensor(t, tensor.shape, tensor.dtype, "input")
    for t in read | produced:
        tensors.setdefault(t, graph.tensors[t])
    outside = {t for op in graph.ops if not first <= op.layer <= last for t in op.inputs}
    outputs = [t for t in dict.fromkeys(t for op in ops for t in op.outputs)
               if t in outside or t in graph.outputs]
    meta = dict(graph.meta)
    meta["stage_layers"] = [first, last]
    return OpGraph(name or f"{graph.name}[{first}:{last}]", tensors, ops, inputs, outputs, meta)

"""The batch dimension of a saved graph, so the planner can rebuild it at any microbatch size.

A graph imported from JAX is one fixed batch. The planner needs the same model at
every microbatch size it tries (global batch / B), and a plan needs it at the size it
chose. `mark_batch(small, large, b_small, b_large)` compares two traces of the same
function at two batch sizes and records, in `meta["batch"]`, what the batch moves:

    {"size": b, "dims": {tensor: [dims proportional to the batch]},
     "params": {op: {param: [[path, +1 | -1], ...]}}}

A dimension (or an integer op parameter, such as a reshape's target shape) is batch
proportional when it is b_small * k in one trace and b_large * k in the other (a float
parameter too: a mean's divisor folded into a `scalar`); one that scales as 1 / batch
(a mean's reciprocal) is marked -1. Anything else that differs means the function's structure depends on its batch,
and marking refuses. `resize_batch(graph, b)` rescales what is marked and rebuilds the
graph through `graph_from_json`, so every op is re-checked by its primitive's shape
rule: a resize that a primitive does not accept fails there, loudly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._serialize import graph_from_json, graph_to_json
from ._types import OpGraph

BATCH_KEY = "batch"
# Float parameters come from float32 constants (the importer rounds them): proportional
# to the batch within float32's precision.
FLOAT_RTOL = 1e-6


class BatchError(ValueError):
    """A graph whose batch cannot be marked or resized."""


def batch_size(graph: OpGraph) -> int | None:
    """The batch a graph records (`mark_batch`), or None."""
    info = graph.meta.get(BATCH_KEY)
    return int(info["size"]) if isinstance(info, Mapping) and "size" in info else None


def mark_batch(small: OpGraph, large: OpGraph, b_small: int, b_large: int) -> OpGraph:
    """`small` with `meta["batch"]` recording what moves with the batch (module doc)."""
    if b_large == b_small or b_small < 1:
        raise BatchError(f"mark_batch needs two different batch sizes, got {b_small} and {b_large}")
    if [op.name for op in small.ops] != [op.name for op in large.ops] or set(small.tensors) != set(large.tensors):
        raise BatchError("the graph's ops differ between batch sizes: its structure depends on the batch")
    dims: dict[str, list[int]] = {}
    for name, t in small.tensors.items():
        moved: list = []
        _diff(t.shape, large.tensors[name].shape, (), b_small, b_large, moved, f"tensor {name!r}'s shape")
        if moved:
            dims[name] = [path[0] for path, _ in moved]
    params: dict[str, dict[str, list]] = {}
    for op, other in zip(small.ops, large.ops, strict=True):
        found: dict[str, list] = {}
        a, b = dict(op.params), dict(other.params)
        if a.keys() != b.keys():
            raise BatchError(f"op {op.name!r} has different parameters at another batch size")
        for key in a:
            paths = []
            _diff(a[key], b[key], (), b_small, b_large, paths, f"op {op.name!r} parameter {key!r}")
            if paths:
                found[key] = [[list(p), s] for p, s in paths]
        if found:
            params[op.name] = found
    meta = dict(small.meta)
    meta[BATCH_KEY] = {"size": int(b_small), "dims": dims, "params": params}
    return small.replace(meta=meta)


def _proportional(x: Any, y: Any, b0: int, b1: int) -> bool:
    return isinstance(x, int) and isinstance(y, int) and x % b0 == 0 and x // b0 * b1 == y


def _diff(x: Any, y: Any, path: tuple[int, ...], b0: int, b1: int, out: list, where: str) -> None:
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            _diff(u, v, (*path, i), b0, b1, out, where)
        return
    if x == y:
        return
    if isinstance(x, bool) or isinstance(y, bool):
        raise BatchError(f"{where} changes with the batch ({x!r} vs {y!r})")
    floats = isinstance(x, float) and isinstance(y, float) and x != 0
    if _proportional(x, y, b0, b1) or (floats and abs(x * b1 - y * b0) <= FLOAT_RTOL * abs(x * b1)):
        out.append((path, 1))
    elif floats and abs(x * b0 - y * b1) <= FLOAT_RTOL * abs(x * b0):
        out.append((path, -1))
    else:
        raise BatchError(f"{where} is {x!r} at batch {b0} and {y!r} at batch {b1}: not proportional to the batch")


def resize_batch(graph: OpGraph, batch: int) -> OpGraph:
    """`graph` at batch `batch`, rescaled along what `meta["batch"]` marks (module doc)."""
    b0 = batch_size(graph)
    if b0 is None:
        raise BatchError(f"graph {graph.name!r} records no batch dimension, so it runs only at the batch it "
                         f"was saved with; re-import it with graphs.from_jax (which marks it)")
    if batch == b0:
        return graph
    if batch < 1:
        raise BatchError(f"batch {batch} must be at least 1")
    info = graph.meta[BATCH_KEY]
    data = graph_to_json(graph)
    for t in data["tensors"]:
        for d in info["dims"].get(t["name"], ()):
            t["shape"][d] = t["shape"][d] // b0 * batch
    for op in data["ops"]:
        for key, paths in info["params"].get(op["name"], {}).items():
            for path, sign in paths:
                op["params"][key] = _scaled(op["params"][key], list(path), b0, batch, sign)
    data["meta"] = {**data["meta"], BATCH_KEY: {**info, "size": int(batch)}}
    return graph_from_json(data, f"graph {graph.name!r} at batch {batch}")


def _scaled(value: Any, path: list[int], b0: int, b1: int, sign: int) -> Any:
    if path:
        items = list(value)
        items[path[0]] = _scaled(items[path[0]], path[1:], b0, b1, sign)
        return items
    if isinstance(value, int):
        return value // b0 * b1
    return value * b1 / b0 if sign > 0 else value * b0 / b1

"""JSON save/load of graphs with a schema version; an exact round trip.

Files are read as data only. A malformed or wrong-schema file raises
`GraphFormatError` naming the file and the field, and every loaded op is re-checked
by its primitive's shape rule, so a hand-edited file cannot smuggle in a graph the
rest of alpasim would misread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._jsonfile import read_json_file
from ._primitives import PrimitiveError, infer_outputs
from ._types import GraphError, Op, OpGraph, Tensor

SCHEMA = "alpasim.graph/1"


class GraphFormatError(ValueError):
    """A graph file that is not valid JSON, has the wrong schema or a bad field."""


def graph_to_json(graph: OpGraph) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "name": graph.name,
        "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "role": t.role}
                    for t in graph.tensors.values()],
        "ops": [_op_to_json(op) for op in graph.ops],
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "meta": graph.meta,
    }


def _op_to_json(op: Op) -> dict[str, Any]:
    d: dict[str, Any] = {"name": op.name, "prim": op.prim, "inputs": list(op.inputs),
                         "outputs": list(op.outputs), "params": {k: _listify(v) for k, v in op.params},
                         "layer": op.layer, "phase": op.phase}
    if op.origin is not None:
        d["origin"] = op.origin
    if op.remat:
        d["remat"] = True
    if op.tags:
        d["tags"] = sorted(op.tags)
    return d


def _listify(v: Any) -> Any:
    return [_listify(x) for x in v] if isinstance(v, tuple) else v


def _field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if key not in d:
        if default is not ...:
            return default
        raise GraphFormatError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, (int,))):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise GraphFormatError(f"{where}: field {key!r} must be {names}, got {v!r}")
    return v


def graph_from_json(data: Any, source: str = "<graph JSON>") -> OpGraph:
    if not isinstance(data, dict):
        raise GraphFormatError(f"{source}: top level must be a JSON object")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise GraphFormatError(f"{source}: field 'schema' is {schema!r}, expected {SCHEMA!r}")
    tensors: dict[str, Tensor] = {}
    for i, td in enumerate(_field(data, "tensors", list, source)):
        where = f"{source}: tensors[{i}]"
        if not isinstance(td, dict):
            raise GraphFormatError(f"{where}: must be an object")
        shape = _field(td, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise GraphFormatError(f"{where}: field 'shape' must be a list of integers, got {shape!r}")
        try:
            t = Tensor(_field(td, "name", str, where), tuple(shape), _field(td, "dtype", str, where),
                       _field(td, "role", str, where))
        except ValueError as e:
            raise GraphFormatError(f"{where}: {e}") from None
        tensors[t.name] = t
    ops = []
    for i, od in enumerate(_field(data, "ops", list, source)):
        where = f"{source}: ops[{i}]"
        if not isinstance(od, dict):
            raise GraphFormatError(f"{where}: must be an object")
        try:
            op = Op(name=_field(od, "name", str, where), prim=_field(od, "prim", str, where),
                    inputs=tuple(_field(od, "inputs", list, where)), outputs=tuple(_field(od, "outputs", list, where)),
                    params=_field(od, "params", dict, where, {}), layer=_field(od, "layer", int, where, -1),
                    phase=_field(od, "phase", str, where, "forward"), origin=_field(od, "origin", (str, type(None)),
                                                                                     where, None),
                    remat=_field(od, "remat", bool, where, False), tags=frozenset(_field(od, "tags", list, where, [])))
        except (ValueError, TypeError) as e:
            raise GraphFormatError(f"{where}: {e}") from None
        _check_op(op, tensors, where)
        ops.append(op)
    try:
        return OpGraph(_field(data, "name", str, source), tensors, ops, _field(data, "inputs", list, source, []),
                       _field(data, "outputs", list, source, []), _field(data, "meta", dict, source, {}))
    except GraphError as e:
        raise GraphFormatError(f"{source}: {e}") from None


def _check_op(op: Op, tensors: dict[str, Tensor], where: str) -> None:
    missing = [t for t in op.inputs + op.outputs if t not in tensors]
    if missing:
        raise GraphFormatError(f"{where}: op {op.name!r} names unknown tensors {missing}")
    try:
        expected = infer_outputs(op.prim, op.attrs, [tensors[t] for t in op.inputs])
    except PrimitiveError as e:
        raise GraphFormatError(f"{where}: op {op.name!r}: {e}") from None
    got = [(tensors[t].shape, tensors[t].dtype) for t in op.outputs]
    if [s for s, _ in expected] != [s for s, _ in got]:
        raise GraphFormatError(f"{where}: op {op.name!r} ({op.prim}) outputs have shapes {[s for s, _ in got]}, "
                               f"the primitive computes {[s for s, _ in expected]}")


def save_graph(graph: OpGraph, path: str | Path) -> None:
    Path(path).write_text(json.dumps(graph_to_json(graph), separators=(",", ":")))


def load_graph(path: str | Path) -> OpGraph:
    return graph_from_json(read_json_file(path, GraphFormatError), str(path))

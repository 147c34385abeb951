"""Value types of an operator graph: `Tensor`, `Op` and `OpGraph`.

A graph is data. Tensors and ops are frozen and hashable so that they can key caches
(a stage's structure is solved once); an `OpGraph` keeps its ops in a valid
topological (definition) order and offers a networkx view only when a graph
algorithm needs one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
ROLES = ("input", "param", "activation", "grad", "optimizer_state")
PHASES = ("forward", "backward", "update")


def _freeze(value: Any) -> Any:
    """Turn lists (e.g. from JSON) into tuples so op params stay hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        raise TypeError(f"op params must be flat, got a nested mapping {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Tensor:
    """A named n-d array: shape, dtype and what it is for in training."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str = "activation"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}; "
                             f"expected one of {sorted(DTYPE_BYTES)}")
        if self.role not in ROLES:
            raise ValueError(f"tensor {self.name!r}: unknown role {self.role!r}; expected one of {ROLES}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.size * DTYPE_BYTES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True, slots=True)
class Op:
    """One primitive application.

    `params` holds the primitive's static attributes (an einsum equation, a stride, an
    elementwise function name) as sorted (key, value) pairs so the op stays hashable;
    pass a dict and read it back with `op.attrs` or `op.param(key)`. `layer` is the
    pipeline-layer index (-1 until clustering), `phase` one of forward/backward/update,
    `origin` the forward op a backward or update op was derived from, `remat` marks a
    forward op recomputed during the backward pass, and `tags` are free labels the model
    zoo attaches (``"attention"``, ``"moe"``, ``"head"``...).
    """

    name: str
    prim: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    layer: int = -1
    phase: str = "forward"
    origin: str | None = None
    remat: bool = False
    tags: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        params = self.params
        if isinstance(params, Mapping):
            params = params.items()
        object.__setattr__(self, "params", tuple(sorted((str(k), _freeze(v)) for k, v in params)))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "tags", frozenset(self.tags))
        if self.phase not in PHASES:
            raise ValueError(f"op {self.name!r}: unknown phase {self.phase!r}; expected one of {PHASES}")
        if not self.outputs:
            raise ValueError(f"op {self.name!r} ({self.prim}) has no outputs")

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.params)

    def param(self, key: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        return default

    def replace(self, **changes: Any) -> Op:
        fields = {
            "name": self.name, "prim": self.prim, "inputs": self.inputs, "outputs": self.outputs,
            "params": self.params, "layer": self.layer, "phase": self.phase, "origin": self.origin,
            "remat": self.remat, "tags": self.tags,
        }
        fields.update(changes)
        return Op(**fields)


class GraphError(ValueError):
    """A graph that is not well formed (undefined tensor, bad order, bad shape)."""


class OpGraph:
    """Ops in a valid topological order over a table of named tensors.

    `inputs` are the data fed each step (token ids, labels, images); parameters and
    optimizer states are recognised by their role. `outputs` are what the step returns
    (the loss, the updated parameters). `meta` carries model facts (family, config,
    precision) that reports and planners want but that do not change semantics.
    Construction validates the order, so every `OpGraph` in the program is well formed.
    """

    __slots__ = ("name", "tensors", "ops", "inputs", "outputs", "meta", "__dict__")

    def __init__(
        self,
        name: str,
        tensors: Mapping[str, Tensor] | Iterable[Tensor],
        ops: Iterable[Op],
        inputs: Iterable[str] = (),
        outputs: Iterable[str] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        if isinstance(tensors, Mapping):
            self.tensors: dict[str, Tensor] = dict(tensors)
        else:
            self.tensors = {t.name: t for t in tensors}
        self.ops: tuple[Op, ...] = tuple(ops)
        self.inputs: tuple[str, ...] = tuple(inputs)
        self.outputs: tuple[str, ...] = tuple(outputs)
        self.meta: dict[str, Any] = dict(meta or {})
        self._validate()

    # ----------------------------------------------------------------- checks
    def _validate(self) -> None:
        written = {t for op in self.ops for t in op.outputs}
        defined: set[str] = set()
        for name, t in self.tensors.items():
            if name != t.name:
                raise GraphError(f"tensor table key {name!r} names tensor {t.name!r}")
            # Parameters and optimizer states exist before the step; their updated
            # values are new tensors of the same role written by update ops.
            if t.role in ("input", "param", "optimizer_state") and name not in written:
                defined.add(name)
        for name in self.inputs:
            if name not in self.tensors:
                raise GraphError(f"graph input {name!r} is not a tensor of the graph")
            defined.add(name)
        seen_ops: set[str] = set()
        for op in self.ops:
            if op.name in seen_ops:
                raise GraphError(f"duplicate op name {op.name!r}")
            seen_ops.add(op.name)
            for t in op.inputs:
                if t not in self.tensors:
                    raise GraphError(f"op {op.name!r} reads unknown tensor {t!r}")
                if t not in defined:
                    raise GraphError(f"op {op.name!r} reads {t!r} before it is defined")
            for t in op.outputs:
                if t not in self.tensors:
                    raise GraphError(f"op {op.name!r} writes unknown tensor {t!r}")
                if t in defined:
                    raise GraphError(f"tensor {t!r} is defined twice (second time by op {op.name!r})")
                defined.add(t)
        for t in self.outputs:
            if t not in defined:
                raise GraphError(f"graph output {t!r} is never defined")

    # ------------------------------------------------------------ structure
    @cached_property
    def producer(self) -> dict[str, Op]:
        """Tensor name -> the op that writes it (absent for inputs, params, states)."""
        return {t: op for op in self.ops for t in op.outputs}

    @cached_property
    def consumers(self) -> dict[str, tuple[Op, ...]]:
        """Tensor name -> ops that read it, in program order."""
        out: dict[str, list[Op]] = {name: [] for name in self.tensors}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                out[t].append(op)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def op_index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    @cached_property
    def op_by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    def tensors_with_role(self, role: str) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role == role]

    @property
    def params(self) -> list[Tensor]:
        """Parameters as they enter the step (not the updated values)."""
        return [t for t in self.tensors.values() if t.role == "param" and t.name not in self.producer]

    def num_params(self) -> int:
        return sum(t.size for t in self.params)

    def ops_in_phase(self, phase: str) -> list[Op]:
        return [op for op in self.ops if op.phase == phase]

    @property
    def num_layers(self) -> int:
        layers = {op.layer for op in self.ops}
        return 0 if not layers or layers == {-1} else max(layers) + 1

    def to_networkx(self):
        """A networkx DiGraph with one node per op and an edge per tensor flow."""
        import networkx as nx

        g = nx.DiGraph()
        for op in self.ops:
            g.add_node(op.name, op=op)
        for op in self.ops:
            for t in op.inputs:
                src = self.producer.get(t)
                if src is not None:
                    g.add_edge(src.name, op.name, tensor=t)
        return g

    def replace(self, **changes: Any) -> OpGraph:
        fields = {
            "name": self.name, "tensors": self.tensors, "ops": self.ops,
            "inputs": self.inputs, "outputs": self.outputs, "meta": self.meta,
        }
        fields.update(changes)
        return OpGraph(**fields)

    def __repr__(self) -> str:
        phases = {p: len(self.ops_in_phase(p)) for p in PHASES}
        return (f"OpGraph({self.name!r}, ops={len(self.ops)} {phases}, "
                f"tensors={len(self.tensors)}, params={self.num_params():,})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return (self.name == other.name and self.tensors == other.tensors and self.ops == other.ops
                and self.inputs == other.inputs and self.outputs == other.outputs
                and self.meta == other.meta)

    __hash__ = None  # type: ignore[assignment]

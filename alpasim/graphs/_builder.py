"""`GraphBuilder`: write a forward graph in data order, one primitive call per line.

The model zoo, the JAX importer and the autodiff pass all build graphs through it, so
every op is shape-checked by its primitive's rule at the moment it is added.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from ._primitives import infer_outputs
from ._types import GraphError, Op, OpGraph, Tensor

# How tensor parallelism splits a parameter (Megatron-LM's layouts: Shoeybi et al. 2019,
# Narayanan et al. 2021), tagged by the family builder that knows its model: a column-
# parallel weight splits its output features, a row-parallel one its input features, an
# embedding or head its vocabulary; a replicated one is whole on every rank. A graph's
# tags are its `meta["tensor_parallel"]`: parameter name (last path component) ->
# {"split", "dim", "expert" (dim 0 indexes experts)}. An imported graph has none.
TP_SPLITS = ("column", "row", "vocabulary", "replicated")


def param_split(graph: OpGraph, param: str) -> dict[str, Any] | None:
    """The tensor-parallel tag of `param` in `graph`, or None for an untagged parameter
    (whole on every rank); `graph.meta["tensor_parallel"]` absent: the graph carries no
    tags at all (`ValueError`, naming the graph)."""
    tags = graph.meta.get("tensor_parallel")
    if tags is None:
        raise ValueError(f"{graph.name} carries no tensor-parallel tags (an imported graph): its parameters' "
                         f"split dimensions are known only for the zoo's families")
    return tags.get(param.rsplit("/", 1)[-1])


class GraphBuilder:
    """Accumulates tensors and ops; `scope()` sets the layer, phase and tags of new ops."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self._names: dict[str, int] = {}
        self._op_names: set[str] = set()
        self._op_counts: dict[str, int] = {}
        self.layer = -1
        self.phase = "forward"
        self.tags: frozenset[str] = frozenset()
        self.origin: str | None = None
        self.remat = False
        self.rows: str | None = None        # the batch's row ids, once a dropout needs them
        self.prefix = ""
        self.tp_tags: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------ naming
    def fresh(self, base: str) -> str:
        """A tensor name not used yet, derived from `base`."""
        base = self.prefix + base
        n = self._names.get(base, 0)
        name = base if n == 0 and base not in self.tensors else f"{base}.{n}"
        while name in self.tensors:
            n += 1
            name = f"{base}.{n}"
        self._names[base] = n + 1
        return name

    def _fresh_op(self, base: str) -> str:
        n = self._op_counts.get(base, 0)
        name = base if n == 0 else f"{base}#{n}"
        while name in self._op_names:
            n += 1
            name = f"{base}#{n}"
        self._op_counts[base] = n + 1
        self._op_names.add(name)
        return name

    @contextlib.contextmanager
    def scope(self, *, layer: int | None = None, phase: str | None = None, tags: Sequence[str] = (),
              prefix: str | None = None, origin: str | None = None, remat: bool | None = None) -> Iterator[None]:
        saved = (self.layer, self.phase, self.tags, self.prefix, self.origin, self.remat)
        if layer is not None:
            self.layer = layer
        if phase is not None:
            self.phase = phase
        if prefix is not None:
            self.prefix = prefix
        if origin is not None:
            self.origin = origin
        if remat is not None:
            self.remat = remat
        self.tags = self.tags | frozenset(tags)
        try:
            yield
        finally:
            self.layer, self.phase, self.tags, self.prefix, self.origin, self.remat = saved

    # ------------------------------------------------------------ leaves
    def add_tensor(self, t: Tensor) -> str:
        if t.name in self.tensors:
            raise GraphError(f"tensor {t.name!r} already exists")
        self.tensors[t.name] = t
        return t.name

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        name = self.add_tensor(Tensor(self.fresh(name), tuple(shape), dtype, "input"))
        self.inputs.append(name)
        return name

    def param(self, name: str, shape: Sequence[int], dtype: str = "float32", *,
              tp: tuple[str, int] | str | None = None, expert: bool = False) -> str:
        """A parameter; `tp` tags how tensor parallelism splits it (`TP_SPLITS`): (split,
        dim), or "replicated"; `expert`: its dim 0 indexes experts."""
        if tp is not None:
            split, dim = tp if isinstance(tp, tuple) and len(tp) == 2 else (tp, None)
            if not (tp == "replicated" or (split != "replicated" and split in TP_SPLITS and isinstance(dim, int)
                                           and 0 <= dim < len(shape))):
                raise GraphError(f"parameter {name!r}: tensor-parallel tag {tp!r} is not \"replicated\" or (split, "
                                 f"dim) with a split of {TP_SPLITS[:-1]} and a dimension of {tuple(shape)}")
            self.tp_tags[name] = {"split": split, "dim": dim, "expert": expert}
        return self.add_tensor(Tensor(self.fresh(name), tuple(shape), dtype, "param"))

    def state(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        return self.add_tensor(Tensor(self.fresh(name), tuple(shape), dtype, "optimizer_state"))

    # ------------------------------------------------------------ ops
    def apply(self, prim: str, inputs: Sequence[str], *, name: str | None = None,
              out_names: Sequence[str] | None = None, role: str = "activation",
              **params: Any) -> list[str]:
        """Add one op; returns its output tensor names."""
        ins = [self.tensors[t] for t in inputs]
        outs = infer_outputs(prim, params, ins)
        base = name or prim
        if out_names is None:
            out_names = [self.fresh(base if len(outs) == 1 else f"{base}:{i}") for i in range(len(outs))]
        else:
            out_names = [self.fresh(n) for n in out_names]
        for n, (shape, dtype) in zip(out_names, outs):
            self.tensors[n] = Tensor(n, shape, dtype, role)
        self.ops.append(Op(self._fresh_op(self.prefix + base), prim, tuple(inputs), tuple(out_names), params,
                           layer=self.layer, phase=self.phase, origin=self.origin, remat=self.remat,
                           tags=self.tags))
        return list(out_names)

    def one(self, prim: str, inputs: Sequence[str], **kw: Any) -> str:
        (out,) = self.apply(prim, inputs, **kw)
        return out

    # Short forms for the primitives models use most.
    def einsum(self, equation: str, a: str, b: str, name: str = "einsum", **kw: Any) -> str:
        return self.one("einsum", [a, b], name=name, equation=equation, **kw)

    def ew(self, fn: str, *xs: str, name: str | None = None, **kw: Any) -> str:
        return self.one("elementwise", list(xs), name=name or fn, fn=fn, **kw)

    def dropout(self, x: str, rate: float, name: str) -> str:
        """Inverted dropout of `x` (PyTorch's and Megatron's: kept elements scaled by
        1 / (1 - rate)); `x` itself at rate 0. Its mask (`dropout_mask`, one byte an
        element, what Korthikanti et al. 2022 count for it) is drawn from the rows' ids
        (`sample_index`, an input of the batch; dim 0 of `x` is the batch) and a seed of
        the op's name, so a recomputation draws it again rather than keeping it, as
        Megatron-LM's RNG tracker does."""
        if not rate:
            return x
        t = self.tensors[x]
        if self.rows is None:
            self.rows = self.add_tensor(Tensor("sample_index", t.shape[:1], "int32", "input"))
            self.inputs.append(self.rows)
        if self.tensors[self.rows].shape != t.shape[:1]:
            raise GraphError(f"dropout {name!r}: dim 0 of {t.shape} is not the batch {self.tensors[self.rows].shape}")
        seed = zlib.crc32((self.prefix + name).encode())
        mask = self.one("dropout_mask", [self.rows], name=f"{name}_mask", shape=t.shape, rate=float(rate), seed=seed)
        kept = self.ew("mul", x, scalar=1.0 / (1.0 - rate), scalar_pos=1, name=f"{name}_scale")
        zeros = self.one("full", [], name=f"{name}_zeros", shape=t.shape, dtype=t.dtype, value=0.0)
        return self.ew("select", mask, kept, zeros, name=name)

    def shape(self, t: str) -> tuple[int, ...]:
        return self.tensors[t].shape

    def dtype(self, t: str) -> str:
        return self.tensors[t].dtype

    def build(self, outputs: Sequence[str], meta: dict[str, Any] | None = None) -> OpGraph:
        if self.tp_tags:
            meta = {**(meta or {}), "tensor_parallel": dict(self.tp_tags)}
        return OpGraph(self.name, self.tensors, self.ops, self.inputs, outputs, meta)

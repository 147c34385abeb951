"""The coarse primitive set: shape rules, FLOPs, bytes and dimension maps.

Each primitive knows three things the rest of alpasim needs:

* `infer` — output shapes and dtypes from the inputs and params (the builder and the
  JSON loader use it to check every op);
* `flops` — floating-point operations of one application, counted the way Megatron-LM
  and Alpa report them (a multiply-add is 2 FLOPs; elementwise ops count a few FLOPs
  per element, which is noise next to the contractions);
* `dims` — a `DimMap`: an einsum-style letter for every dimension of every operand.
  Two operand dimensions with the same letter are the same loop, so sharding one
  shards the other; a letter present in inputs but absent from every output is a
  contracted loop (sharding it leaves partial sums that need an all-reduce); letters
  in `reduced_within` stay in the output but the op reduces along them internally
  (softmax and normalisation axes). Spatial loops of a strided convolution get
  distinct letters on input and output: they are not shardable without halos.

The same semantics are implemented in JAX by `alpasim.backends` (lowering) and
checked there against `jax.grad`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _prims_attention, _prims_compute, _prims_layout, _prims_nn  # noqa: F401  (register the rules)
from ._prim_core import LETTERS as LETTERS
from ._prim_core import MATMUL_KINDS as MATMUL_KINDS
from ._prim_core import PRIMITIVES as PRIMITIVES
from ._prim_core import DimMap as DimMap
from ._prim_core import Primitive as Primitive
from ._prim_core import PrimitiveError as PrimitiveError
from ._prim_core import need, primitive
from ._prims_compute import ELEMENTWISE as ELEMENTWISE
from ._prims_compute import ElementwiseFn as ElementwiseFn
from ._prims_compute import parse_einsum as parse_einsum
from ._prims_layout import reshape_groups as reshape_groups
from ._types import Op, Tensor

ShapeDtype = tuple[tuple[int, ...], str]

# ---------------------------------------------------------------------- queries
def infer_outputs(prim: str, params: dict[str, Any], inputs: Sequence[Tensor]) -> list[ShapeDtype]:
    """Output (shape, dtype) pairs of `prim` applied to `inputs`; raises PrimitiveError."""
    p = primitive(prim)
    need(len(inputs) in p.arity or p.arity == (), f"{prim} takes {p.arity} operands, got {len(inputs)}")
    try:
        return p.infer(params, inputs)
    except PrimitiveError:
        raise
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as e:
        raise PrimitiveError(f"{prim}: bad params {params!r} for inputs "
                             f"{[t.shape for t in inputs]}: {e!r}") from None


def op_flops(op: Op, tensors: dict[str, Tensor]) -> float:
    """FLOPs of one application of `op` (see the module docstring for the counting).
    Like its dimension map, a function of the primitive, its parameters and the
    operands' shapes and dtypes, asked for by every stage's pricing: each distinct one
    is counted once."""
    return _kept(_FLOPS, op, tensors, lambda p, ins, outs: float(p.flops(op.attrs, ins, outs)))


def op_bytes(op: Op, tensors: dict[str, Tensor]) -> int:
    """Bytes an op reads and writes once each: the memory-traffic side of a roofline."""
    return sum(tensors[t].nbytes for t in op.inputs) + sum(tensors[t].nbytes for t in op.outputs)


def op_dims(op: Op, tensors: dict[str, Tensor]) -> DimMap:
    """The op's dimension map. It depends only on the primitive, its parameters and the
    operands' shapes, which repeat across a model's layers and are asked for again by
    every pass of the planner (strategies, baselines' restrictions, batch letters), so
    each distinct one is built once."""
    return _kept(_DIMS, op, tensors, lambda p, ins, outs: p.dims(op.attrs, ins, outs))


def _kept(kept: dict, op: Op, tensors: dict[str, Tensor], compute):
    """`compute(primitive, inputs, outputs)`, kept in `kept` under the op's primitive,
    parameters and operands' shapes and dtypes (computed afresh where a parameter is
    not hashable, or is an imported constant's data)."""
    ins, outs = [tensors[t] for t in op.inputs], [tensors[t] for t in op.outputs]
    if op.prim in _NOT_KEPT:
        return compute(primitive(op.prim), ins, outs)
    key = (op.prim, op.params, tuple((t.shape, t.dtype) for t in ins), tuple((t.shape, t.dtype) for t in outs))
    try:
        return kept[key]
    except KeyError:
        pass
    except TypeError:                  # a parameter value that is not hashable: not kept
        return compute(primitive(op.prim), ins, outs)
    if len(kept) >= _KEPT:
        kept.clear()
    value = kept[key] = compute(primitive(op.prim), ins, outs)
    return value


_DIMS: dict[tuple, DimMap] = {}
_FLOPS: dict[tuple, float] = {}
# An imported constant's parameters hold its data (megabytes of base64): as a key it would
# outlive its graph, and its map (one letter run) is cheap to build anyway.
_NOT_KEPT = frozenset({"constant"})
_KEPT = 100_000               # distinct (primitive, parameters, shapes); a zoo model has hundreds


def op_kind(op: Op) -> str:
    return primitive(op.prim).kind


def is_heavy(op: Op) -> bool:
    """Contractions and convolutions: the ops whose parallel algorithm matters."""
    return primitive(op.prim).heavy

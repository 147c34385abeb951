"""Core of the primitive set: the `Primitive` and `DimMap` types, the registry, helpers.

The rules themselves live in `_prims_compute`, `_prims_layout` and `_prims_nn`; see
`_primitives` for what each rule provides.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._types import Tensor

ShapeDtype = tuple[tuple[int, ...], str]
LETTERS = string.ascii_lowercase + string.ascii_uppercase


class PrimitiveError(ValueError):
    """An op whose inputs or params do not fit its primitive."""


@dataclass(frozen=True, slots=True)
class DimMap:
    """Einsum-style letters for every operand dimension of one op (see module doc)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    reduced_within: frozenset[str] = frozenset()
    unshardable: frozenset[str] = frozenset()

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def contracted(self) -> frozenset[str]:
        out = set("".join(self.outputs))
        return frozenset(c for c in "".join(self.inputs) if c not in out)


@dataclass(frozen=True)
class Primitive:
    """Rules of one primitive; `kind` groups primitives for cost models and reports."""

    name: str
    kind: str
    infer: Callable[[dict[str, Any], Sequence[Tensor]], list[ShapeDtype]]
    flops: Callable[[dict[str, Any], Sequence[Tensor], Sequence[Tensor]], float]
    dims: Callable[[dict[str, Any], Sequence[Tensor], Sequence[Tensor]], DimMap]
    arity: tuple[int, ...] = (1,)
    heavy: bool = False


PRIMITIVES: dict[str, Primitive] = {}
MATMUL_KINDS = frozenset({"einsum", "conv"})


def register(p: Primitive) -> Primitive:
    PRIMITIVES[p.name] = p
    return p


def primitive(name: str) -> Primitive:
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise PrimitiveError(f"unknown primitive {name!r}; known: {', '.join(sorted(PRIMITIVES))}") from None


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise PrimitiveError(msg)


def letter_run(n: int, start: int = 0) -> str:
    need(n + start <= len(LETTERS), f"rank {n} is too large for a dimension map")
    return LETTERS[start:start + n]


def dimmap(ins: Sequence[str], outs: Sequence[str], tensors: Sequence[Tensor],
           within: str = "", fixed: str = "") -> DimMap:
    """A DimMap; `within` letters are reduced inside the op, `fixed` ones cannot be
    sharded at all (their data layout differs between operands: strided spatial loops,
    the fresh axes of a reshape, the cut axis of a slice)."""
    sizes: dict[str, int] = {}
    for term, t in zip(list(ins) + list(outs), tensors):
        for c, d in zip(term, t.shape):
            sizes.setdefault(c, d)
    return DimMap(tuple(ins), tuple(outs), tuple(sorted(sizes.items())), frozenset(within), frozenset(fixed))


def same_letters(ins: Sequence[Tensor], outs: Sequence[Tensor]) -> DimMap:
    """Every operand of full rank shares letters; rank-0 operands get none."""
    rank = max(t.rank for t in list(ins) + list(outs))
    full = letter_run(rank)
    pick = lambda t: full if t.rank == rank else ""  # noqa: E731
    return dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs))

"""Weight gradients accumulated unreduced, as the plan prices them.

The planner synchronises a weight gradient once per iteration: each device sums its own
*unreduced partial* (the contribution of its slice of the batch, or of whatever
contracted dimension the op's strategy splits) over the microbatches, and one
all-reduce or reduce-scatter after the last backward combines the partials
(`solvers._strategies._finish_outputs`: a weight gradient's reducing collective is
`sync`; `solvers._intra_problem.accumulator_factor`: a gradient reduce-scattered once
is accumulated at its whole unreduced size). In JAX's global view the gradient of a
batch-split contraction is the reduced sum, so a plain backward all-reduces it every
microbatch and keeps a reduced accumulator: neither the time nor the memory the plan
priced.

Here such a gradient keeps a *replica axis*. A weight-gradient op whose contracted
letters (`graphs.op_dims`: letters of its inputs its output lacks) are split over mesh
axes A by the layouts its layer reads them in is evaluated once per slice: each such
letter's dimension of size n is viewed as (R, n / R), R the product of its axes'
sizes, with the R part laid out on those axes, and the op is `jax.vmap`-ed over it.
Every device then computes its own partial with no collective, and the result
(R, *shape) has R laid out on A — per device exactly the unreduced partial the plan
prices. It stays that way through the ops that are linear in it (a dtype cast, the sum
of two contributions) into the accumulator; the update sums the replica axis into the
gradient's planned layout (one all-reduce or reduce-scatter per iteration) before Adam.
Any other reader of a partial gradient gets it summed first, so the values are the
same whatever the graph does with them.

Only ops whose output is a sum over the split letter qualify: einsum, a sum `reduce`,
a filter gradient, an embedding gradient (all single-output). Ops with several outputs
(layer- and batch-norm gradients: their input gradient needs the whole microbatch's
sums) keep the reduced form; their weight gradients are per-channel vectors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.graphs import OpGraph, Op, is_weight_grad, op_dims
from alpasim.solvers import ShardingSpec

from ._lowering import eval_op

SPLITTABLE_PRIMS = frozenset({"einsum", "conv2d_filter_grad", "embedding_grad"})
LINEAR_EW = frozenset({"add"})


@dataclass(frozen=True, slots=True)
class PartialGrad:
    """A gradient tensor held as (R, *shape): the partial sums of R slices."""

    letters: tuple[tuple[str, int, tuple[int, ...]], ...]   # (letter, R_i, mesh axes) per split letter
    base: tuple[tuple[int, ...], ...]                        # the per-dimension mesh axes of each slice's result

    @property
    def replicas(self) -> int:
        return math.prod(r for _, r, _ in self.letters)

    @property
    def axes(self) -> tuple[int, ...]:
        return tuple(a for _, _, ax in self.letters for a in ax)

    def sharding(self, mesh: Mesh) -> NamedSharding:
        """The layout of the (R, *shape) array: R on the split axes, the rest as each slice's result."""
        def name(axes):
            return tuple(mesh.axis_names[a] for a in axes) if axes else None
        return NamedSharding(mesh, PartitionSpec(name(self.axes), *(name(d) for d in self.base)))


def _splittable(op: Op) -> bool:
    if len(op.outputs) != 1:
        return False
    return op.prim in SPLITTABLE_PRIMS or (op.prim == "reduce" and op.attrs.get("kind") == "sum")


def _linear(op: Op) -> bool:
    """An op whose output is linear in each of its (gradient) inputs."""
    return op.prim == "convert" or (op.prim == "elementwise" and op.attrs.get("fn") in LINEAR_EW
                                    and "scalar" not in op.attrs)


def partial_gradients(ops, train: OpGraph, stage) -> dict[str, PartialGrad]:
    """The backward tensors of a plan's stage (`PipelineStage`, with `layer_specs`) held
    unreduced (module doc), by name: the weight-gradient ops' outputs and what linear
    ops and `carried` operands make of them."""
    layer_specs = {stage.layers[0] + i: {t: ShardingSpec.parse(v) for t, v in specs.items()}
                   for i, specs in enumerate(stage.layer_specs)}
    mesh_shape = tuple(stage.logical_mesh)
    out: dict[str, PartialGrad] = {}
    for op in ops.backward:
        if op.outputs[0] in ops.carried:
            src = out.get(ops.carried[op.outputs[0]])
            if src is not None:
                out[op.outputs[0]] = src
            continue
        if _linear(op):
            got = [out.get(t) for t in op.inputs]
            if got and all(g is not None for g in got) and len({(g.replicas, g.axes) for g in got}) == 1 \
                    and all(train.tensors[t].shape == train.tensors[op.outputs[0]].shape for t in op.inputs):
                out[op.outputs[0]] = got[0]
            continue
        if not _splittable(op) or not is_weight_grad(op, 0, train.tensors) or any(t in out for t in op.inputs):
            continue
        info = _split_of(op, train, layer_specs.get(op.layer, {}), mesh_shape)
        if info is not None:
            out[op.outputs[0]] = info
    return out


def _split_of(op: Op, train: OpGraph, specs: Mapping[str, ShardingSpec], mesh_shape: Sequence[int]
              ) -> PartialGrad | None:
    if not all(t in specs for t in op.inputs):
        return None
    dm = op_dims(op, train.tensors)
    axes_of: dict[str, tuple[int, ...]] = {}
    for term, t in zip(dm.inputs, op.inputs, strict=True):
        dims = specs[t].dims
        if len(dims) != len(term) or len(set(term)) != len(term):
            return None
        for c, ax in zip(term, dims, strict=True):
            ax = tuple(a for a in ax if mesh_shape[a] > 1)
            if axes_of.setdefault(c, ax) != ax:
                return None    # the inputs disagree on the letter's split: leave it to XLA
    (term_out,) = dm.outputs
    split = [(c, math.prod(mesh_shape[a] for a in ax), ax) for c, ax in axes_of.items()
             if ax and c not in term_out]
    base = tuple(axes_of.get(c, ()) for c in term_out)
    used = [a for _, _, ax in split for a in ax] + [a for ax in base for a in ax]
    if not split or len(used) != len(set(used)):
        return None    # nothing split, or one mesh axis on two letters: leave it to XLA
    return PartialGrad(tuple(split), base)


def eval_split(op: Op, operands: Sequence[Any], info: PartialGrad, train: OpGraph, mesh: Mesh,
               in_shardings: Sequence[NamedSharding | None]) -> jax.Array:
    """`op`'s output as (R, *shape): the op vmapped over each split letter's slices."""
    dm = op_dims(op, train.tensors)
    xs = list(operands)
    specs = [list(s.spec) + [None] * (x.ndim - len(s.spec)) if s is not None else [None] * x.ndim
             for s, x in zip(in_shardings, xs, strict=True)]
    shift = [0] * len(xs)           # R axes put in front of each operand so far
    levels = []
    for letter, r, ax in info.letters:
        level = []
        for i, term in enumerate(dm.inputs):
            if letter not in term:
                level.append(None)
                continue
            d = term.index(letter) + shift[i]
            x = xs[i]
            x = jnp.moveaxis(x.reshape(x.shape[:d] + (r, x.shape[d] // r) + x.shape[d + 1:]), d, 0)
            specs[i] = [tuple(mesh.axis_names[a] for a in ax)] + specs[i][:d] + [None] + specs[i][d + 1:]
            xs[i] = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*specs[i])))
            shift[i] += 1
            level.append(0)
        levels.append(level)

    def f(*vals):
        return eval_op(op, vals)[0]

    for level in levels:             # the last letter's R is in front: its vmap is the outermost
        f = jax.vmap(f, in_axes=tuple(level))
    y = f(*xs)                       # (R_last, ..., R_first, *shape)
    n = len(levels)
    y = jnp.transpose(y, (*reversed(range(n)), *range(n, y.ndim)))
    return y.reshape((info.replicas,) + y.shape[n:])

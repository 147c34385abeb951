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

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._types import Op, Tensor

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


def _register(p: Primitive) -> Primitive:
    PRIMITIVES[p.name] = p
    return p


def primitive(name: str) -> Primitive:
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise PrimitiveError(f"unknown primitive {name!r}; known: {', '.join(sorted(PRIMITIVES))}") from None


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise PrimitiveError(msg)


def _letters(n: int, start: int = 0) -> str:
    _need(n + start <= len(LETTERS), f"rank {n} is too large for a dimension map")
    return LETTERS[start:start + n]


def _dimmap(ins: Sequence[str], outs: Sequence[str], tensors: Sequence[Tensor],
            within: str = "") -> DimMap:
    sizes: dict[str, int] = {}
    for letters, t in zip(list(ins) + list(outs), tensors):
        for c, d in zip(letters, t.shape):
            sizes.setdefault(c, d)
    return DimMap(tuple(ins), tuple(outs), tuple(sorted(sizes.items())), frozenset(within))


def _same_letters(ins: Sequence[Tensor], outs: Sequence[Tensor]) -> DimMap:
    """Every operand of full rank shares letters; rank-0 operands get none."""
    rank = max(t.rank for t in list(ins) + list(outs))
    full = _letters(rank)
    pick = lambda t: full if t.rank == rank else ""  # noqa: E731
    return _dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs))


def _elems(ts: Sequence[Tensor]) -> int:
    return sum(t.size for t in ts)


# ----------------------------------------------------------------------- einsum
def parse_einsum(equation: str) -> tuple[list[str], str]:
    """Split `"bsh,hf->bsf"` into (["bsh", "hf"], "bsf"); explicit outputs only."""
    _need("->" in equation, f"einsum equation {equation!r} needs an explicit '->' output")
    lhs, out = equation.replace(" ", "").split("->")
    ins = lhs.split(",")
    for term in ins + [out]:
        _need(all(c in LETTERS for c in term), f"einsum equation {equation!r}: letters only")
        _need(len(set(term)) == len(term), f"einsum equation {equation!r}: repeated letter in {term!r}")
    _need(set(out) <= set("".join(ins)), f"einsum equation {equation!r}: output letter not in inputs")
    return ins, out


def _einsum_sizes(equation: str, ins: Sequence[Tensor]) -> dict[str, int]:
    terms, _ = parse_einsum(equation)
    _need(len(terms) == len(ins), f"einsum {equation!r} takes {len(terms)} operands, got {len(ins)}")
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ins):
        _need(len(term) == t.rank, f"einsum {equation!r}: operand {t.name!r} has shape {t.shape}, "
                                   f"term {term!r} expects rank {len(term)}")
        for c, d in zip(term, t.shape):
            _need(sizes.setdefault(c, d) == d,
                  f"einsum {equation!r}: letter {c!r} is {sizes[c]} and {d} ({t.name!r})")
    return sizes


def _einsum_infer(p, ins):
    sizes = _einsum_sizes(p["equation"], ins)
    _, out = parse_einsum(p["equation"])
    return [(tuple(sizes[c] for c in out), p.get("dtype", ins[0].dtype))]


def _einsum_flops(p, ins, outs):
    sizes = _einsum_sizes(p["equation"], ins)
    # Each point of the full loop nest is one multiply-add: 2 FLOPs.
    return 2.0 * math.prod(sizes.values())


def _einsum_dims(p, ins, outs):
    terms, out = parse_einsum(p["equation"])
    return _dimmap(terms, [out], list(ins) + list(outs))


_register(Primitive("einsum", "einsum", _einsum_infer, _einsum_flops, _einsum_dims, arity=(2,), heavy=True))


# ----------------------------------------------------------------------- conv2d
def _conv_out(size: int, k: int, stride: int, pad: tuple[int, int]) -> int:
    return (size + pad[0] + pad[1] - k) // stride + 1


def _conv_geometry(p, x_shape, w_shape):
    _need(len(x_shape) == 4 and len(w_shape) == 4, "conv2d takes NHWC inputs and HWIO filters")
    n, h, w, c = x_shape
    kh, kw, ci, co = w_shape
    _need(c == ci, f"conv2d: input has {c} channels, filter expects {ci}")
    sh, sw = p.get("strides", (1, 1))
    pad = p.get("padding", ((0, 0), (0, 0)))
    ho, wo = _conv_out(h, kh, sh, pad[0]), _conv_out(w, kw, sw, pad[1])
    _need(ho > 0 and wo > 0, f"conv2d: empty output for input {x_shape} and filter {w_shape}")
    return (n, ho, wo, co)


def _conv_infer(p, ins):
    return [(_conv_geometry(p, ins[0].shape, ins[1].shape), ins[0].dtype)]


def _conv_flops_from(x_shape, w_shape, y_shape):
    n, ho, wo, co = y_shape
    kh, kw, ci, _ = w_shape
    return 2.0 * n * ho * wo * co * kh * kw * ci


_CONV_X, _CONV_W, _CONV_Y = "nhwc", "klcf", "nHWf"
_register(Primitive(
    "conv2d", "conv", _conv_infer,
    lambda p, ins, outs: _conv_flops_from(ins[0].shape, ins[1].shape, outs[0].shape),
    lambda p, ins, outs: _dimmap([_CONV_X, _CONV_W], [_CONV_Y], list(ins) + list(outs)),
    arity=(2,), heavy=True))


def _conv_in_grad_infer(p, ins):
    dy, w = ins
    x_shape = tuple(p["input_shape"])
    _need(_conv_geometry(p, x_shape, w.shape) == dy.shape,
          f"conv2d_input_grad: cotangent {dy.shape} does not match input {x_shape}")
    return [(x_shape, dy.dtype)]


_register(Primitive(
    "conv2d_input_grad", "conv", _conv_in_grad_infer,
    lambda p, ins, outs: _conv_flops_from(outs[0].shape, ins[1].shape, ins[0].shape),
    lambda p, ins, outs: _dimmap([_CONV_Y, _CONV_W], [_CONV_X], list(ins) + list(outs)),
    arity=(2,), heavy=True))


def _conv_filter_grad_infer(p, ins):
    x, dy = ins
    w_shape = tuple(p["filter_shape"])
    _need(_conv_geometry(p, x.shape, w_shape) == dy.shape,
          f"conv2d_filter_grad: cotangent {dy.shape} does not match filter {w_shape}")
    return [(w_shape, dy.dtype)]


_register(Primitive(
    "conv2d_filter_grad", "conv", _conv_filter_grad_infer,
    lambda p, ins, outs: _conv_flops_from(ins[0].shape, outs[0].shape, ins[1].shape),
    lambda p, ins, outs: _dimmap([_CONV_X, _CONV_Y], [_CONV_W], list(ins) + list(outs)),
    arity=(2,), heavy=True))


# ------------------------------------------------------------------ elementwise
@dataclass(frozen=True)
class ElementwiseFn:
    """An elementwise function: arity, FLOPs per output element, boolean result."""

    arity: int
    flops: float = 1.0
    boolean: bool = False


ELEMENTWISE: dict[str, ElementwiseFn] = {
    # unary
    "neg": ElementwiseFn(1), "exp": ElementwiseFn(1, 4), "log": ElementwiseFn(1, 4),
    "tanh": ElementwiseFn(1, 4), "logistic": ElementwiseFn(1, 4), "relu": ElementwiseFn(1),
    "gelu": ElementwiseFn(1, 8), "rsqrt": ElementwiseFn(1, 2), "sqrt": ElementwiseFn(1, 2),
    "square": ElementwiseFn(1), "abs": ElementwiseFn(1), "sign": ElementwiseFn(1),
    "reciprocal": ElementwiseFn(1), "erf": ElementwiseFn(1, 8), "sin": ElementwiseFn(1, 4),
    "cos": ElementwiseFn(1, 4), "identity": ElementwiseFn(1, 0), "stop_gradient": ElementwiseFn(1, 0),
    "not": ElementwiseFn(1, 1, boolean=True),
    # binary
    "add": ElementwiseFn(2), "sub": ElementwiseFn(2), "mul": ElementwiseFn(2), "div": ElementwiseFn(2),
    "max": ElementwiseFn(2), "min": ElementwiseFn(2), "pow": ElementwiseFn(2, 4),
    "gt": ElementwiseFn(2, boolean=True), "ge": ElementwiseFn(2, boolean=True),
    "lt": ElementwiseFn(2, boolean=True), "le": ElementwiseFn(2, boolean=True),
    "eq": ElementwiseFn(2, boolean=True), "ne": ElementwiseFn(2, boolean=True),
    "and": ElementwiseFn(2, boolean=True), "or": ElementwiseFn(2, boolean=True),
    # derivative helpers used by the VJP rules
    "relu_grad": ElementwiseFn(2, 2), "gelu_grad": ElementwiseFn(2, 12),
    # ternary: select(pred, on_true, on_false)
    "select": ElementwiseFn(3),
}


def _elementwise_infer(p, ins):
    fn = p["fn"]
    _need(fn in ELEMENTWISE, f"unknown elementwise function {fn!r}; known: {', '.join(sorted(ELEMENTWISE))}")
    spec = ELEMENTWISE[fn]
    n_scalar = 1 if "scalar" in p else 0
    _need(len(ins) + n_scalar == spec.arity,
          f"elementwise {fn!r} takes {spec.arity} operands, got {len(ins)} tensors and {n_scalar} scalar")
    shapes = {t.shape for t in ins if t.rank > 0}
    _need(len(shapes) <= 1, f"elementwise {fn!r}: operand shapes differ {[t.shape for t in ins]}; "
                            f"broadcast explicitly first")
    shape = shapes.pop() if shapes else ()
    if spec.boolean:
        dtype = "bool"
    elif fn == "select":
        dtype = ins[1].dtype if len(ins) > 1 else ins[0].dtype
    else:
        dtype = next((t.dtype for t in ins if t.dtype != "bool"), ins[0].dtype)
    return [(shape, p.get("dtype", dtype))]


_register(Primitive(
    "elementwise", "elementwise", _elementwise_infer,
    lambda p, ins, outs: ELEMENTWISE[p["fn"]].flops * outs[0].size,
    lambda p, ins, outs: _same_letters(ins, outs), arity=(1, 2, 3)))

_register(Primitive(
    "convert", "elementwise",
    lambda p, ins: [(ins[0].shape, p["dtype"])],
    lambda p, ins, outs: 0.0,
    lambda p, ins, outs: _same_letters(ins, outs)))


def _bias_add_infer(p, ins):
    x, b = ins
    _need(b.rank <= x.rank and x.shape[x.rank - b.rank:] == b.shape,
          f"bias_add: bias {b.shape} must match the trailing dimensions of {x.shape}")
    return [(x.shape, x.dtype)]


def _bias_add_dims(p, ins, outs):
    x, b = ins
    full = _letters(x.rank)
    return _dimmap([full, full[x.rank - b.rank:]], [full], list(ins) + list(outs))


_register(Primitive("bias_add", "elementwise", _bias_add_infer,
                    lambda p, ins, outs: float(outs[0].size), _bias_add_dims, arity=(2,)))


# ------------------------------------------------------------------- reductions
def _norm_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    out = tuple(sorted(a % rank if rank else 0 for a in axes))
    _need(len(set(out)) == len(out), f"repeated axis in {tuple(axes)}")
    return out


def _reduce_infer(p, ins):
    _need(p["kind"] in ("sum", "max", "min", "mean"), f"reduce: unknown kind {p['kind']!r}")
    x = ins[0]
    axes = _norm_axes(p["axes"], x.rank)
    _need(all(0 <= a < x.rank for a in axes), f"reduce: axes {p['axes']} out of range for {x.shape}")
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


def _reduce_dims(p, ins, outs):
    x = ins[0]
    full = _letters(x.rank)
    axes = _norm_axes(p["axes"], x.rank)
    return _dimmap([full], ["".join(c for i, c in enumerate(full) if i not in axes)], list(ins) + list(outs))


_register(Primitive("reduce", "reduction", _reduce_infer,
                    lambda p, ins, outs: float(ins[0].size), _reduce_dims))


# --------------------------------------------------------------- data movement
def _broadcast_infer(p, ins):
    x = ins[0]
    shape, dims = tuple(p["shape"]), tuple(p["dims"])
    _need(len(dims) == x.rank, f"broadcast: dims {dims} must name one output axis per input axis {x.shape}")
    _need(list(dims) == sorted(dims) and all(0 <= d < len(shape) for d in dims),
          f"broadcast: dims {dims} must be increasing axes of {shape}")
    for i, d in enumerate(dims):
        _need(x.shape[i] in (1, shape[d]), f"broadcast: input axis {i} ({x.shape[i]}) cannot become {shape[d]}")
    return [(shape, x.dtype)]


def _broadcast_dims(p, ins, outs):
    x = ins[0]
    out = _letters(len(p["shape"]))
    letters = "".join(out[d] if x.shape[i] == p["shape"][d] else _letters(1, len(out) + i)
                      for i, d in enumerate(p["dims"]))
    return _dimmap([letters], [out], list(ins) + list(outs))


_register(Primitive("broadcast", "data_movement", _broadcast_infer, lambda p, ins, outs: 0.0, _broadcast_dims))


def _reshape_infer(p, ins):
    shape = tuple(p["shape"])
    _need(math.prod(shape) == ins[0].size, f"reshape: cannot reshape {ins[0].shape} to {shape}")
    return [(shape, ins[0].dtype)]


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up minimal runs of axes of `src` and `dst` with equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi <= pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if pi == pj and (i == len(src) or src[i] != 1 or j == len(dst) or dst[j] != 1):
                if gi and gj:
                    break
        groups.append((gi, gj))
    return groups


def _reshape_dims(p, ins, outs):
    # The leading axes of two matched groups share a letter: sharding the first axis
    # of a group into k blocks is the same data layout on both sides.
    src, dst = ins[0].shape, tuple(p["shape"])
    a, b = [""] * len(src), [""] * len(dst)
    fresh = iter(LETTERS)
    for gi, gj in reshape_groups(src, dst):
        lead = next(fresh)
        for n, i in enumerate(gi):
            a[i] = lead if n == 0 else next(fresh)
        for n, j in enumerate(gj):
            b[j] = lead if n == 0 else next(fresh)
    return _dimmap(["".join(a)], ["".join(b)], list(ins) + list(outs))


_register(Primitive("reshape", "data_movement", _reshape_infer, lambda p, ins, outs: 0.0, _reshape_dims))


def _transpose_infer(p, ins):
    perm = tuple(p["perm"])
    _need(sorted(perm) == list(range(ins[0].rank)), f"transpose: {perm} is not a permutation of {ins[0].rank} axes")
    return [(tuple(ins[0].shape[i] for i in perm), ins[0].dtype)]


def _transpose_dims(p, ins, outs):
    full = _letters(ins[0].rank)
    return _dimmap([full], ["".join(full[i] for i in p["perm"])], list(ins) + list(outs))


_register(Primitive("transpose", "data_movement", _transpose_infer, lambda p, ins, outs: 0.0, _transpose_dims))


def _slice_infer(p, ins):
    x = ins[0]
    start, limit = tuple(p["start"]), tuple(p["limit"])
    _need(len(start) == len(limit) == x.rank, f"slice: start/limit must have rank {x.rank}")
    _need(all(0 <= s <= e <= d for s, e, d in zip(start, limit, x.shape)),
          f"slice: [{start}, {limit}) out of bounds for {x.shape}")
    return [(tuple(e - s for s, e in zip(start, limit)), x.dtype)]


def _slice_dims(p, ins, outs):
    """Axes whose extent is unchanged share a letter; cut or padded axes do not."""
    x, y = ins[0], outs[0]
    a = _letters(x.rank)
    b = "".join(c if x.shape[i] == y.shape[i] else _letters(1, x.rank + i) for i, c in enumerate(a))
    return _dimmap([a], [b], list(ins) + list(outs))


_register(Primitive("slice", "data_movement", _slice_infer, lambda p, ins, outs: 0.0, _slice_dims))


def _pad_infer(p, ins):
    x = ins[0]
    lo, hi = tuple(p["low"]), tuple(p["high"])
    _need(len(lo) == len(hi) == x.rank and min(lo + hi, default=0) >= 0, f"pad: bad low/high {lo} {hi}")
    return [(tuple(d + a + b for d, a, b in zip(x.shape, lo, hi)), x.dtype)]


_register(Primitive("pad", "data_movement", _pad_infer, lambda p, ins, outs: 0.0, _slice_dims))


def _concat_infer(p, ins):
    axis = p["axis"] % ins[0].rank
    base = ins[0].shape
    for t in ins:
        _need(t.rank == len(base) and all(t.shape[i] == base[i] for i in range(len(base)) if i != axis),
              f"concatenate: shapes {[t.shape for t in ins]} disagree off axis {axis}")
    shape = list(base)
    shape[axis] = sum(t.shape[axis] for t in ins)
    return [(tuple(shape), ins[0].dtype)]


def _concat_dims(p, ins, outs):
    rank = outs[0].rank
    axis = p["axis"] % rank
    full = _letters(rank)
    other = lambda k: full[:axis] + _letters(1, rank + k) + full[axis + 1:]  # noqa: E731
    return _dimmap([other(k) for k in range(len(ins))], [other(len(ins))], list(ins) + list(outs))


_register(Primitive("concatenate", "data_movement", _concat_infer, lambda p, ins, outs: 0.0, _concat_dims,
                    arity=(1, 2, 3, 4, 5, 6, 7, 8)))

_register(Primitive("iota", "data_movement",
                    lambda p, ins: [(tuple(p["shape"]), p.get("dtype", "int32"))],
                    lambda p, ins, outs: 0.0,
                    lambda p, ins, outs: _dimmap([], [_letters(outs[0].rank)], list(outs)), arity=(0,)))
_register(Primitive("full", "data_movement",
                    lambda p, ins: [(tuple(p["shape"]), p.get("dtype", "float32"))],
                    lambda p, ins, outs: 0.0,
                    lambda p, ins, outs: _dimmap([], [_letters(outs[0].rank)], list(outs)), arity=(0,)))


# -------------------------------------------------------- softmax and norms
def _axis_dims(p, ins, outs, axis_key="axis"):
    """All operands of the input's rank share letters; lower-rank ones take the trailing letters."""
    rank = ins[0].rank
    full = _letters(rank)
    axis = p.get(axis_key, -1) % rank
    pick = lambda t: full[rank - t.rank:]  # noqa: E731
    return _dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs), within=full[axis])


_register(Primitive("softmax", "softmax", lambda p, ins: [(ins[0].shape, ins[0].dtype)],
                    lambda p, ins, outs: 5.0 * ins[0].size, _axis_dims))


def _softmax_grad_infer(p, ins):
    dy, y = ins
    _need(dy.shape == y.shape, f"softmax_grad: cotangent {dy.shape} vs output {y.shape}")
    return [(y.shape, dy.dtype)]


_register(Primitive("softmax_grad", "softmax", _softmax_grad_infer,
                    lambda p, ins, outs: 4.0 * ins[0].size, _axis_dims, arity=(2,)))


def _layer_norm_infer(p, ins):
    x, gamma, beta = ins
    _need(gamma.shape == beta.shape == x.shape[-1:],
          f"layer_norm: scale {gamma.shape} and bias {beta.shape} must equal the last axis of {x.shape}")
    return [(x.shape, x.dtype)]


_register(Primitive("layer_norm", "normalization", _layer_norm_infer,
                    lambda p, ins, outs: 8.0 * ins[0].size, _axis_dims, arity=(3,)))


def _layer_norm_grad_infer(p, ins):
    dy, x, gamma = ins
    _need(dy.shape == x.shape and gamma.shape == x.shape[-1:], "layer_norm_grad: operand shapes disagree")
    return [(x.shape, dy.dtype), (gamma.shape, gamma.dtype), (gamma.shape, gamma.dtype)]


_register(Primitive("layer_norm_grad", "normalization", _layer_norm_grad_infer,
                    lambda p, ins, outs: 12.0 * ins[0].size, _axis_dims, arity=(3,)))


def _bn_dims(p, ins, outs):
    # Batch norm reduces over N, H and W: all but the channel axis are reduced within.
    rank = ins[0].rank
    full = _letters(rank)
    pick = lambda t: full if t.rank == rank else full[-1]  # noqa: E731
    return _dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs), within=full[:-1])


def _batch_norm_infer(p, ins):
    x, gamma, beta = ins
    _need(gamma.shape == beta.shape == x.shape[-1:], f"batch_norm: scale/bias must be ({x.shape[-1]},)")
    return [(x.shape, x.dtype)]


_register(Primitive("batch_norm", "normalization", _batch_norm_infer,
                    lambda p, ins, outs: 8.0 * ins[0].size, _bn_dims, arity=(3,)))


def _batch_norm_grad_infer(p, ins):
    dy, x, gamma = ins
    _need(dy.shape == x.shape and gamma.shape == x.shape[-1:], "batch_norm_grad: operand shapes disagree")
    return [(x.shape, dy.dtype), (gamma.shape, gamma.dtype), (gamma.shape, gamma.dtype)]


_register(Primitive("batch_norm_grad", "normalization", _batch_norm_grad_infer,
                    lambda p, ins, outs: 12.0 * ins[0].size, _bn_dims, arity=(3,)))


# ----------------------------------------------------------- embedding / loss
def _embedding_infer(p, ins):
    table, ids = ins
    _need(table.rank == 2, f"embedding: table must be (vocab, hidden), got {table.shape}")
    _need(not ids.is_float, f"embedding: ids must be integers, got {ids.dtype}")
    return [(ids.shape + table.shape[1:], table.dtype)]


def _embedding_dims(p, ins, outs):
    table, ids = ins
    idx = _letters(ids.rank)
    v, h = _letters(2, ids.rank)
    return _dimmap([v + h, idx], [idx + h], list(ins) + list(outs))


_register(Primitive("embedding", "embedding", _embedding_infer,
                    lambda p, ins, outs: 0.0, _embedding_dims, arity=(2,)))


def _embedding_grad_infer(p, ins):
    dy, ids = ins
    _need(dy.shape[:-1] == ids.shape, f"embedding_grad: cotangent {dy.shape} vs ids {ids.shape}")
    return [((int(p["vocab"]), dy.shape[-1]), p.get("dtype", dy.dtype))]


def _embedding_grad_dims(p, ins, outs):
    dy, ids = ins
    idx = _letters(ids.rank)
    v, h = _letters(2, ids.rank)
    return _dimmap([idx + h, idx], [v + h], list(ins) + list(outs))


_register(Primitive("embedding_grad", "embedding", _embedding_grad_infer,
                    lambda p, ins, outs: float(ins[0].size), _embedding_grad_dims, arity=(2,)))


def _xent_infer(p, ins):
    logits, labels = ins
    _need(logits.shape[:-1] == labels.shape and not labels.is_float,
          f"softmax_cross_entropy: labels {labels.shape} ({labels.dtype}) must index logits {logits.shape}")
    return [((), "float32")]


def _xent_dims(p, ins, outs):
    logits, labels = ins
    full = _letters(logits.rank)
    return _dimmap([full, full[:-1]], [""], list(ins) + list(outs))


_register(Primitive("softmax_cross_entropy", "loss", _xent_infer,
                    lambda p, ins, outs: 6.0 * ins[0].size, _xent_dims, arity=(2,)))


def _xent_grad_infer(p, ins):
    dloss, logits, labels = ins
    _need(dloss.rank == 0, "softmax_cross_entropy_grad: loss cotangent must be a scalar")
    return [(logits.shape, logits.dtype)]


def _xent_grad_dims(p, ins, outs):
    dloss, logits, labels = ins
    full = _letters(logits.rank)
    return _dimmap(["", full, full[:-1]], [full], list(ins) + list(outs), within=full[-1])


_register(Primitive("softmax_cross_entropy_grad", "loss", _xent_grad_infer,
                    lambda p, ins, outs: 6.0 * ins[1].size, _xent_grad_dims, arity=(3,)))


# ------------------------------------------------------------------ MoE gating
def _gating_infer(p, ins):
    gates = ins[0]
    _need(gates.rank == 3, f"top2_gating: gates must be (groups, group_size, experts), got {gates.shape}")
    g, s, e = gates.shape
    c = int(p["capacity"])
    _need(c > 0, f"top2_gating: capacity must be positive, got {c}")
    return [((g, s, e, c), gates.dtype), ((g, s, e, c), gates.dtype)]


def _gating_dims(p, ins, outs):
    return _dimmap(["gse"], ["gsec", "gsec"], list(ins) + list(outs), within="se")


_register(Primitive("top2_gating", "gating", _gating_infer,
                    lambda p, ins, outs: 10.0 * outs[0].size, _gating_dims))


def _gating_grad_infer(p, ins):
    dcombine, gates = ins
    g, s, e = gates.shape
    _need(dcombine.shape == (g, s, e, int(p["capacity"])), "top2_gating_grad: cotangent shape mismatch")
    return [(gates.shape, gates.dtype)]


_register(Primitive("top2_gating_grad", "gating", _gating_grad_infer,
                    lambda p, ins, outs: 10.0 * ins[0].size,
                    lambda p, ins, outs: _dimmap(["gsec", "gse"], ["gse"], list(ins) + list(outs), within="se"),
                    arity=(2,)))


# ------------------------------------------------------------------- pooling
def _pool_geometry(p, x_shape):
    n, h, w, c = x_shape
    kh, kw = p["window"]
    sh, sw = p["strides"]
    pad = p.get("padding", ((0, 0), (0, 0)))
    return (n, _conv_out(h, kh, sh, pad[0]), _conv_out(w, kw, sw, pad[1]), c)


_register(Primitive("max_pool", "pooling", lambda p, ins: [(_pool_geometry(p, ins[0].shape), ins[0].dtype)],
                    lambda p, ins, outs: float(outs[0].size * math.prod(p["window"])),
                    lambda p, ins, outs: _dimmap(["nhwc"], ["nHWc"], list(ins) + list(outs))))


def _pool_grad_infer(p, ins):
    dy, x = ins
    _need(_pool_geometry(p, x.shape) == dy.shape, "max_pool_grad: cotangent does not match the pooled input")
    return [(x.shape, dy.dtype)]


_register(Primitive("max_pool_grad", "pooling", _pool_grad_infer,
                    lambda p, ins, outs: float(ins[0].size * math.prod(p["window"])),
                    lambda p, ins, outs: _dimmap(["nHWc", "nhwc"], ["nhwc"], list(ins) + list(outs)),
                    arity=(2,)))


# ------------------------------------------------------------------ optimizer
def _adam_infer(p, ins):
    # (param, grad, m, v) or, with mixed precision, (param, grad, master, m, v).
    _need(len(ins) in (4, 5), f"adam takes 4 or 5 operands, got {len(ins)}")
    shape = ins[0].shape
    _need(all(t.shape == shape for t in ins), f"adam: operand shapes differ {[t.shape for t in ins]}")
    return [(t.shape, t.dtype) for t in ins if t is not ins[1]]


_register(Primitive("adam", "optimizer", _adam_infer,
                    # ~12 FLOPs per element: two moment EMAs, bias corrections, rsqrt, update.
                    lambda p, ins, outs: 12.0 * ins[0].size,
                    lambda p, ins, outs: _same_letters(ins, outs), arity=(4, 5)))


# ---------------------------------------------------------------------- queries
def infer_outputs(prim: str, params: dict[str, Any], inputs: Sequence[Tensor]) -> list[ShapeDtype]:
    """Output (shape, dtype) pairs of `prim` applied to `inputs`; raises PrimitiveError."""
    p = primitive(prim)
    _need(len(inputs) in p.arity or p.arity == (), f"{prim} takes {p.arity} operands, got {len(inputs)}")
    try:
        return p.infer(params, inputs)
    except PrimitiveError:
        raise
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as e:
        raise PrimitiveError(f"{prim}: bad params {params!r} for inputs "
                             f"{[t.shape for t in inputs]}: {e!r}") from None


def op_flops(op: Op, tensors: dict[str, Tensor]) -> float:
    """FLOPs of one application of `op` (see the module docstring for the counting)."""
    p = primitive(op.prim)
    return float(p.flops(op.attrs, [tensors[t] for t in op.inputs], [tensors[t] for t in op.outputs]))


def op_bytes(op: Op, tensors: dict[str, Tensor]) -> int:
    """Bytes an op reads and writes once each: the memory-traffic side of a roofline."""
    return sum(tensors[t].nbytes for t in op.inputs) + sum(tensors[t].nbytes for t in op.outputs)


def op_dims(op: Op, tensors: dict[str, Tensor]) -> DimMap:
    p = primitive(op.prim)
    return p.dims(op.attrs, [tensors[t] for t in op.inputs], [tensors[t] for t in op.outputs])


def op_kind(op: Op) -> str:
    return primitive(op.prim).kind


def is_heavy(op: Op) -> bool:
    """Contractions and convolutions: the ops whose parallel algorithm matters."""
    return primitive(op.prim).heavy

"""Rules of the compute primitives: einsum, conv2d (and its gradients), elementwise, reductions."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._prim_core import LETTERS, Primitive, dimmap, letter_run, need, register, same_letters
from ._types import Tensor


# ----------------------------------------------------------------------- einsum
@functools.lru_cache(maxsize=4096)
def parse_einsum(equation: str) -> tuple[tuple[str, ...], str]:
    """Split `"bsh,hf->bsf"` into (("bsh", "hf"), "bsf"); explicit outputs only. Kept:
    a model's few equations are parsed again for every op's size, FLOPs and map."""
    need("->" in equation, f"einsum equation {equation!r} needs an explicit '->' output")
    lhs, out = equation.replace(" ", "").split("->")
    ins = tuple(lhs.split(","))
    for term in (*ins, out):
        need(all(c in LETTERS for c in term), f"einsum equation {equation!r}: letters only")
        need(len(set(term)) == len(term), f"einsum equation {equation!r}: repeated letter in {term!r}")
    need(set(out) <= set("".join(ins)), f"einsum equation {equation!r}: output letter not in inputs")
    return ins, out


def _einsum_sizes(equation: str, ins: Sequence[Tensor]) -> dict[str, int]:
    terms, _ = parse_einsum(equation)
    need(len(terms) == len(ins), f"einsum {equation!r} takes {len(terms)} operands, got {len(ins)}")
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ins):
        need(len(term) == t.rank, f"einsum {equation!r}: operand {t.name!r} has shape {t.shape}, "
                                   f"term {term!r} expects rank {len(term)}")
        for c, d in zip(term, t.shape):
            need(sizes.setdefault(c, d) == d,
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
    return dimmap(terms, [out], list(ins) + list(outs))


register(Primitive("einsum", "einsum", _einsum_infer, _einsum_flops, _einsum_dims, arity=(2,), heavy=True))


# ----------------------------------------------------------------------- conv2d
def conv_out(size: int, k: int, stride: int, pad: tuple[int, int]) -> int:
    return (size + pad[0] + pad[1] - k) // stride + 1


def _conv_geometry(p, x_shape, w_shape):
    need(len(x_shape) == 4 and len(w_shape) == 4, "conv2d takes NHWC inputs and HWIO filters")
    n, h, w, c = x_shape
    kh, kw, ci, co = w_shape
    need(c == ci, f"conv2d: input has {c} channels, filter expects {ci}")
    sh, sw = p.get("strides", (1, 1))
    pad = p.get("padding", ((0, 0), (0, 0)))
    ho, wo = conv_out(h, kh, sh, pad[0]), conv_out(w, kw, sw, pad[1])
    need(ho > 0 and wo > 0, f"conv2d: empty output for input {x_shape} and filter {w_shape}")
    return (n, ho, wo, co)


def _conv_infer(p, ins):
    return [(_conv_geometry(p, ins[0].shape, ins[1].shape), ins[0].dtype)]


def _conv_flops_from(x_shape, w_shape, y_shape):
    n, ho, wo, co = y_shape
    kh, kw, ci, _ = w_shape
    return 2.0 * n * ho * wo * co * kh * kw * ci


_CONV_X, _CONV_W, _CONV_Y = "nhwc", "klcf", "nHWf"
# Spatial loops of a strided convolution would need halo exchanges: never sharded.
_CONV_SPATIAL = "hwklHW"
register(Primitive(
    "conv2d", "conv", _conv_infer,
    lambda p, ins, outs: _conv_flops_from(ins[0].shape, ins[1].shape, outs[0].shape),
    lambda p, ins, outs: dimmap([_CONV_X, _CONV_W], [_CONV_Y], list(ins) + list(outs), fixed=_CONV_SPATIAL),
    arity=(2,), heavy=True))


def _conv_in_grad_infer(p, ins):
    dy, w = ins
    x_shape = tuple(p["input_shape"])
    need(_conv_geometry(p, x_shape, w.shape) == dy.shape,
          f"conv2d_input_grad: cotangent {dy.shape} does not match input {x_shape}")
    return [(x_shape, dy.dtype)]


register(Primitive(
    "conv2d_input_grad", "conv", _conv_in_grad_infer,
    lambda p, ins, outs: _conv_flops_from(outs[0].shape, ins[1].shape, ins[0].shape),
    lambda p, ins, outs: dimmap([_CONV_Y, _CONV_W], [_CONV_X], list(ins) + list(outs), fixed=_CONV_SPATIAL),
    arity=(2,), heavy=True))


def _conv_filter_grad_infer(p, ins):
    x, dy = ins
    w_shape = tuple(p["filter_shape"])
    need(_conv_geometry(p, x.shape, w_shape) == dy.shape,
          f"conv2d_filter_grad: cotangent {dy.shape} does not match filter {w_shape}")
    return [(w_shape, dy.dtype)]


register(Primitive(
    "conv2d_filter_grad", "conv", _conv_filter_grad_infer,
    lambda p, ins, outs: _conv_flops_from(ins[0].shape, outs[0].shape, ins[1].shape),
    lambda p, ins, outs: dimmap([_CONV_X, _CONV_Y], [_CONV_W], list(ins) + list(outs), fixed=_CONV_SPATIAL),
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
    need(fn in ELEMENTWISE, f"unknown elementwise function {fn!r}; known: {', '.join(sorted(ELEMENTWISE))}")
    spec = ELEMENTWISE[fn]
    n_scalar = 1 if "scalar" in p else 0
    need(len(ins) + n_scalar == spec.arity,
          f"elementwise {fn!r} takes {spec.arity} operands, got {len(ins)} tensors and {n_scalar} scalar")
    shapes = {t.shape for t in ins if t.rank > 0}
    need(len(shapes) <= 1, f"elementwise {fn!r}: operand shapes differ {[t.shape for t in ins]}; "
                            f"broadcast explicitly first")
    shape = shapes.pop() if shapes else ()
    if spec.boolean:
        dtype = "bool"
    elif fn == "select":
        dtype = ins[1].dtype if len(ins) > 1 else ins[0].dtype
    else:
        dtype = next((t.dtype for t in ins if t.dtype != "bool"), ins[0].dtype)
    return [(shape, p.get("dtype", dtype))]


register(Primitive(
    "elementwise", "elementwise", _elementwise_infer,
    lambda p, ins, outs: ELEMENTWISE[p["fn"]].flops * outs[0].size,
    lambda p, ins, outs: same_letters(ins, outs), arity=(1, 2, 3)))

register(Primitive(
    "convert", "elementwise",
    lambda p, ins: [(ins[0].shape, p["dtype"])],
    lambda p, ins, outs: 0.0,
    lambda p, ins, outs: same_letters(ins, outs)))


def _bias_add_infer(p, ins):
    x, b = ins
    need(b.rank <= x.rank and x.shape[x.rank - b.rank:] == b.shape,
          f"bias_add: bias {b.shape} must match the trailing dimensions of {x.shape}")
    return [(x.shape, x.dtype)]


def _bias_add_dims(p, ins, outs):
    x, b = ins
    full = letter_run(x.rank)
    return dimmap([full, full[x.rank - b.rank:]], [full], list(ins) + list(outs))


register(Primitive("bias_add", "elementwise", _bias_add_infer,
                    lambda p, ins, outs: float(outs[0].size), _bias_add_dims, arity=(2,)))


# ------------------------------------------------------------------- reductions
def _norm_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    out = tuple(sorted(a % rank if rank else 0 for a in axes))
    need(len(set(out)) == len(out), f"repeated axis in {tuple(axes)}")
    return out


def _reduce_infer(p, ins):
    need(p["kind"] in ("sum", "max", "min", "mean"), f"reduce: unknown kind {p['kind']!r}")
    x = ins[0]
    axes = _norm_axes(p["axes"], x.rank)
    need(all(0 <= a < x.rank for a in axes), f"reduce: axes {p['axes']} out of range for {x.shape}")
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


def _reduce_dims(p, ins, outs):
    x = ins[0]
    full = letter_run(x.rank)
    axes = _norm_axes(p["axes"], x.rank)
    return dimmap([full], ["".join(c for i, c in enumerate(full) if i not in axes)], list(ins) + list(outs))


register(Primitive("reduce", "reduction", _reduce_infer,
                    lambda p, ins, outs: float(ins[0].size), _reduce_dims))

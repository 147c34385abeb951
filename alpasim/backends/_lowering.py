"""JAX semantics of the primitive set, and `lower_graph`: an OpGraph as a JAX function.

Every primitive of `alpasim.graphs.PRIMITIVES` has one implementation here, written
the way the VJP rules in `alpasim.graphs._autodiff` assume it behaves: the backward
primitives (`softmax_grad`, `layer_norm_grad`, `softmax_cross_entropy_grad`, ...) are
closed-form kernels, checked in the tests against `jax.grad` of their forward
primitive. The convolution and gating cotangents are `jax.vjp` of the forward
implementation: their index bookkeeping is exactly what XLA's transposition rules
already get right. Two are written out instead, so that XLA:CPU runs them without
workspaces the cost model does not price: a 1x1 convolution and its gradients are
matmuls over the strided pixels (`_conv2d_filter_grad`), and max pooling's cotangent is
masks per window offset (`_max_pool_grad`).

Conventions: softmax, norms and the loss compute in float32 and cast back (what
Megatron-LM's fused kernels do for half precision); every op's results are cast to
the dtypes its graph declares, and a result whose shape disagrees with the graph is a
`LoweringError`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from alpasim.graphs import ELEMENTWISE, PRIMITIVES, Op, OpGraph, constant_array

F32 = jnp.float32
Impl = Callable[..., Any]  # (params dict, *operands) -> array | tuple of arrays
LOWERINGS: dict[str, Impl] = {}


class LoweringError(ValueError):
    """A graph that cannot be evaluated: a missing leaf, an unknown primitive, a bad shape."""


def _lowers(*prims: str):
    def deco(fn: Impl) -> Impl:
        for p in prims:
            LOWERINGS[p] = fn
        return fn
    return deco


# --------------------------------------------------------------------- einsum
@_lowers("einsum")
def _einsum(p, a, b):
    dtype = jnp.dtype(p["dtype"]) if "dtype" in p else None
    return jnp.einsum(p["equation"], a, b, preferred_element_type=dtype)


# --------------------------------------------------------------------- conv2d
def _conv(x, w, strides, padding):
    """NHWC input, HWIO filter -> NHWC output."""
    return lax.conv_general_dilated(x, w, window_strides=tuple(strides), padding=tuple(map(tuple, padding)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _geometry(p) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    return tuple(p.get("strides", (1, 1))), tuple(p.get("padding", ((0, 0), (0, 0))))


def _pointwise(p, filter_shape) -> bool:
    """A 1x1 convolution without padding: a matmul over the strided pixels."""
    return tuple(filter_shape[:2]) == (1, 1) and all(tuple(pad) == (0, 0) for pad in _geometry(p)[1])


def _pick(x, offset, strides, count):
    """x[:, i + a*sh, j + b*sw] for a < count[0], b < count[1]: NHWC pixels on a grid."""
    (i, j), (sh, sw), (n, _, _, c) = offset, strides, x.shape
    return lax.slice(x, (0, i, j, 0), (n, i + (count[0] - 1) * sh + 1, j + (count[1] - 1) * sw + 1, c),
                     (1, sh, sw, 1))


def _spread(x, offset, strides, extent):
    """`_pick`'s transpose: x's pixel (a, b) at (i + a*sh, j + b*sw) of zeros of spatial
    `extent`, by one strided pad (interior padding stride - 1)."""
    (i, j), (sh, sw), (_, oh, ow, _) = offset, strides, x.shape
    return lax.pad(x, np.array(0, x.dtype), ((0, 0, 0), (i, extent[0] - i - (oh - 1) * sh - 1, sh - 1),
                                             (j, extent[1] - j - (ow - 1) * sw - 1, sw - 1), (0, 0, 0)))


def _strided_pixels(x, strides):
    """The pixels a 1x1 convolution of `strides` reads: every stride-th, from the first."""
    _, h, w, _ = x.shape
    return x if tuple(strides) == (1, 1) else _pick(x, (0, 0), strides, (-(-h // strides[0]), -(-w // strides[1])))


@_lowers("conv2d")
def _conv2d(p, x, w):
    if _pointwise(p, w.shape):
        # As XLA and cuDNN run a 1x1 convolution: one matmul, no layout change.
        return jnp.einsum("nhwc,cd->nhwd", _strided_pixels(x, _geometry(p)[0]), w[0, 0])
    return _conv(x, w, *_geometry(p))


@_lowers("conv2d_input_grad")
def _conv2d_input_grad(p, dy, w):
    strides, padding = _geometry(p)
    if _pointwise(p, w.shape):
        dx = jnp.einsum("nhwd,cd->nhwc", dy, w[0, 0].astype(dy.dtype))
        # Each output pixel came from input pixel (a * sh, b * sw); the others read none.
        return dx if strides == (1, 1) else _spread(dx, (0, 0), strides, p["input_shape"][1:3])
    # conv2d is linear in x, so the transpose does not depend on the point (zeros).
    x0 = jnp.zeros(tuple(p["input_shape"]), dy.dtype)
    _, vjp = jax.vjp(lambda x: _conv(x, w.astype(dy.dtype), strides, padding), x0)
    return vjp(dy)[0]


@_lowers("conv2d_filter_grad")
def _conv2d_filter_grad(p, x, dy):
    strides, padding = _geometry(p)
    if _pointwise(p, p["filter_shape"]):
        # The weight gradient of a matmul, contracting batch and pixels: XLA's
        # transpose of the convolution would first copy x and dy into batch-minor
        # layouts (on XLA:CPU two temporaries of their size, which no cost model of
        # the op's operands and result prices).
        xs = _strided_pixels(x.astype(dy.dtype), strides)
        return lax.dot_general(xs, dy, (((0, 1, 2), (0, 1, 2)), ((), ())))[None, None]
    w0 = jnp.zeros(tuple(p["filter_shape"]), dy.dtype)
    _, vjp = jax.vjp(lambda w: _conv(x.astype(dy.dtype), w, strides, padding), w0)
    return vjp(dy)[0]


# ---------------------------------------------------------------- elementwise
_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_grad(dy, x):
    """dy * d/dx of the tanh-approximate GeLU 0.5 x (1 + tanh(c (x + 0.044715 x^3)))."""
    xf = x.astype(F32)
    t = jnp.tanh(_GELU_C * (xf + 0.044715 * xf ** 3))
    d = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * xf * xf)
    return (dy.astype(F32) * d).astype(dy.dtype)


_EW_FNS: dict[str, Callable[..., Any]] = {
    "neg": jnp.negative, "exp": jnp.exp, "log": jnp.log, "tanh": jnp.tanh, "logistic": jax.nn.sigmoid,
    "relu": jax.nn.relu, "gelu": lambda x: jax.nn.gelu(x, approximate=True), "rsqrt": lax.rsqrt,
    "sqrt": jnp.sqrt, "square": jnp.square, "abs": jnp.abs, "sign": jnp.sign,
    "reciprocal": jnp.reciprocal, "erf": lax.erf, "sin": jnp.sin, "cos": jnp.cos,
    "identity": lambda x: x, "stop_gradient": lax.stop_gradient, "not": jnp.logical_not,
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
    "max": jnp.maximum, "min": jnp.minimum, "pow": jnp.power,
    "gt": jnp.greater, "ge": jnp.greater_equal, "lt": jnp.less, "le": jnp.less_equal,
    "eq": jnp.equal, "ne": jnp.not_equal, "and": jnp.logical_and, "or": jnp.logical_or,
    "relu_grad": lambda dy, x: jnp.where(x > 0, dy, jnp.zeros_like(dy)),
    "gelu_grad": _gelu_grad,
    "select": jnp.where,
}
assert set(_EW_FNS) == set(ELEMENTWISE), sorted(set(ELEMENTWISE) ^ set(_EW_FNS))


@_lowers("elementwise")
def _elementwise(p, *xs):
    fn = _EW_FNS[p["fn"]]
    if "scalar" in p:
        # A Python scalar is weakly typed: `x * 0.5` keeps x's dtype.
        (x,) = xs
        xs = (p["scalar"], x) if p.get("scalar_pos", 1) == 0 else (x, p["scalar"])
    y = fn(*xs)
    return y.astype(p["dtype"]) if "dtype" in p else y


@_lowers("convert")
def _convert(p, x):
    return x.astype(p["dtype"])


@_lowers("bias_add")
def _bias_add(p, x, b):
    return x + b.astype(x.dtype)  # numpy broadcasting aligns b with the trailing dims


# ------------------------------------------------------- reductions and layout
_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}


@_lowers("reduce")
def _reduce(p, x):
    return _REDUCE[p["kind"]](x, axis=tuple(a % max(x.ndim, 1) for a in p["axes"]))


@_lowers("broadcast")
def _broadcast(p, x):
    return lax.broadcast_in_dim(x, tuple(p["shape"]), tuple(p["dims"]))


@_lowers("reshape")
def _reshape(p, x):
    return jnp.reshape(x, tuple(p["shape"]))


@_lowers("transpose")
def _transpose(p, x):
    return jnp.transpose(x, tuple(p["perm"]))


@_lowers("slice")
def _slice(p, x):
    return lax.slice(x, tuple(p["start"]), tuple(p["limit"]))


@_lowers("pad")
def _pad(p, x):
    return lax.pad(x, jnp.zeros((), x.dtype), [(lo, hi, 0) for lo, hi in zip(p["low"], p["high"])])


@_lowers("concatenate")
def _concatenate(p, *xs):
    return jnp.concatenate(xs, axis=p["axis"])


@_lowers("iota")
def _iota(p):
    return lax.broadcasted_iota(jnp.dtype(p.get("dtype", "int32")), tuple(p["shape"]), p["dimension"])


@_lowers("constant")
def _constant(p):
    return jnp.asarray(constant_array(p))


@_lowers("full")
def _full(p):
    return jnp.full(tuple(p["shape"]), p["value"], jnp.dtype(p.get("dtype", "float32")))


def _fmix32(x):
    """murmur3's 32-bit finaliser: a bijection of uint32 whose output bits are uniform."""
    u32 = jnp.uint32
    x = (x ^ (x >> 16)) * u32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * u32(0xC2B2AE35)
    return x ^ (x >> 16)


@_lowers("dropout_mask")
def _dropout_mask(p, rows):
    """Keep (True) with probability 1 - rate: the top 24 bits of fmix(fmix(row id xor
    the op's seed) + the element's place in its row) (`alpasim.graphs._prims_nn`).
    Hashing the row first spreads rows' offsets over all of uint32 (a row's id times the
    row's size would wrap mod 2^32 and repeat masks every few rows). Integer
    elementwise ops on global indices only, so any sharding computes the same bits."""
    shape = tuple(p["shape"])
    u32 = jnp.uint32
    place, stride = jnp.zeros(shape, u32), 1
    for d in reversed(range(1, len(shape))):
        place = place + lax.broadcasted_iota(u32, shape, d) * u32(stride % 2**32)
        stride *= shape[d]
    row = _fmix32(rows.astype(u32) ^ u32(p["seed"] % 2**32))
    x = _fmix32(lax.broadcast_in_dim(row, shape, (0,)) + place)
    return (x >> 8).astype(F32) * (1.0 / 2**24) >= p["rate"]


# ------------------------------------------------------------ softmax and norms
@_lowers("softmax")
def _softmax(p, x):
    """softmax(scale * x) along `axis`; `causal` masks key index > query index (last two axes)."""
    z = x.astype(F32) * p.get("scale", 1.0)
    if p.get("causal", False):
        q, k = x.shape[-2:]
        allowed = jnp.arange(k)[None, :] <= jnp.arange(q)[:, None]  # (q, k)
        z = jnp.where(allowed, z, -jnp.inf)
    return jax.nn.softmax(z, axis=p.get("axis", -1)).astype(x.dtype)


@_lowers("softmax_grad")
def _softmax_grad(p, dy, y):
    """scale * y * (dy - sum(dy * y)): masked entries have y = 0 and get no gradient."""
    d, yf = dy.astype(F32), y.astype(F32)
    dot = jnp.sum(d * yf, axis=p.get("axis", -1), keepdims=True)
    return (p.get("scale", 1.0) * yf * (d - dot)).astype(dy.dtype)


# ------------------------------------------------------------ fused attention
def _attention_fn(p, q, k, v):
    """(out, lse) of `attention` (`alpasim.graphs._prims_attention`) through
    `jax.nn.dot_product_attention`, which takes (batch, seq, heads, head_dim) and returns
    the log-sum-exp as its residual. Every (batch, head) letter pair is an independent
    head, so the letters q and k share fold into its heads axis (batch 1), q's own
    letters (GQA's r query heads per KV head) after them: query head (shared..., r) then
    reads KV head (shared...), jax's contiguous grouping. XLA:CPU materialises the
    scores; a GPU's fused kernel (`implementation="cudnn"`) would not."""
    q_term, k_term, _ = p["equation"].split("->")[0].split(",")
    shared = [c for c in q_term if c in k_term and c not in "qkd"]
    own = [c for c in q_term if c not in k_term and c not in "qd"]
    q_order = ["q", *shared, *own, "d"]
    qt = jnp.transpose(q, [q_term.index(c) for c in q_order])
    kv_perm = [k_term.index(c) for c in ["k", *shared, "d"]]
    kt, vt = (jnp.transpose(x, kv_perm) for x in (k, v))
    seq, head = qt.shape[0], qt.shape[-1]
    out, lse = jax.nn.dot_product_attention(
        qt.reshape(1, seq, -1, head), kt.reshape(1, kt.shape[0], -1, head), vt.reshape(1, vt.shape[0], -1, head),
        scale=p.get("scale", 1.0), is_causal=bool(p.get("causal", False)), return_residual=True)
    out = jnp.transpose(out.reshape(qt.shape), [q_order.index(c) for c in q_term])
    lse_term, lse_order = q_term.replace("d", ""), q_order[:-1]
    lse = jnp.transpose(lse.reshape(qt.shape[:-1]), [lse_order.index(c) for c in lse_term])
    return out.astype(q.dtype), lse.astype(F32)


@_lowers("attention")
def _attention(p, q, k, v):
    return _attention_fn(p, q, k, v)


@_lowers("attention_grad")
def _attention_grad(p, dout, q, k, v, out, lse):
    """The kernel's backward recomputes the probabilities from q and k (here with
    `jax.vjp` of the forward; `out` and `lse` are the residuals a GPU kernel reads)."""
    _, vjp = jax.vjp(lambda a, b, c: _attention_fn(p, a, b, c)[0], q, k, v)
    return vjp(dout.astype(q.dtype))


def _normalize(x, axes, eps):
    """(x - mean) * rstd over `axes`, with rstd = 1 / sqrt(var + eps)."""
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    return (xf - mean) * rstd, rstd


def _norm(x, gamma, beta, axes, eps):
    xhat, _ = _normalize(x, axes, eps)
    return (xhat * gamma.astype(F32) + beta.astype(F32)).astype(x.dtype)


def _norm_grad(dy, x, gamma, axes, eps):
    """(dx, dgamma, dbeta) of y = xhat * gamma + beta, xhat normalised over `axes`.

    With g = dy * gamma: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), the means
    over the normalised axes; dgamma and dbeta sum over every axis but the channel.
    """
    xhat, rstd = _normalize(x, axes, eps)
    d = dy.astype(F32)
    g = d * gamma.astype(F32)
    dx = rstd * (g - jnp.mean(g, axis=axes, keepdims=True) - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True))
    lead = tuple(range(x.ndim - 1))
    dgamma, dbeta = jnp.sum(d * xhat, axis=lead), jnp.sum(d, axis=lead)
    return dx.astype(dy.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


@_lowers("layer_norm")
def _layer_norm(p, x, gamma, beta):
    return _norm(x, gamma, beta, (x.ndim - 1,), p.get("eps", 1e-5))


@_lowers("layer_norm_grad")
def _layer_norm_grad(p, dy, x, gamma):
    return _norm_grad(dy, x, gamma, (x.ndim - 1,), p.get("eps", 1e-5))


@_lowers("batch_norm")
def _batch_norm(p, x, gamma, beta):
    """Training-mode batch norm: statistics of this batch over every axis but the channel."""
    return _norm(x, gamma, beta, tuple(range(x.ndim - 1)), p.get("eps", 1e-5))


@_lowers("batch_norm_grad")
def _batch_norm_grad(p, dy, x, gamma):
    return _norm_grad(dy, x, gamma, tuple(range(x.ndim - 1)), p.get("eps", 1e-5))


# --------------------------------------------------------- embedding and loss
@_lowers("embedding")
def _embedding(p, table, ids):
    return jnp.take(table, ids, axis=0)


@_lowers("take_along")
def _take_along(p, x, idx):
    return jnp.take_along_axis(x, idx, axis=p["axis"])


@_lowers("take_along_grad")
def _take_along_grad(p, dy, idx):
    """The transpose of take_along: dy scatter-added where the indices point."""
    shape = list(dy.shape)
    shape[p["axis"]] = p["size"]
    _, vjp = jax.vjp(lambda x: jnp.take_along_axis(x, idx, axis=p["axis"]), jnp.zeros(shape, dy.dtype))
    return vjp(dy)[0]


@_lowers("embedding_grad")
def _embedding_grad(p, dy, ids):
    """Scatter-add of the rows of dy into (vocab, hidden); repeated ids accumulate."""
    hidden = dy.shape[-1]
    rows = dy.reshape(-1, hidden).astype(F32)
    table = jnp.zeros((int(p["vocab"]), hidden), F32).at[ids.reshape(-1)].add(rows)
    return table.astype(p.get("dtype", dy.dtype))


@_lowers("softmax_cross_entropy")
def _xent(p, logits, labels):
    """Mean over label positions of -log_softmax(logits)[label], in float32."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1))


@_lowers("softmax_cross_entropy_grad")
def _xent_grad(p, dloss, logits, labels):
    """dloss * (softmax - onehot(labels)) / positions, in the logits dtype."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=F32)
    return (dloss.astype(F32) * (probs - onehot) / labels.size).astype(logits.dtype)


# ------------------------------------------------------------------ MoE gating
def top2_gating(gates, capacity: int):
    """GShard top-2 gating as in Alpa's benchmark MoE (lingvo's Top2Gating, no aux loss):
    `topk_gating` with k = 2 and the two kept weights renormalised."""
    return topk_gating(gates, 2, capacity, normalize=True)


def topk_gating(gates, k: int, capacity: int, normalize: bool = True):
    """Top-k gating with expert capacity.

    gates (G, S, E) -> combine (G, S, E, C) and dispatch (G, S, E, C). Each token picks
    its best expert, then the best of the rest, k times; tokens queue per expert in
    sequence order, all first choices ahead of all second choices and so on, and those
    past capacity C are dropped. With `normalize` the kept gate values are rescaled to
    sum to one (GShard, Mixtral), else they are the softmax's own (DeepSeek-V2).
    """
    _, _, e = gates.shape
    rest, queued = gates, 0
    parts = []
    for _ in range(k):
        mask = jax.nn.one_hot(jnp.argmax(rest, axis=-1), e, dtype=jnp.int32)     # (G, S, E)
        gate = jnp.sum(rest * mask.astype(gates.dtype), axis=-1)                  # (G, S)
        rest = rest * (1 - mask).astype(gates.dtype)
        pos = jnp.cumsum(mask, axis=1) - mask + queued                            # slot in the expert's buffer
        mask = mask * (pos < capacity)
        queued = queued + jnp.sum(mask, axis=1, keepdims=True)
        parts.append((gate * jnp.sum(mask, axis=-1).astype(gates.dtype), mask, pos))
    if normalize:
        denom = sum(g for g, _, _ in parts)
        denom = jnp.where(denom > 0, denom, jnp.ones_like(denom))
        parts = [(g / denom, m, pos) for g, m, pos in parts]

    def part(gate, mask, pos):
        slot = jax.nn.one_hot(jnp.sum(pos * mask, axis=-1), capacity, dtype=gates.dtype)  # (G, S, C)
        return gate[..., None, None] * mask.astype(gates.dtype)[..., None] * slot[:, :, None, :]

    combine = sum(part(*x) for x in parts)
    return combine, (combine > 0).astype(gates.dtype)


def _gating_of(p):
    return lambda g: topk_gating(g, int(p.get("k", 2)), int(p["capacity"]), bool(p.get("normalize", True)))


@_lowers("top2_gating", "topk_gating")
def _topk_gating(p, gates):
    return _gating_of(p)(gates)


@_lowers("top2_gating_grad", "topk_gating_grad")
def _topk_gating_grad(p, dcombine, gates):
    _, vjp = jax.vjp(lambda g: _gating_of(p)(g)[0], gates)
    return vjp(dcombine.astype(gates.dtype))[0]


# --------------------------------------------------------------------- pooling
def _max_pool_fn(p, x):
    pad = ((0, 0), *map(tuple, p.get("padding", ((0, 0), (0, 0)))), (0, 0))
    # A concrete -inf init lets JAX recognise reduce_window_max (and differentiate it).
    return lax.reduce_window(x, np.array(-np.inf, x.dtype), lax.max, (1, *p["window"], 1),
                             (1, *p["strides"], 1), pad)


@_lowers("max_pool")
def _max_pool(p, x):
    return _max_pool_fn(p, x)


def _window_rows(k: int, stride: int, windows: int, size: int, low: int) -> tuple[int, int]:
    """(first, last) window whose pixel at offset k along one axis lies inside the
    image of `size` padded by `low` before it; last < first where none does."""
    return -(-max(low - k, 0) // stride), min(windows - 1, (size - 1 + low - k) // stride)


def _window_pixels(x, offset, strides, count, low):
    """`_pick` of x padded with -inf by `low` rows and columns, without the padded copy:
    the in-range pixels picked from x, the rest padded in at the pooled size."""
    (i, j), (sh, sw), (oh, ow), (pt, pl) = offset, strides, count, low
    n, h, w, c = x.shape
    a0, a1 = _window_rows(i, sh, oh, h, pt)
    b0, b1 = _window_rows(j, sw, ow, w, pl)
    if a1 < a0 or b1 < b0:           # every window reads padding at this offset
        return jnp.full((n, oh, ow, c), -np.inf, x.dtype)
    v = _pick(x, (a0 * sh + i - pt, b0 * sw + j - pl), strides, (a1 - a0 + 1, b1 - b0 + 1))
    return lax.pad(v, np.array(-np.inf, x.dtype), ((0, 0, 0), (a0, oh - 1 - a1, 0), (b0, ow - 1 - b1, 0), (0, 0, 0)))


@_lowers("max_pool_grad")
def _max_pool_grad(p, dy, x):
    """Max pooling's cotangent as masks, one window offset at a time.

    Each output's cotangent goes to the first maximum of its window in row-major order,
    as XLA's select-and-scatter (the transpose JAX writes) does. We do not emit
    select-and-scatter: XLA:CPU expands it into a reduce-window over (value, index)
    tuples whose scratch is the padded input plus one s32 index array per dimension,
    five pool inputs' worth live at once, which no cost model of the op's operands
    and result accounts for. Here the scratch is the padded cotangent alone: for each
    of the window's offsets, the outputs whose first maximum sits there, scattered
    back by a strided pad (interior padding = stride - 1).

    "Sits there" is bitwise equality with the window's maximum, so the maximum is taken
    over the very pixel arrays it is compared with (`_window_pixels`: slices of x, the
    padding added at the pooled size, with no padded copy of x), not by a reduce-window.
    With y = reduce_window(x) and the pixels sliced from a padded copy, XLA computed
    the two in different kinds of fusion, each recomputing x from its batch norm and
    ReLU, and nothing makes two fusions round alike: under XLA:CPU's legacy emitters
    at -O0 one pixel in twenty of Wide-ResNet's stem got a wrong cotangent (the stem's
    gradients 12x their norm off), though the op alone was right. An optimization
    barrier on x does not make x one buffer there (XLA:CPU expands the barrier away
    before fusing; tried, the gradients stayed wrong), so both sides are computed
    alike instead. `tests/graphs/test_autodiff.py`'s Wide-ResNet, whose pooled x is a
    fused producer inside one program, failed before and passes now, under either
    emitter family.
    """
    (kh, kw), (sh, sw) = p["window"], p["strides"]
    (pt, pb), (pl, pr) = map(tuple, p.get("padding", ((0, 0), (0, 0))))
    n, h, w, c = x.shape
    _, oh, ow, _ = dy.shape
    padded = (n, pt + h + pb, pl + w + pr, c)
    pixels = {(i, j): _window_pixels(x, (i, j), (sh, sw), (oh, ow), (pt, pl)) for i in range(kh) for j in range(kw)}
    y = functools.reduce(jnp.maximum, pixels.values())
    g = dy.astype(x.dtype)
    zero = np.array(0, x.dtype)
    taken = jnp.zeros(y.shape, bool)
    dxp = jnp.zeros(padded, x.dtype)
    for offset, v in pixels.items():
        first = (v == y) & ~taken
        taken = taken | first
        # Output (a, b) reads padded position (i + a*sh, j + b*sw) at this offset.
        dxp = dxp + _spread(jnp.where(first, g, zero), offset, (sh, sw), padded[1:3])
    return lax.slice(dxp, (0, pt, pl, 0), (n, pt + h, pl + w, c))


# ------------------------------------------------------------------- optimizer
@_lowers("adam")
def _adam(p, *xs):
    """One Adam step with step-1 bias correction (Kingma & Ba, 2015; decoupled decay).

    (param, grad, m, v) -> (param', m', v'), or with an fp32 master copy
    (param, grad, master, m, v) -> (param', master', m', v'), param' = master' in the
    param dtype. upd = lr * m'/(1-b1) / (sqrt(v'/(1-b2)) + eps) + weight_decay * w.
    """
    lr, b1, b2, eps, wd = (p.get(k, d) for k, d in
                           (("lr", 1e-4), ("b1", 0.9), ("b2", 0.999), ("eps", 1e-8), ("weight_decay", 0.0)))
    if len(xs) == 5:
        param, grad, master, m, v = xs
        w = master.astype(F32)
    else:
        param, grad, m, v = xs
        w = param.astype(F32)
    g = grad.astype(F32)
    m = b1 * m.astype(F32) + (1 - b1) * g
    v = b2 * v.astype(F32) + (1 - b2) * g * g
    w = w - (lr * (m / (1 - b1)) / (jnp.sqrt(v / (1 - b2)) + eps) + wd * w)
    if len(xs) == 5:
        return w.astype(param.dtype), w, m, v
    return w.astype(param.dtype), m, v


assert set(LOWERINGS) == set(PRIMITIVES), sorted(set(LOWERINGS) ^ set(PRIMITIVES))


# ------------------------------------------------------------------- graphs
def eval_op(op: Op, operands: Sequence[Any]) -> list[jax.Array]:
    """The values of `op`'s outputs for the given operand values (no dtype or shape checks)."""
    impl = LOWERINGS.get(op.prim)
    if impl is None:
        raise LoweringError(f"op {op.name!r}: no JAX lowering for primitive {op.prim!r}")
    out = impl(op.attrs, *operands)
    return list(out) if isinstance(out, tuple) else [out]


def graph_leaves(graph: OpGraph) -> list[str]:
    """Tensors read before any op writes them: inputs, parameters and optimizer states."""
    leaves = dict.fromkeys(graph.inputs)
    written: set[str] = set()
    for op in graph.ops:
        leaves.update((t, None) for t in op.inputs if t not in written)
        written.update(op.outputs)
    leaves.update((t, None) for t in graph.outputs if t not in written)
    return list(leaves)


def lower_graph(graph: OpGraph, outputs: Iterable[str] | None = None
                ) -> Callable[[Mapping[str, Any]], dict[str, jax.Array]]:
    """A pure function env -> values that evaluates `graph`'s ops in order.

    `env` maps every leaf (see `graph_leaves`) to its value; the result maps every
    tensor (leaves included) to its value, or only `outputs` when given. The function
    can be wrapped in `jax.jit`, `jax.grad` or `jax.vmap` like any JAX function.
    """
    for op in graph.ops:
        if op.prim not in LOWERINGS:
            raise LoweringError(f"op {op.name!r}: no JAX lowering for primitive {op.prim!r}")
    wanted = None if outputs is None else tuple(outputs)
    for t in wanted or ():
        if t not in graph.tensors:
            raise LoweringError(f"graph {graph.name!r} has no tensor {t!r} to return")
    leaves = graph_leaves(graph)
    tensors = graph.tensors
    dtypes = {name: jax.dtypes.canonicalize_dtype(t.dtype) for name, t in tensors.items()}

    def run(env: Mapping[str, Any]) -> dict[str, jax.Array]:
        missing = [t for t in leaves if t not in env]
        if missing:
            raise LoweringError(f"graph {graph.name!r}: no value for leaves {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''}")
        values = {name: jnp.asarray(v) for name, v in env.items()}
        for op in graph.ops:
            outs = eval_op(op, [values[t] for t in op.inputs])
            for name, v in zip(op.outputs, outs, strict=True):
                if v.shape != tensors[name].shape:
                    raise LoweringError(f"op {op.name!r} ({op.prim}) made {name!r} of shape {v.shape}; "
                                        f"the graph says {tensors[name].shape}")
                values[name] = v if v.dtype == dtypes[name] else v.astype(dtypes[name])
        return values if wanted is None else {t: values[t] for t in wanted}

    return run


def random_leaves(graph: OpGraph, seed: int = 0, scale: float = 0.02) -> dict[str, np.ndarray]:
    """Plausible values for every leaf of `graph`, for tests and benchmark runs.

    Float parameters and inputs are normal(0, scale) (norm scales 1 + that); integer
    inputs are uniform below the smallest bound their consumers imply (an embedding's
    vocabulary, a loss's class count); optimizer states are zeros, except fp32 master
    weights, which copy their parameter.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    masters: dict[str, str] = {}
    for op in graph.ops:
        if op.prim == "adam" and len(op.inputs) == 5:
            masters[op.inputs[2]] = op.inputs[0]
    for name in graph_leaves(graph):
        t = graph.tensors[name]
        dtype = jax.dtypes.canonicalize_dtype(t.dtype)
        if t.role == "optimizer_state":
            continue
        if t.is_float:
            x = rng.normal(0.0, scale, t.shape)
            if t.role == "param" and any(op.prim in ("layer_norm", "batch_norm") and op.inputs[1] == name
                                         for op in graph.consumers[name]):
                x += 1.0
            out[name] = x.astype(dtype)
        elif t.dtype == "bool":
            out[name] = rng.random(t.shape) < 0.5
        else:
            out[name] = rng.integers(0, _index_bound(graph, name), t.shape).astype(dtype)
    for name in graph_leaves(graph):
        t = graph.tensors[name]
        if t.role == "optimizer_state":
            src = masters.get(name)
            out[name] = (out[src].astype(np.float32) if src in out
                         else np.zeros(t.shape, jax.dtypes.canonicalize_dtype(t.dtype)))
    return out


def _index_bound(graph: OpGraph, name: str) -> int:
    """The smallest bound the integer tensor `name`'s readers imply (2 when none does)."""
    return max(1, min(_index_bounds(graph, name), default=2))


def _index_bounds(graph: OpGraph, name: str, depth: int = 0) -> list[int]:
    """Every bound `name`'s readers imply, following it through reshapes, broadcasts
    and integer elementwise ops (an imported loss normalises negative labels and
    reshapes them before its take_along)."""
    bounds = []
    for op in graph.consumers[name]:
        if op.prim in ("embedding", "embedding_grad") and op.inputs[1] == name:
            bounds.append(graph.tensors[op.inputs[0]].shape[0] if op.prim == "embedding" else op.param("vocab"))
        elif op.prim in ("softmax_cross_entropy", "softmax_cross_entropy_grad") and op.inputs[-1] == name:
            bounds.append(graph.tensors[op.inputs[-2]].shape[-1])
        elif op.prim == "take_along" and op.inputs[1] == name:
            bounds.append(graph.tensors[op.inputs[0]].shape[op.param("axis")])
        elif op.prim == "take_along_grad" and op.inputs[1] == name:
            bounds.append(op.param("size"))
        elif op.prim == "dropout_mask":     # row ids: any int32 draws its own row of the mask
            bounds.append(2**31 - 1)
        elif (op.prim in ("reshape", "broadcast", "elementwise", "select") and depth < 8
              and not graph.tensors[op.outputs[0]].is_float):
            bounds += _index_bounds(graph, op.outputs[0], depth + 1)
    return bounds

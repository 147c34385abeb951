"""The JAX importer's rule table: one handler per JAX primitive, onto alpasim's set.

Handlers receive the importer (which owns the graph builder), the jaxpr equation and
its operands (graph tensor names or constant `Splat`s) and return the values of the
equation's outputs. `SUPPORTED` is what `from_jax` accepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any


from ._primitives import LETTERS
from ._jax_values import JaxImportError, Splat, Value, dtype_name, py_scalar

if TYPE_CHECKING:
    from ._jax_import import _Importer

# ------------------------------------------------------------ primitive map
# JAX primitives that map onto one elementwise function each.
ELEMENTWISE_FNS = {
    "neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "logistic", "rsqrt": "rsqrt",
    "sqrt": "sqrt", "square": "square", "abs": "abs", "sign": "sign", "erf": "erf", "sin": "sin", "cos": "cos",
    "not": "not", "stop_gradient": "stop_gradient",
    "add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "max", "min": "min",
    "pow": "pow", "gt": "gt", "ge": "ge", "lt": "lt", "le": "le", "eq": "eq", "ne": "ne", "and": "and", "or": "or",
}
# Primitives that only change how XLA treats a value: the value passes through.
PASSTHROUGH = frozenset({"copy", "copy_p", "sharding_constraint", "reduce_precision", "optimization_barrier",
                          "pvary", "mesh_cast"})
# Call-like primitives whose body is inlined, and the param that holds it.
INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                     "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"})

# --------------------------------------------------------------- handlers
Handler = Callable[["_Importer", Any, list[Value]], list[Value]]
HANDLERS: dict[str, Handler] = {}


def _handles(*prims: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for p in prims:
            HANDLERS[p] = fn
        return fn
    return deco


def _aval(eqn: Any, i: int = 0) -> Any:
    return eqn.outvars[i].aval


def out_aval(eqn: Any) -> tuple[tuple[int, ...], str]:
    aval = _aval(eqn)
    return tuple(aval.shape), dtype_name(aval.dtype)


@_handles("dot_general")
def _dot_general(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    # Output layout as dot_general defines it: batch dims, lhs free dims, rhs free dims.
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = _aval(eqn)
    dtype = dtype_name(out.dtype)
    a, c = (imp.tensor(v) for v in ins)
    if imp.b.dtype(a) != imp.b.dtype(c):
        a, c = (x if imp.b.dtype(x) == dtype else imp.op("convert", [x], dtype=dtype) for x in (a, c))
    ra, rc_ = len(imp.b.shape(a)), len(imp.b.shape(c))
    letters = iter(LETTERS)
    ta = [next(letters) for _ in range(ra)]
    tc: list[str | None] = [None] * rc_
    for i, j in list(zip(lc, rc)) + list(zip(lb, rb)):
        tc[j] = ta[i]
    tc = [t or next(letters) for t in tc]
    res = ([ta[i] for i in lb] + [ta[i] for i in range(ra) if i not in lc and i not in lb]
           + [tc[j] for j in range(rc_) if j not in rc and j not in rb])
    kw = {"dtype": dtype} if dtype != imp.b.dtype(a) else {}
    return [imp.op("einsum", [a, c], name="einsum", equation=f"{''.join(ta)},{''.join(tc)}->{''.join(res)}", **kw)]


@_handles("conv_general_dilated")
def _conv(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    bad = {k: p[k] for k in ("lhs_dilation", "rhs_dilation") if any(d != 1 for d in p[k])}
    bad.update({k: p[k] for k in ("feature_group_count", "batch_group_count") if p[k] != 1})
    if len(lhs_spec) != 4:
        bad["spatial dims"] = len(lhs_spec) - 2
    if any(lo < 0 or hi < 0 for lo, hi in p["padding"]):
        bad["padding"] = p["padding"]
    if bad:
        raise JaxImportError(f"conv_general_dilated maps to conv2d only for 2-D convolutions without "
                             f"dilation or grouping and with non-negative padding; got {bad}")
    x, w = (imp.tensor(v) for v in ins)
    # Spec entries name (batch/out-feature, feature/in-feature, spatial...) axes.
    x = _transpose(imp, x, (lhs_spec[0], lhs_spec[2], lhs_spec[3], lhs_spec[1]))  # -> NHWC
    w = _transpose(imp, w, (rhs_spec[2], rhs_spec[3], rhs_spec[1], rhs_spec[0]))  # -> HWIO
    y = imp.op("conv2d", [x, w], name="conv2d", strides=tuple(p["window_strides"]),
               padding=tuple(tuple(int(v) for v in pad) for pad in p["padding"]))
    to_nhwc = {out_spec[0]: 0, out_spec[2]: 1, out_spec[3]: 2, out_spec[1]: 3}
    y = _transpose(imp, y, tuple(to_nhwc[j] for j in range(4)))
    return [_cast(imp, y, dtype_name(_aval(eqn).dtype))]


def _transpose(imp: _Importer, x: str, perm: Sequence[int]) -> str:
    """A transpose, composed with the transpose that made `x` (NCHW <-> NHWC round trips vanish)."""
    perm = tuple(int(i) for i in perm)
    if x in imp._perm:
        x, inner = imp._perm[x]
        perm = tuple(inner[i] for i in perm)
    if perm == tuple(range(len(perm))):
        return x
    out = imp.op("transpose", [x], perm=perm)
    imp._perm[out] = (x, perm)
    return out


def _cast(imp: _Importer, x: str, dtype: str) -> str:
    return x if imp.b.dtype(x) == dtype else imp.op("convert", [x], dtype=dtype)


@_handles("reduce_window_max")
def _max_pool(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    p = eqn.params
    window, strides, pad = p["window_dimensions"], p["window_strides"], p["padding"]
    pooled = {i for i in range(len(window)) if window[i] != 1 or strides[i] != 1 or tuple(pad[i]) != (0, 0)}
    dilated = any(d != 1 for d in tuple(p["base_dilation"]) + tuple(p["window_dilation"]))
    layout = next((perm for perm in ((0, 1, 2, 3), (0, 2, 3, 1)) if pooled <= set(perm[1:3])), None)
    if len(window) != 4 or dilated or layout is None:
        raise JaxImportError(f"reduce_window_max maps to max_pool only for undilated 2-D pooling over the H, W "
                             f"axes of NHWC or NCHW; got window {window}, strides {strides}")
    x = _transpose(imp, imp.tensor(ins[0]), layout)
    h, w = layout[1], layout[2]
    y = imp.op("max_pool", [x], name="max_pool", window=(window[h], window[w]), strides=(strides[h], strides[w]),
               padding=(tuple(pad[h]), tuple(pad[w])))
    inv = tuple(sorted(range(4), key=lambda i: layout[i]))
    return [_transpose(imp, y, inv)]


@_handles("gather")
def _gather(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    # Out-of-range ids (clipped or filled by JAX) are not modelled.
    dn, sizes = eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])
    if isinstance(ins[1], Splat):
        return [_static_gather(imp, eqn, imp.tensor(ins[0]), ins[1])]
    table, idx = (imp.tensor(v) for v in ins)
    t_shape, i_shape = imp.b.shape(table), imp.b.shape(idx)
    along = _take_along_axis(dn, sizes, len(t_shape), i_shape)
    if along is not None:
        return [imp.op("take_along", [table, imp.reshape(idx, i_shape[:-1])], name="take_along", axis=along)]
    row = _row_lookup_with_column_start(imp, dn, sizes, t_shape, idx)
    if row is not None:     # table[ids, 0:] (equinox's Embedding under vmap): the row index and a 0
        ids = imp.reshape(row, i_shape[:-1])
        out = imp.op("embedding", [table, ids], name="embedding")
        return [imp.reshape(out, tuple(_aval(eqn).shape))]
    axis = _take_axis(dn, sizes, t_shape, i_shape)
    if axis is None:
        raise JaxImportError(f"gather maps to embedding only as a lookup along one axis, table[ids] or "
                             f"jnp.take(table, ids, axis), with ids of any rank; got table {t_shape}, indices "
                             f"{i_shape}, {dn}, slice_sizes {sizes}")
    return [_take(imp, table, imp.reshape(idx, i_shape[:-1]), axis, sizes, dn)]


def _take_axis(dn: Any, sizes: tuple[int, ...], t_shape: tuple[int, ...], i_shape: tuple[int, ...]) -> int | None:
    """The axis of a gather that is `jnp.take(table, ids, axis)` (one index per position
    of `ids`, any rank, each picking one entry of `axis` and a slice of the other axes
    that starts at 0), else None. The picked axis may be kept as a unit axis."""
    if len(dn.start_index_map) != 1 or i_shape[-1:] != (1,) or getattr(dn, "operand_batching_dims", ()):
        return None
    (axis,) = dn.start_index_map
    collapsed = tuple(dn.collapsed_slice_dims)
    kept = sum(1 for d in range(len(t_shape)) if d not in collapsed)
    if sizes[axis] != 1 or collapsed not in ((), (axis,)) or len(dn.offset_dims) != kept:
        return None
    return axis


def _take(imp: _Importer, table: str, ids: str, axis: int, sizes: tuple[int, ...], dn: Any) -> str:
    """`jnp.take(table, ids, axis)` as an `embedding` of the table seen as rows: the
    sliced table with `axis` moved first and the other axes flattened (a reshape, free;
    a transpose only for an axis other than 0), looked up by `ids` of any rank, the
    rows unflattened and moved to where the gather puts its offset dims.

    Why this is the gather: entry (i, o) of the lookup is table'[ids[i], o], with o
    running over the other axes in order, which is the gather's output at index dims i
    and offset dims o. The lookup is priced as one (ids + 2 x output bytes, no FLOPs),
    its dims map shards the ids' axes and the row, and its backward is the embedding's
    (a scatter-add into the flattened table), reshaped back through the same views."""
    shape = imp.b.shape(table)
    rank, n_ids = len(shape), len(imp.b.shape(ids))
    others = [d for d in range(rank) if d != axis]
    table = _slice(imp, table, [0] * rank, [shape[axis] if d == axis else sizes[d] for d in range(rank)])
    rows = imp.reshape(_transpose(imp, table, [axis] + others), (shape[axis], math.prod(sizes[d] for d in others)))
    out = imp.op("embedding", [rows, ids], name="embedding")
    kept = tuple(sizes[d] for d in range(rank) if d not in dn.collapsed_slice_dims)
    out = imp.reshape(out, imp.b.shape(ids) + kept)
    # The lookup's axes are (ids..., offsets...); the gather puts offset k at offset_dims[k].
    offset_at = {int(o): n_ids + k for k, o in enumerate(dn.offset_dims)}
    batch = iter(range(n_ids))
    return _transpose(imp, out, [offset_at[p] if p in offset_at else next(batch) for p in range(n_ids + len(kept))])


def _row_lookup_with_column_start(imp: _Importer, dn: Any, sizes: tuple[int, ...], t_shape: tuple[int, ...],
                                  idx: str) -> str | None:
    """The row ids of a 2-D gather whose index vector is (row, constant 0) and whose
    slice is one whole row, else None. The index vector is a concatenation the
    importer made from the ids and a splat (`_Importer.concat_parts`)."""
    parts = imp.concat_parts.get(idx)
    if (len(t_shape) != 2 or tuple(dn.start_index_map) != (0, 1) or tuple(dn.collapsed_slice_dims)
            or getattr(dn, "operand_batching_dims", ()) or sizes != (1, t_shape[1]) or parts is None
            or len(parts) != 2):
        return None
    rows, cols = parts
    n = len(imp.b.shape(idx))
    if (isinstance(rows, Splat) or not isinstance(cols, Splat) or cols.value != 0
            or imp.b.shape(rows)[-1:] != (1,) or tuple(dn.offset_dims) != (n - 1, n)):
        return None
    return rows


def _take_along_axis(dn: Any, sizes: tuple[int, ...], rank: int, i_shape: tuple[int, ...]) -> int | None:
    """The axis of a gather that is `take_along_axis` (every other operand dim batched
    with the same index dim, one index per position, nothing sliced), else None."""
    if len(dn.start_index_map) != 1 or i_shape[-1:] != (1,) or len(i_shape) != rank + 1:
        return None
    (axis,) = dn.start_index_map
    others = tuple(d for d in range(rank) if d != axis)
    if (tuple(dn.collapsed_slice_dims) == (axis,) and not tuple(dn.offset_dims) and sizes == (1,) * rank
            and tuple(getattr(dn, "operand_batching_dims", ())) == others
            and tuple(getattr(dn, "start_indices_batching_dims", ())) == others):
        return axis
    return None


def _static_gather(imp: _Importer, eqn: Any, x: str, index: Splat) -> str:
    """A gather at constant indices (`x[..., 0]` through jnp.take): a slice, with the
    collapsed dims reshaped away."""
    dn, sizes = eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])
    shape = imp.b.shape(x)
    out = tuple(_aval(eqn).shape)
    if index.shape[:-1] or getattr(dn, "operand_batching_dims", ()):
        raise JaxImportError(f"gather at a constant index with index batch {index.shape[:-1]}: only a single "
                             f"constant start maps to a slice ({dn})")
    start = [0] * len(shape)
    for d in dn.start_index_map:
        start[d] = min(max(int(index.value), 0), shape[d] - sizes[d])   # JAX clamps the start
    kept = [d for d in range(len(shape)) if d not in dn.collapsed_slice_dims]
    if tuple(dn.offset_dims) != tuple(range(len(kept))) or tuple(sizes[d] for d in kept) != out:
        raise JaxImportError(f"gather at a constant index with offset dims {dn.offset_dims}: only slices in "
                             f"operand order map ({dn})")
    y = _slice(imp, x, start, [s + n for s, n in zip(start, sizes)])
    return imp.reshape(y, out)


@_handles("convert_element_type")
def _convert(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    dtype = dtype_name(eqn.params["new_dtype"])
    (x,) = ins
    return [x.cast(dtype) if isinstance(x, Splat) else _cast(imp, x, dtype)]


@_handles("broadcast_in_dim")
def _broadcast_in_dim(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    x, shape = ins[0], tuple(eqn.params["shape"])
    if isinstance(x, Splat):
        return [Splat(x.value, shape, x.dtype)]
    return [imp.broadcast(x, shape, eqn.params["broadcast_dimensions"])]


@_handles("reshape", "squeeze")
def _reshape(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        raise JaxImportError(f"reshape with dimensions={eqn.params['dimensions']} (a transposing reshape)")
    return [imp.reshape(ins[0], _aval(eqn).shape)]


@_handles("transpose")
def _transpose_prim(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    (x,) = ins
    if isinstance(x, Splat):
        return [Splat(x.value, tuple(_aval(eqn).shape), x.dtype)]
    return [_transpose(imp, x, eqn.params["permutation"])]


@_handles("reduce_sum", "reduce_max", "reduce_min")
def _reduce(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    kind = eqn.primitive.name.removeprefix("reduce_")
    (x,) = ins
    axes = tuple(int(a) for a in eqn.params["axes"])
    out_shape = tuple(_aval(eqn).shape)
    if isinstance(x, Splat):
        n = math.prod(x.shape[a] for a in axes)
        return [Splat(py_scalar(x.value * n if kind == "sum" else x.value, x.dtype), out_shape, x.dtype)]
    return [imp.op("reduce", [x], name=f"reduce_{kind}", kind=kind, axes=axes) if axes else x]


def _slice(imp: _Importer, x: str, start: Sequence[int], limit: Sequence[int]) -> str:
    start, limit = tuple(int(s) for s in start), tuple(int(e) for e in limit)
    if start == (0,) * len(start) and limit == imp.b.shape(x):
        return x
    return imp.op("slice", [x], name="slice", start=start, limit=limit)


@_handles("slice")
def _slice_prim(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    x = imp.tensor(ins[0])
    start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
    strides = eqn.params.get("strides") or (1,) * len(start)
    for axis, step in enumerate(strides):
        if step != 1:   # x[..., a:b:s]: split the axis into (n / s, s) and take one column
            x, start, limit = _strided(imp, x, axis, start, limit, int(step))
    return [_slice(imp, x, start, limit)]


def _strided(imp: _Importer, x: str, axis: int, start: list[int], limit: list[int], step: int):
    """`x` with the strided slice along `axis` done (reshape, slice, reshape), and the
    unit-stride starts and limits left for the other axes."""
    shape = imp.b.shape(x)
    n = shape[axis]
    if n % step:
        raise JaxImportError(f"slice with stride {step} along an axis of {n}: alpasim maps a strided slice "
                             f"only where the stride divides the axis")
    count = max(0, -(-(limit[axis] - start[axis]) // step))
    q0, r0 = divmod(start[axis], step)
    split = shape[:axis] + (n // step, step) + shape[axis + 1:]
    y = imp.reshape(x, split)
    lo = [0] * len(split)
    hi = list(split)
    lo[axis], hi[axis], lo[axis + 1], hi[axis + 1] = q0, q0 + count, r0, r0 + 1
    y = _slice(imp, y, lo, hi)
    y = imp.reshape(y, shape[:axis] + (count,) + shape[axis + 1:])
    start, limit = list(start), list(limit)
    start[axis], limit[axis] = 0, count
    return y, start, limit


@_handles("stack")
def _stack(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    return [imp.stack(ins, int(eqn.params["axis"]))]


@_handles("dynamic_slice")
def _dynamic_slice(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    x, starts = imp.tensor(ins[0]), ins[1:]
    if not all(isinstance(s, Splat) for s in starts):
        raise JaxImportError("dynamic_slice with traced start indices; only constant starts map to slice")
    sizes, shape = eqn.params["slice_sizes"], imp.b.shape(x)
    # JAX clamps starts so the slice stays in bounds.
    start = [min(max(int(s.value), 0), d - n) for s, d, n in zip(starts, shape, sizes)]
    return [_slice(imp, x, start, [s + n for s, n in zip(start, sizes)])]


@_handles("split")
def _split(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    x, axis = imp.tensor(ins[0]), int(eqn.params["axis"])
    shape, outs, offset = imp.b.shape(x), [], 0
    for n in eqn.params["sizes"]:
        start = [offset if i == axis else 0 for i in range(len(shape))]
        limit = [offset + int(n) if i == axis else d for i, d in enumerate(shape)]
        outs.append(_slice(imp, x, start, limit))
        offset += int(n)
    return outs


@_handles("concatenate")
def _concatenate(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    axis = int(eqn.params["dimension"])
    out = imp.concat([imp.tensor(v) for v in ins], axis)
    if axis == len(imp.b.shape(out)) - 1:
        imp.concat_parts[out] = list(ins)     # an index vector a gather may read
    return [out]


@_handles("pad")
def _pad(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    x, fill = imp.tensor(ins[0]), ins[1]
    config = [tuple(int(v) for v in c) for c in eqn.params["padding_config"]]
    if any(interior for _, _, interior in config) or not (isinstance(fill, Splat) and fill.value == 0):
        raise JaxImportError(f"pad maps to alpasim's pad only with zero fill and no interior padding; got "
                             f"padding_config {config}, fill {fill}")
    shape = imp.b.shape(x)
    # Negative padding crops: slice first, then pad with the non-negative part.
    x = _slice(imp, x, [max(-lo, 0) for lo, _, _ in config], [d - max(-hi, 0) for d, (_, hi, _) in zip(shape, config)])
    low, high = tuple(max(lo, 0) for lo, _, _ in config), tuple(max(hi, 0) for _, hi, _ in config)
    if any(low + high):
        x = imp.op("pad", [x], name="pad", low=low, high=high)
    return [x]


@_handles("iota")
def _iota(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    p = eqn.params
    return [imp.op("iota", [], name="iota", shape=tuple(p["shape"]), dimension=int(p["dimension"]),
                   dtype=dtype_name(p["dtype"]))]


@_handles("select_n")
def _select_n(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    pred, cases, out = ins[0], ins[1:], out_aval(eqn)
    if isinstance(pred, Splat):
        return [cases[int(pred.value)]]
    if len(cases) != 2:
        raise JaxImportError(f"select_n with {len(cases)} cases; only two-way selects map to select")
    if imp.b.dtype(pred) != "bool":
        pred = imp.ew("ne", [pred, Splat(0, (), imp.b.dtype(pred))], (imp.b.shape(pred), "bool"))
    # select_n(pred, on_false, on_true) is select(pred, on_true, on_false).
    return [imp.ew("select", [pred, cases[1], cases[0]], out)]


@_handles("clamp")
def _clamp(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    lo, x, hi = ins
    out = out_aval(eqn)
    return [imp.ew("min", [imp.ew("max", [x, lo], out), hi], out)]


@_handles("integer_pow")
def _integer_pow(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    y, (x,), out = int(eqn.params["y"]), ins, out_aval(eqn)
    if y == 1:
        return [x]
    if y in (2, -1):
        return [imp.ew("square" if y == 2 else "reciprocal", [x], out)]
    return [imp.ew("pow", [x, Splat(float(y), (), out[1])], out)]


# Unary JAX primitives written with supported functions: f(fn, *operands), floats are constants.
_COMPOSITE: dict[str, Callable[[Callable[..., Value], Value], Value]] = {
    "erfc": lambda f, x: f("sub", 1.0, f("erf", x)),
    "exp2": lambda f, x: f("exp", f("mul", x, math.log(2.0))),
    "log1p": lambda f, x: f("log", f("add", x, 1.0)),
    "expm1": lambda f, x: f("sub", f("exp", x), 1.0),
    "tan": lambda f, x: f("div", f("sin", x), f("cos", x)),
    "is_finite": lambda f, x: f("eq", f("sub", x, x), 0.0),  # inf - inf and nan - nan are nan
}


def _composite(imp: _Importer, eqn: Any, ins: list[Value]) -> list[Value]:
    (x,) = ins
    shape, dtype = out_aval(eqn)
    float_dtype = imp.b.dtype(x) if isinstance(x, str) else x.dtype

    def f(fn: str, *xs: Value | float) -> Value:
        xs = [Splat(py_scalar(v, float_dtype), (), float_dtype) if isinstance(v, float) else v for v in xs]
        return imp.ew(fn, xs, (shape, "bool" if fn == "eq" else float_dtype))

    return [_COMPOSITE[eqn.primitive.name](f, x)]


HANDLERS.update(dict.fromkeys(_COMPOSITE, _composite))

SUPPORTED: tuple[str, ...] = tuple(sorted(set(HANDLERS) | set(ELEMENTWISE_FNS) | PASSTHROUGH))

"""Rules of the data-movement primitives: broadcast, reshape, transpose, slice, pad, concatenate, iota, full."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ._prim_core import LETTERS, Primitive, dimmap, letter_run, need, register


# --------------------------------------------------------------- data movement
def _broadcast_infer(p, ins):
    x = ins[0]
    shape, dims = tuple(p["shape"]), tuple(p["dims"])
    need(len(dims) == x.rank, f"broadcast: dims {dims} must name one output axis per input axis {x.shape}")
    need(list(dims) == sorted(dims) and all(0 <= d < len(shape) for d in dims),
          f"broadcast: dims {dims} must be increasing axes of {shape}")
    for i, d in enumerate(dims):
        need(x.shape[i] in (1, shape[d]), f"broadcast: input axis {i} ({x.shape[i]}) cannot become {shape[d]}")
    return [(shape, x.dtype)]


def _broadcast_dims(p, ins, outs):
    x = ins[0]
    out = letter_run(len(p["shape"]))
    term = "".join(out[d] if x.shape[i] == p["shape"][d] else letter_run(1, len(out) + i)
                   for i, d in enumerate(p["dims"]))
    # An expanded size-1 axis has nothing to split; new output axes may be sharded.
    return dimmap([term], [out], list(ins) + list(outs), fixed="".join(c for c in term if c not in out))


register(Primitive("broadcast", "data_movement", _broadcast_infer, lambda p, ins, outs: 0.0, _broadcast_dims))


def _reshape_infer(p, ins):
    shape = tuple(p["shape"])
    need(math.prod(shape) == ins[0].size, f"reshape: cannot reshape {ins[0].shape} to {shape}")
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
    # of a group into k blocks is the same data layout on both sides. Axes of extent 1
    # hold no layout and are passed over: (b, s, 1, n, d) -> (b, s, n, d) keeps n's.
    src, dst = ins[0].shape, tuple(p["shape"])
    a, b = [""] * len(src), [""] * len(dst)
    fresh = iter(LETTERS)
    trailing = []
    for gi, gj in reshape_groups(src, dst):
        lead = next(fresh)
        first_i = next((i for i in gi if src[i] > 1), gi[0] if gi else None)
        first_j = next((j for j in gj if dst[j] > 1), gj[0] if gj else None)
        for i in gi:
            a[i] = lead if i == first_i else next(fresh)
        for j in gj:
            b[j] = lead if j == first_j else next(fresh)
        trailing += [a[i] for i in gi if i != first_i] + [b[j] for j in gj if j != first_j]
    return dimmap(["".join(a)], ["".join(b)], list(ins) + list(outs), fixed="".join(trailing))


register(Primitive("reshape", "data_movement", _reshape_infer, lambda p, ins, outs: 0.0, _reshape_dims))


def _transpose_infer(p, ins):
    perm = tuple(p["perm"])
    need(sorted(perm) == list(range(ins[0].rank)), f"transpose: {perm} is not a permutation of {ins[0].rank} axes")
    return [(tuple(ins[0].shape[i] for i in perm), ins[0].dtype)]


def _transpose_dims(p, ins, outs):
    full = letter_run(ins[0].rank)
    return dimmap([full], ["".join(full[i] for i in p["perm"])], list(ins) + list(outs))


register(Primitive("transpose", "data_movement", _transpose_infer, lambda p, ins, outs: 0.0, _transpose_dims))


def _slice_infer(p, ins):
    x = ins[0]
    start, limit = tuple(p["start"]), tuple(p["limit"])
    need(len(start) == len(limit) == x.rank, f"slice: start/limit must have rank {x.rank}")
    need(all(0 <= s <= e <= d for s, e, d in zip(start, limit, x.shape)),
          f"slice: [{start}, {limit}) out of bounds for {x.shape}")
    return [(tuple(e - s for s, e in zip(start, limit)), x.dtype)]


def _slice_dims(p, ins, outs):
    """Axes whose extent is unchanged share a letter; cut or padded axes do not."""
    x, y = ins[0], outs[0]
    a = letter_run(x.rank)
    b = "".join(c if x.shape[i] == y.shape[i] else letter_run(1, x.rank + i) for i, c in enumerate(a))
    cut = "".join(c for c in a + b if c not in a or c not in b)
    return dimmap([a], [b], list(ins) + list(outs), fixed=cut)


register(Primitive("slice", "data_movement", _slice_infer, lambda p, ins, outs: 0.0, _slice_dims))


def _pad_infer(p, ins):
    x = ins[0]
    lo, hi = tuple(p["low"]), tuple(p["high"])
    need(len(lo) == len(hi) == x.rank and min(lo + hi, default=0) >= 0, f"pad: bad low/high {lo} {hi}")
    return [(tuple(d + a + b for d, a, b in zip(x.shape, lo, hi)), x.dtype)]


register(Primitive("pad", "data_movement", _pad_infer, lambda p, ins, outs: 0.0, _slice_dims))


def _concat_infer(p, ins):
    axis = p["axis"] % ins[0].rank
    base = ins[0].shape
    for t in ins:
        need(t.rank == len(base) and all(t.shape[i] == base[i] for i in range(len(base)) if i != axis),
              f"concatenate: shapes {[t.shape for t in ins]} disagree off axis {axis}")
    shape = list(base)
    shape[axis] = sum(t.shape[axis] for t in ins)
    return [(tuple(shape), ins[0].dtype)]


def _concat_dims(p, ins, outs):
    rank = outs[0].rank
    axis = p["axis"] % rank
    full = letter_run(rank)
    other = lambda k: full[:axis] + letter_run(1, rank + k) + full[axis + 1:]  # noqa: E731
    return dimmap([other(k) for k in range(len(ins))], [other(len(ins))], list(ins) + list(outs),
                  fixed=letter_run(len(ins) + 1, rank))


register(Primitive("concatenate", "data_movement", _concat_infer, lambda p, ins, outs: 0.0, _concat_dims,
                    arity=(1, 2, 3, 4, 5, 6, 7, 8)))

register(Primitive("iota", "data_movement",
                    lambda p, ins: [(tuple(p["shape"]), p.get("dtype", "int32"))],
                    lambda p, ins, outs: 0.0,
                    lambda p, ins, outs: dimmap([], [letter_run(outs[0].rank)], list(outs)), arity=(0,)))
# A captured constant array (a RoPE table, a causal mask): its elements travel in the op's
# `data` param (base64 of the C-order bytes, `constant_array` reads them back).
register(Primitive("constant", "data_movement",
                    lambda p, ins: [(tuple(p["shape"]), p["dtype"])],
                    lambda p, ins, outs: 0.0,
                    lambda p, ins, outs: dimmap([], [letter_run(outs[0].rank)], list(outs)), arity=(0,)))
register(Primitive("full", "data_movement",
                    lambda p, ins: [(tuple(p["shape"]), p.get("dtype", "float32"))],
                    lambda p, ins, outs: 0.0,
                    lambda p, ins, outs: dimmap([], [letter_run(outs[0].rank)], list(outs)), arity=(0,)))


def constant_params(arr: np.ndarray) -> dict:
    """The params of a `constant` op holding `arr` (JSON-safe: the bytes in base64)."""
    arr = np.ascontiguousarray(arr)
    dtype = "bool" if arr.dtype == np.bool_ else arr.dtype.name
    return {"shape": tuple(int(d) for d in arr.shape), "dtype": dtype,
            "data": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii")}


def constant_array(params: Mapping) -> np.ndarray:
    """The array a `constant` op's params (`op.attrs`) hold (`constant_params`)."""
    dtype = np.dtype(np.bool_ if params["dtype"] == "bool" else params["dtype"]).newbyteorder("<")
    data = np.frombuffer(base64.b64decode(params["data"]), dtype)
    return data.reshape(tuple(params["shape"])).astype(dtype.newbyteorder("="))

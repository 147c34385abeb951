"""Rules of the network primitives: softmax, norms, embedding, loss, MoE gating, pooling, Adam."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

from ._prim_core import Primitive, dimmap, letter_run, need, register, same_letters
from ._prims_compute import conv_out


# -------------------------------------------------------- softmax and norms
def _axis_dims(p, ins, outs, axis_key="axis"):
    """All operands of the input's rank share letters; lower-rank ones take the trailing letters."""
    rank = ins[0].rank
    full = letter_run(rank)
    axis = p.get(axis_key, -1) % rank
    pick = lambda t: full[rank - t.rank:]  # noqa: E731
    return dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs), within=full[axis])


register(Primitive("softmax", "softmax", lambda p, ins: [(ins[0].shape, ins[0].dtype)],
                    lambda p, ins, outs: 5.0 * ins[0].size, _axis_dims))


# ------------------------------------------------------------------ dropout
def _dropout_mask_infer(p, ins):
    (rows,) = ins
    shape = tuple(p["shape"])
    need(len(shape) >= 1 and rows.shape == shape[:1] and not rows.is_float,
         f"dropout_mask: rows must be integer ids of shape {shape[:1]}, got {rows.dtype}{rows.shape}")
    need(0.0 < p["rate"] < 1.0, f"dropout_mask: rate must lie in (0, 1), got {p['rate']!r}")
    return [(shape, "bool")]


# A dropout mask drawn from a counter-based hash of (seed, the row's id, the element's
# place in its row), as GPU dropout draws Philox numbers from (seed, offset): the same
# element gets the same bit on any device and in any pass, so the backward and a
# recomputed forward regenerate it instead of keeping it. The row ids are data of the
# batch (`sample_index`), so a microbatch draws exactly its rows of the whole batch's
# mask. About 8 integer operations an element (murmur3's finaliser).
register(Primitive("dropout_mask", "elementwise", _dropout_mask_infer,
                    lambda p, ins, outs: 8.0 * outs[0].size,
                    lambda p, ins, outs: dimmap(["a"], ["a" + letter_run(outs[0].rank - 1, 1)],
                                                list(ins) + list(outs))))


def _softmax_grad_infer(p, ins):
    dy, y = ins
    need(dy.shape == y.shape, f"softmax_grad: cotangent {dy.shape} vs output {y.shape}")
    return [(y.shape, dy.dtype)]


register(Primitive("softmax_grad", "softmax", _softmax_grad_infer,
                    lambda p, ins, outs: 4.0 * ins[0].size, _axis_dims, arity=(2,)))


def _layer_norm_infer(p, ins):
    x, gamma, beta = ins
    need(gamma.shape == beta.shape == x.shape[-1:],
          f"layer_norm: scale {gamma.shape} and bias {beta.shape} must equal the last axis of {x.shape}")
    return [(x.shape, x.dtype)]


register(Primitive("layer_norm", "normalization", _layer_norm_infer,
                    lambda p, ins, outs: 8.0 * ins[0].size, _axis_dims, arity=(3,)))


def _layer_norm_grad_infer(p, ins):
    dy, x, gamma = ins
    need(dy.shape == x.shape and gamma.shape == x.shape[-1:], "layer_norm_grad: operand shapes disagree")
    return [(x.shape, dy.dtype), (gamma.shape, gamma.dtype), (gamma.shape, gamma.dtype)]


register(Primitive("layer_norm_grad", "normalization", _layer_norm_grad_infer,
                    lambda p, ins, outs: 12.0 * ins[0].size, _axis_dims, arity=(3,)))


def _bn_dims(p, ins, outs):
    # Batch norm reduces over N, H and W: all but the channel axis are reduced within.
    rank = ins[0].rank
    full = letter_run(rank)
    pick = lambda t: full if t.rank == rank else full[-1]  # noqa: E731
    return dimmap([pick(t) for t in ins], [pick(t) for t in outs], list(ins) + list(outs), within=full[:-1])


def _batch_norm_infer(p, ins):
    x, gamma, beta = ins
    need(gamma.shape == beta.shape == x.shape[-1:], f"batch_norm: scale/bias must be ({x.shape[-1]},)")
    return [(x.shape, x.dtype)]


register(Primitive("batch_norm", "normalization", _batch_norm_infer,
                    lambda p, ins, outs: 8.0 * ins[0].size, _bn_dims, arity=(3,)))


def _batch_norm_grad_infer(p, ins):
    dy, x, gamma = ins
    need(dy.shape == x.shape and gamma.shape == x.shape[-1:], "batch_norm_grad: operand shapes disagree")
    return [(x.shape, dy.dtype), (gamma.shape, gamma.dtype), (gamma.shape, gamma.dtype)]


register(Primitive("batch_norm_grad", "normalization", _batch_norm_grad_infer,
                    lambda p, ins, outs: 12.0 * ins[0].size, _bn_dims, arity=(3,)))


# ----------------------------------------------------------- embedding / loss
def _embedding_infer(p, ins):
    table, ids = ins
    need(table.rank == 2, f"embedding: table must be (vocab, hidden), got {table.shape}")
    need(not ids.is_float, f"embedding: ids must be integers, got {ids.dtype}")
    return [(ids.shape + table.shape[1:], table.dtype)]


def _embedding_dims(p, ins, outs):
    table, ids = ins
    idx = letter_run(ids.rank)
    v, h = letter_run(2, ids.rank)
    return dimmap([v + h, idx], [idx + h], list(ins) + list(outs))


register(Primitive("embedding", "embedding", _embedding_infer,
                    lambda p, ins, outs: 0.0, _embedding_dims, arity=(2,)))


def _embedding_grad_infer(p, ins):
    dy, ids = ins
    need(dy.shape[:-1] == ids.shape, f"embedding_grad: cotangent {dy.shape} vs ids {ids.shape}")
    return [((int(p["vocab"]), dy.shape[-1]), p.get("dtype", dy.dtype))]


def _embedding_grad_dims(p, ins, outs):
    dy, ids = ins
    idx = letter_run(ids.rank)
    v, h = letter_run(2, ids.rank)
    return dimmap([idx + h, idx], [v + h], list(ins) + list(outs))


register(Primitive("embedding_grad", "embedding", _embedding_grad_infer,
                    lambda p, ins, outs: float(ins[0].size), _embedding_grad_dims, arity=(2,)))


# take_along: out[..., k, ...] = x[..., idx[..., k, ...], ...] along `axis` (numpy's
# take_along_axis; optax's integer-label cross-entropy picks each label's logit so).
# The gathered axis is not sharded: each device would need every index's owner.
def _take_along_infer(p, ins):
    x, idx = ins
    axis = int(p["axis"])
    need(not idx.is_float and idx.rank == x.rank, f"take_along: indices {idx.shape} ({idx.dtype}) must be "
                                                  f"integers of the rank of {x.shape}")
    need(all(a == b for d, (a, b) in enumerate(zip(x.shape, idx.shape)) if d != axis),
         f"take_along: indices {idx.shape} and operand {x.shape} differ off axis {axis}")
    return [(idx.shape, x.dtype)]


def _take_along_terms(axis: int, rank: int) -> tuple[str, str, str]:
    """(operand letters, index letters, the unshardable letter) of take_along and its
    gradient: shared letters off `axis`, the gathered axis and the index axis apart.

    The gathered axis may be split, as Megatron-LM's vocabulary-parallel cross-entropy
    splits the logits: each device picks the entries its slice holds (zero elsewhere)
    and the partial results are summed (take_along), or each scatters into its own
    slice (the gradient). The index axis is not split."""
    full = letter_run(rank)
    v, k = letter_run(2, rank)
    return full[:axis] + v + full[axis + 1:], full[:axis] + k + full[axis + 1:], k


def _take_along_dims(p, ins, outs):
    x_term, i_term, fixed = _take_along_terms(int(p["axis"]), ins[0].rank)
    return dimmap([x_term, i_term], [i_term], list(ins) + list(outs), fixed=fixed)


register(Primitive("take_along", "embedding", _take_along_infer,
                    lambda p, ins, outs: 0.0, _take_along_dims, arity=(2,)))


def _take_along_grad_infer(p, ins):
    dy, idx = ins
    need(dy.shape == idx.shape, f"take_along_grad: cotangent {dy.shape} vs indices {idx.shape}")
    shape = list(dy.shape)
    shape[int(p["axis"])] = int(p["size"])
    return [(tuple(shape), dy.dtype)]


def _take_along_grad_dims(p, ins, outs):
    x_term, i_term, fixed = _take_along_terms(int(p["axis"]), ins[0].rank)
    return dimmap([i_term, i_term], [x_term], list(ins) + list(outs), fixed=fixed)


register(Primitive("take_along_grad", "embedding", _take_along_grad_infer,
                    lambda p, ins, outs: float(ins[0].size), _take_along_grad_dims, arity=(2,)))


# The loss primitives, each with the input it reads its logits from.
LOSS_LOGITS: Mapping[str, int] = MappingProxyType({"softmax_cross_entropy": 0, "softmax_cross_entropy_grad": 1})


def _xent_infer(p, ins):
    logits, labels = ins
    need(logits.shape[:-1] == labels.shape and not labels.is_float,
          f"softmax_cross_entropy: labels {labels.shape} ({labels.dtype}) must index logits {logits.shape}")
    return [((), "float32")]


def _xent_dims(p, ins, outs):
    # The class axis may be split, as Megatron's vocab-parallel loss splits it: each
    # token's max, sum of exponentials and target logit are then all-reduced across the
    # shards (priced by the strategies, `solvers._strategies.vocab_parallel`), and the
    # loss is whole on every shard (not a partial sum over classes).
    logits, labels = ins
    full = letter_run(logits.rank)
    return dimmap([full, full[:-1]], [""], list(ins) + list(outs))


register(Primitive("softmax_cross_entropy", "loss", _xent_infer,
                    lambda p, ins, outs: 6.0 * ins[0].size, _xent_dims, arity=(2,)))


def _xent_grad_infer(p, ins):
    dloss, logits, labels = ins
    need(dloss.rank == 0, "softmax_cross_entropy_grad: loss cotangent must be a scalar")
    return [(logits.shape, logits.dtype)]


def _xent_grad_dims(p, ins, outs):
    dloss, logits, labels = ins
    full = letter_run(logits.rank)
    return dimmap(["", full, full[:-1]], [full], list(ins) + list(outs))


register(Primitive("softmax_cross_entropy_grad", "loss", _xent_grad_infer,
                    lambda p, ins, outs: 6.0 * ins[1].size, _xent_grad_dims, arity=(3,)))


# ------------------------------------------------------------------ MoE gating
# top2_gating: GShard's (Alpa's benchmark MoE); topk_gating: k choices per token
# (Mixtral's top-2 over renormalised weights, DeepSeek's top-6 over raw softmax ones).
def _gating_infer(p, ins):
    gates = ins[0]
    need(gates.rank == 3, f"gating: gates must be (groups, group_size, experts), got {gates.shape}")
    g, s, e = gates.shape
    c = int(p["capacity"])
    need(c > 0, f"gating: capacity must be positive, got {c}")
    k = int(p.get("k", 2))
    need(1 <= k <= e, f"gating: k must be between 1 and the {e} experts, got {k}")
    return [((g, s, e, c), gates.dtype), ((g, s, e, c), gates.dtype)]


def _gating_dims(p, ins, outs):
    return dimmap(["gse"], ["gsec", "gsec"], list(ins) + list(outs), within="se")


def _gating_grad_infer(p, ins):
    dcombine, gates = ins
    g, s, e = gates.shape
    need(dcombine.shape == (g, s, e, int(p["capacity"])), "gating grad: cotangent shape mismatch")
    return [(gates.shape, gates.dtype)]


for _name in ("top2_gating", "topk_gating"):
    register(Primitive(_name, "gating", _gating_infer,
                        lambda p, ins, outs: 5.0 * int(p.get("k", 2)) * outs[0].size, _gating_dims))
    register(Primitive(f"{_name}_grad", "gating", _gating_grad_infer,
                        lambda p, ins, outs: 5.0 * int(p.get("k", 2)) * ins[0].size,
                        lambda p, ins, outs: dimmap(["gsec", "gse"], ["gse"], list(ins) + list(outs), within="se"),
                        arity=(2,)))


# ------------------------------------------------------------------- pooling
def _pool_geometry(p, x_shape):
    n, h, w, c = x_shape
    kh, kw = p["window"]
    sh, sw = p["strides"]
    pad = p.get("padding", ((0, 0), (0, 0)))
    return (n, conv_out(h, kh, sh, pad[0]), conv_out(w, kw, sw, pad[1]), c)


register(Primitive("max_pool", "pooling", lambda p, ins: [(_pool_geometry(p, ins[0].shape), ins[0].dtype)],
                    lambda p, ins, outs: float(outs[0].size * math.prod(p["window"])),
                    lambda p, ins, outs: dimmap(["nhwc"], ["nHWc"], list(ins) + list(outs), fixed="hwHW")))


def _pool_grad_infer(p, ins):
    dy, x = ins
    need(_pool_geometry(p, x.shape) == dy.shape, "max_pool_grad: cotangent does not match the pooled input")
    return [(x.shape, dy.dtype)]


register(Primitive("max_pool_grad", "pooling", _pool_grad_infer,
                    lambda p, ins, outs: float(ins[0].size * math.prod(p["window"])),
                    lambda p, ins, outs: dimmap(["nHWc", "nhwc"], ["nhwc"], list(ins) + list(outs), fixed="hwHW"),
                    arity=(2,)))


# ------------------------------------------------------------------ optimizer
def _adam_infer(p, ins):
    # (param, grad, m, v) or, with mixed precision, (param, grad, master, m, v).
    need(len(ins) in (4, 5), f"adam takes 4 or 5 operands, got {len(ins)}")
    shape = ins[0].shape
    need(all(t.shape == shape for t in ins), f"adam: operand shapes differ {[t.shape for t in ins]}")
    return [(t.shape, t.dtype) for t in ins if t is not ins[1]]


register(Primitive("adam", "optimizer", _adam_infer,
                    # ~12 FLOPs per element: two moment EMAs, bias corrections, rsqrt, update.
                    lambda p, ins, outs: 12.0 * ins[0].size,
                    lambda p, ins, outs: same_letters(ins, outs), arity=(4, 5)))

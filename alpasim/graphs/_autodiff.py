"""Training graphs: reverse-mode VJP rules per primitive, rematerialisation and Adam.

`training_graph(forward)` walks the forward ops backwards from the scalar loss and asks
each primitive's vector-Jacobian rule for the ops that carry cotangents to its inputs.
Every derived op records the forward op it comes from (`origin`) and that op's layer,
so a pipeline stage always holds the forward and the backward of the same layers.
Adam update ops follow, one per parameter, placed in the layer of the parameter's
first use. Planning therefore never needs JAX; `alpasim.backends` lowers both graphs to
JAX and the tests compare the derived gradients with `jax.grad`.

Rematerialisation is Megatron-LM's "full" activation recomputation: each layer keeps
only its inputs, and its whole forward (except ops tagged ``keep``, such as the
language-model head, which Megatron does not checkpoint) is recomputed just before its
backward. Recomputed ops have phase ``backward`` and ``remat=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._builder import GraphBuilder
from ._precision import PrecisionRecipe, get_recipe
from ._primitives import parse_einsum
from ._recompute import KERNEL_STASHES, RECOMPUTE_POLICIES, recompute_fusible
from ._types import Op, OpGraph, Tensor

HALF = frozenset({"float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """Adam hyperparameters carried as update-op params (they do not change costs)."""

    lr: float = 1e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


class AutodiffError(ValueError):
    """A forward graph with an op alpasim cannot differentiate (e.g. a gradient
    primitive written into the forward pass: second derivatives are not derived)."""


class _Ctx:
    """What a VJP rule may do: read forward values, emit ops, make zeros."""

    def __init__(self, b: GraphBuilder, fwd: OpGraph, remap: dict[str, str]) -> None:
        self.b = b
        self.fwd = fwd
        self.remap = remap

    def x(self, name: str) -> str:
        """The forward value of `name` (its recomputed copy under remat)."""
        return self.remap.get(name, name)

    def t(self, name: str) -> Tensor:
        return self.b.tensors[name]

    def zeros(self, like: str) -> str:
        t = self.b.tensors[like]
        return self.b.one("full", [], name="zeros", shape=t.shape, dtype=t.dtype, value=0.0)

    def ew(self, fn: str, *xs: str, **kw) -> str:
        return self.b.ew(fn, *xs, **kw)

    def scale(self, x: str, c: float) -> str:
        return self.b.ew("mul", x, scalar=float(c), scalar_pos=1)

    def cast(self, x: str, dtype: str) -> str:
        return x if self.b.dtype(x) == dtype else self.b.one("convert", [x], dtype=dtype)


Rule = Callable[[_Ctx, Op, list[str | None], list[bool]], list[str | None]]
VJP_RULES: dict[str, Rule] = {}


def _rule(*prims: str):
    def deco(fn: Rule) -> Rule:
        for p in prims:
            VJP_RULES[p] = fn
        return fn
    return deco


# ------------------------------------------------------------------- einsum
def _einsum_operand_grad(c: _Ctx, dy: str, out: str, other: str, other_term: str,
                         target: str, target_shape: tuple[int, ...], dtype: str) -> str:
    """Cotangent of one einsum operand: contract dy with the other operand."""
    keep = "".join(ch for ch in target if ch in out or ch in other_term)
    g = c.b.einsum(f"{out},{other_term}->{keep}", dy, other, name="einsum_grad")
    if keep != target:  # letters summed inside the operand alone: broadcast back
        dims = tuple(target.index(ch) for ch in keep)
        g = c.b.one("broadcast", [g], shape=target_shape, dims=dims)
    return c.cast(g, dtype)


@_rule("einsum")
def _einsum_vjp(c, op, cts, needs):
    (dy,) = cts
    (a_term, b_term), out = parse_einsum(op.param("equation"))
    a, b = op.inputs
    grads: list[str | None] = [None, None]
    if needs[0]:
        grads[0] = _einsum_operand_grad(c, dy, out, c.x(b), b_term, a_term, c.t(a).shape, c.t(a).dtype)
    if needs[1]:
        grads[1] = _einsum_operand_grad(c, dy, out, c.x(a), a_term, b_term, c.t(b).shape, c.t(b).dtype)
    return grads


# -------------------------------------------------------------------- conv
@_rule("conv2d")
def _conv_vjp(c, op, cts, needs):
    (dy,) = cts
    x, w = op.inputs
    geo = {"strides": op.param("strides", (1, 1)), "padding": op.param("padding", ((0, 0), (0, 0)))}
    dx = c.b.one("conv2d_input_grad", [dy, c.x(w)], input_shape=c.t(x).shape, **geo) if needs[0] else None
    dw = c.b.one("conv2d_filter_grad", [c.x(x), dy], filter_shape=c.t(w).shape, **geo) if needs[1] else None
    return [dx, dw]


@_rule("max_pool")
def _pool_vjp(c, op, cts, needs):
    return [c.b.one("max_pool_grad", [cts[0], c.x(op.inputs[0])], **op.attrs)]


# -------------------------------------------------------------- elementwise
def _elementwise_vjp(c: _Ctx, op: Op, cts, needs):
    grads = _elementwise_cotangents(c, op, cts, needs)
    # A rank-0 operand broadcasts against the others: its cotangent is the sum.
    for i, (t, g) in enumerate(zip(op.inputs, grads)):
        if g is not None and c.t(t).rank == 0 and c.b.shape(g):
            grads[i] = c.b.one("reduce", [g], kind="sum", axes=tuple(range(len(c.b.shape(g)))))
    return grads


def _elementwise_cotangents(c: _Ctx, op: Op, cts, needs):
    (dy,) = cts
    fn = op.param("fn")
    xs = [c.x(t) for t in op.inputs]
    y = c.x(op.outputs[0])
    scalar = op.param("scalar")
    spos = op.param("scalar_pos", 1)
    if scalar is not None:
        (x,) = xs
        if fn == "add":
            return [dy]
        if fn == "sub":
            return [dy if spos == 1 else c.ew("neg", dy)]
        if fn == "mul":
            return [c.scale(dy, scalar)]
        if fn == "div":
            if spos == 1:
                return [c.scale(dy, 1.0 / scalar)]
            return [c.ew("neg", c.ew("mul", dy, c.ew("div", y, x)))]  # d(c/x) = -c/x^2 = -y/x
        if fn == "pow":
            if spos == 1:  # x ** c
                return [c.ew("mul", dy, c.scale(c.ew("pow", x, scalar=scalar - 1.0, scalar_pos=1), scalar))]
            return [c.ew("mul", dy, c.scale(y, math.log(scalar)))]  # c ** x
        if fn in ("max", "min"):
            cmp = "gt" if fn == "max" else "lt"
            mask = c.ew(cmp, x, scalar=scalar, scalar_pos=1)
            return [c.ew("select", mask, dy, c.zeros(dy))]
        if fn in ELEMENTWISE_NO_GRAD:
            return [None]
        raise AutodiffError(f"elementwise {fn!r} with a scalar operand has no derivative rule")
    if fn in ELEMENTWISE_NO_GRAD:
        return [None] * len(xs)
    if fn == "add":
        return [dy, dy]
    if fn == "sub":
        return [dy, c.ew("neg", dy) if needs[1] else None]
    if fn == "mul":
        a, b = xs
        return [c.ew("mul", dy, b) if needs[0] else None, c.ew("mul", dy, a) if needs[1] else None]
    if fn == "div":
        a, b = xs
        da = c.ew("div", dy, b)
        return [da, c.ew("neg", c.ew("mul", da, c.ew("div", a, b))) if needs[1] else None]
    if fn in ("max", "min"):
        a, b = xs
        mask = c.ew("gt" if fn == "max" else "lt", a, b)
        zero = c.zeros(dy)
        return [c.ew("select", mask, dy, zero) if needs[0] else None,
                c.ew("select", mask, zero, dy) if needs[1] else None]
    if fn == "pow":
        a, b = xs
        da = c.ew("mul", dy, c.ew("mul", b, c.ew("div", y, a)))
        db = c.ew("mul", dy, c.ew("mul", y, c.ew("log", a))) if needs[1] else None
        return [da, db]
    if fn == "select":
        p, a, b = xs
        zero = c.zeros(dy)
        return [None, c.ew("select", p, dy, zero) if needs[1] else None,
                c.ew("select", p, zero, dy) if needs[2] else None]
    (x,) = xs
    if fn in ("identity",):
        return [dy]
    if fn == "neg":
        return [c.ew("neg", dy)]
    if fn == "exp":
        return [c.ew("mul", dy, y)]
    if fn == "log":
        return [c.ew("div", dy, x)]
    if fn == "tanh":
        return [c.ew("mul", dy, c.ew("sub", c.ew("square", y), scalar=1.0, scalar_pos=0))]
    if fn == "logistic":
        return [c.ew("mul", dy, c.ew("mul", y, c.ew("sub", y, scalar=1.0, scalar_pos=0)))]
    if fn == "relu":
        return [c.ew("relu_grad", dy, x)]
    if fn == "gelu":
        return [c.ew("gelu_grad", dy, x)]
    if fn == "rsqrt":
        return [c.ew("mul", dy, c.scale(c.ew("div", y, x), -0.5))]
    if fn == "sqrt":
        return [c.ew("div", c.scale(dy, 0.5), y)]
    if fn == "square":
        return [c.ew("mul", dy, c.scale(x, 2.0))]
    if fn == "abs":
        return [c.ew("mul", dy, c.ew("sign", x))]
    if fn == "reciprocal":
        return [c.ew("neg", c.ew("mul", dy, c.ew("square", y)))]
    if fn == "erf":
        bump = c.ew("exp", c.ew("neg", c.ew("square", x)))
        return [c.ew("mul", dy, c.scale(bump, 2.0 / math.sqrt(math.pi)))]
    if fn == "sin":
        return [c.ew("mul", dy, c.ew("cos", x))]
    if fn == "cos":
        return [c.ew("neg", c.ew("mul", dy, c.ew("sin", x)))]
    raise AutodiffError(f"elementwise {fn!r} has no derivative rule")


ELEMENTWISE_NO_GRAD = frozenset({"stop_gradient", "sign", "gt", "ge", "lt", "le", "eq", "ne", "and", "or",
                                 "not", "relu_grad", "gelu_grad"})
VJP_RULES["elementwise"] = _elementwise_vjp


@_rule("convert")
def _convert_vjp(c, op, cts, needs):
    return [c.cast(cts[0], c.t(op.inputs[0]).dtype)]


@_rule("bias_add")
def _bias_add_vjp(c, op, cts, needs):
    (dy,) = cts
    x, bias = op.inputs
    lead = c.t(x).rank - c.t(bias).rank
    db = None
    if needs[1]:
        db = c.b.one("reduce", [dy], name="bias_grad", kind="sum", axes=tuple(range(lead))) if lead else dy
        db = c.cast(db, c.t(bias).dtype)
    return [dy if needs[0] else None, db]


# ---------------------------------------------------------- shape and layout
def _axes(op: Op, rank: int) -> tuple[int, ...]:
    return tuple(sorted(a % rank for a in op.param("axes")))


@_rule("reduce")
def _reduce_vjp(c, op, cts, needs):
    (dy,) = cts
    x = op.inputs[0]
    shape = c.t(x).shape
    axes = _axes(op, len(shape))
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    bcast = c.b.one("broadcast", [dy], shape=shape, dims=kept)
    kind = op.param("kind")
    if kind == "sum":
        return [bcast]
    if kind == "mean":
        return [c.scale(bcast, 1.0 / math.prod(shape[a] for a in axes))]
    y = c.b.one("broadcast", [c.x(op.outputs[0])], shape=shape, dims=kept)
    mask = c.ew("eq", c.x(x), y)
    return [c.ew("select", mask, bcast, c.zeros(bcast))]


@_rule("broadcast")
def _broadcast_vjp(c, op, cts, needs):
    (dy,) = cts
    x = c.t(op.inputs[0])
    shape, dims = op.param("shape"), op.param("dims")
    summed = [d for d in range(len(shape)) if d not in dims]
    summed += [d for i, d in enumerate(dims) if x.shape[i] != shape[d]]
    g = c.b.one("reduce", [dy], kind="sum", axes=tuple(sorted(summed))) if summed else dy
    if c.b.shape(g) != x.shape:
        g = c.b.one("reshape", [g], shape=x.shape)
    return [g]


@_rule("reshape")
def _reshape_vjp(c, op, cts, needs):
    return [c.b.one("reshape", [cts[0]], shape=c.t(op.inputs[0]).shape)]


@_rule("transpose")
def _transpose_vjp(c, op, cts, needs):
    perm = op.param("perm")
    inv = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return [c.b.one("transpose", [cts[0]], perm=inv)]


@_rule("slice")
def _slice_vjp(c, op, cts, needs):
    shape = c.t(op.inputs[0]).shape
    start, limit = op.param("start"), op.param("limit")
    return [c.b.one("pad", [cts[0]], low=tuple(start), high=tuple(d - e for d, e in zip(shape, limit)))]


@_rule("pad")
def _pad_vjp(c, op, cts, needs):
    shape = c.t(op.inputs[0]).shape
    low = op.param("low")
    return [c.b.one("slice", [cts[0]], start=tuple(low), limit=tuple(a + d for a, d in zip(low, shape)))]


@_rule("concatenate")
def _concat_vjp(c, op, cts, needs):
    (dy,) = cts
    rank = c.t(op.inputs[0]).rank
    axis = op.param("axis") % rank
    out, offset = [], 0
    full = c.b.shape(dy)
    for t, need in zip(op.inputs, needs):
        n = c.t(t).shape[axis]
        if need:
            start = tuple(offset if i == axis else 0 for i in range(rank))
            limit = tuple(offset + n if i == axis else full[i] for i in range(rank))
            out.append(c.b.one("slice", [dy], start=start, limit=limit))
        else:
            out.append(None)
        offset += n
    return out


# --------------------------------------------------- softmax, norms, losses
@_rule("softmax")
def _softmax_vjp(c, op, cts, needs):
    return [c.b.one("softmax_grad", [cts[0], c.x(op.outputs[0])], axis=op.param("axis", -1),
                    scale=op.param("scale", 1.0))]


@_rule("layer_norm", "batch_norm")
def _norm_vjp(c, op, cts, needs):
    (dy,) = cts
    x, gamma, _ = op.inputs
    dx, dg, db = c.b.apply(f"{op.prim}_grad", [dy, c.x(x), c.x(gamma)], eps=op.param("eps", 1e-5))
    return [dx if needs[0] else None, dg if needs[1] else None, db if needs[2] else None]


@_rule("attention")
def _attention_vjp(c, op, cts, needs):
    # The log-sum-exp output is the kernel's residual for its backward, not a value the
    # loss reads (NONDIFF_OUTPUTS), so only the attention output carries a cotangent.
    dout = cts[0]
    if dout is None:
        return [None, None, None]
    q, k, v = op.inputs
    out, lse = op.outputs
    grads = c.b.apply("attention_grad", [dout, c.x(q), c.x(k), c.x(v), c.x(out), c.x(lse)], **op.attrs)
    return [g if need else None for g, need in zip(grads, needs)]


@_rule("embedding")
def _embedding_vjp(c, op, cts, needs):
    table, ids = op.inputs
    vocab = c.t(table).shape[0]
    return [c.b.one("embedding_grad", [cts[0], c.x(ids)], vocab=vocab, dtype=c.t(table).dtype), None]


@_rule("take_along")
def _take_along_vjp(c, op, cts, needs):
    x, idx = op.inputs
    axis = op.param("axis")
    return [c.b.one("take_along_grad", [cts[0], c.x(idx)], axis=axis, size=c.t(x).shape[axis]), None]


@_rule("softmax_cross_entropy")
def _xent_vjp(c, op, cts, needs):
    logits, labels = op.inputs
    return [c.b.one("softmax_cross_entropy_grad", [cts[0], c.x(logits), c.x(labels)]), None]


@_rule("top2_gating", "topk_gating")
def _gating_vjp(c, op, cts, needs):
    # The dispatch mask is piecewise constant in the gates: only the combine weights
    # carry a gradient (as in GShard's and Alpa's implementations).
    dcombine = cts[0]
    if dcombine is None:
        return [None]
    return [c.b.one(f"{op.prim}_grad", [dcombine, c.x(op.inputs[0])], **op.attrs)]


NO_INPUT_PRIMS = frozenset({"iota", "full", "constant"})


# ------------------------------------------------------------------- driver
# Outputs that are piecewise constant in the inputs and so carry no cotangent.
NONDIFF_OUTPUTS: dict[str, frozenset[int]] = {"top2_gating": frozenset({1}), "topk_gating": frozenset({1}),
                                               "attention": frozenset({1})}


def _needs_grad(fwd: OpGraph) -> set[str]:
    """Float tensors that depend on a float parameter (those that carry cotangents)."""
    live = {t.name for t in fwd.params if t.is_float}
    for op in fwd.ops:
        if op.prim == "elementwise" and op.param("fn") in ELEMENTWISE_NO_GRAD:
            continue
        if any(t in live for t in op.inputs):
            dead = NONDIFF_OUTPUTS.get(op.prim, frozenset())
            live.update(t for i, t in enumerate(op.outputs) if fwd.tensors[t].is_float and i not in dead)
    return live


def training_graph(forward: OpGraph, *, remat: bool = False, optimizer: AdamConfig | None = None,
                   name: str | None = None, precision: str | PrecisionRecipe | None = None,
                   recompute: str = "none", kernels: str = "per-op") -> OpGraph:
    """Forward graph with a scalar loss -> forward + backward + Adam update graph.

    `recompute`: "none" keeps every forward value a backward reads (eager frameworks,
    Megatron-LM); "fusible" keeps each layer's minimum cut and recomputes cheap ops in
    the backward (`_recompute`, as a fusing compiler does); "selective" also recomputes
    attention's QK^T and softmax, so no (s, s) tensor is stashed (Korthikanti et al.
    2022's selective recomputation). `kernels` ("per-op" or "fused",
    `_recompute.KERNEL_STASHES`): whether elementwise and normalisation chains run op by
    op, each keeping what its backward reads, or as hand-fused kernels that recompute
    their intermediates from their saved inputs ("fusible" already recomputes more).

    `precision` names the recipe (`_precision`, default mixed-fp32grad): under it a
    half-precision parameter's gradient is cast to fp32 as the backward produces it,
    and that fp32 tensor is the gradient the microbatches accumulate into and Adam
    reads."""
    recipe = get_recipe(precision)
    if recipe.weights == "float32":
        half = [t.name for t in forward.params if t.dtype in HALF]
        if half:
            raise ValueError(f"graph {forward.name!r}: precision {recipe.name!r} trains float32 weights, but "
                             f"parameter {half[0]!r} is {forward.tensors[half[0]].dtype}; build the model with "
                             f"dtype=float32")
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {recompute!r}")
    if kernels not in KERNEL_STASHES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_STASHES)}, got {kernels!r}")
    if len(forward.outputs) != 1 or forward.tensors[forward.outputs[0]].rank != 0:
        raise ValueError(f"graph {forward.name!r}: a training graph needs exactly one scalar output (the loss), "
                         f"got outputs {list(forward.outputs)}")
    if any(op.phase != "forward" for op in forward.ops):
        raise ValueError(f"graph {forward.name!r} already has backward or update ops")
    optimizer = optimizer or AdamConfig()
    loss = forward.outputs[0]
    b = GraphBuilder(name or forward.name)
    b.tensors.update(forward.tensors)
    b.ops.extend(forward.ops)
    b.inputs.extend(forward.inputs)
    b._op_names.update(op.name for op in forward.ops)
    for t in forward.tensors:
        b._names[t] = 1

    needs = _needs_grad(forward)
    remap: dict[str, str] = {}
    ctx = _Ctx(b, forward, remap)
    ct: dict[str, str | None] = {}
    carried: list[str] = []
    ct_layer: dict[str, int] = {}
    recomputed_layers: set[int] = set()

    loss_op = forward.producer[loss]
    with b.scope(phase="backward", layer=loss_op.layer, origin=loss_op.name):
        ct[loss] = b.one("full", [], name="loss_grad_seed", shape=(), dtype=forward.tensors[loss].dtype, value=1.0)

    for op in reversed(forward.ops):
        cts = [ct.get(t) for t in op.outputs]
        if all(g is None for g in cts) or op.prim in NO_INPUT_PRIMS:
            continue
        in_needs = [t in needs for t in op.inputs]
        if not any(in_needs):
            continue
        with b.scope(phase="backward", layer=op.layer, origin=op.name, tags=op.tags, prefix=f"{op.name}:"):
            if remat and op.layer not in recomputed_layers:
                recomputed_layers.add(op.layer)
                _recompute_layer(b, forward, op.layer, remap)
            cts = [g if g is not None else ctx.zeros(t) for g, t in zip(cts, op.outputs)]
            rule = VJP_RULES.get(op.prim)
            if rule is None:
                raise AutodiffError(f"op {op.name!r}: primitive {op.prim!r} cannot be differentiated; "
                                    f"differentiable primitives: {', '.join(sorted(VJP_RULES))}")
            grads = rule(ctx, op, cts, in_needs)
            for t, g, need in zip(op.inputs, grads, in_needs):
                if g is None or not need:
                    continue
                if forward.tensors[t].role == "param":
                    _tag_producer(b, g, t)
                prev = ct.get(t)
                if prev is not None and forward.tensors[t].role == "param" and ct_layer[t] != op.layer:
                    carried.append(prev)    # a tied copy's contribution, handed across layers
                ct[t] = g if prev is None else b.ew("add", prev, g, name="grad_acc")
                ct_layer[t] = op.layer
            for t in dict.fromkeys(op.inputs):
                # The parameter's last contribution (its first use): cast its gradient to
                # the accumulator's dtype now, as frameworks add each microbatch's
                # gradient into it as soon as it is complete.
                if t in ct and forward.tensors[t].role == "param" and forward.consumers[t][0] is op:
                    want = recipe.grad_dtype(forward.tensors[t].dtype)
                    if b.tensors[ct[t]].dtype != want:
                        # After the backward, the cast is a pass that also adds into the
                        # accumulator (`graphs._precision`, DeepSpeed's BF16_Optimizer).
                        after = {"accumulate": True} if recipe.accumulation == "after-backward" else {}
                        ct[t] = b.one("convert", [ct[t]], name=f"{t}:grad_cast", dtype=want, **after)

    graph = _append_updates(b, forward, ct, optimizer, loss, recipe, carried)
    graph.meta["kernels"] = kernels
    if recompute == "fusible":
        return recompute_fusible(graph)
    if recompute == "selective" or kernels == "fused":
        return recompute_fusible(graph, selective=recompute == "selective", kernels=kernels)
    return graph


# An op's output k that is parameter p's gradient (or a contribution to it) carries the
# tag "weight_grad:k:p": its partial sums are accumulated over the microbatches and
# synchronised once per iteration, whatever dtype the gradient is then kept in, and a
# layout rule for p's gradient applies to it.
WEIGHT_GRAD_TAG = "weight_grad"


def _tag_producer(b: GraphBuilder, tensor: str, param: str) -> None:
    for i in range(len(b.ops) - 1, -1, -1):
        if tensor in b.ops[i].outputs:
            k = b.ops[i].outputs.index(tensor)
            b.ops[i] = b.ops[i].replace(tags=b.ops[i].tags | {f"{WEIGHT_GRAD_TAG}:{k}:{param}"})
            return


def weight_grad_params(op: Op) -> dict[int, str]:
    """Output index -> the parameter whose gradient (contribution) that output is."""
    out = {}
    for tag in op.tags:
        if tag.startswith(WEIGHT_GRAD_TAG + ":"):
            _, k, param = tag.split(":", 2)
            out[int(k)] = param
    return out


def is_weight_grad(op: Op, k: int, tensors) -> bool:
    """Whether output `k` of `op` is a parameter's gradient or a contribution to it."""
    return tensors[op.outputs[k]].role == "grad" or k in weight_grad_params(op)


def makes_weight_grad(op: Op, tensors) -> bool:
    """Whether any output of `op` is a parameter's gradient or a contribution to it."""
    return any(is_weight_grad(op, k, tensors) for k in range(len(op.outputs)))


def in_weight_pass(backward: Sequence[Op], tensors) -> list[bool]:
    """For each op of `backward` (in order): whether a zero-bubble schedule runs it in
    its W pass (Qi et al. 2024). W holds the ops that make only weight gradients and
    every op that reads what they make (casts, sums); the rest is B, which the previous
    stage waits for (an op that also makes an input gradient, a norm's backward, stays
    in B). The planner prices this split and the runtimes run it."""
    made: set[str] = set()
    out = []
    for op in backward:
        weight = bool(op.outputs) and (all(is_weight_grad(op, k, tensors) for k in range(len(op.outputs)))
                                       or any(t in made for t in op.inputs))
        if weight:
            made.update(op.outputs)
        out.append(weight)
    return out


def _recompute_layer(b: GraphBuilder, fwd: OpGraph, layer: int, remap: dict[str, str]) -> None:
    """Re-emit the forward ops of `layer` (except `keep` ops) reading recomputed values."""
    for op in fwd.ops:
        if op.layer != layer or "keep" in op.tags:
            continue
        ins = [remap.get(t, t) for t in op.inputs]
        with b.scope(remat=True, origin=op.name, tags=op.tags, prefix=""):
            outs = b.apply(op.prim, ins, name=f"{op.name}:remat", out_names=[f"{t}:remat" for t in op.outputs],
                           **op.attrs)
        remap.update(zip(op.outputs, outs))


def _append_updates(b: GraphBuilder, fwd: OpGraph, ct: dict[str, str | None], opt: AdamConfig,
                    loss: str, recipe: PrecisionRecipe, carried: list[str]) -> OpGraph:
    outputs = [loss]
    hyper = {"lr": opt.lr, "b1": opt.b1, "b2": opt.b2, "eps": opt.eps, "weight_decay": opt.weight_decay}
    for p in fwd.params:
        g = ct.get(p.name)
        if g is None:
            continue
        first_use = fwd.consumers[p.name][0]
        if b.tensors[g].role == "activation" and g not in fwd.tensors:
            b.tensors[g] = Tensor(g, b.tensors[g].shape, b.tensors[g].dtype, "grad")
        with b.scope(phase="update", layer=first_use.layer, origin=first_use.name, tags=()):
            ins = [p.name, g]
            out_names = [f"{p.name}:new"]
            roles = ["param"]
            if p.dtype in HALF:
                ins.append(b.state(f"{p.name}:master", p.shape, "float32"))
                out_names.append(f"{p.name}:master:new")
                roles.append("optimizer_state")
            ins += [b.state(f"{p.name}:adam_m", p.shape, "float32"), b.state(f"{p.name}:adam_v", p.shape, "float32")]
            out_names += [f"{p.name}:adam_m:new", f"{p.name}:adam_v:new"]
            roles += ["optimizer_state", "optimizer_state"]
            outs = b.apply("adam", ins, name=f"adam:{p.name}", out_names=out_names, **hyper)
            for o, role in zip(outs, roles):
                t = b.tensors[o]
                b.tensors[o] = Tensor(o, t.shape, t.dtype, role)
            outputs += outs
    meta = dict(fwd.meta)
    meta["training"] = True
    meta["precision"] = recipe.name
    # Gradient contributions of a parameter used in two layers (tied embeddings), made in
    # one layer's backward and summed in the other's: the stage-memory model carries them.
    meta["tied_grads"] = sorted(carried)
    return b.build(outputs, meta)


def tied_param(graph: OpGraph, grad: str) -> str | None:
    """The parameter whose optimizer step reads the tied gradient contribution `grad`
    (a `meta["tied_grads"]` tensor) or a sum it is part of; None if none in `graph` does."""
    by_grad = {op.inputs[1]: op.inputs[0] for op in graph.ops if op.prim == "adam"}
    todo, seen = [grad], set()
    while todo:
        x = todo.pop()
        if x in by_grad:
            return by_grad[x]
        if x not in seen:
            seen.add(x)
            todo += [o for op in graph.consumers.get(x, ()) for o in op.outputs]
    return None

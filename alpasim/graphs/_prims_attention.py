"""Fused attention: softmax(scale * Q K^T, causal mask) V as one kernel, and its gradient.

What every large training run since 2023 runs (FlashAttention 2, Dao 2023; FlashAttention
3, Shah et al. 2024; cuDNN's fused attention, which Transformer Engine, and so
Megatron-core, calls): the (s, s) scores and probabilities live in on-chip memory one
tile at a time and never reach HBM. The forward writes the output and, per query, the
log-sum-exp of its scores (float32), which the backward reads to recompute the
probabilities tile by tile.

`attention` takes q, k, v and an `equation` in einsum letters, e.g. GPT's
``bnqd,bnkd,bnkd->bnqd`` or grouped-query attention's ``bqgrd,bkgd,bkgd->bqgrd`` (r
query heads share each of g KV heads). The letters `q`, `k` and `d` are reserved: query
positions, key positions, head dimension. Outputs: the attention output (q's letters)
and the log-sum-exp (q's letters without d, float32). `attention_grad` takes
(dout, q, k, v, out, lse) and returns (dq, dk, dv).

FLOPs are the model's, as for explicit attention (and Megatron-LM's formula, which
counts attention whole): forward 4 * (batch letters) * q * k * d, two matmuls; the
backward twice that. What a kernel executes differs (a causal kernel skips the tiles
above the diagonal; the backward recomputes Q K^T), and is priced by the cost model
(`alpasim.costmodels._attention`), so a plan's FLOP rate compares across kernels.

Dimensions: the batch and head letters shard freely (no communication: each head
attends alone); q, k and d do not (splitting k or d leaves partial softmax sums, and
splitting q is context parallelism, which needs the KV exchange priced).
"""

from __future__ import annotations

import dataclasses
import math

from ._prim_core import Primitive, dimmap, need, register
from ._prims_compute import parse_einsum

RESERVED = "qkd"


def attention_terms(equation: str) -> tuple[str, str, str]:
    """(q term, k term, v term) of an attention equation, checked (module doc)."""
    ins, out = parse_einsum(equation)
    need(len(ins) == 3, f"attention equation {equation!r} takes q, k, v: three terms")
    q, k, v = ins
    need(out == q, f"attention equation {equation!r}: the output has q's letters")
    need(k == v, f"attention equation {equation!r}: k and v have the same letters")
    need(q[-1] == "d" and k[-1] == "d" and "q" in q and "k" in k and "q" not in k and "k" not in q,
         f"attention equation {equation!r}: q's term has 'q' and k's 'k' (positions), both end in 'd' (head dim)")
    need(set(k) - {"k"} <= set(q), f"attention equation {equation!r}: k's batch and head letters are q's")
    return q, k, v


def lse_term(q_term: str) -> str:
    return q_term.replace("d", "")


def _sizes(equation: str, ins) -> dict[str, int]:
    terms = attention_terms(equation)
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ins):
        need(len(term) == t.rank, f"attention {equation!r}: operand {t.name!r} has shape {t.shape}, "
                                  f"term {term!r} expects rank {len(term)}")
        for c, n in zip(term, t.shape):
            need(sizes.setdefault(c, n) == n, f"attention {equation!r}: letter {c!r} is {sizes[c]} and {n}")
    return sizes


def attention_forward_flops(p, ins) -> float:
    """Under context parallelism (attribute `context_parallel`, cp) each query chunk
    attends to the keys of all cp chunks: cp times its own chunk's products."""
    sizes = _sizes(p["equation"], ins[:3])
    batch = math.prod(n for c, n in sizes.items() if c not in RESERVED)
    return 4.0 * batch * sizes["q"] * sizes["k"] * sizes["d"] * p.get("context_parallel", 1)


def _infer(p, ins):
    q_term, _, _ = attention_terms(p["equation"])
    _sizes(p["equation"], ins)
    q = ins[0]
    return [(q.shape, q.dtype), (tuple(n for c, n in zip(q_term, q.shape) if c != "d"), "float32")]


def _dims(p, ins, outs):
    q, k, v = attention_terms(p["equation"])
    return dimmap([q, k, v], [q, lse_term(q)], list(ins) + list(outs), fixed=RESERVED)


register(Primitive("attention", "attention", _infer, lambda p, ins, outs: attention_forward_flops(p, ins), _dims,
                   arity=(3,), heavy=True))


def _grad_infer(p, ins):
    dout, q, k, v, out, lse = ins
    q_term, _, _ = attention_terms(p["equation"])
    _sizes(p["equation"], [q, k, v])
    need(dout.shape == out.shape == q.shape, f"attention_grad: dout {dout.shape}, out {out.shape} and q {q.shape} differ")
    need(lse.shape == tuple(n for c, n in zip(q_term, q.shape) if c != "d"),
         f"attention_grad: lse {lse.shape} does not match q {q.shape}")
    return [(q.shape, dout.dtype), (k.shape, dout.dtype), (v.shape, dout.dtype)]


def _grad_dims(p, ins, outs):
    q, k, v = attention_terms(p["equation"])
    return dimmap([q, q, k, v, q, lse_term(q)], [q, k, v], list(ins) + list(outs), fixed=RESERVED)


register(Primitive("attention_grad", "attention", _grad_infer,
                   lambda p, ins, outs: 2.0 * attention_forward_flops(p, ins[1:4]), _grad_dims,
                   arity=(6,), heavy=True))


# ------------------------------------------------------------------ builders
ATTENTION_KERNELS = ("explicit", "fused")


def check_attention_kernel(cfg) -> None:
    """A model config's `attention`: "explicit" (scores and probabilities as (s, s)
    tensors, einsum-softmax-einsum: Megatron-LM to 2022, Alpa) or "fused" (one kernel)."""
    if cfg.attention not in ATTENTION_KERNELS:
        raise ValueError(f"{cfg.family}: attention must be one of {', '.join(ATTENTION_KERNELS)}, "
                         f"got {cfg.attention!r}")


def check_context_parallel(cfg) -> None:
    """A config's `context_parallel` (one rank's view, `context_parallel_view`): a
    positive integer; above 1 only with the fused kernel (the KV all-gather form runs
    the fused kernel on each chunk) and an even chunk (two halves per rank)."""
    cp = cfg.context_parallel
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"{cfg.family}: context_parallel must be a positive integer, got {cp!r}")
    if cp > 1 and cfg.attention != "fused":
        raise ValueError(f"{cfg.family}: context parallelism runs the fused attention kernel on each chunk; "
                         f"attention is {cfg.attention!r}")
    if cp > 1 and cfg.seq % 2:
        raise ValueError(f"{cfg.family}: a context-parallel chunk of {cfg.seq} positions does not split into "
                         f"two halves (load balancing)")


def context_parallel_view(cfg, cp: int):
    """One rank's view of `cfg` (a whole-sequence zoo config with `context_parallel`)
    under context parallelism of degree `cp`, as Llama 3 ran it (Llama Team 2024, sec.
    3.3.2) and Transformer Engine's `AttnFuncWithCPAndKVAllGather` runs it: each
    sequence is cut into 2 cp chunks and rank i holds chunks i and 2 cp - 1 - i, so that
    every rank does the same share of causal attention. Each rank computes every token
    op on its s / cp positions, all-gathers K and V over the cp group before its
    attention kernel, and in the backward gathers them again and reduce-scatters dK and
    dV (`solvers._context_parallel` prices those). So the view is the model at
    sequence s / cp with cp times the sequences (the chunks), whose attention ops carry
    `context_parallel`: their FLOPs and kernel time are those of whole sequences,
    1 / cp a chunk."""
    why = context_parallel_refusal(cfg, cp)
    if why:
        raise ValueError(why)
    return dataclasses.replace(cfg, seq=cfg.seq // cp, batch=cfg.batch * cp, context_parallel=cp)


def context_parallel_refusal(cfg, cp: int) -> str:
    """Why `cfg` has no context-parallel view of degree `cp` whatever its attention
    kernel ("" if it has one); the kernel is checked when the view is built."""
    if not hasattr(cfg, "context_parallel"):
        return f"context parallelism is built for Llama models (RoPE, no position table); {cfg.family} is not one"
    if cfg.context_parallel != 1:
        return f"{cfg.family}: already a context-parallel view (cp {cfg.context_parallel})"
    if cfg.seq % (2 * cp):
        return f"{cfg.family}: sequence {cfg.seq} does not cut into 2 x cp = {2 * cp} equal chunks"
    return ""


def attention_core(b, kernel: str, equation: str, q: str, k: str, v: str, *, scores: str, scale: float,
                   causal: bool, dropout: float = 0.0, context_parallel: int = 1) -> str:
    """softmax(scale * q k^T) v on a builder, as `kernel` computes it: "fused", the
    `attention` op (its log-sum-exp stays for the backward); "explicit", the scores
    (letters `scores`: q's batch and head letters, q and k), a softmax, dropout of the
    probabilities at rate `dropout` (Megatron's `attention_dropout`; inside the fused
    kernel it is no op), and the context. `context_parallel` > 1 (fused only): the
    op's keys span that many chunks (`context_parallel_view`)."""
    if kernel == "fused":
        extra = {"context_parallel": context_parallel} if context_parallel > 1 else {}
        out, _ = b.apply("attention", [q, k, v], name="attention", out_names=["attention", "attention_lse"],
                         equation=equation, scale=scale, causal=causal, **extra)
        return out
    q_term, k_term, v_term = attention_terms(equation)
    s = b.einsum(f"{q_term},{k_term}->{scores}", q, k, name="scores")
    probs = b.one("softmax", [s], name="softmax", axis=-1, scale=scale, causal=causal)
    probs = b.dropout(probs, dropout, "probs_dropout")
    return b.einsum(f"{scores},{v_term}->{q_term}", probs, v, name="context")


def attention_geometry(op, tensors) -> tuple[int, int, int, int, bool]:
    """(batch x heads, query positions, key positions, head dim, causal) of an
    `attention` or `attention_grad` op, whole (not per shard). A context-parallel op's
    (`context_parallel_view`) is its whole sequences': cp chunks of cp times the
    positions each, so that a shard of it is priced as its share of whole-sequence
    kernels (load-balanced causal chunks do the same share each)."""
    q_name = op.inputs[0] if op.prim == "attention" else op.inputs[1]
    q_term, k_term, _ = attention_terms(op.attrs["equation"])
    q_sizes = dict(zip(q_term, tensors[q_name].shape))
    k_name = op.inputs[1] if op.prim == "attention" else op.inputs[2]
    k_len = dict(zip(k_term, tensors[k_name].shape))["k"]
    batch = math.prod(n for c, n in q_sizes.items() if c not in RESERVED)
    cp = op.attrs.get("context_parallel", 1)
    whole = batch // cp if batch % cp == 0 else batch / cp    # a part of a sequence's chunks: its share
    return whole, q_sizes["q"] * cp, k_len * cp, q_sizes["d"], bool(op.attrs.get("causal"))

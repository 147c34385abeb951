"""Recompute-fusible: stash the least, recompute cheap ops inside the backward.

A backward reads forward values: a matmul's weight gradient its input, a GeLU's
gradient its input, a division's gradient both operands. Kept as they are, those reads
make the stash depend on how finely the model is written: a built-in GeLU is one op
whose gradient reads its input, while `jax.nn.gelu` traced into the graph is ten ops
whose gradients read six full-size intermediates. A compiler that fuses the backward
(torch.compile's min-cut partitioner, Chen et al. 2016's checkpointing applied to cheap
ops) instead keeps a minimum set of tensors and recomputes the rest inside the
backward's fused kernels, where recomputing an elementwise chain costs no extra memory
traffic.

`recompute_fusible(graph)` does that per layer, as a minimum cut (`selective=True` is
the "selective" policy: the same cut over attention's score path alone; see there;
`kernels="fused"` is what hand-fused kernels recompute, below):

* **Recomputable**: a forward value of the layer made by an elementwise, layout,
  normalisation or softmax op (`RECOMPUTABLE_PRIMS`) from values that are themselves
  recomputable or kept. Reductions, contractions, gathers and the loss are never
  recomputed (a reduction would reread its whole input; a matmul is the expensive
  work), so their outputs are kept when the backward needs them.
* **Free**: parameters, constants and values another layer's backward keeps anyway.
* **Cut**: the set of kept values of least total bytes from which every value the
  layer's backward reads is free, kept, or recomputable (max-flow/min-cut over a
  split-node graph, networkx). Ties go to values the backward reads directly, so a
  one-op built-in kernel whose output is needed keeps that output rather than its input.
* **Rewrite**: every value the backward reads and the cut does not keep is recomputed by
  copies of its forward ops (``<op>:recompute``, phase backward, ``remat=True``) placed
  just before their first reader, and the backward reads the copies.

The result is a training graph like any other: liveness, fusion pricing, the solvers
and the JAX runtime read it as it is, so what is priced is what runs. Full
rematerialisation (`remat=True`) already recomputes whole layers; this pass then only
touches what remat keeps (the language-model head).

**Kernels** (`KERNEL_STASHES`). A graph written op by op (Llama's RMSNorm as a cast, a
mean of squares, an rsqrt and three products; SwiGLU as a sigmoid and two products;
RoPE as broadcast tables and a rotation) stashes every intermediate an op's backward
reads when each op is its own kernel ("per-op": JAX's autodiff keeps them as residuals,
and XLA's fusion does not change what a program's outputs are). The systems that train
such models on GPUs run those chains as hand-fused kernels instead, and a fused
kernel's backward recomputes its intermediates from the inputs it saved ("fused"):
Transformer Engine's RMSNorm and LayerNorm save their input and the inverse standard
deviation (`transformer_engine/pytorch/module/layernorm_linear.py`, `rmsnorm_fwd`
returns `rsigma`, saved for `rmsnorm_bwd`), Megatron-core's fused bias-SwiGLU saves its
input (`megatron/core/fusions/fused_bias_swiglu.py`, `SwiGLUFunction.forward` saves
`input` alone), and fused RoPE saves only the frequencies
(`megatron/core/models/common/embeddings/rope_utils.py`, `fused_apply_rotary_pos_emb`).
What a GEMM, attention, normalisation or softmax kernel's backward reads stays saved,
as each such module saves its own inputs (the column-parallel linear after a norm saves
the norm's output; the second MLP GEMM saves SwiGLU's output). So under "fused" a value
is recomputable only where every backward reader of it is an elementwise op of the
chain; a hidden-state dropout's mask is never redrawn (Megatron's fused
bias-dropout-add saves it), only selective recomputation redraws attention's.
"""

from __future__ import annotations

from ._types import Op, OpGraph, Tensor

RECOMPUTE_POLICIES = ("none", "fusible", "selective")
# How elementwise and normalisation chains run (module doc, "Kernels").
KERNEL_STASHES = ("per-op", "fused")
RECOMPUTABLE_PRIMS = frozenset({
    "elementwise", "broadcast", "reshape", "transpose", "convert", "bias_add", "slice", "pad", "concatenate",
    "iota", "full", "layer_norm", "softmax", "dropout_mask",
})
# Capacity units per byte: the low units break ties toward values the backward reads.
_SCALE = 1 << 8


def expanding_contraction(op: Op, tensors) -> bool:
    """A contraction of two activations whose result is larger than both together:
    attention's scores QK^T, (b, a, s, s) from two (b, s, h), much memory for little
    compute (2 head-size FLOPs an element). A matmul with a weight (an MLP's first
    projection, the logits) also expands, but recomputing it is the layer's real work."""
    return (op.prim == "einsum" and all(tensors[t].role == "activation" for t in op.inputs)
            and tensors[op.outputs[0]].size > sum(tensors[t].size for t in op.inputs))


def recompute_fusible(graph: OpGraph, selective: bool = False, kernels: str | None = None) -> OpGraph:
    """`graph` (a training graph) with each layer's stash cut to its minimum (module doc).

    `kernels="fused"` cuts over what hand-fused kernels recompute (module doc,
    "Kernels"): with `selective`, attention's core as well; without, that alone (the
    "none" policy run as fused kernels). Unset, `selective=False` is the "fusible"
    policy.

    `selective` instead recomputes only attention's core: expanding contractions
    (`expanding_contraction`) and the cheap ops downstream of them (the softmax, its
    mask and scale, the dropout of its probabilities and that dropout's mask). That is
    Korthikanti et al. 2022's selective activation recomputation (Megatron-LM's
    `--recompute-granularity selective`): QK^T and the softmax run again in the
    backward, so no (s, s) tensor is stashed, and every other value is kept as under
    "none", but values of no inputs (a `full` of zeros) that a recomputed core op
    reads, which are made again; found by structure, so it applies to imported graphs
    too."""
    import networkx as nx

    producer, consumers, tensors = graph.producer, graph.consumers, graph.tensors
    fwd_of = {t: op for t, op in producer.items() if op.phase == "forward"}
    # Forward values read by each layer's backward, and by any other layer's.
    read_by: dict[int, set[str]] = {}
    for op in graph.ops:
        if op.phase == "backward":
            for t in op.inputs:
                if t in fwd_of:
                    read_by.setdefault(op.layer, set()).add(t)
    kept_elsewhere = {t for layer, ts in read_by.items() for t in ts if fwd_of[t].layer != layer}

    # Attention's core, in one pass in op order: the outputs of an expanding
    # contraction, and of a cheap op of the same layer that reads one.
    core: set[str] = set()
    for op in graph.ops:
        if op.phase == "forward" and (expanding_contraction(op, tensors) or op.prim in RECOMPUTABLE_PRIMS and any(
                u in core and fwd_of[u].layer == op.layer for u in op.inputs)):
            core.update(op.outputs)
    # A dropout mask the core applies is drawn again with it, as Megatron's RNG tracker
    # replays it inside the recomputed core; the hidden states' masks stay kept.
    for op in graph.ops:
        if op.phase == "forward" and op.prim == "dropout_mask" and any(
                u in core for c in consumers[op.outputs[0]] for u in c.inputs):
            core.update(op.outputs)

    if kernels not in (None, *KERNEL_STASHES):
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_STASHES)}, got {kernels!r}")
    fused = kernels == "fused"
    # Under fused kernels: what a kernel other than an elementwise chain's reads in the
    # backward (a GEMM's input, a norm's, attention's) is saved by that kernel.
    saved = {t for op in graph.ops if op.phase == "backward" and op.prim not in RECOMPUTABLE_PRIMS
             for t in op.inputs if t in fwd_of} if fused else set()

    def recomputable(t: str, layer: int) -> bool:
        p = fwd_of.get(t)
        if p is None or p.layer != layer or t in kept_elsewhere:
            return False
        if selective and (t in core or not p.inputs and p.prim in RECOMPUTABLE_PRIMS):
            # Selective: the core, and values of no inputs (a `full` of zeros) that a
            # recomputed core op reads: made again rather than kept.
            return True
        if fused:
            return p.prim in RECOMPUTABLE_PRIMS and p.prim != "dropout_mask" and t not in saved
        return not selective and p.prim in RECOMPUTABLE_PRIMS

    def free(t: str) -> bool:
        return t not in producer or producer[t].prim == "constant" or t in kept_elsewhere

    plans: dict[int, set[str]] = {}           # layer -> values its backward recomputes
    for layer, needed in read_by.items():
        wanted = {t for t in needed if fwd_of[t].layer == layer and recomputable(t, layer)}
        if not wanted:
            continue
        g = nx.DiGraph()
        seen: set[str] = set()
        stack = list(wanted)
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            # ("in", t) on the source side: t is made by the forward; ("out", t) on the
            # sink side: t is there in the backward. Cutting in -> out keeps t.
            direct = t in needed
            if free(t):
                g.add_edge("src", ("in", t))
                g.add_edge(("in", t), ("out", t), capacity=0)
                continue
            g.add_edge(("in", t), ("out", t), capacity=tensors[t].nbytes * _SCALE + (0 if direct else 1))
            if direct:
                g.add_edge(("out", t), "sink")
            if recomputable(t, layer):
                for u in producer[t].inputs:
                    g.add_edge(("out", u), ("in", t))
                    stack.append(u)
            else:
                g.add_edge("src", ("in", t))
        if "sink" not in g or "src" not in g:
            continue
        _, (reach, _) = nx.minimum_cut(g, "src", "sink")
        kept = {t for t in seen if ("in", t) in reach and ("out", t) not in reach}
        recompute = {t for t in seen if ("out", t) not in reach and t not in kept}
        if recompute & needed:
            plans[layer] = recompute
    policy = "selective" if selective else "none" if fused else "fusible"
    return _rewrite(graph, plans, fwd_of, policy) if plans else graph


def _rewrite(graph: OpGraph, plans: dict[int, set[str]], fwd_of: dict[str, Op], policy: str) -> OpGraph:
    tensors = dict(graph.tensors)
    copies: dict[tuple[int, str], str] = {}
    ops: list[Op] = []
    names = set(graph.op_by_name)

    def value(t: str, layer: int) -> str:
        if t not in plans[layer]:
            return t
        key = (layer, t)
        if key not in copies:
            op = fwd_of[t]
            ins = tuple(value(u, layer) for u in op.inputs)
            outs = tuple(f"{x}:recompute" for x in op.outputs)
            for x, y in zip(op.outputs, outs):
                src = tensors[x]
                tensors[y] = Tensor(y, src.shape, src.dtype, src.role)
            name = f"{op.name}:recompute"
            while name in names:
                name += "'"
            names.add(name)
            ops.append(op.replace(name=name, inputs=ins, outputs=outs, phase="backward", layer=layer,
                                  origin=op.name, remat=True))
            for x, y in zip(op.outputs, outs):
                copies[(layer, x)] = y
        return copies[key]

    for op in graph.ops:
        if op.phase == "backward" and op.layer in plans and any(t in plans[op.layer] for t in op.inputs):
            op = op.replace(inputs=tuple(value(t, op.layer) for t in op.inputs))
        ops.append(op)
    meta = {**graph.meta, "recompute": policy}
    return graph.replace(tensors=tensors, ops=ops, meta=meta)

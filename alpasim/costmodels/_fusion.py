"""Kernel fusion: which ops run as one kernel, and what each then moves through HBM.

XLA fuses chains of elementwise ops, broadcasts, layout changes and reductions into
single kernels, whose intermediates stay in registers and never reach device memory.
An imported JAX graph spells a LayerNorm or a GeLU as ten small ops where a built-in
graph has one; priced op by op it would pay ten memory round trips and ten launches,
and hold ten intermediates live. Both are priced here as the fused kernel XLA (or a
hand-written fused kernel, as Megatron-LM's) runs:

* **Fusible** ops (`FUSIBLE_PRIMS`): elementwise, broadcast, reshape, transpose,
  convert, bias_add, reduce, slice, pad, concatenate, iota, full and the normalisation
  and softmax kernels with their gradients. Everything else (contractions,
  convolutions, gathers and scatters, pooling, batch norm, the optimizer, gating) is a
  kernel boundary.
* **Kernels**: fusible ops joined greedily, in graph order, along producer-consumer
  edges within one (layer, phase) — the units the planner schedules. A join is refused
  when the kernel would stop being convex: when an op outside it that it reads from
  descends from one of its members (a path out through a matmul and back in), so it
  would wait on its own output. Ancestry is a bitmask per op.
* **Traffic**: a kernel reads each external input once and writes each output that
  something outside it (or the graph's caller) reads once; a reshape is a view and
  aliases its input. Each member op is charged the reads it makes first and the writes
  of its own outputs, so summing members prices the kernel; the first member pays the
  launch. An op alone in its kernel is charged as before, less duplicate reads.
* **Memory**: a kernel's internal tensors are never allocated (`internal`), which the
  stage liveness uses.

Ignored: XLA's limits on what one kernel may hold (a reduction followed by a broadcast
of it may split into two kernels that both read the input; new Triton-based fusions
make many of those one kernel again), epilogue fusion into GEMMs (cuBLASLt's bias and
GeLU epilogues), multi-output sibling fusion of kernels that only share inputs, and
duplication of a cheap producer into several consumer kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from alpasim.graphs import LOSS_LOGITS, RECOMPUTABLE_PRIMS, OpGraph

# What the backward may recompute is fusible; so are reductions, the gradient kernels
# of the normalisation and softmax ops, and the loss.
FUSIBLE_PRIMS = RECOMPUTABLE_PRIMS | {
    "reduce", "softmax_grad", "layer_norm_grad", "softmax_cross_entropy", "softmax_cross_entropy_grad",
}
# Ops whose output is a view of their input: no kernel, no traffic.
VIEW_PRIMS = frozenset({"reshape"})


def accumulating_cast(op) -> bool:
    """A gradient's cast marked to add into its accumulator after the backward
    (`graphs.PrecisionRecipe.accumulation` "after-backward", DeepSpeed's BF16_Optimizer:
    `hp_grad.add_(lp.grad.to(fp32))` per parameter, two PyTorch kernels of their own): a
    kernel boundary, priced by `_compute.accumulate_bytes`."""
    return op.prim == "convert" and bool(op.param("accumulate"))


def unfused_loss(op) -> bool:
    """A cross-entropy marked to run as Megatron's unfused fp32 kernels
    (`graphs.with_loss_kernel`): a kernel boundary, priced by `_compute.loss_bytes`."""
    return op.prim in LOSS_LOGITS and op.param("kernel") == "unfused-fp32"


@dataclass(frozen=True, slots=True)
class OpAccess:
    """What one op is charged inside its kernel: HBM bytes, and whether it launches it."""

    nbytes: int
    launch: bool


@dataclass(frozen=True, slots=True)
class Fusion:
    """The kernels of a graph (tuples of op names, in graph order) and per-op charges."""

    kernels: tuple[tuple[str, ...], ...]
    kernel_of: Mapping[str, int]
    access: Mapping[str, OpAccess]
    internal: frozenset[str]            # tensors that live only inside one kernel

    def of(self, op_name: str) -> OpAccess | None:
        return self.access.get(op_name)


def fuse(graph: OpGraph) -> Fusion:
    """Kernels, per-op HBM charges and internal tensors of `graph` (module doc),
    computed once per graph object (graphs are not changed after construction)."""
    cached = graph.__dict__.get(_CACHE)
    if cached is None:
        cached = graph.__dict__[_CACHE] = _fuse(graph)
    return cached


_CACHE = "_costmodels_fusion"


def _fuse(graph: OpGraph) -> Fusion:
    producer = graph.producer
    index = graph.op_index
    fusible = {op.name: op.prim in FUSIBLE_PRIMS and not unfused_loss(op) and not accumulating_cast(op)
               for op in graph.ops}
    anc: dict[str, int] = {}              # op -> bitmask (over op indices) of its ancestors
    parent: dict[str, str] = {op.name: op.name for op in graph.ops}
    members: dict[str, int] = {}          # kernel root -> bitmask of its ops
    feeders: dict[str, set[str]] = {}     # kernel root -> ops outside it that it reads from

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for op in graph.ops:
        inputs = list(dict.fromkeys(p.name for p in (producer.get(t) for t in op.inputs) if p is not None))
        mask = 0
        for p in inputs:
            mask |= anc[p] | (1 << index[p])
        anc[op.name] = mask
        if not fusible[op.name]:
            continue
        members[op.name], feeders[op.name] = 1 << index[op.name], set(inputs)
        for p in inputs:
            q = graph.op_by_name[p]
            if not fusible[p] or (q.layer, q.phase) != (op.layer, op.phase):
                continue
            a, b = find(op.name), find(p)
            if a == b:
                continue
            merged = members[a] | members[b]
            outside = {w for w in feeders[a] | feeders[b] if not (merged >> index[w]) & 1}
            # Convex: no op outside the kernel descends from a member (a path out and back).
            if any(anc[w] & merged for w in outside):
                continue
            parent[b] = a
            members[a], feeders[a] = merged, outside
            del members[b], feeders[b]

    groups: dict[str, list[str]] = {}
    for op in graph.ops:
        if fusible[op.name]:
            groups.setdefault(find(op.name), []).append(op.name)
    kernels = tuple(tuple(names) for names in groups.values())
    kernel_of = {name: k for k, names in enumerate(kernels) for name in names}

    def root(t: str) -> str:
        """The buffer a tensor is a view of (through reshapes)."""
        while (p := producer.get(t)) is not None and p.prim in VIEW_PRIMS:
            t = p.inputs[0]
        return t

    outputs = set(graph.outputs)

    def read_outside(t: str, k: int) -> bool:
        """Is `t` (or a view of it) read by an op outside kernel `k`, or returned?"""
        if t in outputs:
            return True
        for c in graph.consumers.get(t, ()):
            if kernel_of.get(c.name) != k:
                return True
            if c.prim in VIEW_PRIMS and read_outside(c.outputs[0], k):
                return True
        return False

    tensors = graph.tensors
    access: dict[str, OpAccess] = {}
    internal: set[str] = set()
    for k, names in enumerate(kernels):
        charged: set[str] = set()
        first = True
        for name in names:
            op = graph.op_by_name[name]
            if op.prim in VIEW_PRIMS:
                access[name] = OpAccess(0, False)
                continue
            nbytes = 0
            for t in op.inputs:
                r = root(t)
                p = producer.get(r)
                if (p is not None and kernel_of.get(p.name) == k) or r in charged:
                    continue
                charged.add(r)
                nbytes += tensors[t].nbytes
            for t in op.outputs:
                if read_outside(t, k):
                    nbytes += tensors[t].nbytes
                else:
                    internal.add(t)
            access[name] = OpAccess(nbytes, first)
            first = False
        for name in names:   # a view of an internal tensor is internal too (in order: views of views)
            op = graph.op_by_name[name]
            if op.prim in VIEW_PRIMS and op.inputs[0] in internal and not read_outside(op.outputs[0], k):
                internal.add(op.outputs[0])
    return Fusion(kernels, kernel_of, access, frozenset(internal))

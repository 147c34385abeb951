"""Per-device memory of a pipeline stage as its schedule runs it, from tensor liveness.

One microbatch of one layer (its forward ops, then its backward ops; the update runs
after the last microbatch and is not part of this) keeps an *activation* — any tensor
that is not a parameter, gradient or optimizer state — live from the op that writes it
(a tensor the layer receives: from the first op that reads it, i.e. from its arrival;
a cotangent it receives: from the start of its backward, recomputation included)
to the last op of the layer that reads it, except what the forward keeps for the
backward (the *stash*): it lives to the end of the backward. A stage's backward is one
compiled program and the stash is among its arguments; XLA never reuses an argument's
buffer for a temporary and frees it only when the program returns (the JAX backend
and Alpa's runtime run a stage this way; a framework that frees each saved tensor at
its last read, as PyTorch's autograd does, needs less, by at most the stashes of the
layers whose backward has finished). A forward result handed on (to the next
layer or stage) lives to the end of the layer's forward; a cotangent handed back to the
previous layer lives to the end of the layer's backward. An elementwise op (or a cast or
reshape) whose operand dies there writes into that operand's buffer. A value that lives
only inside one fused kernel (`_fusion`) is never allocated. A gradient made by
a contraction or reduction is a buffer of its own at the op that makes it (it is then
added into the persistent accumulator). An op whose sharding plan splits a loop it
contracts or reduces over a mesh axis (a row-parallel matmul, a weight gradient summed
over the data-parallel axis) first writes its whole *unreduced partial* result on each
device, in the layout of its uncontracted loops, and its all-reduce or reduce-scatter
writes the reduced result into a buffer of its own (a collective is a new value, not
an in-place op): at that op the partial (the collective's input, `nbytes` of the
strategy's collectives) is live next to the output and every other live tensor. This
term depends on the op's strategy, so the planner adds it (`solvers._intra_problem`:
one candidate peak per such op); one device has no partials. From that one pass:

    stash s_l  = bytes live across the layer's forward -> backward boundary (what the
                 microbatch keeps for its backward: with full remat only the layer input)
    peak  p_l  = the most bytes live at any op of the layer (s_l included)

A stage of layers k..i runs, per microbatch, F_k .. F_i then B_i .. B_k. The stage's
stash S = sum_l s_l is held through the whole backward, and while layer j runs in it
the layer adds its working set beyond its own stash, so one microbatch peaks at

    P = S + max_j (p_j - s_j)          S = sum_l s_l

(the forward, where only the stashes of layers before j exist, never exceeds this).
Under 1F1B (and GPipe) with w = min(stages from this one to the end, B) microbatches
in flight, the other w - 1 each hold S while one runs (seed eq. 5, made exact):

    total = params + grads + optimizer + max(w * S + (P - S), update) + buffers

`transient_bytes` is P - S (the running layer's working set beyond the stashes); the
buffers are what a layer keeps outside the graph (ZeRO-3's gathered parameters); the
update term is the optimizer step's own working set (copies in the layouts Adam reads
and writes when they differ from the stored ones), held when no activation is.
This is Korthikanti et al. 2022 section 4 evaluated on our op set instead of written by
hand: with full recompute S is the layer inputs (their 2sbh per layer) and P - S the
one recomputed layer's working set; without it S is their 34sbh + 5as^2b less the
dropout masks our graphs do not have.

Ignored: allocator fragmentation, workspaces inside an op (cuBLAS, attention kernels),
the framework's and CUDA's context, and a handed-on tensor that the producing layer's
backward also reads (it is counted in both layers' stash: an over-count, never under).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from alpasim.graphs import OpGraph

from ._fusion import fuse

PERSISTENT_ROLES = frozenset({"param", "grad", "optimizer_state"})
# Ops that can write their result into an operand's buffer when that operand dies there
# and has the result's size (XLA's buffer assignment shares them; frameworks run such
# ops in place): the operand's lifetime then ends one op earlier.
IN_PLACE_PRIMS = frozenset({"elementwise", "bias_add", "convert", "reshape"})


@dataclass(frozen=True, slots=True)
class Liveness:
    """Activation lifetimes of one layer graph's forward + backward ops.

    `intervals[t] = (first, last)` op indices (into `order`) between which `t` is live;
    `boundary` is the index of the last forward op (-1 when there is none)."""

    order: tuple[int, ...]                       # indices into graph.ops of the ops run per microbatch
    intervals: Mapping[str, tuple[int, int]]
    boundary: int

    def stash(self) -> list[str]:
        """Tensors live across the forward -> backward boundary."""
        b = self.boundary
        return [t for t, (s, e) in self.intervals.items() if s <= b < e]

    def live_sets(self) -> list[list[str]]:
        """The tensors live at each op where one dies: the candidates for the peak."""
        points = sorted({e for _, e in self.intervals.values()})
        return [[t for t, (s, e) in self.intervals.items() if s <= p <= e] for p in points]


def is_activation(graph: OpGraph, name: str) -> bool:
    return graph.tensors[name].role not in PERSISTENT_ROLES and not name.endswith(":new")


def _made_then_added(graph: OpGraph, op, t: str) -> bool:
    """A microbatch's gradient made by a contraction or reduction (not an elementwise op,
    which adds into the accumulator in place): a buffer of its own at the op that makes
    it, added into the accumulator right after."""
    return graph.tensors[t].role == "grad" and op.phase == "backward" and op.prim not in IN_PLACE_PRIMS


def liveness(graph: OpGraph) -> Liveness:
    """Lifetimes of the activations of `graph` under the rules of the module docstring.

    A tied copy's gradient contribution that `graph` receives from another layer
    (`meta["tied_grads"]`) is not counted here: from another stage it arrives summed,
    once per iteration, into the gradient accumulator; from the same stage
    `one_microbatch_peak`'s carries count it."""
    order = tuple(i for i, op in enumerate(graph.ops) if op.phase != "update")
    boundary = max((n for n, i in enumerate(order) if graph.ops[i].phase == "forward"), default=-1)
    end = len(order) - 1
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    produced_in_forward: set[str] = set()
    produced = {t for i in order for t in graph.ops[i].outputs}
    carried = set(graph.meta.get("tied_grads", ())) - produced
    for n, i in enumerate(order):
        op = graph.ops[i]
        for t in op.inputs:
            if is_activation(graph, t) and t not in carried:
                first.setdefault(t, n)
                last[t] = n
        for t in op.outputs:
            if is_activation(graph, t) or _made_then_added(graph, op, t):
                first.setdefault(t, n)
                last.setdefault(t, n)
                if op.phase == "forward":
                    produced_in_forward.add(t)
    for t in graph.outputs:
        if t in first:
            last[t] = max(last[t], boundary if t in produced_in_forward else end)
    for t, n in first.items():
        if n > boundary and t not in produced:
            first[t] = boundary + 1     # a cotangent arrives before the layer's backward starts
        elif n <= boundary < last[t]:
            last[t] = end               # a stash is an argument of the backward: held until it returns
    dropped: set[str] = set()
    for n, i in enumerate(order):
        op = graph.ops[i]
        if op.prim not in IN_PLACE_PRIMS or len(op.outputs) != 1 or not is_activation(graph, op.outputs[0]):
            continue
        size = graph.tensors[op.outputs[0]].nbytes
        for t in dict.fromkeys(op.inputs):
            if t in first and last[t] == n and t not in dropped and graph.tensors[t].nbytes == size \
                    and t not in op.outputs:
                if first[t] == n:
                    dropped.add(t)     # arrived for this op alone: it lives on in the sender's count
                else:
                    last[t] = n - 1
                break
    internal = fuse(graph).internal     # inside one fused kernel: never in device memory
    return Liveness(order, {t: (first[t], last[t]) for t in first if t not in dropped and t not in internal},
                    boundary)


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """One microbatch of one layer: what it stashes for its backward and its peak."""

    stash_bytes: float
    peak_bytes: float


def layer_memory(graph: OpGraph, bytes_of: Callable[[str], float] | None = None) -> LayerMemory:
    """`LayerMemory` of a layer graph; `bytes_of(t)` gives a tensor's bytes per device
    (default: its whole size, one device)."""
    size = bytes_of or (lambda t: float(graph.tensors[t].nbytes))
    live = liveness(graph)
    stash = float(sum(size(t) for t in live.stash()))
    n = len(live.order)
    delta = np.zeros(n + 1)
    for t, (s, e) in live.intervals.items():
        b = size(t)
        delta[s] += b
        delta[e + 1] -= b
    peak = float(np.cumsum(delta[:n]).max()) if n else 0.0
    return LayerMemory(stash, max(peak, stash))


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Per-device bytes of one stage under its schedule (formula: module docstring)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    stash_bytes: float          # per microbatch in flight
    inflight: int
    transient_bytes: float      # the running layer's working set beyond the stashes
    buffer_bytes: float         # outside the graph: ZeRO-3's gathered parameters
    total_bytes: float
    update_bytes: float = 0.0   # the optimizer step's working set (no activations are live then)

    def __post_init__(self) -> None:
        for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "stash_bytes", "transient_bytes",
                     "buffer_bytes", "total_bytes", "update_bytes"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"StageMemory: {name} must be a number >= 0, got {v!r}")
        if not isinstance(self.inflight, int) or self.inflight < 1:
            raise ValueError(f"StageMemory: inflight must be an integer >= 1, got {self.inflight!r}")

    @property
    def persistent_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> float:
        """One microbatch at its peak (P): its stash plus the transient."""
        return self.stash_bytes + self.transient_bytes

    def terms(self) -> dict[str, float]:
        """The summands of `total_bytes`, by name (for out-of-memory answers)."""
        return {"parameters": self.params_bytes, "gradients": self.grads_bytes,
                "optimizer states": self.optimizer_bytes,
                f"stashed activations ({self.inflight} microbatches in flight)": self.inflight * self.stash_bytes,
                "the running layer's working set": self.transient_bytes, "buffers": self.buffer_bytes,
                "the optimizer step's working set": self.update_bytes}

    def to_json(self) -> dict:
        return asdict(self)


def one_microbatch_peak(layers: Sequence[LayerMemory], carries: Sequence[tuple[int, int, float]] = ()) -> float:
    """P = S + max_j (p_j - s_j) over a stage's layers in order (every stash is held).

    `carries` are (from, to, bytes): a tensor layer `from`'s backward hands to a layer
    `to` < from (a tied weight's gradient from the LM head to the embedding), live
    through the backward of `to` and of every layer in between, where it adds to their
    peak (taken as their backward's: true of transformer layers, whose backward holds
    the forward's stash and more)."""
    total = sum(m.stash_bytes for m in layers)
    best = 0.0
    for j, m in enumerate(layers):
        extra = sum(b for src, dst, b in carries if dst <= j < src)
        best = max(best, total - m.stash_bytes + m.peak_bytes + extra)
    return best


def stage_memory(layers: Sequence[LayerMemory], *, params_bytes: float, grads_bytes: float,
                 optimizer_bytes: float, inflight: int, buffer_bytes: float = 0.0,
                 carries: Sequence[tuple[int, int, float]] = (), update_bytes: float = 0.0) -> StageMemory:
    """The one function the planner's table, the plans and the out-of-memory bound use
    (the table applies it vectorised: `range_peak`). The optimizer step runs after the
    last microbatch, when no activation is live: the stage peaks at the larger of the
    two phases."""
    stash = float(sum(m.stash_bytes for m in layers))
    transient = max(one_microbatch_peak(layers, carries) - stash, 0.0)
    total = (params_bytes + grads_bytes + optimizer_bytes + max(inflight * stash + transient, update_bytes)
             + buffer_bytes)
    return StageMemory(float(params_bytes), float(grads_bytes), float(optimizer_bytes), stash, int(inflight),
                       transient, float(buffer_bytes), float(total), float(update_bytes))


def range_peak(stash: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """`one_microbatch_peak` of every layer range at once: (L, ...) -> (L, L, ...), entry
    [k, i] for layers k..i (inf where k > i). O(L^2) vectorised over the trailing axes."""
    num_layers = stash.shape[0]
    prefix = np.concatenate([np.zeros((1,) + stash.shape[1:]), np.cumsum(stash, axis=0)])
    over = peak - stash                               # p_j - s_j
    out = np.full((num_layers,) + stash.shape, math.inf)
    for k in range(num_layers):
        out[k, k:] = np.maximum.accumulate(over[k:], axis=0) + (prefix[k + 1:] - prefix[k])
    return out


def carry_peak(stash: np.ndarray, peak: np.ndarray, src: int, dst: int, carry: np.ndarray) -> np.ndarray:
    """For the ranges k <= dst, i >= src (those holding both ends of a carry): the
    one-microbatch peak through layers dst..src-1, with the carried bytes
    added; (L, L, ...) with -inf elsewhere (combine with `range_peak` by max)."""
    num_layers = stash.shape[0]
    prefix = np.concatenate([np.zeros((1,) + stash.shape[1:]), np.cumsum(stash, axis=0)])
    out = np.full((num_layers, num_layers) + stash.shape[1:], -math.inf)
    if src <= dst:
        return out
    inner = (peak[dst:src] - stash[dst:src]).max(axis=0) + carry
    for k in range(dst + 1):
        out[k, src:] = inner + (prefix[src + 1:] - prefix[k])
    return out


def range_max(x: np.ndarray) -> np.ndarray:
    """max_{l in k..i} x_l for every range: (L, ...) -> (L, L, ...), -inf where k > i."""
    num_layers = x.shape[0]
    out = np.full((num_layers,) + x.shape, -math.inf)
    for k in range(num_layers):
        out[k, k:] = np.maximum.accumulate(x[k:], axis=0)
    return out

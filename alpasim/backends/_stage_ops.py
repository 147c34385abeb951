"""What a stage's forward and backward programs compute: the training graph's own ops.

The planner prices a stage from the training graph's ops of its layers
(`alpasim.graphs.stage_graph`): the forward ops, then the backward ops the VJP rules
derived (under remat each layer's forward re-emitted as `remat=True` ops just before
that layer's backward, so each layer's input is the checkpoint), and its memory from
their liveness (`costmodels.liveness`). `stage_ops` reads the same sub-graph and says
what the backend's two per-microbatch programs take and give, so the backend runs
exactly what was priced:

- forward: the forward ops; reads the parameters, the received activations and the
  data; returns the activations later stages read (and the loss), plus the *stash*:
  every forward-produced or received tensor the stage's backward ops read. Its sum
  equals the sum over the stage's layers of `liveness(layer).stash()` unless a layer
  output is also read by the producing layer's backward (the per-layer figure counts
  it in both layers; `stash_check`).
- backward: the backward ops (recomputation included); reads the parameters, the stash
  and the received cotangents (training-graph tensors the plan's backward transfers
  name); adds each parameter's gradient — the tensor its `adam` op reads, after the
  `<param>:grad_cast` to the accumulation dtype — into its accumulator as soon as it
  is made, and returns the cotangents earlier stages read.

Tied parameters (GPT's word embedding, read by the embedding and by the LM head) as
Megatron-LM splits them: a stage that reads a parameter whose `adam` op lives in
another stage keeps its own *copy* with its own accumulator and Adam states. The
training graph sums the head's contribution into the embedding's gradient
(`grad_acc`, reading a `meta["tied_grads"]` tensor); across stages that sum happens
once per iteration, on the accumulators (the plan's `per_iteration` transfer), so
the owner's backward skips the carried operand (`carried`) and the copy accumulates
the contribution it makes (`grads`).
"""

from __future__ import annotations

from dataclasses import dataclass

from alpasim.costmodels import liveness
from alpasim.graphs import Op, OpGraph, stage_graph, tied_param


@dataclass(frozen=True)
class StageOps:
    """The ops and edge tensors of one stage's forward and backward (training-graph names)."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    params: tuple[str, ...]             # every parameter the stage's ops read
    owned: tuple[str, ...]              # those whose adam op is in the stage
    acts_in: tuple[str, ...]            # forward activations received
    data: tuple[str, ...]               # graph inputs read
    acts_out: tuple[str, ...]           # forward activations other stages read (the loss not among them)
    loss: str | None
    stash: tuple[str, ...]              # forward-produced or received, read by the backward
    cts_in: tuple[str, ...]             # backward tensors of other stages this backward reads
    cts_out: tuple[str, ...]            # backward tensors other stages read (tied contributions not among them)
    grads: dict[str, str]               # parameter -> the gradient tensor its accumulator adds per microbatch
    carried: dict[str, str]             # grad_acc output -> its local operand (the other arrives per iteration)
    adam: dict[str, Op]                 # owned and copied parameter -> its adam op

    @property
    def copies(self) -> tuple[str, ...]:
        return tuple(p for p in self.params if p not in self.owned)


def stage_ops(train: OpGraph, first: int, last: int) -> StageOps:
    """`StageOps` of layers first..last of the training graph `train` (module doc)."""
    sub = stage_graph(train, first, last)
    fwd = tuple(op for op in sub.ops if op.phase == "forward")
    bwd = tuple(op for op in sub.ops if op.phase == "backward")
    made_f = {t for op in fwd for t in op.outputs}
    made_b = {t for op in bwd for t in op.outputs}
    outside = {t for op in train.ops if not first <= op.layer <= last for t in op.inputs}
    tied = set(train.meta.get("tied_grads", ()))
    role = {t: train.tensors[t].role for t in sub.tensors}
    reads = list(dict.fromkeys(t for op in (*fwd, *bwd) for t in op.inputs))
    producer = train.producer
    params = tuple(t for t in reads if role[t] == "param")
    data = tuple(t for t in reads if role[t] == "input" and t not in producer)
    received = [t for t in reads if t not in made_f | made_b and t in producer]
    acts_in = tuple(t for t in received if producer[t].phase == "forward")
    cts_in = tuple(t for t in received if producer[t].phase == "backward" and t not in tied)
    loss = next((t for t in train.outputs if t in made_f and role[t] != "param"), None)
    acts_out = tuple(t for t in dict.fromkeys(t for op in fwd for t in op.outputs) if t in outside)
    cts_out = tuple(t for t in dict.fromkeys(t for op in bwd for t in op.outputs) if t in outside and t not in tied)
    bwd_reads = dict.fromkeys(t for op in bwd for t in op.inputs)
    stash = tuple(t for t in bwd_reads if t in made_f or t in acts_in or t in data)

    carried = {}
    for op in bwd:
        gone = [t for t in op.inputs if t in tied and t not in made_b]
        if gone:
            rest = [t for t in op.inputs if t not in gone]
            if op.prim != "elementwise" or op.param("fn") != "add" or len(rest) != 1:
                raise ValueError(f"op {op.name!r} reads the tied contribution {gone} but is not a two-operand add")
            carried[op.outputs[0]] = rest[0]

    adam_of = {op.inputs[0]: op for op in train.ops if op.prim == "adam"}
    owned = tuple(p for p in params if p in adam_of and first <= adam_of[p].layer <= last)
    grads = {p: adam_of[p].inputs[1] for p in owned}
    for t in tied & made_b:
        if t in outside:
            p = _tied_param(train, t)
            if p not in owned:
                grads[p] = t
    adam = {p: adam_of[p] for p in params if p in adam_of}
    return StageOps(fwd, bwd, params, owned, acts_in, data, acts_out, loss, stash, cts_in, cts_out, grads,
                    carried, adam)


def _tied_param(train: OpGraph, t: str) -> str:
    """The parameter whose gradient the tied contribution `t` is summed into."""
    p = tied_param(train, t)
    if p is None:
        raise ValueError(f"tied gradient contribution {t!r} feeds no adam op")
    return p


def layer_stash_sum(train: OpGraph, first: int, last: int, bytes_of) -> float:
    """Sum over layers first..last of the bytes of `liveness(layer).stash()` (what the
    planner's stage stash is), for comparison with `StageOps.stash`."""
    total = 0.0
    for layer in range(first, last + 1):
        g = stage_graph(train, layer, layer)
        total += sum(bytes_of(t) for t in liveness(g).stash())
    return total

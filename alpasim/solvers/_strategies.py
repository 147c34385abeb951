"""Parallel algorithms of one op on a 2-D mesh, enumerated from its dimension map.

An op's `DimMap` names every loop with a letter (seed 3.4.4, Table 3). A strategy maps
each live mesh axis to at most one letter (both axes to one letter is S01), and that
fixes everything else:

* operand specs: a dimension is split on the axes its letter is mapped to;
* partial outputs: an output that lacks a mapped letter (a contraction, a gather over
  a sharded vocabulary, a reduction) holds partial sums on those axes and pays an
  all-reduce; or, as a separate strategy, a reduce-scatter onto one of its free
  dimensions (the consumer then sees it sharded);
* compute: the op's work divided by the number of loop shards (replication repeats it).

For batched matmul this yields the paper's Table 3: #1 (i->0, j->1: no communication),
#2 (i->0, k->1: all-reduce on axis 1) and #7 (k->{0,1}: all-reduce on both axes).
Heavy ops (contractions, convolutions) must use every live mesh axis unless replication
is allowed (Alpa never replicates them); letters a primitive marks unshardable or
reduced-within are never split, and no operand may be split unevenly.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from alpasim.costmodels import CostModel, OpAccess, fuse, unfused_loss
from alpasim.graphs import LOSS_LOGITS, WEIGHT_GRAD_TAG, Op, Tensor, is_heavy, is_weight_grad, op_dims

from ._mesh import LogicalMesh
from ._resharding import Collective
from ._spec import ShardingSpec, spec_fits


@dataclass(frozen=True, slots=True)
class Strategy:
    """One parallel algorithm: loop->axes map, operand specs, own collectives and costs."""

    loops: tuple[tuple[str, tuple[int, ...]], ...]
    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    collectives: tuple[Collective, ...]
    comm_s: float                 # collectives run every microbatch
    compute_s: float
    sync: tuple[bool, ...] = ()   # per collective: once per iteration (gradient sync)?
    sync_s: float = 0.0           # collectives run once per iteration
    update: bool = False          # an optimizer op: its compute runs once per iteration

    @property
    def name(self) -> str:
        loops = ",".join(f"{c}@{''.join(map(str, a))}" for c, a in self.loops) or "replicated"
        if any(k.kind == "reduce_scatter" for k in self.collectives):
            loops += " reduce-scatter->" + "/".join(map(str, self.out_specs))
        return loops

    def cost_s(self, with_compute: bool, microbatches: int = 1) -> float:
        """Seconds per microbatch, with once-per-iteration work amortised over `microbatches`.

        With gradient accumulation a weight gradient is summed locally over the
        microbatches and synchronised once, and the optimizer runs once: that is why data
        parallelism's communication is amortised while tensor parallelism's is not.
        """
        compute = (self.compute_s / microbatches if self.update else self.compute_s) if with_compute else 0.0
        return self.comm_s + self.sync_s / microbatches + compute


def _spec_of(term: str, loops: Mapping[str, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(loops.get(c, ()) for c in term))


# Strategy lists by (op signature, mesh, cost model, allow_replicated_heavy), for the
# process: every layer problem of a plan, and of every configuration of a baseline's
# grid, asks for the same few hundred signatures again. Oldest entries go first.
_STRATEGY_MEMO: OrderedDict = OrderedDict()
STRATEGY_MEMO_ENTRIES = 1 << 14


def op_signature(op: Op, tensors: Mapping[str, Tensor], access: OpAccess | None) -> tuple:
    """What an op's strategies depend on: its primitive and attributes, phase, shapes,
    dtypes and roles, which outputs are weight gradients, its kernel charge; not its
    name, nor the parameter names its weight-gradient tags carry."""
    tags = frozenset(t for t in op.tags if not t.startswith(WEIGHT_GRAD_TAG + ":"))
    grads = tuple(is_weight_grad(op, k, tensors) for k in range(len(op.outputs)))
    shapes = tuple((tensors[t].shape, tensors[t].dtype, tensors[t].role) for t in (*op.inputs, *op.outputs))
    return (op.prim, op.params, op.phase, op.remat, tags, grads, len(op.inputs), shapes, access)


def graph_strategies(op: Op, graph, mesh: LogicalMesh, cost_model: CostModel, *,
                     allow_replicated_heavy: bool = False, signature: tuple | None = None) -> list[Strategy]:
    """`enumerate_strategies` of `op` priced in its fused kernel of `graph`, memoised by
    the op's signature (`op_signature`): a layer's repeated ops, the baselines'
    restrictions, the ILP built after them and the same layer at the next grid point
    share one enumeration. A cost model that is not hashable (by value) is keyed by its
    identity and held by the memo, so the identity is not reused while it is there.
    `signature` is the op's `op_signature`, when the caller has it already."""
    access = fuse(graph).of(op.name)
    try:
        hash(cost_model)
        model_key: Any = cost_model
    except TypeError:
        model_key = ("id", id(cost_model))
    if signature is None:
        signature = op_signature(op, graph.tensors, access)
    key = (signature, mesh, model_key, allow_replicated_heavy)
    hit = _STRATEGY_MEMO.get(key)
    if hit is None:
        hit = _STRATEGY_MEMO[key] = (cost_model, enumerate_strategies(
            op, graph.tensors, mesh, cost_model, access=access, allow_replicated_heavy=allow_replicated_heavy))
        if len(_STRATEGY_MEMO) > STRATEGY_MEMO_ENTRIES:
            _STRATEGY_MEMO.popitem(last=False)
    else:
        _STRATEGY_MEMO.move_to_end(key)
    return list(hit[1])        # a copy: callers may filter or extend their own list


def enumerate_strategies(op: Op, tensors: Mapping[str, Tensor], mesh: LogicalMesh, cost_model: CostModel,
                         *, allow_replicated_heavy: bool = False, access: OpAccess | None = None) -> list[Strategy]:
    """Every valid strategy of `op` on `mesh`, cheapest first among duplicates; `access`:
    the op's charge in its fused kernel (`costmodels.fuse` of its graph)."""
    dm = op_dims(op, tensors)
    ins = [tensors[t] for t in op.inputs]
    outs = [tensors[t] for t in op.outputs]
    letters = list(dict.fromkeys("".join(dm.inputs) + "".join(dm.outputs)))
    shardable = [c for c in letters if c not in dm.unshardable and c not in dm.reduced_within]
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    heavy = is_heavy(op) and not allow_replicated_heavy
    # A vocab-parallel loss is whole on every class shard: its class letter leaves no
    # partial sum (`vocab_parallel` prices what it all-reduces instead).
    in_letters = set("".join(dm.inputs)) - set(class_letter(op, dm))
    found: dict[tuple, Strategy] = {}
    for choice in itertools.product([None, *shardable], repeat=len(live)):
        if heavy and None in choice:
            continue
        loops: dict[str, tuple[int, ...]] = {}
        for a, c in zip(live, choice):
            if c is not None:
                loops[c] = loops.get(c, ()) + (a,)
        in_specs = tuple(_spec_of(term, loops) for term in dm.inputs)
        base_out = tuple(_spec_of(term, loops) for term in dm.outputs)
        if not all(spec_fits(s, t.shape, mesh) for s, t in zip(in_specs + base_out, ins + outs)):
            continue
        split = {c: mesh.axis_size(axes) for c, axes in loops.items()}
        compute_s = cost_model.op_time_s(op, tensors, num_shards=math.prod(split.values()), access=access, split=split)
        update = op.phase == "update"
        grads = tuple(is_weight_grad(op, k, tensors) for k in range(len(op.outputs)))
        stats = vocab_parallel(op, dm, ins, loops, mesh)
        for out_specs, collectives in _finish_outputs(dm.outputs, outs, base_out, loops, in_letters,
                                                     dm.unshardable | dm.reduced_within, mesh, grads):
            sync = tuple(update or is_grad for _, is_grad in collectives) + (False,) * len(stats)
            collectives = [c for c, _ in collectives] + stats
            comm_s = sum(c.time_s(mesh) for c, x in zip(collectives, sync) if not x)
            sync_s = sum(c.time_s(mesh) for c, x in zip(collectives, sync) if x)
            s = Strategy(tuple(sorted(loops.items())), in_specs, out_specs, tuple(collectives), comm_s, compute_s,
                         sync, sync_s, update)
            key = (in_specs, out_specs, tuple(collectives))
            if key not in found or s.cost_s(True) < found[key].cost_s(True):
                found[key] = s
    return list(found.values())


def class_letter(op: Op, dm) -> str:
    """The class letter of a softmax cross-entropy (or its gradient): its logits' last
    letter; "" for any other op."""
    i = LOSS_LOGITS.get(op.prim)
    return "" if i is None else dm.inputs[i][-1]


def vocab_parallel(op: Op, dm, ins: Sequence[Tensor], loops: Mapping[str, tuple[int, ...]],
                   mesh: LogicalMesh) -> list[Collective]:
    """The all-reduces of a cross-entropy whose class axis is split, one float32 value a
    token each, over the class letter's axes (the tokens are the shard's own).
    Megatron-LM's vocab-parallel loss (megatron/core/tensor_parallel/cross_entropy.py,
    `_VocabParallelCrossEntropy`, the "unfused-fp32" kernel) all-reduces each token's max
    logit, its target's logit and its sum of exponentials, three collectives, and keeps
    the softmax, so its gradient all-reduces nothing. A fused kernel all-reduces the max,
    then the target logit with the sum (two), and its gradient, which recomputes the
    softmax from the logits, the max and the sum again."""
    letter = class_letter(op, dm)
    axes = tuple(sorted(loops.get(letter, ()))) if letter else ()
    if not axes:
        return []
    i = LOSS_LOGITS[op.prim]
    term, logits, forward = dm.inputs[i], ins[i], i == 0
    token_axes = tuple(a for c, ax in loops.items() if c in term[:-1] for a in ax)
    per_value = 4 * logits.size / logits.shape[-1] / mesh.axis_size(token_axes)
    if unfused_loss(op):
        values = (1, 1, 1) if forward else ()
    else:
        values = (1, 2) if forward else (1, 1)
    return [Collective("all_reduce", v * per_value, axes) for v in values]


def _finish_outputs(terms: Sequence[str], outs: Sequence[Tensor], base: tuple[ShardingSpec, ...],
                    loops: Mapping[str, tuple[int, ...]], in_letters: set[str], fixed: frozenset[str],
                    mesh: LogicalMesh, grads: Sequence[bool] = ()):
    """Yield (output specs, collectives) for the all-reduce form and reduce-scatter forms;
    `grads[k]`: output k is a parameter's gradient (`graphs.is_weight_grad`)."""
    grads = tuple(grads) or (False,) * len(outs)
    partial: list[tuple[int, ...]] = []
    for term in terms:
        axes = tuple(sorted(a for c, ax in loops.items() if c in in_letters and c not in term for a in ax))
        partial.append(axes)
    # Each collective comes with whether it finishes a weight gradient (synchronised once
    # per iteration, after accumulation) rather than an activation (every microbatch).
    all_reduce = [(Collective("all_reduce", t.nbytes / s.num_shards(mesh), p), g)
                  for t, s, p, g in zip(outs, base, partial, grads) if p]
    yield base, all_reduce
    partial_outputs = [i for i, p in enumerate(partial) if p]
    if len(partial_outputs) != 1:
        return
    (i,) = partial_outputs
    axes, t, term = partial[i], outs[i], terms[i]
    for d, c in enumerate(term):
        if base[i].dims[d] or c in fixed or c in loops:
            continue
        dims = list(base[i].dims)
        dims[d] = axes
        spec = ShardingSpec(tuple(dims))
        if not spec_fits(spec, t.shape, mesh):
            continue
        before = t.nbytes / base[i].num_shards(mesh)
        specs = base[:i] + (spec,) + base[i + 1:]
        yield specs, [(Collective("reduce_scatter", before, axes), grads[i])]

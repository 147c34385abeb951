"""Hand-designed intra-op assignments, expressed as restrictions of the same problem.

A baseline is the ILP with fewer choices, so it is priced by exactly the same cost
model, resharding rules and memory accounting as Alpa's plan:

* **data parallel**: every op splits its batch loop over all live mesh axes, parameters
  and optimizer states are replicated, gradients are all-reduced (no reduce-scatter);
* **Megatron-LM**: mesh axis 0 is data parallel, axis 1 tensor parallel. Parameters
  are stored in Megatron's layout on axis 1 — column-parallel Q/K/V and first MLP
  weights, row-parallel output projection and second MLP weight, vocabulary-parallel
  embedding, expert weights split like the MLP — and every op that reads such a weight
  splits the weight's sharded loop on axis 1 (no weight is ever gathered). What is
  left (attention's head loop, activation layouts) the ILP chooses.
* **ZeRO-2** (Rajbhandari et al. 2020): data parallel forward and backward with
  replicated fp16 parameters; every weight gradient is reduce-scattered over all devices
  (never all-reduced), the Adam op runs on a 1/N slice (so fp32 master, m and v are
  stored 1/N), and the new fp16 parameter is all-gathered back to its replicated layout
  by the update's loop-back edge. Cost: reduce-scatter + all-gather = one all-reduce.
* **ZeRO-3**: ZeRO-2 with the fp16 parameters also stored 1/N; every forward or
  backward read of a parameter then all-gathers it (the resharding edge charges each read).
* **Heuristic** (the paper's Figure 8 baseline): every leaf tensor (parameters, stage
  inputs) sharded on its largest dimension over the whole mesh, then each op in order
  takes the one strategy with the least resharding + own communication given the specs
  so far (a greedy, GSPMD-like propagation). One strategy per op: the ILP only prices it.
* **DeepSpeed-MoE** (Rajbhandari et al. 2022): expert parallelism for the expert
  weights and the ops local to the experts, ZeRO-2 data parallelism for everything
  else; the dispatch and combine all-to-alls appear as resharding. Equals ZeRO-2 on a
  graph without experts.

Batch loops are found by propagating the batch dimension (axis 0 of every stage
input) through the ops' dimension maps. Every batch loop is split over all live mesh
axes. `REWRITE_ALLOWED` says which baselines may take the post-ILP weight-update-sharding
rewrite (Megatron-LM and plain data parallelism have none).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping

from alpasim.costmodels import CostModel
from alpasim.graphs import (LOSS_LOGITS, Op, OpGraph, Tensor, is_weight_grad, makes_weight_grad, op_dims,
                            param_split, tied_param, weight_grad_params)

from ._mesh import LogicalMesh
from ._resharding import Collective, resharding_time_s
from ._spec import ShardingSpec, all_specs, spec_fits
from ._strategies import Strategy, class_letter, graph_strategies

# Relative margin under which two greedy (heuristic) choices tie; the earlier one in
# `enumerate_strategies` order wins, so the result is deterministic.
TIE_RTOL = 1e-12


def batch_letters(graph: OpGraph) -> dict[str, frozenset[str]]:
    """Op name -> the letters of its loops that run over the batch.

    From the inputs' leading dimension forward, and back again from readers to
    producers in the forward pass: a batch dimension can be born inside the graph,
    where a table is broadcast to the activations' shape (RoPE's cos and sin). Left
    out, such a tensor was kept whole on every data-parallel rank, and its stash grew
    with dp. (Not in the backward: a rematerialised copy is transient, and splitting
    the position table's copy there turned data parallelism's once-an-iteration
    embedding-gradient reduction into one per microbatch; `test_partial_grads.py`.)"""
    out = dict(_propagated_letters(graph, {(t, 0) for t in graph.inputs if graph.tensors[t].rank > 0}))
    read_over_batch: dict[str, set[int]] = {}
    for op in reversed(graph.ops):
        if op.phase != "forward":
            continue
        dm = op_dims(op, graph.tensors)
        letters = set(out[op.name])
        for t, term in zip(op.outputs, dm.outputs):
            letters.update(term[d] for d in read_over_batch.get(t, ()))
        out[op.name] = frozenset(letters - dm.unshardable)
        for t, term in zip(op.inputs, dm.inputs):
            read_over_batch.setdefault(t, set()).update(d for d, c in enumerate(term) if c in out[op.name])
    return out


def sequence_letters(graph: OpGraph) -> dict[str, frozenset[str]]:
    """Op name -> the letters of its loops that run over the sequence (axis 1 of every
    stage input of rank 2 or more: token ids, labels, hidden states, cotangents). The
    sequence stays the sequence through an op that cannot split it (attention's core
    needs every key): the projection after it reduce-scatters onto it."""
    return _propagated_letters(graph, {(t, 1) for t in graph.inputs if graph.tensors[t].rank > 1},
                               through_unshardable=True)


def _propagated_letters(graph: OpGraph, flagged: set[tuple[str, int]],
                        through_unshardable: bool = False) -> dict[str, frozenset[str]]:
    """Op name -> the letters of its loops over the (tensor, dim)s in `flagged`, which
    flow from each op's inputs to the output dims that keep the letter (also past an
    op that cannot shard them, with `through_unshardable`)."""
    flagged = set(flagged)
    out: dict[str, frozenset[str]] = {}
    for op in graph.ops:
        dm = op_dims(op, graph.tensors)
        found = {term[d] for t, term in zip(op.inputs, dm.inputs) for d in range(len(term)) if (t, d) in flagged}
        letters = found - dm.unshardable
        out[op.name] = frozenset(letters)
        for t, term in zip(op.outputs, dm.outputs):
            flagged.update((t, d) for d, c in enumerate(term) if c in (found if through_unshardable else letters))
    return out


def _axes_of(s: Strategy) -> dict[int, str]:
    return {a: c for c, axes in s.loops for a in axes}


def data_parallel_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for pure data parallelism."""
    batch = batch_letters(graph)
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    restrict: dict[str, list[Strategy]] = {}
    for op in graph.ops:
        options = [s for s in _options(op, graph, mesh, cost_model)
                   if not any(c.kind == "reduce_scatter" for c in s.collectives)]
        letters = batch[op.name]
        keep = [s for s in options if all(_axes_of(s).get(a) in letters for a in live)] if letters else \
            [s for s in options if not s.loops]
        restrict[op.name] = keep or [s for s in options if not s.loops]
    return restrict, _replicated_params(graph)


def megatron_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, *,
                         sequence_parallel: bool = False):
    """(restrict, leaf_specs) for Megatron-LM's data x tensor parallel layout.

    With `sequence_parallel` (Korthikanti et al. 2022), every op outside the
    tensor-parallel regions (the ops no split weight's dimension reaches: norms,
    residual adds, dropout, the embedding's output) splits its sequence loop over the
    tensor-parallel axis instead of repeating its work there, and a region's partial
    sums are reduce-scattered onto the sequence instead of all-reduced; entering a
    region all-gathers the sequence (a resharding edge). The backward mirrors it: the
    all-gather's gradient is a reduce-scatter, and the weight gradients' reads gather
    the stashed sequence shard again, as Megatron-LM does.
    """
    batch = batch_letters(graph)
    params = _megatron_params(graph, mesh)
    leaf_specs = {**_megatron_inputs(graph, mesh, sequence_parallel), **params}
    seq = sequence_letters(graph) if sequence_parallel and mesh.shape[1] > 1 else {}
    split = _propagated_letters(graph, {(t, d) for t, specs in params.items()
                                        for d, axes in enumerate(specs[0].dims) if 1 in axes}) if seq else {}
    restrict: dict[str, list[Strategy]] = {}
    param_of_grad = params_of_grads(graph)
    for op in graph.ops:
        dm = op_dims(op, graph.tensors)
        must: dict[int, set[str]] = {}
        if mesh.shape[0] > 1 and batch[op.name]:
            must[0] = set(batch[op.name])
        for t, term in zip(op.inputs, dm.inputs):
            spec = leaf_specs.get(t)
            if spec is not None and len(spec) == 1:
                for d, axes in enumerate(spec[0].dims):
                    if 1 in axes:
                        must[1] = {term[d]}
        loss = op.prim in LOSS_LOGITS
        if seq and 1 not in must and not loss:
            # Inside a region the split weight's letter; outside, the sequence.
            letters = set(split[op.name] or seq[op.name]) - set(batch[op.name])
            if letters:
                must[1] = letters
        # Megatron-LM without sequence parallelism reduces tensor-parallel partial sums
        # with all-reduce only (a reduce-scatter would leave the sequence split); with
        # it, a reduce-scatter over the tensor-parallel axis onto the sequence.
        options = [s for s in _options(op, graph, mesh, cost_model)
                   if not any(c.kind == "reduce_scatter" for c in s.collectives)
                   or (seq and _scatters_onto(op, s, graph.tensors, seq[op.name]))]
        keep = [s for s in options if all(_axes_of(s).get(a) in letters for a, letters in must.items())]
        if 0 not in must and mesh.shape[0] > 1:
            keep = [s for s in keep if 0 not in _axes_of(s)]
        if loss and mesh.shape[1] > 1:
            # Megatron-LM splits the loss over the vocabulary, the logits' last axis
            # (its vocab-parallel cross-entropy), never over a sequence it does not have.
            keep = [s for s in keep if _axes_of(s).get(1) == class_letter(op, dm)] or keep
        # No distributed optimizer: gradients (and each contribution to one, such as the
        # LM head's to the tied embedding's), master weights and Adam moments are laid
        # out as the parameter is.
        if op.prim == "adam":
            owners = dict.fromkeys(range(len(op.outputs)), op.inputs[0])
        else:
            owners = grad_owners(op, param_of_grad)
        owners = {k: p for k, p in owners.items() if p in leaf_specs}
        if owners:
            def laid_out(s: Strategy) -> bool:
                return all(s.out_specs[k] == leaf_specs[p][0] for k, p in owners.items())
            keep = [s for s in keep if laid_out(s)] or [s for s in options if laid_out(s)] or keep
        restrict[op.name] = keep or options
    return restrict, leaf_specs


def _scatters_onto(op: Op, s: Strategy, tensors: Mapping[str, Tensor], letters: frozenset[str]) -> bool:
    """`s` reduce-scatters only over the tensor-parallel axis, onto a dimension whose
    letter is one of `letters` (the sequence)."""
    if any(c.kind == "reduce_scatter" and c.axes != (1,) for c in s.collectives):
        return False
    loops = dict(s.loops)
    dm = op_dims(op, tensors)
    onto = {c for term, spec in zip(dm.outputs, s.out_specs) for c, axes in zip(term, spec.dims)
            if 1 in axes and c not in loops}
    return bool(onto) and onto <= letters


def megatron_distopt_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, *,
                                 sequence_parallel: bool = False, per_microbatch: bool = False):
    """(restrict, leaf_specs) for Megatron-LM with Megatron-core's distributed optimizer:
    its layouts, with each Adam step on a slice of the parameter's layout over the
    data-parallel axis (axis 0), each weight gradient reduce-scattered onto such a slice
    once an iteration (it accumulates whole first, as Megatron's gradient buffer does),
    or, in a layout where it cannot be scattered evenly, all-reduced once an iteration
    (the flat buffer's scatter and gather: `_layer_options._sync_terms`), and the casts
    into the accumulator in any layout. The reduce-scatter and the
    updated weights' all-gather cost what the all-reduce did; the master weights and
    Adam moments take 1/dp. (A parameter with no dimension left to slice keeps
    Megatron's replicated step.)

    `per_microbatch`: the gradients are sharded too (ZeRO-2, as Llama 3's FSDP ran
    beside Megatron-style tensor and pipeline parallelism): each microbatch's weight
    gradient is reduce-scattered as the backward makes it, and the device accumulates
    only its slice (`_scatter_gradients`), so the gradient accumulators take 1/dp."""
    restrict, leaf_specs = megatron_restriction(graph, mesh, cost_model, sequence_parallel=sequence_parallel)
    if mesh.shape[0] == 1:
        return restrict, leaf_specs
    out = dict(restrict)
    for op in graph.ops:
        if op.prim == "adam" and op.inputs[0] in leaf_specs:
            stored = leaf_specs[op.inputs[0]][0]
            sliced = [x for x in _options(op, graph, mesh, cost_model) if _one_more_axis(x.out_specs[0], stored, 0)]
            out[op.name] = sliced or restrict[op.name]
        elif op.prim in ("convert", "elementwise") and all(graph.tensors[t].role == "grad" for t in op.outputs):
            out[op.name] = _options(op, graph, mesh, cost_model)
        elif makes_weight_grad(op, graph.tensors):
            # A layout whose gradient cannot be scattered evenly over dp (GPT's position
            # table, 4096 x 7168, over 48 ranks) keeps its once-an-iteration all-reduce;
            # dropping it had left only layouts that gather the whole batch's cotangent.
            scattered = [v for x in restrict[op.name]
                         for v in _scatter_gradients(op, x, graph.tensors, mesh, per_microbatch) or [x]
                         if all(c.kind != "reduce_scatter" or c.axes == (0,) for c in v.collectives)]
            out[op.name] = list(dict.fromkeys(scattered)) or restrict[op.name]
    return out, leaf_specs


def params_of_grads(graph: OpGraph) -> dict[str, str]:
    """Gradient tensor -> the parameter whose Adam step reads it."""
    return {op.inputs[1]: op.inputs[0] for op in graph.ops if op.prim == "adam"}


def grad_owners(op, param_of_grad: dict[str, str]) -> dict[int, str]:
    """Output index -> the parameter whose gradient (or contribution to one) `op` makes
    there: autodiff's tags (`graphs.weight_grad_params`), and an output an Adam step
    reads (`params_of_grads`)."""
    owners = dict(weight_grad_params(op))
    if op.outputs[0] in param_of_grad:
        owners[0] = param_of_grad[op.outputs[0]]
    return owners


def optimizer_state_shards(restriction: str | None, mesh: LogicalMesh) -> int:
    """The devices a baseline splits each optimizer state over beyond its parameter's
    layout, for states it keeps outside the graph (a tied copy's, `_stage_costs`): the
    data-parallel degree under the distributed optimizer, else 1."""
    return mesh.shape[0] if restriction in DISTRIBUTED_OPTIMIZER else 1


def _unsliced_states(restriction: str | None, layer: OpGraph, specs, mesh: LogicalMesh):
    """(parameter, state) of each optimizer state the distributed optimizer's layouts
    could not slice over the data-parallel axis (no dimension of the parameter's layout
    divides evenly by dp), and that Megatron-core shards all the same: its optimizer
    holds the states of a flat, padded buffer of all parameters, 1/dp of it on each
    rank (megatron/core/optimizer/distrib_optimizer.py, `_build_model_gbuf_range`), so
    divisibility never keeps a state whole. None for the other baselines."""
    if restriction not in DISTRIBUTED_OPTIMIZER or mesh.shape[0] == 1:
        return
    for op in layer.ops:
        if op.prim == "adam":
            for t in op.inputs:
                spec = specs.get(t)
                if layer.tensors[t].role == "optimizer_state" and spec is not None \
                        and not any(0 in d for d in spec.dims):
                    yield op.inputs[0], t


def unsliced_params(restriction: str | None, layer: OpGraph, specs, mesh: LogicalMesh) -> set[str]:
    """The parameters with a state in Megatron-core's flat buffer (`_unsliced_states`)."""
    return {p for p, _ in _unsliced_states(restriction, layer, specs, mesh)}


def unsliced_state_bytes(restriction: str | None, layer: OpGraph, specs, mesh: LogicalMesh) -> float:
    """Optimizer-state bytes per device of `_unsliced_states`. The caller takes
    (1 - 1/dp) of these off. 0 for the other baselines."""
    return sum((layer.tensors[t].nbytes / specs[t].num_shards(mesh)
                for _, t in _unsliced_states(restriction, layer, specs, mesh)), 0.0)


def _one_more_axis(spec: ShardingSpec, base: ShardingSpec, axis: int) -> bool:
    """`spec` is `base` with `axis` added to exactly one dimension."""
    grown = [d for d, (a, b) in enumerate(zip(spec.dims, base.dims)) if a != b]
    return len(grown) == 1 and sorted(spec.dims[grown[0]]) == sorted((*base.dims[grown[0]], axis))


def _replicated_params(graph: OpGraph) -> dict[str, list[ShardingSpec]]:
    return {t.name: [ShardingSpec.replicated(t.rank)] for t in graph.params}


def _megatron_inputs(graph: OpGraph, mesh: LogicalMesh, sequence_parallel: bool) -> dict[str, list[ShardingSpec]]:
    """A stage's inputs (token ids, labels, the hidden states and cotangents that cross
    pipeline stages) split over the data-parallel axis on their batch dimension, as
    Megatron-LM's data loader and point-to-point sends hold them
    (`p2p_communication` sends each data-parallel rank's own microbatch). Left free, the
    ILP could take a cotangent with its sequence on the data-parallel axis (slicing
    costs the same on either dimension), and the stage before had to send each device
    pieces of 16 others' sequences. With sequence parallelism a hidden state may also
    have its sequence on the tensor-parallel axis, as Megatron sends it."""
    out = _tied_grad_inputs(graph, mesh)
    if mesh.shape[0] == 1:
        return out
    skip = {t.name for t in graph.params} | set(graph.meta.get("tied_grads", ()))   # a tied copy's gradient
    for t in graph.inputs:
        tensor = graph.tensors[t]
        if t in skip or tensor.rank == 0:
            continue
        rest = ((),) * (tensor.rank - 1)
        specs = [ShardingSpec(((0,),) + rest)]
        if sequence_parallel and tensor.rank > 2 and mesh.shape[1] > 1:
            specs.insert(0, ShardingSpec(((0,), (1,)) + rest[1:]))
        specs = [x for x in specs if spec_fits(x, tensor.shape, mesh)]
        if specs:
            out[t] = specs
    return out


def _tied_grad_inputs(graph: OpGraph, mesh: LogicalMesh) -> dict[str, list[ShardingSpec]]:
    """A tied copy's gradient from another stage (the LM head's, for the embedding it
    shares) laid out as the parameter it is summed into: Megatron-LM all-reduces the
    embedding gradients between the first and last stage's matching tensor-parallel
    ranks (`_allreduce_word_embedding_grads`, over the embedding group), each holding
    the same vocabulary slice. Left free, the ILP took it split on the hidden size, and
    every device of the last stage sent a piece to every device of the first."""
    params = {t.name: t for t in graph.params}
    out = {}
    for t in graph.meta.get("tied_grads", ()):
        p = tied_param(graph, t) if t in graph.inputs else None
        if p in params and params[p].shape == graph.tensors[t].shape:
            out[t] = [_megatron_param_spec(graph, params[p], mesh)]
    return out


def _megatron_param_spec(graph: OpGraph, t: Tensor, mesh: LogicalMesh) -> ShardingSpec:
    """Parameter `t` split on the dimension its family's builder tags for tensor
    parallelism (`graphs.param_split`) over the tensor-parallel axis."""
    tag = param_split(graph, t.name)
    dim = tag["dim"] if tag is not None else None
    if dim is not None and mesh.shape[1] > 1:
        dims = [()] * t.rank
        dims[dim] = (1,)
        candidate = ShardingSpec(tuple(dims))
        if spec_fits(candidate, t.shape, mesh):
            return candidate
    return ShardingSpec.replicated(t.rank)


def _megatron_params(graph: OpGraph, mesh: LogicalMesh) -> dict[str, list[ShardingSpec]]:
    return {t.name: [_megatron_param_spec(graph, t, mesh)] for t in graph.params}


# ------------------------------------------------------------------------- ZeRO
def zero2_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for ZeRO stage 2: data parallel, gradients reduce-scattered,
    optimizer states and the update on a 1/N slice, parameters replicated."""
    restrict, leaf_specs = data_parallel_restriction(graph, mesh, cost_model)
    return _shard_weight_update(graph, mesh, cost_model, restrict), leaf_specs


def zero3_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for ZeRO stage 3: ZeRO-2 with the parameters stored 1/N
    (each forward or backward read all-gathers them)."""
    restrict, leaf_specs = zero2_restriction(graph, mesh, cost_model)
    return restrict, {t.name: _sharded_on_all_axes(t, mesh) or leaf_specs[t.name] for t in graph.params}


def _live(mesh: LogicalMesh) -> list[int]:
    return [a for a in (0, 1) if mesh.shape[a] > 1]


def _options(op: Op, graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel,
             allow_replicated_heavy: bool = True) -> list[Strategy]:
    """`enumerate_strategies` of `op`, priced in its fused kernel of `graph` as the ILP
    prices it (and shared with it: `graph_strategies`)."""
    return graph_strategies(op, graph, mesh, cost_model, allow_replicated_heavy=allow_replicated_heavy)


def _sharded_on_all_axes(t: Tensor, mesh: LogicalMesh) -> list[ShardingSpec]:
    """Every spec of `t` that splits it over all live mesh axes (1/N per device)."""
    live = set(_live(mesh))
    return [s for s in all_specs(t.shape, mesh) if set(s.axes_used()) == live] if live else []


def _shard_weight_update(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel,
                         restrict: Mapping[str, list[Strategy]]) -> dict[str, list[Strategy]]:
    """ZeRO's weight update on top of `restrict`: gradient producers reduce-scatter
    instead of all-reducing, Adam runs on a slice over every live axis. The scatter
    runs every microbatch, as DeepSpeed's does: a device keeps only its slice of the
    gradient, so it cannot sum whole gradients over the microbatches first (the memory
    model counts a gradient scattered once per iteration at its unreduced size).

    A gradient with no evenly divisible free dimension keeps its all-reduce (its update
    is still sliced; slicing a replicated tensor is free).
    """
    live = set(_live(mesh))
    out = dict(restrict)
    for op in graph.ops:
        if op.prim == "adam":
            sliced = [s for s in _options(op, graph, mesh, cost_model) if set(_axes_of(s)) == live]
            out[op.name] = sliced or out[op.name]
        elif op.prim in ("convert", "elementwise") and all(graph.tensors[t].role == "grad" for t in op.outputs):
            # The cast into the fp32 accumulator (or a tied gradient's sum) runs in
            # whatever layout the scattered gradient arrives in.
            out[op.name] = _options(op, graph, mesh, cost_model)
        elif makes_weight_grad(op, graph.tensors):
            # Every layout here splits the same batch loops: a gradient scatters in all of
            # them or in none (then it keeps its all-reduce).
            scattered = [v for s in out[op.name] for v in _scatter_gradients(op, s, graph.tensors, mesh,
                                                                             per_microbatch=True)]
            out[op.name] = list(dict.fromkeys(scattered)) or out[op.name]
    return out


def _scatter_gradients(op: Op, s: Strategy, tensors: Mapping[str, Tensor], mesh: LogicalMesh,
                       per_microbatch: bool = False) -> list[Strategy]:
    """`s` with every partial-sum gradient output reduce-scattered onto one of its free
    dimensions instead of all-reduced, one variant per choice of dimensions; [] if some
    gradient cannot be scattered evenly.

    `enumerate_strategies` has these forms only for ops with a single partial output,
    scattered onto a dimension the op could split; ZeRO scatters every gradient (a
    flat buffer in DeepSpeed), so here layer norm's scale and bias gradients get them
    too, onto any dimension the op did not split: the reduce-scatter runs after the op
    has finished, so a dimension it reduces within is as good as any. Priced by the
    same collective model; `per_microbatch` makes the scatters run every microbatch
    (ZeRO) instead of once per iteration.
    """
    dm = op_dims(op, tensors)
    loops = dict(s.loops)
    in_letters = set("".join(dm.inputs))
    per_output: list[list[tuple[ShardingSpec, Collective | None]]] = []
    for k, (t, term, spec) in enumerate(zip(op.outputs, dm.outputs, s.out_specs)):
        tensor = tensors[t]
        partial = tuple(sorted(a for c, axes in loops.items() if c in in_letters and c not in term for a in axes))
        nbytes = tensor.nbytes / spec.num_shards(mesh)
        if not partial:
            per_output.append([(spec, None)])
        elif not is_weight_grad(op, k, tensors):
            per_output.append([(spec, Collective("all_reduce", nbytes, partial))])
        else:
            forms = []
            for d, c in enumerate(term):
                if spec.dims[d] or c in loops:
                    continue
                dims = list(spec.dims)
                dims[d] = partial
                scattered = ShardingSpec(tuple(dims))
                if spec_fits(scattered, tensor.shape, mesh):
                    forms.append((scattered, Collective("reduce_scatter", nbytes, partial)))
            if not forms:
                return []
            per_output.append(forms)
    variants = []
    for combo in itertools.product(*per_output):
        collectives, sync = [], []
        for k, (_, c) in enumerate(combo):
            if c is not None:
                collectives.append(c)
                scatter = c.kind == "reduce_scatter" and per_microbatch
                sync.append(s.update or (is_weight_grad(op, k, tensors) and not scatter))
        comm_s = sum(c.time_s(mesh) for c, x in zip(collectives, sync) if not x)
        sync_s = sum(c.time_s(mesh) for c, x in zip(collectives, sync) if x)
        variants.append(Strategy(s.loops, s.in_specs, tuple(spec for spec, _ in combo), tuple(collectives),
                                 comm_s, s.compute_s, tuple(sync), sync_s, s.update))
    return variants


# -------------------------------------------------------------------- heuristic
def heuristic_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for the paper's "Heuristic": shard the largest dimension
    of every leaf tensor, then propagate greedily, one strategy per op.

    Greedy step: given the specs fixed so far, an op takes the strategy of least
    resharding of its operands + own collectives (+ for Adam, the trip of the new
    value back to the parameter's stored layout), all counted once (one microbatch);
    ties go to the earlier strategy (`TIE_RTOL`). Compute is not weighed: GSPMD's
    propagation does not look at it, and heavy ops use every axis anyway.
    """
    tensors = graph.tensors
    leaves = [t for t in dict.fromkeys(t for op in graph.ops for t in op.inputs)
              if t not in graph.producer and tensors[t].role != "optimizer_state"]
    current = {t: _largest_dim_spec(tensors[t].shape, mesh) for t in leaves}
    leaf_specs = {t: [spec] for t, spec in current.items()}
    restrict: dict[str, list[Strategy]] = {}
    for op in graph.ops:
        options = (_options(op, graph, mesh, cost_model, allow_replicated_heavy=False)
                   or _options(op, graph, mesh, cost_model))
        best, best_cost = options[0], float("inf")
        for s in options:
            cost = s.comm_s + s.sync_s
            for t, need in zip(op.inputs, s.in_specs):
                if t in current:
                    cost += resharding_time_s(current[t], need, tensors[t].nbytes, mesh)
            if op.prim == "adam" and op.inputs[0] in current:
                cost += resharding_time_s(s.out_specs[0], current[op.inputs[0]], tensors[op.outputs[0]].nbytes, mesh)
            if cost < best_cost * (1 - TIE_RTOL) - 1e-15:
                best, best_cost = s, cost
        restrict[op.name] = [best]
        current.update(zip(op.outputs, best.out_specs))
    return restrict, leaf_specs


def _largest_dim_spec(shape: tuple[int, ...], mesh: LogicalMesh) -> ShardingSpec:
    """The largest dimension that splits over every live axis, sharded on all of them;
    else the largest that splits over the bigger axis alone (then the smaller);
    else replicated. Ties go to the earlier dimension (and axis)."""
    live = _live(mesh)
    by_size = sorted(range(len(shape)), key=lambda d: -shape[d])
    groups = [tuple(live)] if live else []
    if len(live) > 1:
        groups += [(a,) for a in sorted(live, key=lambda a: (-mesh.shape[a], a))]
    for axes in groups:
        for d in by_size:
            if shape[d] % mesh.axis_size(axes) == 0:
                dims = [()] * len(shape)
                dims[d] = axes
                return ShardingSpec(tuple(dims))
    return ShardingSpec.replicated(len(shape))


# ---------------------------------------------------------------- DeepSpeed-MoE
def deepspeed_moe_restriction(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel):
    """(restrict, leaf_specs) for DeepSpeed-MoE: expert parallelism for the expert
    weights and the ops local to the experts, ZeRO-2 data parallelism elsewhere.

    The expert loop takes every live axis if the expert count divides by the device
    count, else the biggest single axis it divides (the rest of the mesh is the
    expert-data-parallel group: batch split, gradients reduce-scattered over it).
    """
    restrict, leaf_specs = zero2_restriction(graph, mesh, cost_model)
    # Expert weights, tagged by their family's builder (an untagged graph has none):
    # (E, M, H) and (E, H, M), the expert dimension dim 0.
    tagged = "tensor_parallel" in graph.meta
    experts = [t for t in graph.params if tagged and (param_split(graph, t.name) or {}).get("expert")]
    axes = _expert_axes({t.shape[0] for t in experts}, mesh)
    if not experts or not axes:
        return restrict, leaf_specs
    batch = batch_letters(graph)
    rest = [a for a in _live(mesh) if a not in axes]
    for op_name, letter in _expert_local_ops(graph, experts).items():
        op = graph.op_by_name[op_name]
        options = [s for s in _options(op, graph, mesh, cost_model)
                   if not any(c.kind == "reduce_scatter" for c in s.collectives)]
        keep = [s for s in options if _expert_parallel(s, letter, axes, rest, batch[op_name], op.prim == "adam")]
        if makes_weight_grad(op, graph.tensors):
            keep = [v for s in keep for v in _scatter_gradients(op, s, graph.tensors, mesh, per_microbatch=True)] \
                or keep
        if keep:
            restrict[op_name] = list(dict.fromkeys(keep))
    for t in experts:
        dims = [()] * t.rank
        dims[0] = axes
        leaf_specs[t.name] = [ShardingSpec(tuple(dims))]
    return restrict, leaf_specs


def _expert_parallel(s: Strategy, letter: str, axes: tuple[int, ...], rest: list[int], batch: frozenset[str],
                     update: bool) -> bool:
    """Expert loop on `axes`; on the other axes the batch (or, for the update, any
    loop: ZeRO over the expert-data-parallel group)."""
    m = _axes_of(s)
    if any(m.get(a) != letter for a in axes):
        return False
    if update:
        return all(a in m for a in rest)
    return all(m.get(a) in batch if batch else a not in m for a in rest)


def _expert_axes(counts: set[int], mesh: LogicalMesh) -> tuple[int, ...]:
    """Mesh axes of the expert loop: all live axes, else the biggest single axis that
    divides every expert count (axis 1, inside a node, on a tie), else none."""
    live = _live(mesh)
    if not counts or not live:
        return ()
    candidates = [tuple(live)] + sorted(((a,) for a in live), key=lambda a: (-mesh.shape[a[0]], -a[0]))
    for axes in candidates:
        if all(n % mesh.axis_size(axes) == 0 for n in counts):
            return axes
    return ()


def _expert_local_ops(graph: OpGraph, experts: list[Tensor]) -> dict[str, str]:
    """Op name -> its expert letter, for the ops that can run expert-parallel with no
    communication of their own: every operand and every output carries the expert
    dimension (propagated from dim 0 of the expert weights). Dispatch and combine
    (expert dimension created or contracted) are not: between them and the experts
    the tokens move by all-to-all."""
    flagged = {(t.name, 0) for t in experts}
    out: dict[str, str] = {}
    for op in graph.ops:
        dm = op_dims(op, graph.tensors)
        letters = sorted({term[d] for t, term in zip(op.inputs, dm.inputs) for d in range(len(term))
                          if (t, d) in flagged})
        for c in letters:
            if all(c in term for t, term in zip(op.inputs, dm.inputs) if graph.tensors[t].rank) and \
                    all(c in term for term in dm.outputs):
                out[op.name] = c
                flagged.update((t, d) for t, term in zip(op.outputs, dm.outputs) for d, x in enumerate(term) if x == c)
                break
    return out


BASELINES: Mapping[str, object] = {
    "data_parallel": data_parallel_restriction, "megatron": megatron_restriction,
    "megatron_distopt": megatron_distopt_restriction,
    "megatron_sp": functools.partial(megatron_restriction, sequence_parallel=True),
    "megatron_sp_distopt": functools.partial(megatron_distopt_restriction, sequence_parallel=True),
    "megatron_zero2": functools.partial(megatron_distopt_restriction, per_microbatch=True),
    "megatron_sp_zero2": functools.partial(megatron_distopt_restriction, sequence_parallel=True, per_microbatch=True),
    "zero2": zero2_restriction, "zero3": zero3_restriction, "heuristic": heuristic_restriction,
    "deepspeed_moe": deepspeed_moe_restriction,
}
# Whether the post-ILP weight-update-sharding rewrite may run: neither plain data
# parallelism nor Megatron-LM shards the optimizer step, and GSPMD's propagation has no
# such pass. The ZeRO forms already shard the update (the rewrite finds nothing to do).
# Megatron-LM with Megatron-core's distributed optimizer (`megatron_distopt`) shards the
# update by its restriction, not by the rewrite.
REWRITE_ALLOWED: Mapping[str, bool] = {"data_parallel": False, "megatron": False, "megatron_distopt": False,
                                       "megatron_sp": False, "megatron_sp_distopt": False,
                                       "megatron_zero2": False, "megatron_sp_zero2": False,
                                       "zero2": True, "zero3": True, "heuristic": False, "deepspeed_moe": True}
# The baselines with Megatron-core's distributed optimizer (`optimizer_state_shards`).
DISTRIBUTED_OPTIMIZER: frozenset[str] = frozenset({"megatron_distopt", "megatron_sp_distopt", "megatron_zero2",
                                                   "megatron_sp_zero2"})
# The baselines whose weight gradients are scattered every microbatch
# (`_shard_weight_update`); every other plan reduces them once per iteration, after
# accumulating each device's unreduced partials (executors follow: `backends._partial_grads`).
PER_MICROBATCH_GRAD_SYNC: frozenset[str] = frozenset({"zero2", "zero3", "deepspeed_moe", "megatron_zero2",
                                                      "megatron_sp_zero2"})
# Of those, the baselines whose per-microbatch gradient scatters move the recipe's
# accumulator dtype (fp32 under mixed-fp32grad), not the gradient's: Llama 3
# reduce-scatters its gradients in FP32 (its paper, sec. 3.3.2). DeepSpeed's ZeRO
# reduces in the model's dtype unless told otherwise (`communication_data_type`).
ACCUMULATOR_SCATTER: frozenset[str] = frozenset({"megatron_zero2", "megatron_sp_zero2"})

"""The options of one layer kind on one logical mesh: the intra-op ILP's small Pareto set.

For each (kind, logical mesh) the ILP gives the fastest plan, the smallest (memory
first, time as tie-break) and one in between (`layer_options`). Each `LayerOption`
records time per microbatch, the once-per-iteration sync and update, persistent bytes
(params, grads, optimizer states) and, by liveness, what one microbatch stashes for its
backward and its peak (`costmodels.layer_memory`), with the layouts it was priced in.
Layers are keyed by their canonical structure (ops, shapes, dtypes, roles; names
dropped: `canonical_key`), so the 46 middle layers of GPT-3 39B are one kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from alpasim.costmodels import AnalyticCostModel, Cluster, CostModel
from alpasim.graphs import DTYPE_BYTES, OpGraph, get_recipe, in_weight_pass, is_heavy, makes_weight_grad, op_flops

from ._accumulation import unreduced_accumulation_s
from ._cache import digest
from ._context_parallel import kv_exchange_s
from ._intra_baselines import (ACCUMULATOR_SCATTER, BASELINES, PER_MICROBATCH_GRAD_SYNC, REWRITE_ALLOWED, grad_owners,
                               optimizer_state_shards, params_of_grads, unsliced_params, unsliced_state_bytes)
from ._intra_op import IntraOpInfeasible, min_memory_choice, solve_intra_op, solve_problem
from ._intra_plan import IntraOpPlan, realize
from ._intra_problem import build_problem
from ._mesh import LogicalMesh
from ._resharding import Collective
from ._spec import ShardingSpec
from ._tp_overlap import tp_overlap_s

INF = math.inf
# Memory-first ILP keeps this many microbatches of activations in flight when it looks
# for the smallest plan (a typical 1F1B depth; the table then applies the real one).
REFERENCE_INFLIGHT = 4
# Only look for an in-between option when the fastest plan is this much bigger.
PARETO_GAP = 1.5
TOP_HEAVY = 6
# Stage costs are estimates: a plan within 0.1% of the best is good enough, and proving
# the last 0.1% is most of HiGHS's time on two-axis meshes.
PLANNING_MIP_GAP = 1e-3
# A planning ILP that has not proven its optimum by then returns its incumbent (flagged
# in the option's `ilp_status`): one hard layer must not stall the whole table.
PLANNING_TIME_LIMIT_S = 15.0
# The memory-bounded Pareto points are the hardest MIPs (the budget binds); 1% of slack
# on them halves their time and only moves a point along a curve we sample coarsely.
PARETO_MIP_GAP = 1e-2
# The fastest plan at the least memory is a refinement of a plan already in hand (the
# least-memory solve's): it gets this long, then its incumbent, or that plan, flagged
# `time_limit`, stands in. So does the in-between point (without an incumbent it is
# left out; the fastest and the smallest plans bound the front). Near the memory frontier the budgeted MIP can be much harder
# than either end (a GPT block of hidden 256 on 2x2 with fused pricing: past 15 s at a
# 1 % budget, 1.2 s at 3 %).
PARETO_REFINE_TIME_LIMIT_S = 1.0
# HiGHS's presolve can loop past its time limit on memory-bounded layer problems (seen
# on MoE expert layers); these solves run without it (see `solve_ilp`).
PARETO_PRESOLVE = False


@dataclass(frozen=True, slots=True)
class LayerOption:
    """One intra-op plan of one layer kind on one logical mesh, summarised."""

    time_s: float               # forward + backward per microbatch (compute + communication)
    sync_s: float               # gradient sync + optimizer, once per iteration
    persistent_bytes: float
    activation_bytes: float
    param_specs: tuple[str, ...]                 # in the layer's canonical parameter order
    heavy: tuple[tuple[int, str, str], ...]      # (op index, strategy, output spec) of the heaviest ops
    ilp_status: str = "optimal"
    forward_s: float = 0.0                       # the forward share of time_s
    input_specs: tuple[str, ...] = ()            # layout of each layer-graph input, in `graph.inputs` order
    output_specs: tuple[str, ...] = ()           # layout of each layer-graph output, in `graph.outputs` order
    stash_bytes: float | None = None             # kept from forward to backward (None: = activation_bytes)
    # The split of persistent_bytes, and what the stage composition needs beyond it:
    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    tied: tuple[float, float, float] = (0.0, 0.0, 0.0)   # a tied copy's (param, grad, state) bytes, in the above
    gather_bytes: float = 0.0                    # parameters gathered before use (ZeRO-3's buffer)
    update_bytes: float = 0.0                    # the optimizer step's working set
    # The layout of every tensor of the layer graph, in `canonical_tensors` order: what
    # the option was priced with, so an executor runs exactly it (empty: from before).
    tensor_specs: tuple[str, ...] = ()
    # The weight-gradient collectives of the iteration (inside sync_s): their seconds
    # as priced one per gradient, and their bytes by (kind, mesh axes), which the table
    # re-prices in buckets that overlap the backward (`costmodels._overlap`).
    grad_sync_s: float = 0.0
    grad_groups: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    # Of time_s, the input gradients' collectives that run while a weight gradient
    # reading the same cotangent computes (`hidden_collectives_s`), hidden with overlap.
    hidden_s: float = 0.0
    # Of the backward's compute, what a zero-bubble schedule runs as W, and the bytes per
    # device of activations and cotangents W reads (held from B until W): `weight_pass`.
    weight_grad_s: float = 0.0
    weight_stash_bytes: float = 0.0
    # Of time_s, the tensor-parallel collectives that Transformer Engine's comm-GEMM
    # overlap hides (`_tp_overlap.tp_overlap_s`), and the forward's share of them.
    tp_hidden_s: float = 0.0
    tp_hidden_forward_s: float = 0.0
    # Of sync_s, the all-gathers that bring the updated parameters back to their layout
    # after a sharded optimizer step (the distributed optimizer's, ZeRO's): what
    # Megatron-core's --overlap-param-gather runs in the next forward. Priced one per
    # parameter; their bytes by mesh axes, which the overlap re-prices in buckets.
    param_gather_s: float = 0.0
    gather_groups: tuple[tuple[tuple[int, ...], float], ...] = ()
    # Of time_s, the weight gradients' reduce-scatters a sharded-gradient baseline runs
    # every microbatch (`_intra_baselines.PER_MICROBATCH_GRAD_SYNC`), and the same at
    # the bytes its system moves them in (`grad_scatters`): with gradient overlap they
    # run on a stream of their own beside the next work (`busy_s`, the simulator's
    # gradient stream), without it inline in the backward.
    grad_scatter_s: float = 0.0
    grad_scatter_stream_s: float = 0.0
    # What its plan's collectives move, by kind (`IntraOpPlan.collective_bytes`): the
    # plan records each stage's sum, and `alpasim run` compares the compiled programs
    # with it instead of solving the stage again.
    collective_bytes: tuple[tuple[str, float], ...] = ()
    # Each op's strategy (`Strategy.name`), in the layer graph's op order: with the
    # tensor layouts, what lets an executor rebuild the priced plan without a solve
    # (`_intra_op.replay_intra_op`).
    strategy_names: tuple[str, ...] = ()

    @property
    def tied_bytes(self) -> float:
        return sum(self.tied)

    def busy_s(self, overlap: bool, tp_overlap: bool = False) -> float:
        """Forward + backward per microbatch, less what overlap hides: with tensor-
        parallel overlap `tp_hidden_s` (its pairs include the backward's that `hidden_s`
        counts), else with gradient overlap `hidden_s`."""
        scatter = self.grad_scatter_s - (0.0 if overlap else self.grad_scatter_stream_s)
        if tp_overlap:
            return self.time_s - self.tp_hidden_s - scatter
        return (self.time_s - self.hidden_s if overlap else self.time_s) - scatter

    def forward_busy_s(self, tp_overlap: bool = False) -> float:
        """The forward per microbatch, less what tensor-parallel overlap hides of it."""
        return self.forward_s - self.tp_hidden_forward_s if tp_overlap else self.forward_s

    @property
    def inflight_bytes(self) -> float:
        """What each further microbatch in flight adds (seed eq. 5's mem_act)."""
        return self.activation_bytes if self.stash_bytes is None else min(self.stash_bytes, self.activation_bytes)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LayerOption:
        """An option from its JSON, validated (ValueError/TypeError/KeyError otherwise):
        every time and size a finite number >= 0, every spec a string. The disk cache
        reads entries through this, so a damaged entry is a miss (`DiskCache.get`)."""
        o = cls(d["time_s"], d["sync_s"], d["persistent_bytes"], d["activation_bytes"], tuple(d["param_specs"]),
                tuple(tuple(h) for h in d["heavy"]), d.get("ilp_status", "optimal"), d.get("forward_s", 0.0),
                tuple(d.get("input_specs", ())), tuple(d.get("output_specs", ())), d.get("stash_bytes"),
                d.get("params_bytes", 0.0), d.get("grads_bytes", 0.0), d.get("optimizer_bytes", 0.0),
                tuple(d.get("tied", (0.0, 0.0, 0.0))), d.get("gather_bytes", 0.0), d.get("update_bytes", 0.0),
                tuple(d.get("tensor_specs", ())), d.get("grad_sync_s", 0.0),
                tuple((str(k), tuple(int(a) for a in axes), b) for k, axes, b in d.get("grad_groups", ())),
                d.get("hidden_s", 0.0), d.get("weight_grad_s", 0.0), d.get("weight_stash_bytes", 0.0),
                d.get("tp_hidden_s", 0.0), d.get("tp_hidden_forward_s", 0.0), d.get("param_gather_s", 0.0),
                tuple((tuple(int(a) for a in axes), b) for axes, b in d.get("gather_groups", ())),
                d.get("grad_scatter_s", 0.0), d.get("grad_scatter_stream_s", 0.0),
                tuple((str(k), b) for k, b in d.get("collective_bytes", ())),
                tuple(str(n) for n in d.get("strategy_names", ())))
        numbers = [o.time_s, o.sync_s, o.persistent_bytes, o.activation_bytes, o.forward_s, o.params_bytes,
                   o.grads_bytes, o.optimizer_bytes, *o.tied, o.gather_bytes, o.update_bytes, o.grad_sync_s,
                   *(b for _, _, b in o.grad_groups), o.hidden_s, o.weight_grad_s, o.weight_stash_bytes,
                   o.tp_hidden_s, o.tp_hidden_forward_s, o.param_gather_s, *(b for _, b in o.gather_groups),
                   o.grad_scatter_s, o.grad_scatter_stream_s, *(b for _, b in o.collective_bytes)]
        if o.stash_bytes is not None:
            numbers.append(o.stash_bytes)
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
                raise ValueError(f"a layer option's times and sizes are finite numbers >= 0, got {x!r}")
        if len(o.tied) != 3:
            raise ValueError("a layer option's tied split has three terms")
        specs = (*o.param_specs, *o.input_specs, *o.output_specs, *o.tensor_specs)
        if not all(isinstance(x, str) for x in specs) or not isinstance(o.ilp_status, str):
            raise TypeError("a layer option's specs and status are strings")
        return o


def _sync_terms(restriction: str | None, layer: OpGraph, plan):
    """The layer option's `sync_s`, `grad_sync_s`, `grad_groups`, `param_gather_s` and
    `gather_groups`: `plan`'s once-an-iteration collectives, of them those that finish
    weight gradients in the backward (what can overlap it; by (kind, mesh axes) in
    bytes), and the all-gathers that return updated parameters to their layout (the
    loop-backs of a sharded optimizer step; by mesh axes). A recipe that reduces its
    accumulator whole (`graphs.PrecisionRecipe.reduce_whole`, DeepSpeed's
    BF16_Optimizer) all-reduces it over dp where the layout reduce-scatters it, and
    still gathers the stepped slices.

    A weight gradient is reduced once an iteration, after the microbatches' gradients
    are summed in the recipe's accumulator (`graphs.RECIPES`): Megatron-LM reduces its
    fp32 `main_grad` (a bf16 model's always: arguments.py turns on
    --accumulate-allreduce-grads-in-fp32 with --bf16). So each such collective is priced
    on the accumulator's bytes, not the 16-bit gradient the ILP placed it on.

    Under the distributed optimizer a weight gradient still all-reduced over the
    data-parallel axis (alone or with tp) is in Megatron-core's flat buffer
    (megatron/core/distributed/param_and_grad_buffer.py), which reduce-scatters every
    gradient (`grad_data`, padded to divide) and all-gathers the weights after the step
    (`param_data`, in the weights' dtype). So priced: a reduce-scatter (and an
    all-reduce over tp of what the layout sums there too), and the gather unless the
    parameter's step here is sliced, whose loop-back already gathers it
    (`_intra_baselines.unsliced_params`); a contribution to a parameter another layer
    updates (a tied copy's) too."""
    recipe, mesh = get_recipe(layer.meta.get("precision")), plan.mesh
    param_of_grad = params_of_grads(layer)
    sharded = optimizer_state_shards(restriction, mesh) > 1
    sliced = set(param_of_grad.values()) - unsliced_params(restriction, layer, plan.specs, mesh)
    sync_s, grad_s, gather_s = plan.sync_s + plan.update_s, 0.0, 0.0
    groups: dict[tuple[str, tuple[int, ...]], float] = {}
    gathers: dict[tuple[int, ...], float] = {}
    for p in plan.collectives:
        op, c = layer.op_by_name.get(p.op), p.collective
        if p.per_iteration and p.op.startswith("loop-back:") and c.kind == "all_gather":
            gather_s += c.time_s(mesh)
            gathers[tuple(c.axes)] = gathers.get(tuple(c.axes), 0.0) + c.nbytes
        if not p.per_iteration or op is None or op.phase != "backward":
            continue
        owners = grad_owners(op, param_of_grad)
        accumulated = c.nbytes * _accumulator_width(layer, op, owners, recipe)
        keys = [(c.kind, tuple(c.axes))]
        if recipe.reduce_whole and c.kind == "reduce_scatter" and 0 in c.axes:
            keys = [("all_reduce", tuple(c.axes))]      # the whole accumulator, then a slice stepped
        if sharded and c.kind == "all_reduce" and 0 in c.axes:
            # The flat buffer's reduce-scatter over dp; a sum over tp besides (a sequence-
            # parallel norm's gradient: Megatron-core's _allreduce_layernorm_grads) stays an
            # all-reduce there. A recipe that reduces its accumulator whole all-reduces it.
            rest = tuple(a for a in c.axes if a != 0)
            if not recipe.reduce_whole:
                keys = [("reduce_scatter", (0,))] + ([("all_reduce", rest)] if rest else [])
            if not set(owners.values()) & sliced:                             # no loop-back gathers it
                gather = Collective("all_gather", c.nbytes, (0,)).time_s(mesh)    # the weights, in their dtype
                gather_s, sync_s = gather_s + gather, sync_s + gather
                gathers[(0,)] = gathers.get((0,), 0.0) + c.nbytes
        sync_s -= c.time_s(mesh)
        for key in keys:
            t = Collective(key[0], accumulated, key[1]).time_s(mesh)
            grad_s, sync_s = grad_s + t, sync_s + t
            groups[key] = groups.get(key, 0.0) + accumulated
    return (sync_s, grad_s, tuple((k, axes, b) for (k, axes), b in sorted(groups.items())), gather_s,
            tuple(sorted(gathers.items())))


def _accumulator_width(layer: OpGraph, op, owners: Mapping[int, str], recipe) -> float:
    """How many times the bytes of the gradient `op` makes (its first gradient output,
    `owners`) the recipe's accumulator holds: 2 for a 16-bit gradient summed in fp32."""
    dtype = layer.tensors[op.outputs[min(owners, default=0)]].dtype
    return DTYPE_BYTES[recipe.grad_dtype(dtype)] / DTYPE_BYTES[dtype]


def grad_scatters(restriction: str | None, layer: OpGraph, plan) -> tuple[float, float]:
    """(seconds as the ILP priced them, seconds at the bytes the system moves) of the
    weight gradients' reduce-scatters that `plan` runs every microbatch under a
    sharded-gradient baseline (`_intra_baselines.PER_MICROBATCH_GRAD_SYNC`); (0, 0)
    otherwise. Under `ACCUMULATOR_SCATTER` they move the recipe's accumulator (fp32
    gradients, as Llama 3 reduce-scattered them), else the gradient's own dtype."""
    if restriction not in PER_MICROBATCH_GRAD_SYNC:
        return 0.0, 0.0
    recipe, mesh = get_recipe(layer.meta.get("precision")), plan.mesh
    param_of_grad = params_of_grads(layer)
    priced = moved = 0.0
    for p in plan.collectives:
        op, c = layer.op_by_name.get(p.op), p.collective
        if p.per_iteration or op is None or op.phase != "backward" or c.kind != "reduce_scatter":
            continue
        owners = grad_owners(op, param_of_grad)
        if not owners:
            continue
        width = _accumulator_width(layer, op, owners, recipe) if restriction in ACCUMULATOR_SCATTER else 1.0
        priced += c.time_s(mesh)
        moved += Collective(c.kind, c.nbytes * width, c.axes).time_s(mesh)
    return priced, moved


def weight_pass(layer: OpGraph, plan) -> tuple[float, float]:
    """(compute seconds, bytes per device held from B until W) of a zero-bubble
    schedule's W pass (`graphs.in_weight_pass`, the split the runtimes run): what W
    reads that it does not make itself, parameters aside, is what B hands it. A tied
    gradient another stage sends is summed once an iteration, not held per microbatch."""
    carried = set(layer.meta.get("tied_grads", ()))
    backward = [op for op in layer.ops if op.phase == "backward"]
    seconds, read, made = 0.0, {}, set()
    for op, weight in zip(backward, in_weight_pass(backward, layer.tensors), strict=True):
        if not weight:
            continue
        seconds += plan.strategies[op.name].compute_s
        for t in op.inputs:
            if t not in made and t not in carried and layer.tensors[t].role != "param" and t in plan.specs:
                read[t] = layer.tensors[t].nbytes / plan.specs[t].num_shards(plan.mesh)
        made.update(op.outputs)
    return seconds, float(sum(read.values()))


def hidden_collectives_s(layer: OpGraph, plan) -> float:
    """Seconds of per-microbatch collectives that independent compute hides, as
    Megatron-LM's asynchronous tensor-parallel all-reduce does: an input gradient's
    reduction (dX = dY W^T, a partial sum over the split dimension) runs while the
    weight gradient that reads the same cotangent (dW = X^T dY) computes, since neither
    needs the other. Each weight gradient's compute hides at most once; nothing else
    is assumed to overlap."""
    readers: dict[str, list[str]] = {}
    for op in layer.ops:
        if op.phase == "backward" and makes_weight_grad(op, layer.tensors):
            for t in op.inputs:
                readers.setdefault(t, []).append(op.name)
    left = {name: plan.strategies[name].compute_s for names in readers.values() for name in names}
    hidden = 0.0
    for op in layer.ops:
        if op.phase != "backward" or op.name in left:
            continue
        s = plan.strategies[op.name]
        sync = s.sync or (False,) * len(s.collectives)
        comm = sum(c.time_s(plan.mesh) for c, x in zip(s.collectives, sync) if not x)
        for t in op.inputs:
            for name in readers.get(t, ()):
                take = min(comm, left[name])
                hidden, comm, left[name] = hidden + take, comm - take, left[name] - take
    return hidden


def read_options(value: Any) -> list[LayerOption]:
    """A cached list of layer options (`DiskCache.get`'s reader): a non-empty list."""
    if not isinstance(value, list) or not value:
        raise ValueError("a cached entry of layer options is a non-empty list")
    return [LayerOption.from_json(d) for d in value]


# Op params that change the values an op computes but not its cost or layouts: a dropout
# mask's seed differs from layer to layer, and layers of one kind still share a plan.
VALUE_ONLY_PARAMS = frozenset({"seed"})


def canonical_key(graph: OpGraph) -> str:
    """A digest of a layer's structure with names replaced by first-appearance indices
    (`VALUE_ONLY_PARAMS` left out)."""
    index: dict[str, int] = {}

    def ref(t: str) -> int:
        return index.setdefault(t, len(index))

    ops = []
    for op in graph.ops:
        ops.append([op.prim, op.phase, [[k, v] for k, v in op.params if k not in VALUE_ONLY_PARAMS],
                    [[ref(t), list(graph.tensors[t].shape), graph.tensors[t].dtype, graph.tensors[t].role]
                     for t in op.inputs],
                    [[ref(t), list(graph.tensors[t].shape), graph.tensors[t].dtype, graph.tensors[t].role]
                     for t in op.outputs]])
    outputs = sorted(index[t] for t in graph.outputs if t in index)
    return digest({"ops": ops, "outputs": outputs})


def canonical_tensors(graph: OpGraph) -> list[str]:
    """The layer graph's tensors in first-appearance order over its ops' inputs and
    outputs: the order `canonical_key` numbers them in, so two layers of one kind list
    corresponding tensors at the same positions."""
    return list(dict.fromkeys(t for op in graph.ops for t in (*op.inputs, *op.outputs)))


def layer_tensor_specs(layer: OpGraph, option: LayerOption) -> dict[str, str]:
    """Tensor -> layout of `layer` (any layer of the option's kind) under `option`."""
    if not option.tensor_specs:
        return {}
    return {t: s for t, s in zip(canonical_tensors(layer), option.tensor_specs, strict=True) if s}


def canonical_params(graph: OpGraph) -> list[str]:
    """The layer's parameters in the order its ops first read them."""
    params = {p.name for p in graph.params}
    return list(dict.fromkeys(t for op in graph.ops for t in op.inputs if t in params))


def mesh_key(mesh: LogicalMesh) -> list:
    return [[a.size, a.link.bandwidth_gbps, a.link.latency_s, a.message_link.bandwidth_gbps,
             a.message_link.latency_s, *([a.link.sweep.to_json()] if a.link.sweep is not None else [])]
            for a in mesh.axes]


def layer_options(layer: OpGraph, mesh: LogicalMesh, cluster: Cluster, microbatches: int,
                  restriction: str | None = None, pareto: bool = True,
                  cost_model: CostModel | None = None) -> list[LayerOption]:
    """The Pareto set of plans of one layer on one mesh (see the module doc).

    With a `restriction` (a baseline of `_intra_baselines.BASELINES`: data parallel,
    Megatron-LM, ZeRO, ...) the layer gets that baseline's single plan instead: a
    hand-designed system has one layout per configuration, not a memory trade-off.
    `pareto=False` keeps only the fastest plan (for graphs with many distinct layers).
    `cost_model` prices ops (None: `AnalyticCostModel(cluster)`)."""
    model = AnalyticCostModel(cluster) if cost_model is None else cost_model
    params = canonical_params(layer)
    heavy = sorted((i for i, op in enumerate(layer.ops) if is_heavy(op)),
                   key=lambda i: -op_flops(layer.ops[i], layer.tensors))[:TOP_HEAVY]

    def summarise(plan, status: str) -> LayerOption:
        mem = plan.memory
        shards = optimizer_state_shards(restriction, mesh)
        t_param, t_grad, t_opt = tied_copy_bytes(layer, plan.specs, mesh, shards)
        # Megatron-core's flat buffer shards the states the layouts could not slice.
        opt = mem.optimizer_bytes - unsliced_state_bytes(restriction, layer, plan.specs, mesh) * (1 - 1 / shards)
        sync_s, grad_sync_s, grad_groups, param_gather_s, gather_groups = _sync_terms(restriction, layer, plan)
        kv_forward, kv_backward = kv_exchange_s(layer, plan, mesh, cluster, model)     # context parallelism's
        accumulate = unreduced_accumulation_s(layer, plan, model)      # DeepSpeed's BF16_Optimizer pass
        weight_s, weight_bytes = weight_pass(layer, plan)
        return LayerOption(plan.time_s + kv_forward + kv_backward + accumulate, sync_s,
                           mem.params_bytes + mem.grads_bytes + opt + t_grad + t_opt,
                           mem.activations_peak_bytes, tuple(str(plan.specs[p]) for p in params),
                           tuple((i, plan.strategies[layer.ops[i].name].name,
                                  "/".join(map(str, plan.strategies[layer.ops[i].name].out_specs))) for i in heavy),
                           status, plan.forward_s + kv_forward, tuple(str(plan.specs[t]) for t in layer.inputs),
                           tuple(str(plan.specs[t]) for t in layer.outputs), mem.stash_bytes,
                           mem.params_bytes, mem.grads_bytes + t_grad, opt + t_opt,
                           (t_param, t_grad, t_opt), gathered_param_bytes(layer, plan), mem.update_bytes,
                           tuple(str(plan.specs[t]) if t in plan.specs else "" for t in canonical_tensors(layer)),
                           grad_sync_s, grad_groups, hidden_collectives_s(layer, plan),
                           weight_s + accumulate, weight_bytes,       # the pass runs in W (in_weight_pass)
                           *tp_overlap_s(layer, plan), param_gather_s, gather_groups,
                           *grad_scatters(restriction, layer, plan), tuple(sorted(plan.collective_bytes().items())),
                           tuple(plan.strategies[op.name].name for op in layer.ops))

    kw = restricted_solve_kwargs(restriction, layer, mesh, model)
    fast = solve_intra_op(layer, mesh, model, with_compute=True, microbatches=microbatches, mip_gap=PLANNING_MIP_GAP,
                          time_limit_s=PLANNING_TIME_LIMIT_S, **kw)
    options = [summarise(fast.plan, fast.status)]
    if restriction is not None or not pareto:
        return options
    # The least memory is proven to within PARETO_MIP_GAP, so the fastest plan is looked
    # for within that much of it: a tighter budget than the bound is known to would ask
    # the MIP to separate plans the first solve could not tell apart (an imported GPT
    # block on 2x2: 15 s to the time limit at 0.1 %, 1.2 s at 1 %, and a plan 12 % faster).
    least, small = min_memory_choice(fast.problem, activation_multiplier=REFERENCE_INFLIGHT,
                                     slack=PARETO_MIP_GAP, mip_gap=PARETO_MIP_GAP,
                                     time_limit_s=PLANNING_TIME_LIMIT_S, presolve=PARETO_PRESOLVE,
                                     refine_time_limit_s=PARETO_REFINE_TIME_LIMIT_S)
    if small is not None:
        options.append(summarise(small.plan, small.status))
        big = fast.plan.memory.with_inflight(REFERENCE_INFLIGHT)
        if big > PARETO_GAP * least and least > 0:
            try:
                mid = solve_problem(fast.problem, memory_budget_bytes=math.sqrt(big * least),
                                    activation_multiplier=REFERENCE_INFLIGHT, mip_gap=PARETO_MIP_GAP,
                                    time_limit_s=PARETO_REFINE_TIME_LIMIT_S, presolve=PARETO_PRESOLVE,
                                    sample=True)
                options.append(summarise(mid.plan, mid.status))
            except (IntraOpInfeasible, RuntimeError):
                pass
    options.sort(key=lambda o: (o.time_s + o.sync_s / microbatches, o.persistent_bytes))
    front: list[LayerOption] = []
    for o in options:  # keep only options that save memory for the time they cost
        if all(_reference_bytes(o) < _reference_bytes(p) for p in front):
            front.append(o)
    return front


def tied_copy_bytes(layer: OpGraph, specs, mesh: LogicalMesh, state_shards: int = 1) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per device of the tied parameters `layer` reads but
    whose update lives in another layer (the LM head's copy of the word embedding).
    Megatron-LM gives such a copy its own gradient and optimizer state on the last stage
    and all-reduces the two copies' gradients once per iteration (priced as the
    per-iteration gradient transfer, `stage_transfers`); a stage holding both counts
    the table once (`_assemble` subtracts the copy). `state_shards`: the devices its
    master weight and Adam moments are split over beyond the weight's own layout (the
    data-parallel degree under Megatron-core's distributed optimizer)."""
    recipe = get_recipe(layer.meta.get("precision"))
    updated = {op.inputs[0] for op in layer.ops if op.prim == "adam"}
    param = grad = opt = 0.0
    for p in layer.params:
        if p.name in updated or p.name not in specs:
            continue
        per_device = p.nbytes / specs[p.name].num_shards(mesh)
        grad_item = recipe.grad_bytes(p.dtype)
        # Beyond the weight and its gradient: Adam's fp32 m and v, and an fp32 master for 16-bit weights.
        state_bytes = recipe.bytes_per_param(p.dtype) - p.itemsize - grad_item
        param += per_device
        grad += per_device * grad_item / p.itemsize
        opt += per_device * state_bytes / p.itemsize / state_shards
    return param, grad, opt


# DeepSpeed's ZeRO-3 prefetches the next layer's parameters while one layer runs, so
# two layers' gathered parameters can be held at once.
GATHER_BUFFERS = 2


def gathered_param_bytes(layer: OpGraph, plan) -> float:
    """Bytes per device of the layer's parameters as their readers need them, for those
    stored more finely sharded than that (ZeRO-3 stores 1/N and gathers before each
    use), times `GATHER_BUFFERS`; 0 for a plan that stores what it reads."""
    total = 0.0
    for p in layer.params:
        stored = plan.specs.get(p.name)
        if stored is None:
            continue
        held = stored.num_shards(plan.mesh)
        need = held
        for op in layer.consumers.get(p.name, ()):
            s = plan.strategies.get(op.name)
            if s is None or op.phase == "update":
                continue
            for t, spec in zip(op.inputs, s.in_specs):
                if t == p.name:
                    need = min(need, spec.num_shards(plan.mesh))
        if need < held:
            total += p.nbytes / need
    return GATHER_BUFFERS * total


def restricted_solve_kwargs(restriction: str | None, layer: OpGraph, mesh: LogicalMesh, model) -> dict:
    """`solve_intra_op` keywords that turn the ILP into the named baseline."""
    if restriction is None:
        return {}
    if restriction not in BASELINES:
        raise ValueError(f"unknown intra-op restriction {restriction!r}; choose one of {', '.join(BASELINES)}")
    restrict, leaf_specs = BASELINES[restriction](layer, mesh, model)
    return {"restrict": restrict, "leaf_specs": leaf_specs, "rewrite": REWRITE_ALLOWED.get(restriction, False),
            "allow_replicated_heavy": True}


def replay_intra_op(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, layers: Sequence[OpGraph],
                    strategies: Sequence[Sequence[str]], specs: Mapping[str, ShardingSpec], *,
                    microbatches: int = 1, restriction: str | None = None) -> IntraOpPlan:
    """The plan its layers were priced with, rebuilt with no solve from what the plan
    recorded: each op's strategy (`LayerOption.strategy_names`, named among the
    choices its own layer graph offered under `restriction`, as it was solved) and each
    leaf's layout. Every op is then fixed to its one strategy, so the stage's problem has
    a single choice per node. `ValueError` where a name is not exactly one choice."""
    chosen: dict[str, list] = {}
    offered: dict[str, list] = {}     # a layer kind's choices by op position, as the planner solved it once
    for layer, names in zip(layers, strategies, strict=True):
        kind = canonical_key(layer)
        if kind not in offered:
            kw = restricted_solve_kwargs(restriction, layer, mesh, cost_model)
            solved = build_problem(layer, mesh, cost_model, with_compute=True, microbatches=microbatches,
                                   allow_replicated_heavy=kw.get("allow_replicated_heavy", False),
                                   restrict=kw.get("restrict"), leaf_specs=kw.get("leaf_specs"))
            offered[kind] = [solved.strategies[op.name] for op in layer.ops]
        for op, options, name in zip(layer.ops, offered[kind], names, strict=True):
            match = [s for s in options if s.name == name]
            if len(match) != 1:
                raise ValueError(f"{graph.name}: op {op.name}'s recorded strategy {name!r} is {len(match)} of its "
                                 f"choices on a {mesh} mesh, not one")
            chosen[op.name] = match
    leaves = {t: [specs[t]] for t in graph.tensors if t not in graph.producer and t in specs}
    problem = build_problem(graph, mesh, cost_model, with_compute=True, microbatches=microbatches,
                            allow_replicated_heavy=True, restrict=chosen, leaf_specs=leaves)
    return realize(problem, (0,) * len(problem.nodes))


def _reference_bytes(o: LayerOption) -> float:
    """An option's memory with `REFERENCE_INFLIGHT` microbatches in flight (eq. 5)."""
    return o.persistent_bytes + o.activation_bytes + (REFERENCE_INFLIGHT - 1) * o.inflight_bytes

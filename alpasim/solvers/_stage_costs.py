"""The stage cost table t_intra(layers k..i, submesh, stages after) from the intra-op ILP.

Solving one ILP per (layer range, submesh, logical view, stages-after) is what made
Alpa's compilation take 40 minutes. We solve per *layer kind* instead and compose:

1. Layers are keyed by their canonical structure (ops, shapes, dtypes, roles; names
   dropped), so the 46 middle layers of GPT-3 39B are one kind, solved once per
   logical mesh — in memory and on disk (`_cache.DiskCache`), across runs.
2. For each (kind, logical mesh) the ILP gives a small Pareto set of plans: the fastest,
   the smallest (memory first, time as tie-break) and one in between. Each option
   records time per microbatch, once-per-iteration sync/update time, persistent bytes
   (params, grads, optimizer states) and, by liveness, what one microbatch stashes for
   its backward and its peak (`costmodels.layer_memory`).
3. A stage k..i on a view sums its layers' options (prefix sums; one option index for
   the whole stage); its memory is `costmodels.stage_memory` with min(s, B)
   microbatches in flight (seed eq. 5, s = stages from this one to the end): persistent
   + in-flight stashes + the one running layer's working set + buffers, never a sum of
   per-layer peaks. It takes the fastest option that fits the device; a submesh takes
   its fastest logical view. Infeasible = inf.

What the composition ignores, and why it is acceptable: resharding between two layers
of a stage whose plans disagree on the boundary layout (layers of one kind share a
plan, and the boundary is the residual stream, batch-sharded in practice) and mixing
options inside a stage (a finer knapsack could fit a little more in memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from alpasim.costmodels import (
    DEFAULT_BUCKET_BYTES,
    AnalyticCostModel,
    Cluster,
    CostModel,
    LayerMemory,
    LayerSync,
    StageMemory,
    bucket_count,
    bucket_schedule,
    carry_peak,
    exposed_s,
    gather_exposed_s,
    range_max,
    range_peak,
    stage_memory,
)
from alpasim.graphs import (DTYPE_BYTES, OpGraph, get_recipe, in_weight_pass, is_heavy, makes_weight_grad, op_flops,
                            layer_stage_graphs)

from ._cache import CACHE_VERSION, DiskCache, digest
from ._intra_baselines import (ACCUMULATOR_SCATTER, BASELINES, DISTRIBUTED_OPTIMIZER, PER_MICROBATCH_GRAD_SYNC,
                               REWRITE_ALLOWED, grad_owners,
                               optimizer_state_shards, params_of_grads, unsliced_params, unsliced_state_bytes)
from ._accumulation import unreduced_accumulation_s
from ._context_parallel import cp_cache_key, kv_exchange_s
from ._intra_op import IntraOpInfeasible, min_memory_choice, solve_intra_op, solve_problem
from ._mesh import LogicalMesh
from ._resharding import Collective
from ._spec import ShardingSpec
from ._submesh import SubmeshShape, logical_mesh, logical_shapes, submesh_shapes
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
                tuple((str(k), b) for k, b in d.get("collective_bytes", ())))
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


def scatter_tail_s(scatter_s: float, busy_s: float, microbatches: int) -> float:
    """What a gradient-scatter stream leaves after the last backward: each of the
    `microbatches` backwards adds `scatter_s` to the stream as it ends, and the work
    between two backwards (`busy_s`, a microbatch's forward and backward) runs beside
    it. The last microbatch's scatters always run after, and where the stream is
    slower than the compute it falls behind by the difference every microbatch."""
    if scatter_s <= 0:
        return 0.0
    return scatter_s + max(0.0, (microbatches - 1) * (scatter_s - busy_s))


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


def job_weight(layer: OpGraph, mesh: LogicalMesh) -> float:
    """A rough relative cost of one layer job, for ordering a pool's work: the ILP grows
    with the ops and with the strategies per op, which a second live mesh axis
    multiplies (measured: a GPT block on 2x4 takes several times its time on 1x8)."""
    live = sum(1 for n in mesh.shape if n > 1)
    return len(layer.ops) * (1, 2, 8)[live]


def layer_graphs(graph: OpGraph) -> list[OpGraph]:
    """`stage_graph(graph, l, l)` of every layer, memoised on the graph (graphs are not
    changed once built; a baseline's grid slices one graph many times)."""
    memo = graph.__dict__.get("_solvers_layer_graphs")
    if memo is None:
        memo = graph.__dict__["_solvers_layer_graphs"] = layer_stage_graphs(graph)
    return memo


def mirrored_views(meshes: Sequence[LogicalMesh]) -> set[int]:
    """Indices of the views to leave out because another view is the same 1-D mesh
    with its axes swapped: (n, 1) beside (1, n), the same n devices on the same link.
    The unrestricted ILP then solves the same problem with the axis renamed, so the
    (n, 1) twin would cost an ILP per layer kind for nothing; (1, n) stays (model
    parallelism on the inner axis, as Megatron-LM lays it out). Two-axis views such as
    (2, 4) and (4, 2) are both kept: a dimension split over both axes is S01 (axis 0
    major) on each, which nests inside different one-axis splits, so their optima
    differ (by 0.3-1.3 % on the layers of `test_intra_ilp`). A baseline may give each
    axis a role, so restricted searches keep every view."""
    drop = set()
    for m, mesh in enumerate(meshes):
        if mesh.shape[1] != 1 or mesh.shape[0] == 1:
            continue
        swapped = (mesh.axes[1], mesh.axes[0])
        if any(t != m and other.axes == swapped for t, other in enumerate(meshes)):
            drop.add(m)
    return drop


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
                           *grad_scatters(restriction, layer, plan), tuple(sorted(plan.collective_bytes().items())))

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


def _reference_bytes(o: LayerOption) -> float:
    """An option's memory with `REFERENCE_INFLIGHT` microbatches in flight (eq. 5)."""
    return o.persistent_bytes + o.activation_bytes + (REFERENCE_INFLIGHT - 1) * o.inflight_bytes


def _options_job(job: tuple) -> list[dict]:
    """Top-level (picklable) unit of work for a process pool or a Ray task."""
    layer, mesh, cluster, microbatches, restriction, pareto, cost_model = job
    return [o.to_json() for o in layer_options(layer, mesh, cluster, microbatches, restriction, pareto, cost_model)]


def cost_model_key(cost_model: CostModel | None) -> str | None:
    """What a cache key records of the cost model: None for the analytic one (so keys
    made before profiled models existed stay valid), else the model's `digest`."""
    if cost_model is None or isinstance(cost_model, AnalyticCostModel):
        return None
    key = getattr(cost_model, "digest", None)
    if not isinstance(key, str):
        raise TypeError(f"cost model {type(cost_model).__name__} has no `digest` to key the stage-cost cache")
    return key


@dataclass
class StageCosts:
    """t(k..i, shape, s) with what realises each entry."""

    cost: np.ndarray                    # (L, L, shapes, S) seconds per microbatch (sync amortised), inf if none
    view: np.ndarray                    # (L, L, shapes, S) index into `meshes` of the winning view
    option: np.ndarray                  # (L, L, shapes, S) option index used
    memory: np.ndarray                  # (L, L, shapes, S) per-device bytes of the winner
    least: np.ndarray                   # (L, L, shapes, S) least per-device bytes of any view and option
    shapes: list[SubmeshShape]
    meshes: list[tuple[SubmeshShape, tuple[int, int], LogicalMesh]]
    layer_kind: list[str]               # kind key of each layer
    layer_graphs: list[OpGraph]         # each layer's own graph (forward, backward, update)
    options: dict[tuple[str, int], list[LayerOption]]   # (kind, mesh index) -> options
    ilp_jobs: int
    cache_hits: int
    min_memory_bytes: float             # least per-device memory any stage of one layer needs
    tied_owner: list[TiedCopy | None] = None  # per layer: a tied copy of another layer's parameter
    bucket_bytes: float | None = None   # gradient buckets overlapping the backward (None: no overlap)
    tp_overlap: bool = False            # tensor-parallel collectives overlapped with GEMMs (`LayerOption.busy_s`)
    gather_overlap: bool = False        # buckets' parameter all-gathers in the next forward (`costmodels._overlap`)
    microbatches: int = 1               # the iteration's (a gradient-scatter stream's tail, `scatter_tail_s`)


def build_stage_costs(graph: OpGraph, cluster: Cluster, microbatches: int, *, max_stages: int | None = None,
                      map_fn: Callable[[Callable, Iterable], Iterable] = map, cache: DiskCache | None = None,
                      progress: Callable[[int, int], None] | None = None, restriction: str | None = None,
                      shape_ok: Callable[[SubmeshShape], bool] | None = None,
                      views_of: Callable[[SubmeshShape], Sequence[tuple[int, int]]] | None = None,
                      pareto: bool = True, cost_model: CostModel | None = None,
                      bucket_bytes: float | None = DEFAULT_BUCKET_BYTES, tp_overlap: bool = False,
                      gather_overlap: bool = False) -> StageCosts:
    """The table for `graph`; `restriction` names an intra-op baseline every layer is
    solved under, `shape_ok` narrows the submesh shapes and `views_of` replaces the
    logical views of a shape (baselines that only pipeline, or fix their mesh layout).
    A `cost_model` prices the ops, and its cluster replaces `cluster`: a profiled
    model's cluster carries the measured link, which the meshes then price with.
    `bucket_bytes`: the weight gradients are reduced in buckets of this size that
    overlap the last backward (`costmodels._overlap`); None: one collective per
    gradient after the backward (the paper's accounting). `tp_overlap`: tensor-parallel
    collectives run beside their GEMMs (`_tp_overlap`), as Megatron-core's
    `--tp-comm-overlap` runs them. `gather_overlap` (under the distributed optimizer's
    restrictions, with `bucket_bytes`): each bucket is a reduce-scatter in the backward
    and an all-gather in the next forward, as Megatron-core's distributed optimizer runs
    them with `--overlap-param-gather`."""
    gather_overlap = gather_overlap and bucket_bytes is not None and restriction in DISTRIBUTED_OPTIMIZER
    if cost_model is not None:
        cluster = cost_model.cluster
    cache = cache or DiskCache(enabled=False)
    num_layers = graph.num_layers
    shapes = [sh for sh in submesh_shapes(cluster.nodes, cluster.devices_per_node) if shape_ok is None or shape_ok(sh)]
    meshes = []
    for shape in shapes:
        devices = list(range(shape.size))
        views = logical_shapes(shape, cluster.devices_per_node) if views_of is None else views_of(shape)
        of_shape = [logical_mesh(cluster, devices, view) for view in views]
        drop = mirrored_views(of_shape) if restriction is None else set()
        for k, (view, mesh) in enumerate(zip(views, of_shape)):
            if k not in drop:
                meshes.append((shape, tuple(view), mesh))
    layers = layer_graphs(graph)
    kinds = [canonical_key(g) for g in layers]
    first_of_kind = {k: layers[i] for i, k in reversed(list(enumerate(kinds)))}
    memory = float(cluster.device.memory_bytes)
    device_key = [cluster.device.name, sorted(cluster.device.to_json().items())]
    model_key = cost_model_key(cost_model)

    options: dict[tuple[str, int], list[LayerOption]] = {}
    pending, solved = [], []
    for kind, layer in first_of_kind.items():
        for m, (_, _, mesh) in enumerate(meshes):
            parts = [CACHE_VERSION, kind, mesh_key(mesh), microbatches, device_key, restriction, pareto,
                     get_recipe(layer.meta.get("precision")).to_json(), *cp_cache_key(layer, mesh, cluster)]
            key = digest(parts if model_key is None else parts + [model_key])
            hit = cache.get(key, read=read_options)
            if hit is not None:
                options[(kind, m)] = hit
                continue
            pending.append((layer, mesh, cluster, microbatches, restriction, pareto, cost_model))
            solved.append((kind, m, key))
    # Longest jobs first (a layer's ops on a mesh with two live axes are the hard ILPs),
    # so that a pool ends on short jobs instead of one worker finishing a long one alone.
    order = sorted(range(len(pending)), key=lambda j: -job_weight(pending[j][0], pending[j][1]))
    pending, solved = [pending[j] for j in order], [solved[j] for j in order]
    total = len(pending)
    for n, (result, (kind, m, key)) in enumerate(zip(map_fn(_options_job, pending), solved), 1):
        options[(kind, m)] = read_options(result)
        cache.put(key, result)
        if progress is not None:
            progress(n, total)
    owners = tied_owners(graph, layers)
    costs = _assemble(kinds, options, meshes, shapes, memory, microbatches, num_layers,
                      max_stages or min(num_layers, cluster.num_devices), owners, layers, bucket_bytes, tp_overlap,
                      gather_overlap)
    least = min((o.persistent_bytes + o.activation_bytes for opts in options.values() for o in opts), default=INF)
    return StageCosts(*costs, shapes, meshes, kinds, layers, options, total, cache.hits, least, owners,
                      bucket_bytes, tp_overlap, gather_overlap, microbatches)


@dataclass(frozen=True, slots=True)
class TiedCopy:
    """A layer that reads a parameter another layer (`owner`) updates; `outputs` index
    the layer graph's outputs its backward hands to the owner (gradient contributions)."""

    owner: int
    outputs: tuple[int, ...]


def tied_owners(graph: OpGraph, layers: Sequence[OpGraph]) -> list[TiedCopy | None]:
    """For each layer, its `TiedCopy` (the LM head reading the word embedding), or None."""
    owner = {op.inputs[0]: op.layer for op in graph.ops if op.prim == "adam"}
    readers: dict[str, set[int]] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers.setdefault(t, set()).add(op.layer)
    out: list[TiedCopy | None] = []
    for l, lg in enumerate(layers):
        updated = {op.inputs[0] for op in lg.ops if op.prim == "adam"}
        others = [owner[p.name] for p in lg.params if p.name not in updated and owner.get(p.name, l) != l]
        if not others:
            out.append(None)
            continue
        backward = {t for op in lg.ops if op.phase == "backward" for t in op.outputs}
        outs = tuple(k for k, t in enumerate(lg.outputs) if t in backward and others[0] in readers.get(t, ()))
        out.append(TiedCopy(others[0], outs))
    return out


def carry_bytes(layer: OpGraph, o: LayerOption, copy: TiedCopy, mesh: LogicalMesh) -> float:
    """Per-device bytes of what the copy's backward hands its owner, in the option's layouts."""
    total = 0.0
    for k in copy.outputs:
        t = layer.tensors[layer.outputs[k]]
        shards = ShardingSpec.parse(o.output_specs[k]).num_shards(mesh) if o.output_specs else 1
        total += t.nbytes / shards
    return total


def compose_stage(opts: Sequence[LayerOption], inflight: int, drop_tied: bool = False,
                  carries: Sequence[tuple[int, int, float]] = ()) -> StageMemory:
    """`costmodels.stage_memory` of a stage running `opts` (one option per layer, in
    order). `drop_tied`: the stage also holds the owner of the tied copies among them,
    which are then counted once, and `carries` (from, to, bytes), indices into `opts`,
    are their gradient contributions held from the copy's backward to the owner's."""
    layers = [LayerMemory(o.inflight_bytes, o.activation_bytes) for o in opts]
    tied = [sum(o.tied[i] for o in opts) if drop_tied else 0.0 for i in range(3)]
    return stage_memory(layers, params_bytes=sum(o.params_bytes for o in opts) - tied[0],
                        grads_bytes=sum(o.grads_bytes for o in opts) - tied[1],
                        optimizer_bytes=sum(o.optimizer_bytes for o in opts) - tied[2],
                        inflight=inflight, buffer_bytes=max((o.gather_bytes for o in opts), default=0.0),
                        carries=carries, update_bytes=max((o.update_bytes for o in opts), default=0.0))


def _in_buckets(kind: str, nbytes: float, axes: tuple[int, ...], n: int, mesh: LogicalMesh) -> float:
    """Seconds of `nbytes` moved by `kind` in `n` equal buckets, each its own collective."""
    return n * Collective(kind, nbytes / n, axes).time_s(mesh) if n else 0.0


def layer_sync(o: LayerOption, mesh: LogicalMesh, bucket_bytes: float, tp_overlap: bool = False) -> LayerSync:
    """The option's backward and its gradient collectives re-priced in buckets of
    `bucket_bytes` (each bucket one collective of its own size)."""
    seconds, count = 0.0, 0
    for kind, axes, nbytes in o.grad_groups:
        n = bucket_count(nbytes, bucket_bytes)
        seconds += _in_buckets(kind, nbytes, axes, n, mesh)
        count += n
    return LayerSync(max(o.busy_s(True, tp_overlap) - o.forward_busy_s(tp_overlap), 0.0), seconds, count)


def layer_gathers(o: LayerOption, mesh: LogicalMesh, bucket_bytes: float) -> float:
    """The option's parameter all-gathers' seconds in the next forward, with
    Megatron-core's `--overlap-param-gather` (`costmodels._overlap`): the step's
    gathers (those of the sliced states and a flat buffer's weights, `_sync_terms`) in
    the buckets of the gradients they come from (param_and_grad_buffer.py: a bucket's
    `param_data` is gathered as one, as its `grad_data` is reduce-scattered)."""
    seconds = 0.0
    for axes, nbytes in o.gather_groups:
        grads = sum(b for _, a, b in o.grad_groups if a == axes)
        seconds += _in_buckets("all_gather", nbytes, axes, bucket_count(grads or nbytes, bucket_bytes), mesh)
    return seconds


def stage_sync(opts: Sequence[LayerOption], mesh: LogicalMesh, bucket_bytes: float | None,
               tp_overlap: bool = False, gather_overlap: bool = False
               ) -> tuple[tuple[tuple[float, float], ...], float, float, float]:
    """(buckets, exposed seconds, of those the next forward's wait for its gathers, the
    after-step gathers moved into that forward) of a stage running `opts`: the bucketed
    reduction overlapping its backward where that leaves less after it than one
    collective per gradient does after the backward (many small buckets each pay a
    launch, and a short backward hides little), else no buckets and all of it.
    `gather_overlap`: the parameters' all-gathers run in the next forward
    (`layer_gathers`, `costmodels._overlap`)."""
    unbucketed = sum(o.grad_sync_s for o in opts)
    if bucket_bytes is None:
        return (), unbucketed, 0.0, 0.0
    syncs = [layer_sync(o, mesh, bucket_bytes, tp_overlap) for o in opts]
    wait = moved = 0.0
    if gather_overlap:
        wait = gather_exposed_s([o.forward_busy_s(tp_overlap) for o in opts],
                                [layer_gathers(o, mesh, bucket_bytes) for o in opts])
        moved = sum(o.param_gather_s for o in opts)
    exposed = exposed_s(syncs) + wait
    if exposed >= unbucketed + moved:
        return (), unbucketed, 0.0, 0.0
    return bucket_schedule(syncs), exposed, wait, moved


def gather_ranges(forward: np.ndarray, gather: np.ndarray) -> np.ndarray:
    """`costmodels.gather_exposed_s` of every layer range k..i at once: (L, ...) per-layer
    forward and all-gather seconds -> (L, L, ...). With prefix sums G and F, range k..i
    waits max(0, max_{k<=l<=i} (G_l - F_{l-1}) - (G_{k-1} - F_{k-1}))."""
    zero = np.zeros((1,) + forward.shape[1:])
    g = np.concatenate([zero, np.cumsum(gather, axis=0)])          # G_0 .. G_L
    f = np.concatenate([zero, np.cumsum(forward, axis=0)])
    lead = g[1:] - f[:-1]                                           # G_l - F_{l-1}, l = 1..L
    base = g[:-1] - f[:-1]                                          # G_{k-1} - F_{k-1}
    return np.maximum(range_max(lead) - base[:, None], 0.0)


def exposed_ranges(backward: np.ndarray, sync: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """`costmodels.exposed_s` of every layer range k..i at once: (L, ...) per-layer
    backward seconds, bucketed sync seconds and bucket counts -> (L, L, ...) exposed
    seconds. For a range ending at i the stream's state after layer l does not depend
    on where the range starts, so one pass per distance i - l serves every range."""
    num_layers = backward.shape[0]
    prefix = np.concatenate([np.zeros((1,) + backward.shape[1:]), np.cumsum(backward, axis=0)])
    out = np.full((num_layers,) + backward.shape, INF)
    free = np.zeros(backward.shape)                          # by i: the stream after layers i..l
    n = np.maximum(buckets, 1)
    for d in range(num_layers):
        i = np.arange(d, num_layers)
        l = i - d
        start = prefix[i + 1] - prefix[l + 1]                 # layer l's backward starts
        b, c = backward[l], sync[l]
        end = np.maximum.reduce([free[i] + c, start + b + c / n[l], start + b / n[l] + c])
        free[i] = np.where(buckets[l] > 0, end, free[i])
        out[l, i] = np.maximum(free[i] - (prefix[i + 1] - prefix[l]), 0.0)
    return out


def _table_options(kinds: Sequence[str], options, n_mesh: int, n_opt: int):
    """(layer, mesh, column, option) of every cell of the stage table's per-layer
    arrays: column j holds a layer's j-th option, or its last where it has fewer."""
    for l, kind in enumerate(kinds):
        for m in range(n_mesh):
            opts = options.get((kind, m), [])
            for j in range(n_opt if opts else 0):
                yield l, m, j, opts[min(j, len(opts) - 1)]


def _overlapped_sync(kinds: Sequence[str], options, meshes, shape: tuple[int, int, int], ranges,
                     bucket_bytes: float, tp_overlap: bool, gather_overlap: bool) -> np.ndarray:
    """`stage_sync`'s exposed seconds for every layer range at once, (L, L, M, J): what
    a range's buckets leave after its backward (with `gather_overlap`, plus its next
    forward's wait for the parameters' gathers), or, where that is more, all its
    collectives after the backward. `ranges` sums a per-layer array over each range.
    `gather_overlap` implies buckets (`build_stage_costs`)."""
    backward, bucketed, buckets, unbucketed, forward, gathers, moved = (np.zeros(shape) for _ in range(7))
    # By layer kind: layers of one kind share their option, so its sync and gathers.
    syncs: dict[tuple[str, int, int], tuple[LayerSync, float]] = {}
    for l, m, j, o in _table_options(kinds, options, shape[1], shape[2]):
        known = syncs.get((kinds[l], m, j))
        if known is None:
            mesh = meshes[m][2]
            known = syncs[(kinds[l], m, j)] = (layer_sync(o, mesh, bucket_bytes, tp_overlap),
                                               layer_gathers(o, mesh, bucket_bytes) if gather_overlap else 0.0)
        ls, gathers[l, m, j] = known
        backward[l, m, j], bucketed[l, m, j], buckets[l, m, j] = ls.backward_s, ls.sync_s, ls.buckets
        unbucketed[l, m, j] = o.grad_sync_s
        if gather_overlap:
            forward[l, m, j], moved[l, m, j] = o.forward_busy_s(tp_overlap), o.param_gather_s
    exposed = exposed_ranges(backward, bucketed, buckets)
    if gather_overlap:
        exposed = exposed + gather_ranges(forward, gathers)
    return np.minimum(exposed, ranges(unbucketed) + ranges(moved))


def _with_tied_copies(p_range: np.ndarray, peak_range: np.ndarray, kinds: Sequence[str], options, meshes,
                      owners: Sequence[TiedCopy | None], layers: Sequence[OpGraph], tied: np.ndarray,
                      stash: np.ndarray, peak: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranges' persistent bytes less each tied copy held beside its owner (one set
    of states serves both), and their peak with what a copy after its owner carries
    (`carry_peak`): (L, L, M, J) each, as `_assemble` composes them."""
    num_layers, n_mesh, n_opt = tied.shape
    k_idx, i_idx = np.indices((num_layers, num_layers))
    for l, copy in enumerate(owners):
        if copy is None:
            continue
        lo, hi = min(l, copy.owner), max(l, copy.owner)
        both = (k_idx <= lo) & (i_idx >= hi)                             # ranges holding copy and owner
        p_range = p_range - np.where(both[..., None, None], np.nan_to_num(tied[l], posinf=0.0)[None, None], 0.0)
        if copy.owner < l and copy.outputs:
            carry = np.zeros((n_mesh, n_opt))
            for m in range(n_mesh):
                opts = options.get((kinds[l], m), [])
                for j in range(n_opt):
                    if opts:
                        carry[m, j] = carry_bytes(layers[l], opts[min(j, len(opts) - 1)], copy, meshes[m][2])
            carried = carry_peak(np.nan_to_num(stash, posinf=0.0), np.where(np.isinf(peak), 0.0, peak),
                                 l, copy.owner, carry)
            peak_range = np.maximum(peak_range, carried)
    return p_range, peak_range


def _assemble(kinds: Sequence[str], options, meshes, shapes, memory: float, microbatches: int, num_layers: int,
              s_max: int, owners: Sequence[TiedCopy | None] = (), layers: Sequence[OpGraph] = (),
              bucket_bytes: float | None = None, tp_overlap: bool = False, gather_overlap: bool = False):
    """Compose the layer options into t(k..i, shape, s) and its memory, vectorised.

    Memory is `compose_stage` for every range at once: persistent sums, the one-
    microbatch peak by `range_peak`, the gathered-parameter buffer by `range_max`, a
    tied copy dropped from ranges that also hold its owner. With `bucket_bytes` the
    gradient sync of a range is what its buckets leave exposed after its backward
    (`exposed_ranges`), not the sum of its layers' collectives."""
    n_mesh = len(meshes)
    n_opt = max((len(v) for v in options.values()), default=1)
    shape = (num_layers, n_mesh, n_opt)
    time, pers, peak, stash, tied, gather, update = (np.full(shape, INF) for _ in range(7))
    overlap = bucket_bytes is not None
    for l, m, j, o in _table_options(kinds, options, n_mesh, n_opt):
        # With overlap the gradient sync (and with gather overlap the parameter gathers)
        # is the range's exposed part (`_overlapped_sync`), not each layer's.
        # A sharded-gradient scatter stream ends after the backward (`scatter_tail_s`).
        busy = o.busy_s(overlap, tp_overlap)
        after = o.sync_s - (o.grad_sync_s if overlap else 0.0) - (o.param_gather_s if gather_overlap else 0.0) \
            + (scatter_tail_s(o.grad_scatter_stream_s, busy, microbatches) if overlap else 0.0)
        time[l, m, j] = busy + after / microbatches
        pers[l, m, j] = o.persistent_bytes
        peak[l, m, j] = o.activation_bytes
        stash[l, m, j] = o.inflight_bytes
        tied[l, m, j] = o.tied_bytes
        gather[l, m, j] = o.gather_bytes
        update[l, m, j] = o.update_bytes

    k_idx, i_idx = np.indices((num_layers, num_layers))
    empty = (k_idx > i_idx)[..., None, None]

    def ranges(x: np.ndarray) -> np.ndarray:  # (L, ...) -> (L, L, ...) sums over k..i
        prefix = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, axis=0)])
        out = prefix[None, 1:] - prefix[:-1, None]
        out[k_idx > i_idx] = INF
        return out

    t_range, p_range, s_range = ranges(time), ranges(pers), ranges(np.nan_to_num(stash, posinf=0.0))
    if overlap:
        t_range = t_range + _overlapped_sync(kinds, options, meshes, shape, ranges, bucket_bytes, tp_overlap,
                                             gather_overlap) / microbatches
    peak_range = range_peak(np.nan_to_num(stash, posinf=0.0), np.where(np.isinf(peak), 0.0, peak))
    buffers = np.maximum(range_max(np.where(np.isinf(gather), 0.0, gather)), 0.0)
    updates = np.maximum(range_max(np.where(np.isinf(update), 0.0, update)), 0.0)
    p_range, peak_range = _with_tied_copies(p_range, peak_range, kinds, options, meshes, owners, layers,
                                            tied, stash, peak)
    with np.errstate(invalid="ignore"):                                  # inf - inf on empty ranges
        transient = np.where(np.isfinite(s_range), np.maximum(peak_range - s_range, 0.0), INF)
    base = p_range + buffers                                             # (L, L, M, J): persistent + buffers
    shape_of_mesh = np.array([shapes.index(s) for s, _, _ in meshes])
    cost = np.full((num_layers, num_layers, len(shapes), s_max), INF)
    view = np.zeros(cost.shape, dtype=int)
    opt = np.zeros(cost.shape, dtype=int)
    mem = np.full(cost.shape, INF)
    least = np.full(cost.shape, INF)
    for s in range(1, s_max + 1):
        need = base + np.maximum(min(s, microbatches) * s_range + transient, updates)   # w stashed, or the update
        need = np.where(empty, INF, need)
        smallest = need.min(axis=3)                                      # (L, L, M)
        t = np.where(need <= memory, t_range, INF)
        j_best = np.argmin(t, axis=3)                               # (L, L, M)
        t_best = np.take_along_axis(t, j_best[..., None], axis=3)[..., 0]
        m_need = np.take_along_axis(need, j_best[..., None], axis=3)[..., 0]
        for h in range(len(shapes)):
            cols = np.flatnonzero(shape_of_mesh == h)
            if not len(cols):
                continue
            sub = t_best[:, :, cols]
            pick = np.argmin(sub, axis=2)
            cost[:, :, h, s - 1] = np.take_along_axis(sub, pick[..., None], axis=2)[..., 0]
            view[:, :, h, s - 1] = cols[pick]
            opt[:, :, h, s - 1] = np.take_along_axis(j_best[:, :, cols], pick[..., None], axis=2)[..., 0]
            mem[:, :, h, s - 1] = np.take_along_axis(m_need[:, :, cols], pick[..., None], axis=2)[..., 0]
            least[:, :, h, s - 1] = smallest[:, :, cols].min(axis=2)
    return cost, view, opt, mem, least

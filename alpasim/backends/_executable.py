"""One pipeline stage as three compiled SPMD programs on its own `jax.sharding.Mesh`.

`lower_stage(plan, graph, k, devices)` builds, from the plan and a device list only (so
a worker process can build its stage alone), programs that execute the training
graph's own ops of the stage's layers (`_stage_ops.stage_ops`), the ops the planner
priced (its time and, by liveness, its memory):

- forward(params, acts, data) -> (boundary outputs (and the loss on the last stage),
  stash): the forward ops. The stash is what the backward ops read of the forward's
  values; a stashed stage input or boundary output is not returned twice, the stage
  keeps the array it already has. Under remat it is each layer's input (plus what
  `keep` ops, the LM head, made); without it, every forward value the derived backward
  reads — never a copy of a parameter, which the backward reads from the stage.
- backward(params, acc, stash, cts) -> (acc + grads / B, cotangents for earlier
  stages): the backward ops, recomputation included; each parameter's gradient is
  added into its accumulator as the op that completes it runs. Layers run one after
  another, as the plan prices them: each layer's parameters take a data dependence on
  the gradients the layer after it accumulated (`fence` below), or XLA hoists every
  layer's recomputation and defers every weight gradient to the program's end. The
  accumulators, the stash and the cotangents are donated: the runtime never reads them
  again, so XLA writes the new accumulators in place and may reuse the stash for
  outputs.
- update(params, acc, states) -> (params, states, zeroed acc): Adam exactly as the
  training graph's `adam` ops (their hyperparameters, `_lowering._adam`), run in the
  layouts the stage's intra-op plan stores gradients and optimizer states in — with
  weight-update sharding that is a sharded update followed by an all-gather of the
  new parameters. Everything it takes is donated (replaced by its outputs).

A tied parameter (GPT's word embedding on the first and the head's stage) is split as
Megatron-LM does: each stage keeps a copy with its own accumulator and Adam states;
the two accumulators are summed once per iteration (`_runtime`) and both stages apply
the same update, so the copies stay equal without a refresh.

Shardings: the layouts the planner priced, as they are. A plan carries, per stage and
layer, the layout of every tensor the layer's ops read or write (`stages[i].layer_specs`,
the chosen layer option's own ILP solution); every op's output is constrained to its
layer's layout, a tensor one layer makes and another reads in another layout is
resharded where that layer reads it, a stashed tensor is kept in the layout the layer
whose backward reads it was priced with (so the stash is the priced one, byte for
byte), parameters sit in `param_specs`, optimizer states in the owner layer's layouts,
and boundary tensors leave in the sender's `transfers` src_spec and arrive in the
receiver's dst_spec. Nothing is solved again at run time. A plan from before it carried
`layer_specs` falls back to one ILP over the whole stage with the parameter and boundary
layouts fixed (`_stages.stage_intra_plan`), constraining einsum and conv outputs and
stashed and boundary tensors to it. A stage's intra-op plan object, which a profiled
re-pricing reads, is the priced one replayed from the plan's per-op strategies
(`solvers.replay_intra_op`; built on first use).

On the CPU the programs are compiled with XLA's memory-optimised scheduler
(`compiler_options`).

Weight gradients are reduced when the plan reduces them: once per iteration. A weight
gradient whose contraction the plan splits over mesh axes (the batch, under data
parallelism) is accumulated unreduced, with a replica axis over those axes, and the
update reduces it (all-reduce, or reduce-scatter under weight-update sharding) before
Adam (`_partial_grads`); JAX's global view would otherwise reduce it inside every
microbatch's backward. ZeRO plans, and Megatron configurations with sharded
gradients, scatter every microbatch, as they are priced (their
`solvers.plan_restriction` is in `PER_MICROBATCH_GRAD_SYNC`); a plan from before
`layer_specs` keeps the per-microbatch reduction.

Gradient accumulation: each microbatch's loss cotangent is the graph's seed (1), the
gradient is cast to the accumulation dtype and added with weight 1/B (B microbatches),
so a half-precision gradient is never scaled down into float16's subnormals. The
accumulation dtype is the training graph's gradient tensor's (the `adam` op's second
input, the `<param>:grad_cast` output); a half-precision parameter accumulates in
float32 under every recipe but "mixed" (half gradients, 16 B/param), whatever a graph
built before the recipes existed says (`accumulation_dtype`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.graphs import OpGraph, build_training_graph, in_weight_pass, with_loss_kernel
from alpasim.solvers import PER_MICROBATCH_GRAD_SYNC, IntraOpPlan, PipelinePlan, ShardingSpec, plan_restriction

from ._lowering import eval_op, random_leaves
from ._partial_grads import PartialGrad, eval_split, partial_gradients
from ._stage_ops import StageOps, stage_ops
from ._stages import StagePart, partition, stage_intra_plan

AXIS_NAMES = ("x", "y")
CONSTRAINED_PRIMS = ("einsum", "conv2d", "conv2d_input_grad", "conv2d_filter_grad")
HALF_DTYPES = ("float16", "bfloat16")
# The precision recipe a plan records (`plan.model.precision`); plans from before the
# recipes existed ran what "mixed-fp32grad" now names.
DEFAULT_PRECISION = "mixed-fp32grad"


class StageExecutable:
    """A stage's compiled programs and its state: parameters, gradient accumulators,
    optimizer states and the stash of microbatches between forward and backward."""

    def __init__(self, part: StagePart, ops: StageOps, mesh: Mesh, intra: IntraOpPlan | Callable[[], IntraOpPlan],
                 shardings: dict[str, NamedSharding], compiled: Mapping[str, Any], params: dict, states: dict, *,
                 remat: bool = True, acc_dtypes: dict[str, Any] | None = None,
                 stash_spec: dict[str, jax.ShapeDtypeStruct] | None = None,
                 acc_spec: dict[str, jax.ShapeDtypeStruct] | None = None,
                 split: dict[str, Callable] | None = None) -> None:
        self.part, self.ops, self.mesh, self._intra = part, ops, mesh, intra
        # The backward as B and W (`split_backward_ops`): jitted, compiled at their first
        # call, so a stage that runs its backward whole never compiles them.
        self.split = split or {}
        self.index = part.index
        self.shardings = shardings          # name -> layout: params, grads ("<p>:grad"), states, acts, cts, data
        self.compiled = compiled            # "forward" | "backward" | "update" -> jax Compiled (`StagePrograms`)
        self.params, self.states = params, states
        self.remat = remat
        self.acc_dtypes = acc_dtypes or {p: v.dtype for p, v in params.items()}
        self.stash_spec = stash_spec or {}  # what one microbatch keeps, in its layouts
        # Each accumulator's shape and layout: a gradient the plan reduces once per
        # iteration is accumulated unreduced, (R, *shape) (`_partial_grads`).
        self.acc_spec = acc_spec or {p: jax.ShapeDtypeStruct(params[p].shape, self.acc_dtypes[p],
                                                             sharding=shardings[f"{p}:grad"]) for p in ops.grads}
        self.acc = self._zeros_acc()
        self.stash: dict[int, dict[str, jax.Array]] = {}
        self.weight_stash: dict[int, dict[str, jax.Array]] = {}   # B -> W of a split backward

    @property
    def intra_plan(self) -> IntraOpPlan:
        """The stage's intra-op plan (`_stages.stage_intra_plan`: the priced one replayed
        from the plan's record), built on first use; a profiled re-pricing reads it."""
        if callable(self._intra):
            self._intra = self._intra()
        return self._intra

    # ------------------------------------------------------------- execution
    def forward(self, microbatch: int, acts: dict, data: dict) -> dict[str, jax.Array]:
        """Run the forward of one microbatch; stash what its backward reads."""
        acts = {t: acts[t] for t in self.ops.acts_in}
        data = {t: jax.device_put(data[t], self.shardings[t]) for t in self.ops.data}
        outs, made = self.compiled["forward"](self.params, acts, data)
        self.stash[microbatch] = self.stash_entry(acts, data, outs, made)
        return outs

    def stash_entry(self, acts: dict, data: dict, outs: dict, made: dict) -> dict[str, jax.Array]:
        """What one microbatch keeps from its forward to its backward, by tensor."""
        have = {**acts, **data, **outs, **made}
        return {t: have[t] for t in self.ops.stash}

    def backward(self, microbatch: int, cts: dict) -> dict[str, jax.Array]:
        """Backward of one microbatch: accumulate parameter gradients, return the
        cotangents earlier stages read. Consumes (donates) the microbatch's stash."""
        stash = self.stash.pop(microbatch)
        cts = {t: cts[t] for t in self.ops.cts_in}
        self.acc, cts_out = self.compiled["backward"](self.params, self.acc, stash, cts)
        return cts_out

    def backward_input(self, microbatch: int, cts: dict) -> dict[str, jax.Array]:
        """B of a split backward (`split_backward_ops`): input gradients and the weight
        gradients B makes; keeps what W reads until `backward_weight`."""
        stash = self.stash.pop(microbatch)
        cts = {t: cts[t] for t in self.ops.cts_in}
        self.acc, cts_out, self.weight_stash[microbatch] = self.split["backward_input"](
            self.params, self.acc, stash, cts)
        return cts_out

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients B left, into the accumulators."""
        self.acc = self.split["backward_weight"](self.params, self.acc, self.weight_stash.pop(microbatch))

    def free(self, microbatch: int) -> None:
        self.stash.pop(microbatch, None)
        self.weight_stash.pop(microbatch, None)

    def update(self) -> None:
        self.params, self.states, self.acc = self.compiled["update"](self.params, self.acc, self.states)

    def unreduced(self, param: str) -> bool:
        """Whether `param`'s accumulator holds unreduced partials, (R, *shape)."""
        return self.acc_spec[param].shape != self.params[param].shape

    def grad(self, param: str) -> jax.Array:
        """The accumulated gradient of `param`, reduced, in its planned layout."""
        acc = self.acc[param]
        if self.unreduced(param):
            acc = jax.device_put(acc.sum(axis=0), self.shardings[f"{param}:grad"])
        return acc

    def host_grad(self, param: str) -> np.ndarray:
        """`grad(param)` on the host, reduced there: what a run reports. An eager device
        sum would compile a program per accumulator shape (16 of them, about 25 ms each,
        in a small MoE plan's first step) for a value that is copied to the host anyway.
        The partials are added in float32 at least and rounded once, as XLA's sum does."""
        acc = np.asarray(self.acc[param])
        if not self.unreduced(param):
            return acc
        return acc.sum(axis=0, dtype=np.promote_types(acc.dtype, np.float32)).astype(acc.dtype)

    def add_grad(self, param: str, value: jax.Array) -> None:
        """Add another stage's accumulated gradient of a tied parameter into this one's
        (into the first partial of an unreduced accumulator)."""
        value = jax.device_put(value, self.shardings[f"{param}:grad"]).astype(self.acc[param].dtype)
        acc = self.acc[param]
        acc = acc.at[0].add(value) if self.unreduced(param) else acc + value
        self.acc[param] = jax.device_put(acc, self.acc_spec[param].sharding)

    def set_grad(self, param: str, value: jax.Array) -> None:
        """Replace a tied copy's accumulator by the iteration's summed gradient."""
        self.acc[param] = _zeros_like(self.acc[param])   # in its layout, on the stage's devices
        self.add_grad(param, value)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """Parameters, accumulators and optimizer states as numpy (for a restart)."""
        return {"params": _to_numpy(self.params), "acc": _to_numpy(self.acc), "states": _to_numpy(self.states)}

    def load_state_dict(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        self.params = {p: jax.device_put(v, self.shardings[p]) for p, v in state["params"].items()}
        self.acc = {p: jax.device_put(v, self.acc_spec[p].sharding) for p, v in state["acc"].items()}
        self.states = {k: jax.device_put(v, self.shardings[k]) for k, v in state["states"].items()}
        self.stash.clear()
        self.weight_stash.clear()

    def _zeros_acc(self) -> dict[str, jax.Array]:
        return {p: _zeros_like(a) for p, a in self.acc_spec.items()}


def _zeros_like(a) -> jax.Array:
    """Zeros of `a`'s shape, dtype and sharding, put from the host: `jnp.zeros` outside
    a jitted program compiles one XLA program per shape and sharding (25 ms each on
    XLA:CPU; 64 of them for a 3-stage Wide-ResNet plan), a host copy compiles nothing."""
    return jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)


def accumulation_dtype(param_dtype: str, grad_dtype: str, precision: str) -> np.dtype:
    """The dtype a parameter's gradient accumulates in over microbatches (module doc):
    the training graph's gradient dtype, float32 for a half-precision parameter unless
    the recipe is "mixed"."""
    if param_dtype in HALF_DTYPES and precision != "mixed":
        grad_dtype = "float32"
    return jax.dtypes.canonicalize_dtype(grad_dtype)


def _to_numpy(tree: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items()}


def stage_mesh(plan: PipelinePlan, k: int, devices: Sequence[jax.Device]) -> Mesh:
    """Stage k's devices in its logical shape, axes ("x", "y")."""
    shape = tuple(plan.stages[k].logical_mesh)
    if len(devices) != shape[0] * shape[1]:
        raise ValueError(f"stage {k} has a {shape[0]}x{shape[1]} mesh; got {len(devices)} devices")
    return Mesh(np.array(list(devices), dtype=object).reshape(shape), AXIS_NAMES)


@dataclass(frozen=True)
class StageInputs:
    """What lowering any stage of a plan starts from: the training graph, every stage's
    part and the initial leaves (`stage_inputs`)."""

    train: OpGraph
    parts: list[StagePart]
    leaves: dict[str, np.ndarray]


def plan_training_graph(plan: PipelinePlan, graph: OpGraph) -> OpGraph:
    """The training graph of `plan` (`graph` is `planning_graph(plan.model)`): its remat,
    its recompute policy and kernels, its precision recipe where it records them (older plans: the
    builder's defaults) and its loss kernel (`PipelinePlan.loss_kernel`), so a re-pricing
    (`predict_run`) prices the graph the planner priced; the kernel changes no value the
    backend computes."""
    train = build_training_graph(graph, remat=plan.model.remat, recompute=plan.model.recompute,
                                 precision=plan.model.precision, kernels=plan.model.kernels).graph
    return with_loss_kernel(train, plan.loss_kernel)


def stage_inputs(plan: PipelinePlan, graph: OpGraph, seed: int = 0) -> StageInputs:
    return StageInputs(plan_training_graph(plan, graph), partition(graph, plan), random_leaves(graph, seed))


class StagePrograms(Mapping[str, Any]):
    """A stage's compiled programs by name ("forward", "backward", "update"): those its
    schedule runs are compiled ahead of time (step times then exclude their
    compilation), any other at its first read. A zero-bubble program runs the backward
    as B and W (`StageExecutable.split`, still compiled at their first call, in the
    first step), so its whole backward compiles only if something reads it (the memory
    analysis, a profile, the HLO report)."""

    def __init__(self, compile_fns: dict[str, Callable[[], Any]], ahead: Sequence[str]) -> None:
        self._compile, self._done = compile_fns, {}
        for name in ahead:
            self[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._done:
            self._done[name] = self._compile[name]()
        return self._done[name]

    def __contains__(self, name: object) -> bool:     # a program the stage has, compiled or not
        return name in self._compile

    def __iter__(self) -> Iterator[str]:
        return iter(self._compile)

    def __len__(self) -> int:
        return len(self._compile)

    @property
    def ready(self) -> frozenset[str]:
        """The programs compiled so far."""
        return frozenset(self._done)


def _compile(fn, args: Sequence, options: dict[str, Any] | None):
    """`fn` lowered for `args` (abstract values) and compiled. A donated stash or
    cotangent buffer that no output can reuse is simply freed after the call, which is
    what the runtime does with it anyway: JAX's warning says no more."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return fn.lower(*args).compile(options)


def lower_stage(plan: PipelinePlan, graph: OpGraph, stage_index: int, devices: Sequence[jax.Device], *,
                seed: int = 0, shared: StageInputs | None = None, split_backward: bool = False,
                fence: str | None = "op") -> StageExecutable:
    """Stage `stage_index` of `plan` on `devices`; `graph` is `planning_graph(plan.model)`.

    Parameters start as `random_leaves(graph, seed)` gives them, the values a
    single-device run of the whole graph uses (a tied copy too, and its fp32 master, so
    the copies stay equal). `shared` (`stage_inputs`) carries what every stage derives
    alike, so a process lowering all stages derives it once. `split_backward`: the
    program runs the backward as B and W (zero bubble), so the whole backward is not
    compiled ahead (`StagePrograms`). `fence` (`FENCES`) holds the backward to the
    plan's op order.
    """
    if fence not in FENCES:
        raise ValueError(f"fence {fence!r}: choose one of {', '.join(map(str, FENCES))}")
    shared = shared or stage_inputs(plan, graph, seed)
    train, part, leaves = shared.train, shared.parts[stage_index], shared.leaves
    ops = stage_ops(train, *plan.stages[stage_index].layers)
    mesh = stage_mesh(plan, stage_index, devices)
    if plan.stages[stage_index].layer_specs:    # the layouts the planner priced, as they are
        intra = functools.partial(stage_intra_plan, plan, train, stage_index)
        shardings, stash_sh, layer_sh = _layer_shardings(plan, train, ops, stage_index, mesh)
        partials = {} if plan_restriction(plan) in PER_MICROBATCH_GRAD_SYNC else \
            partial_gradients(ops, train, plan.stages[stage_index])
    else:                                       # a plan from before it carried them: solve the stage again
        intra = stage_intra_plan(plan, train, stage_index)
        shardings = _shardings(plan, train, ops, stage_index, intra, mesh)
        stash_sh, layer_sh = {t: shardings[t] for t in ops.stash}, None
        partials = {}

    params = {p: jax.device_put(leaves[p], shardings[p]) for p in ops.params}
    states = {}
    for p, op in ops.adam.items():
        for t in op.inputs[2:]:  # (master,) m, v
            init = leaves[p].astype(np.float32) if t.endswith(":master") else np.zeros(train.tensors[t].shape,
                                                                                        np.float32)
            states[t] = jax.device_put(init, shardings[t])

    remat = plan.model.remat
    precision = plan.model.precision or DEFAULT_PRECISION
    acc_dtypes = {p: accumulation_dtype(train.tensors[p].dtype, train.tensors[ops.adam[p].inputs[1]].dtype,
                                        precision) for p in ops.grads}
    acc = {}
    for p in ops.grads:
        info = partials.get(ops.grads[p])
        shape = params[p].shape if info is None else (info.replicas, *params[p].shape)
        sh = shardings[f"{p}:grad"] if info is None else info.sharding(mesh)
        acc[p] = jax.ShapeDtypeStruct(shape, acc_dtypes[p], sharding=sh)
    fns = _stage_functions(ops, train, shardings, mesh, plan.microbatches, acc_dtypes, stash_sh, layer_sh,
                           partials, fence)

    def abstract(names, layouts=shardings) -> dict[str, jax.ShapeDtypeStruct]:
        return {t: jax.ShapeDtypeStruct(train.tensors[t].shape, jax.dtypes.canonicalize_dtype(
            train.tensors[t].dtype), sharding=layouts[t]) for t in names}

    p_spec, a_spec, d_spec, ct_spec = (abstract(n) for n in (ops.params, ops.acts_in, ops.data, ops.cts_in))
    st_spec = abstract(ops.stash, stash_sh)
    s_spec = {t: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for t, v in states.items()}
    options = compiler_options(mesh)
    args = {"forward": (p_spec, a_spec, d_spec), "backward": (p_spec, acc, st_spec, ct_spec),
            "update": (p_spec, acc, s_spec)}
    compiled = StagePrograms({name: functools.partial(_compile, fns[name], a, options) for name, a in args.items()},
                             ("forward", "update") if split_backward else tuple(args))
    return StageExecutable(part, ops, mesh, intra, shardings, compiled, params, states, remat=remat,
                           acc_dtypes=acc_dtypes, stash_spec=st_spec, acc_spec=acc,
                           split={k: fns[k] for k in ("backward_input", "backward_weight")})


# How a stage's backward may be held to the plan's op order (`lower_stage(fence=)`,
# `_StageTracer._fence`): "op" ties each layer to the one after it and each weight
# gradient to the next op that reads a parameter; "layer" only the layers; None neither.
# Other than "op" only to measure what XLA does without it (`benchmarks/bench_memory.py
# --fence`).
FENCES = ("op", "layer", None)


def compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    """XLA options for a stage's programs. On the CPU, the memory-minimising scheduler:
    XLA:CPU's default orders ops for thread concurrency and holds buffers a sequential,
    memory-bounded schedule frees (`benchmarks/bench_memory.py --xla-default-scheduler`
    on its Wide-ResNet stages: an update's temporaries 413.8 KiB against 125.3, a remat
    backward's 1,468 against 626); a training runtime is memory-bound, as
    XLA:GPU's scheduler is under its memory limit, and the measured memory then is the
    schedule's, not the thread pool's."""
    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return None


def named_sharding(mesh: Mesh, spec: ShardingSpec | str) -> NamedSharding:
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    return NamedSharding(mesh, PartitionSpec(*spec.partition_spec(AXIS_NAMES)))


def _shardings(plan: PipelinePlan, train: OpGraph, ops: StageOps, k: int, intra: IntraOpPlan,
               mesh: Mesh) -> dict[str, NamedSharding]:
    """Every layout the stage's programs take or produce (see the module doc)."""
    st = plan.stages[k]
    out: dict[str, NamedSharding] = {}
    for t, spec in intra.specs.items():
        out[t] = named_sharding(mesh, spec)
    for p in ops.params:
        out[p] = named_sharding(mesh, st.param_specs.get(p, intra.specs[p]))
    for p in ops.params:
        g = ops.grads.get(p)
        own = p in ops.owned and g in intra.specs
        out[f"{p}:grad"] = named_sharding(mesh, intra.specs[g]) if own else out[p]
    for op in ops.adam.values():  # optimizer states the plan stores nowhere else: with their parameter
        for t in op.inputs[2:]:
            out.setdefault(t, out[op.inputs[0]])
    _boundary_layouts(plan, ops, k, mesh, out)
    return out


def _boundary_layouts(plan: PipelinePlan, ops: StageOps, k: int, mesh: Mesh, out: dict[str, NamedSharding]) -> None:
    """Put the layouts the plan's `transfers` name for stage k's boundary tensors into
    `out` (they win over any other source), and check every boundary or stashed tensor
    has one."""
    sent = {*ops.acts_out, *ops.cts_out, *ops.grads.values()}
    received = {*ops.acts_in, *ops.cts_in}
    for t in plan.transfers:
        if t.src_stage == k and t.src_spec and t.tensor in sent:
            out[t.tensor] = named_sharding(mesh, t.src_spec)
        if t.dst_stage == k and t.dst_spec and t.tensor in received:
            out[t.tensor] = named_sharding(mesh, t.dst_spec)
    for t in (*ops.acts_in, *ops.acts_out, *ops.data, *ops.cts_in, *ops.cts_out, *ops.stash):
        if t not in out:
            raise ValueError(f"stage {k}: the plan gives no layout for boundary or stashed tensor {t!r}")


def _layer_shardings(plan: PipelinePlan, train: OpGraph, ops: StageOps, k: int, mesh: Mesh
                     ) -> tuple[dict[str, NamedSharding], dict[str, NamedSharding], dict[int, dict[str, NamedSharding]]]:
    """The stage's layouts from the plan's `layer_specs` (what each layer was priced in):
    (each tensor's layout where it is made — a stage input's where it arrives or is
    first read —, each stashed tensor's layout — the layout the last layer whose
    backward reads it read it in, so a layer input is kept as that layer reads it —,
    and per layer the layout it reads every tensor in)."""
    st = plan.stages[k]
    first = st.layers[0]
    layer_sh = {first + i: {t: named_sharding(mesh, spec) for t, spec in specs.items()}
                for i, specs in enumerate(st.layer_specs)}
    out: dict[str, NamedSharding] = {}
    for op in (*ops.forward, *ops.backward):
        for t in op.outputs:
            if t in layer_sh[op.layer]:
                out.setdefault(t, layer_sh[op.layer][t])
    for op in (*ops.forward, *ops.backward):   # stage inputs: where first read
        for t in op.inputs:
            if t not in out and t in layer_sh[op.layer]:
                out[t] = layer_sh[op.layer][t]
    for p in ops.params:
        out[p] = named_sharding(mesh, st.param_specs[p]) if p in st.param_specs else out[p]
    for p in ops.params:
        g = ops.grads.get(p)
        out[f"{p}:grad"] = out[g] if p in ops.owned and g in out else out[p]
    for op in ops.adam.values():  # optimizer states as the owner's layer stores them; a copy's with its parameter
        owner = layer_sh.get(op.layer, {})
        for t in op.inputs[2:]:
            out.setdefault(t, owner.get(t, out[op.inputs[0]]))
    _boundary_layouts(plan, ops, k, mesh, out)
    fixed = {*ops.acts_in, *ops.data, *ops.acts_out}   # stashed as they arrive or leave
    stash = {}
    for t in ops.stash:
        readers = [op.layer for op in ops.backward if t in op.inputs and t in layer_sh[op.layer]]
        stash[t] = out[t] if t in fixed or not readers else layer_sh[max(readers)][t]
    return out, stash, layer_sh


def _stage_functions(ops: StageOps, train: OpGraph, shardings: dict[str, NamedSharding], mesh: Mesh,
                     microbatches: int, acc_dtypes: dict[str, Any], stash_sh: dict[str, NamedSharding],
                     layer_sh: dict[int, dict[str, NamedSharding]] | None = None,
                     partials: dict[str, PartialGrad] | None = None, fence: str | None = "op") -> dict[str, Any]:
    """The stage's programs, jitted with their layouts (`_StageTracer` traces them). With
    `layer_sh` (the plan's per-layer layouts) every op's output is constrained to the
    layout its layer was priced with and a tensor one layer makes and another reads in a
    different layout is resharded where that layer reads it, as the planner's per-layer
    plans do. `fence` (`FENCES`) holds the backward to the plan's op order."""
    tr = _StageTracer(ops, train, shardings, mesh, microbatches, acc_dtypes, stash_sh, layer_sh, partials or {},
                      fence)
    p_sh, g_sh = tr.p_sh, tr.g_sh
    a_sh = {t: shardings[t] for t in ops.acts_in}
    d_sh = {t: shardings[t] for t in ops.data}
    st_sh = dict(stash_sh)
    ci_sh = {t: shardings[t] for t in ops.cts_in}
    co_sh = {t: shardings[t] for t in ops.cts_out}
    o_sh = {t: shardings[t] for t in ops.acts_out}
    if ops.loss is not None:
        o_sh[ops.loss] = NamedSharding(mesh, PartitionSpec())
    made_sh = {t: stash_sh[t] for t in tr.made}
    s_sh = {t: shardings[t] for op in ops.adam.values() for t in op.inputs[2:]}
    # Unused arguments are kept: the stage holds them anyway, and each program's memory
    # analysis then counts every buffer it is handed (`_memory`). Donated: what the
    # runtime replaces by the outputs or never reads again (module doc).
    return {
        "forward": jax.jit(tr.forward, in_shardings=(p_sh, a_sh, d_sh), out_shardings=(o_sh, made_sh),
                           keep_unused=True),
        "backward": jax.jit(tr.backward, in_shardings=(p_sh, g_sh, st_sh, ci_sh), out_shardings=(g_sh, co_sh),
                            donate_argnums=(1, 2, 3), keep_unused=True),
        "update": jax.jit(tr.update, in_shardings=(p_sh, g_sh, s_sh), out_shardings=(p_sh, s_sh, g_sh),
                          donate_argnums=(0, 1, 2), keep_unused=True),
        # Compiled at their first call (only a zero-bubble program makes one); the weight
        # stash leaves B in whatever layout XLA gives it.
        "backward_input": jax.jit(tr.backward_input, in_shardings=(p_sh, g_sh, st_sh, ci_sh),
                                  out_shardings=(g_sh, co_sh, None), donate_argnums=(1, 2, 3)),
        "backward_weight": jax.jit(tr.backward_weight, donate_argnums=(1, 2)),
    }


class _StageTracer:
    """The Python functions of one stage's programs, traced by `jax.jit`: forward,
    backward (whole, or split into B and W as zero-bubble schedules run it), update. Each
    runs its ops through `run`, which evaluates them in the plan's layouts."""

    def __init__(self, ops: StageOps, train: OpGraph, shardings: dict[str, NamedSharding], mesh: Mesh,
                 microbatches: int, acc_dtypes: dict[str, Any], stash_sh: dict[str, NamedSharding],
                 layer_sh: dict[int, dict[str, NamedSharding]] | None, partials: dict[str, PartialGrad],
                 fence: str | None = "op") -> None:
        self.ops, self.train, self.shardings, self.mesh, self.fence = ops, train, shardings, mesh, fence
        self.acc_dtypes, self.stash_sh, self.layer_sh, self.partials = acc_dtypes, stash_sh, layer_sh, partials
        constrained = {t for op in (*ops.forward, *ops.backward) if op.prim in CONSTRAINED_PRIMS for t in op.outputs}
        self.constrained = constrained | {*ops.acts_out, *ops.cts_out, *ops.stash}
        self.dtypes = {t: jax.dtypes.canonicalize_dtype(x.dtype) for t, x in train.tensors.items()}
        self.grad_of = {g: p for p, g in ops.grads.items()}
        self.scale = 1.0 / microbatches
        self.split_sh = {t: info.sharding(mesh) for t, info in partials.items()}
        # The forward's stash it makes itself, beside its outputs (what it hands on).
        given, handed = {*ops.acts_in, *ops.data}, {*ops.acts_out, ops.loss}
        self.made = tuple(t for t in ops.stash if t not in handed and t not in given)
        self.reads_of: dict[int, set[str]] = {}
        for op in ops.backward:
            self.reads_of.setdefault(op.layer, set()).update(t for t in op.inputs if t in ops.params)
        # The backward split as zero-bubble schedules run it (`solvers.split_backward`): B runs
        # every backward op but those that make only weight gradients (and what reads
        # them), W those; B hands W what they read (the weight stash). The same ops in the
        # same per-layer layouts (W reshards a kept tensor XLA laid out otherwise); unlike
        # the whole backward, neither program is fenced to the plan's op order.
        self.input_ops, self.weight_ops, self.weight_stash = split_backward_ops(ops, train)
        self.p_sh = {p: shardings[p] for p in ops.params}
        self.g_sh = {p: self.split_sh.get(g, shardings[f"{p}:grad"]) for p, g in ops.grads.items()}  # accumulators

    def _read(self, op, t: str, values: dict, layouts: dict, moved: dict):
        """Op `op`'s input `t` in the layout its layer reads it in (resharded once per
        layer), an unreduced gradient summed unless `op` is linear in it."""
        want = self.layer_sh[op.layer].get(t) if self.layer_sh is not None else None
        if t in self.partials:       # an unreduced gradient: as it is to a linear op, else summed
            if op.outputs[0] in self.partials:
                return values[t]
            if (op.layer, t) not in moved:
                total = values[t].sum(axis=0)
                moved[(op.layer, t)] = total if want is None else jax.lax.with_sharding_constraint(total, want)
            return moved[(op.layer, t)]
        if want is None or layouts.get(t) == want:
            return values[t]
        if (op.layer, t) not in moved:
            moved[(op.layer, t)] = jax.lax.with_sharding_constraint(values[t], want)
        return moved[(op.layer, t)]

    def _laid_out(self, op, t: str, v, layouts: dict):
        """Output `t` of `op` in its dtype and in the layout the plan gives it."""
        if v.dtype != self.dtypes[t]:
            v = v.astype(self.dtypes[t])
        if t in self.partials:
            layouts[t] = self.split_sh[t]
            return jax.lax.with_sharding_constraint(v, self.split_sh[t])
        if self.layer_sh is not None:
            want = self.layer_sh[op.layer].get(t, self.shardings.get(t))
            if want is not None:
                layouts[t] = want
                return jax.lax.with_sharding_constraint(v, want)
            return v
        if t in self.constrained and t in self.shardings:
            return jax.lax.with_sharding_constraint(v, self.shardings[t])
        return v

    def run(self, op_list, values: dict, layouts: dict, on_value=None, fence=None) -> dict:
        """`values` with every op of `op_list` evaluated. layouts: tensor -> the layout its
        value has now (layer-specs plans only); fence(values, op, new_layer) -> values:
        called before each op after the first; on_value(t, v): told each new value."""
        moved: dict[tuple[int, str], Any] = {}   # (layer, tensor) -> resharded for that layer
        layer = None
        for op in op_list:
            if fence is not None and layer is not None:
                values = fence(values, op, op.layer != layer)
            layer = op.layer
            if op.outputs[0] in self.ops.carried:  # the tied contribution arrives once per iteration (module doc)
                outs = [values[self.ops.carried[op.outputs[0]]]]
            else:
                args = [self._read(op, x, values, layouts, moved) for x in op.inputs]
                if op.outputs[0] in self.partials and not any(x in self.partials for x in op.inputs):
                    outs = [eval_split(op, args, self.partials[op.outputs[0]], self.train, self.mesh,
                                       [self.layer_sh[op.layer].get(x) for x in op.inputs])]
                else:
                    outs = eval_op(op, args)
            for t, v in zip(op.outputs, outs, strict=True):
                values[t] = v = self._laid_out(op, t, v, layouts)
                if on_value is not None:
                    on_value(t, v)
        return values

    def forward(self, params, acts, data):
        ops = self.ops
        layouts = {t: self.shardings[t] for t in (*params, *acts, *data)}
        values = self.run(ops.forward, {**params, **acts, **data}, layouts=layouts)
        outs = {t: values[t] for t in ops.acts_out}
        if ops.loss is not None:
            outs[ops.loss] = values[ops.loss]
        made = {t: values[t] for t in self.made}
        return outs, made

    def accumulator(self, acc, added=lambda p: None):
        """(the new accumulators, a `run` hook adding each parameter's gradient into
        them as soon as it is complete, then telling `added`)."""
        new_acc = dict(acc)

        def accumulate(t, v):
            p = self.grad_of.get(t)
            if p is not None:
                new_acc[p] = acc[p] + v.astype(self.acc_dtypes[p]) * jnp.asarray(self.scale, self.acc_dtypes[p])
                added(p)
        return new_acc, accumulate

    def _backward_layouts(self, params, stash, cts) -> dict:
        return {**{t: self.shardings[t] for t in (*params, *cts)}, **{t: self.stash_sh[t] for t in stash}}

    def backward(self, params, acc, stash, cts):
        fresh: list[str] = []    # parameters whose gradient the running layer has accumulated
        new_acc, accumulate = self.accumulator(acc, fresh.append)
        fence = functools.partial(self._fence, fresh, new_acc) if self.fence else None
        values = self.run(self.ops.backward, {**params, **stash, **cts}, on_value=accumulate,
                          layouts=self._backward_layouts(params, stash, cts), fence=fence)
        return new_acc, {t: values[t] for t in self.ops.cts_out}

    def _fence(self, fresh: list[str], new_acc: dict, values: dict, op, new_layer: bool) -> dict:
        """One layer's backward after another, and in a layer each weight gradient where
        the plan prices it: when a layer begins, all its parameters, and before each op,
        the parameters that op reads take a data dependence on the gradients accumulated
        since the last such tie. XLA can then neither hoist the next layer's
        recomputation nor defer a weight gradient (which is off the critical path, so its
        scheduler would otherwise keep its operands, activation-sized, alive: with layers
        alone tied, Wide-ResNet's first remat stage measured 1.12x its plan,
        `bench_memory.py --fence layer`). An optimization barrier would not do: XLA:CPU
        drops it. The dependence is a zero made, on each device, from one element of each
        local accumulator shard: no collective, no copy beyond the (small) parameters."""
        if new_layer:
            gated = sorted(self.reads_of[op.layer])
        elif self.fence == "op":
            gated = sorted({t for t in op.inputs if t in self.ops.params})
        else:
            return values
        if not fresh or not gated:
            return values
        names = list(fresh)
        fresh.clear()

        def tie(accs, ps):
            s = sum(a.reshape(-1)[0].astype(jnp.float32) for a in accs)
            zero = jnp.where(jnp.isfinite(s), s, 0.0) * 0.0
            return [p + zero.astype(p.dtype) for p in ps]

        tied = jax.shard_map(tie, mesh=self.mesh,
                             in_specs=([self.g_sh[p].spec for p in names], [self.p_sh[p].spec for p in gated]),
                             out_specs=[self.p_sh[p].spec for p in gated], check_vma=False)
        made = tied([new_acc[p] for p in names], [values[p] for p in gated])
        return {**values, **dict(zip(gated, made, strict=True))}

    def backward_input(self, params, acc, stash, cts):
        new_acc, accumulate = self.accumulator(acc)
        values = self.run(self.input_ops, {**params, **stash, **cts}, on_value=accumulate,
                          layouts=self._backward_layouts(params, stash, cts))
        return new_acc, {t: values[t] for t in self.ops.cts_out}, {t: values[t] for t in self.weight_stash}

    def backward_weight(self, params, acc, kept):
        new_acc, accumulate = self.accumulator(acc)
        self.run(self.weight_ops, {**params, **kept}, layouts={t: self.shardings[t] for t in params},
                 on_value=accumulate)
        return new_acc

    def update(self, params, acc, states):
        # One parameter after another, as frameworks step their optimizers: each
        # parameter's inputs pass an optimization barrier together with the previous
        # parameter's results (in their stored layouts), so XLA cannot run every
        # parameter's update — and its weight-update-sharding all-gather — at once.
        params, states = dict(params), dict(states)
        done: list[str] = []
        for p, op in self.ops.adam.items():
            g = acc[p]
            if self.ops.grads.get(p) in self.partials:   # the once-per-iteration reduction the plan prices
                g = jax.lax.with_sharding_constraint(g.sum(axis=0), self.shardings[f"{p}:grad"])
            ins = [params[p], g, *(states[t] for t in op.inputs[2:])]
            if done:
                prev, ins = jax.lax.optimization_barrier(([params[q] for q in done[-1:]], ins))
                params[done[-1]] = prev[0]
            new = eval_op(op, ins)
            params[p] = jax.lax.with_sharding_constraint(new[0], self.shardings[p])
            states.update(zip(op.inputs[2:], new[1:]))
            done.append(p)
        return params, states, {p: jnp.zeros_like(v) for p, v in acc.items()}


def split_backward_ops(ops: StageOps, train: OpGraph) -> tuple[tuple, tuple, tuple[str, ...]]:
    """(B's ops, W's ops, the tensors B hands W) of a stage's backward
    (`graphs.in_weight_pass`), each in the backward's order."""
    mask = in_weight_pass(ops.backward, train.tensors)
    weight = [op for op, w in zip(ops.backward, mask, strict=True) if w]
    inputs = [op for op, w in zip(ops.backward, mask, strict=True) if not w]
    made = {t for op in weight for t in op.outputs}
    params = set(ops.params)

    def reads(op) -> tuple[str, ...]:   # a tied gradient's sum reads only its local operand here
        carried = ops.carried.get(op.outputs[0])
        return (carried,) if carried is not None else op.inputs

    kept = tuple(dict.fromkeys(t for op in weight for t in reads(op) if t not in made and t not in params))
    return tuple(inputs), tuple(weight), kept


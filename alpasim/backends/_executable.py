"""One pipeline stage as three compiled SPMD programs on its own `jax.sharding.Mesh`.

`lower_stage(plan, graph, k, devices)` builds, from the plan and a device list only (so
a worker process can build its stage alone):

- forward(params, acts, data) -> (boundary outputs (and the loss on the last stage),
  residuals);
- backward(params, acc, acts, data, residuals, cts) -> (acc + grads / B, cotangents of
  acts). What a microbatch stashes from its forward for its backward follows the plan:
  with remat=True the stage inputs only (acts, data; no residuals), and the backward is
  the `jax.vjp` of the stage function, recomputing the forward inside (full
  rematerialisation); with remat=False the forward itself is the `jax.vjp` and returns
  its residuals (the leaves of the `jax.tree_util.Partial` it gives back), the
  backward applies them without recomputing. A residual that *is* one of the stage's
  inputs is not returned: a parameter is read from the stage's own, a stage input is
  stashed as it came (`ResidualLayout`), so no microbatch holds a copy of the weights;
- update(params, acc, states) -> (params, states, zeroed acc): Adam exactly as the
  training graph's `adam` ops (their hyperparameters, `_lowering._adam`), run in the
  layouts the stage's intra-op plan stores gradients and optimizer states in — with
  weight-update sharding that is a sharded update followed by an all-gather of the
  new parameters.

Shardings: parameters in the plan's `param_specs`; every einsum and conv output and
every boundary tensor constrained with `with_sharding_constraint` to the stage's
intra-op plan (`_stages.stage_intra_plan`); boundary activations leave in the sender's
`transfers` src_spec and arrive in the receiver's dst_spec where the plan gives them;
a cotangent leaves and arrives in the layout of the activation it belongs to. What the
plan leaves free, XLA's SPMD partitioner chooses.

One systematic difference from the plan: the plan synchronises weight gradients once
per iteration, after accumulation; in JAX the gradient of a replicated parameter is
reduced over the data-parallel axis inside each backward (the accumulator lives in the
planned gradient layout), so that reduction runs once per microbatch.

Gradient accumulation: each microbatch's gradient is computed in the compute dtype
(the parameter's) from an unscaled loss cotangent, cast to the accumulation dtype and
added with weight 1/B (B microbatches), so a half-precision gradient is never scaled
down into float16's subnormals. The accumulation dtype is the training graph's gradient
tensor's (the `adam` op's second input); a half-precision parameter accumulates in
float32 under every recipe but "mixed" (half gradients, 16 B/param), whatever a graph
built before the recipes existed says (`accumulation_dtype`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.graphs import OpGraph, build_training_graph
from alpasim.solvers import IntraOpPlan, PipelinePlan, ShardingSpec

from ._lowering import eval_op, random_leaves
from ._stages import StagePart, partition, stage_intra_plan

AXIS_NAMES = ("x", "y")
CONSTRAINED_PRIMS = ("einsum", "conv2d")
HALF_DTYPES = ("float16", "bfloat16")
# The precision recipe a plan records (`plan.model["precision"]`); plans from before the
# recipes existed ran what "mixed-fp32grad" now names.
DEFAULT_PRECISION = "mixed-fp32grad"


@dataclass
class ResidualLayout:
    """Where each leaf of a no-remat forward's vjp comes from, found when the forward is
    traced: ("param" | "act" | "data", name) for a stage input used as a residual,
    ("res", i) for the forward's i-th returned residual. Filled once by that trace and
    read by the backward's; a remat stage has none (`treedef` None)."""

    treedef: Any = None
    sources: list[tuple[str, Any]] = field(default_factory=list)
    out_dtypes: dict[str, Any] = field(default_factory=dict)    # the forward's outputs, to seed the vjp

    @property
    def kept_acts(self) -> tuple[str, ...]:
        return tuple(n for kind, n in self.sources if kind == "act")

    @property
    def kept_data(self) -> tuple[str, ...]:
        return tuple(n for kind, n in self.sources if kind == "data")


class StageExecutable:
    """A stage's compiled programs and its state: parameters, gradient accumulators,
    optimizer states and the stash of microbatches between forward and backward."""

    def __init__(self, part: StagePart, mesh: Mesh, intra: IntraOpPlan, shardings: dict[str, NamedSharding],
                 compiled: dict[str, Any], params: dict, states: dict, *, remat: bool = True,
                 acc_dtypes: dict[str, Any] | None = None, residuals: ResidualLayout | None = None) -> None:
        self.part, self.mesh, self.intra_plan = part, mesh, intra
        self.index = part.index
        self.shardings = shardings          # name -> layout: params, grads ("<p>:grad"), states, acts, data
        self.compiled = compiled            # "forward" | "backward" | "update" -> jax Compiled
        self.params, self.states = params, states
        self.remat = remat
        self.acc_dtypes = acc_dtypes or {p: v.dtype for p, v in params.items()}
        self.residuals = residuals or ResidualLayout()
        # The stage inputs one microbatch keeps for its backward: all of them under remat.
        self.kept_acts = tuple(part.acts_in) if remat else self.residuals.kept_acts
        self.kept_data = tuple(part.data) if remat else self.residuals.kept_data
        self.acc = self._zeros_acc()
        self.stash: dict[int, tuple[dict, dict, list]] = {}

    # ------------------------------------------------------------- execution
    def forward(self, microbatch: int, acts: dict, data: dict) -> dict[str, jax.Array]:
        """Run the forward of one microbatch; stash what its backward reads."""
        acts = {t: acts[t] for t in self.part.acts_in}
        data = {t: jax.device_put(data[t], self.shardings[t]) for t in self.part.data}
        outs, res = self.compiled["forward"](self.params, acts, data)
        self.stash[microbatch] = self.stash_entry(acts, data, res)
        return outs

    def stash_entry(self, acts: dict, data: dict, res: list) -> tuple[dict, dict, list]:
        """What one microbatch keeps from its forward to its backward."""
        return {t: acts[t] for t in self.kept_acts}, {t: data[t] for t in self.kept_data}, res

    def backward(self, microbatch: int, cts: dict) -> dict[str, jax.Array]:
        """Backward of one microbatch: accumulate parameter gradients, return the
        cotangents of the stage's input activations."""
        acts, data, res = self.stash[microbatch]
        cts = {t: cts[t] for t in self.part.acts_out}
        self.acc, act_cts = self.compiled["backward"](self.params, self.acc, acts, data, res, cts)
        return act_cts

    def free(self, microbatch: int) -> None:
        self.stash.pop(microbatch, None)

    def update(self) -> None:
        self.params, self.states, self.acc = self.compiled["update"](self.params, self.acc, self.states)

    def add_grad(self, param: str, value: jax.Array) -> None:
        """Add another stage's accumulated gradient of a parameter this stage owns."""
        value = jax.device_put(value, self.shardings[f"{param}:grad"]).astype(self.acc[param].dtype)
        self.acc[param] = self.acc[param] + value

    def set_param(self, param: str, value: jax.Array) -> None:
        """Refresh a replicated parameter from its owner's new value."""
        self.params[param] = jax.device_put(value, self.shardings[param])

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """Parameters, accumulators and optimizer states as numpy (for a restart)."""
        return {"params": _to_numpy(self.params), "acc": _to_numpy(self.acc), "states": _to_numpy(self.states)}

    def load_state_dict(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        self.params = {p: jax.device_put(v, self.shardings[p]) for p, v in state["params"].items()}
        self.acc = {p: jax.device_put(v, self.shardings[f"{p}:grad"]) for p, v in state["acc"].items()}
        self.states = {k: jax.device_put(v, self.shardings[k]) for k, v in state["states"].items()}
        self.stash.clear()

    def _zeros_acc(self) -> dict[str, jax.Array]:
        return {p: jax.device_put(jnp.zeros(v.shape, self.acc_dtypes[p]), self.shardings[f"{p}:grad"])
                for p, v in self.params.items()}


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


def stage_inputs(plan: PipelinePlan, graph: OpGraph, seed: int = 0) -> StageInputs:
    # The plan's recipe where it records one (older plans: the graph builder's default).
    recipe = {"precision": plan.model["precision"]} if "precision" in plan.model else {}
    return StageInputs(build_training_graph(graph, remat=bool(plan.model.get("remat", True)), **recipe).graph,
                       partition(graph, plan), random_leaves(graph, seed))


def lower_stage(plan: PipelinePlan, graph: OpGraph, stage_index: int, devices: Sequence[jax.Device], *,
                seed: int = 0, shared: StageInputs | None = None) -> StageExecutable:
    """Stage `stage_index` of `plan` on `devices`; `graph` is `planning_graph(plan.model)`.

    Parameters start as `random_leaves(graph, seed)` gives them, the values a
    single-device run of the whole graph uses. `shared` (`stage_inputs`) carries what
    every stage derives alike, so a process lowering all stages derives it once.
    """
    shared = shared or stage_inputs(plan, graph, seed)
    train, part, leaves = shared.train, shared.parts[stage_index], shared.leaves
    intra = stage_intra_plan(plan, train, stage_index)
    mesh = stage_mesh(plan, stage_index, devices)
    shardings = _shardings(plan, train, part, intra, mesh)
    adam = {op.inputs[0]: op for op in train.ops if op.prim == "adam" and op.inputs[0] in part.owned}

    params = {p: jax.device_put(leaves[p], shardings[p]) for p in part.params}
    states = {}
    for p, op in adam.items():
        for t in op.inputs[2:]:  # (master,) m, v
            init = leaves[p].astype(np.float32) if t.endswith(":master") else np.zeros(train.tensors[t].shape,
                                                                                        np.float32)
            states[t] = jax.device_put(init, shardings[t])

    remat = bool(plan.model.get("remat", True))
    precision = str(plan.model.get("precision", DEFAULT_PRECISION))
    grad_of = {op.inputs[0]: op.inputs[1] for op in train.ops if op.prim == "adam"}
    acc_dtypes = {p: accumulation_dtype(train.tensors[p].dtype, train.tensors[grad_of[p]].dtype
                                        if p in grad_of else train.tensors[p].dtype, precision) for p in part.params}
    residuals = ResidualLayout()
    fns = _stage_functions(part, adam, shardings, mesh, plan.microbatches, remat, residuals)

    def abstract(names) -> dict[str, jax.ShapeDtypeStruct]:
        return {t: jax.ShapeDtypeStruct(graph.tensors[t].shape, jax.dtypes.canonicalize_dtype(graph.tensors[t].dtype),
                                        sharding=shardings[t]) for t in names}

    p_spec, a_spec, d_spec, ct_spec = (abstract(n) for n in (part.params, part.acts_in, part.data, part.acts_out))
    acc = {p: jax.ShapeDtypeStruct(v.shape, acc_dtypes[p], sharding=shardings[f"{p}:grad"]) for p, v in params.items()}
    s_spec = {t: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for t, v in states.items()}
    # Compiled ahead of time: step times then exclude compilation, and the HLO is at hand.
    # The forward first: its trace fills `residuals`, which the backward's reads.
    forward = fns["forward"].lower(p_spec, a_spec, d_spec).compile()
    _, res_sh = forward.output_shardings
    res_spec = [jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=sh)
                for r, sh in zip(forward.out_info[1], res_sh, strict=True)]
    kept_a, kept_d = (a_spec, d_spec) if remat else \
        ({t: a_spec[t] for t in residuals.kept_acts}, {t: d_spec[t] for t in residuals.kept_data})
    compiled = {
        "forward": forward,
        "backward": fns["backward"].lower(p_spec, acc, kept_a, kept_d, res_spec, ct_spec).compile(),
        "update": fns["update"].lower(p_spec, acc, s_spec).compile(),
    }
    return StageExecutable(part, mesh, intra, shardings, compiled, params, states, remat=remat,
                           acc_dtypes=acc_dtypes, residuals=residuals)


def _named(mesh: Mesh, spec: ShardingSpec | str) -> NamedSharding:
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    return NamedSharding(mesh, PartitionSpec(*spec.partition_spec(AXIS_NAMES)))


def _shardings(plan: PipelinePlan, train: OpGraph, part: StagePart, intra: IntraOpPlan,
               mesh: Mesh) -> dict[str, NamedSharding]:
    """Every layout the stage's programs take or produce (see the module doc)."""
    k = part.index
    st = plan.stages[k]
    out: dict[str, NamedSharding] = {}
    for t, spec in intra.specs.items():
        out[t] = _named(mesh, spec)
    for p in part.params:
        out[p] = _named(mesh, st.param_specs.get(p, intra.specs[p]))
    grad_of = {op.inputs[0]: op.inputs[1] for op in train.ops if op.prim == "adam"}
    for p in part.params:
        g = grad_of.get(p)
        own = p in part.owned and g in intra.specs
        out[f"{p}:grad"] = _named(mesh, intra.specs[g]) if own else out[p]
    for op in train.ops:  # optimizer states the plan stores nowhere else: with their parameter
        if op.prim == "adam" and op.inputs[0] in part.owned:
            for t in op.inputs[2:]:
                out.setdefault(t, out[op.inputs[0]])
    for t in plan.transfers:  # boundary layouts named by the plan win
        if t["src_stage"] == k and t["direction"] == "forward" and t.get("src_spec") and t["tensor"] in part.acts_out:
            out[t["tensor"]] = _named(mesh, t["src_spec"])
        if t["dst_stage"] == k and t["direction"] == "forward" and t.get("dst_spec") and t["tensor"] in part.acts_in:
            out[t["tensor"]] = _named(mesh, t["dst_spec"])
    for t in (*part.acts_in, *part.acts_out, *part.data):
        if t not in out:
            raise ValueError(f"stage {k}: no layout for boundary tensor {t!r}")
    return out


def _stage_functions(part: StagePart, adam: dict, shardings: dict[str, NamedSharding], mesh: Mesh,
                     microbatches: int, remat: bool, residuals: ResidualLayout) -> dict[str, Any]:
    constrained = {t for op in part.ops if op.prim in CONSTRAINED_PRIMS for t in op.outputs}
    constrained |= set(part.acts_out)

    def body(params: dict, acts: dict, data: dict) -> dict:
        values = {**params, **acts, **data}
        for op in part.ops:
            for t, v in zip(op.outputs, eval_op(op, [values[x] for x in op.inputs]), strict=True):
                if t in constrained and t in shardings:
                    v = jax.lax.with_sharding_constraint(v, shardings[t])
                values[t] = v
        outs = {t: values[t] for t in part.acts_out}
        if part.loss is not None:
            outs[part.loss] = values[part.loss]
        return outs

    def forward_remat(params, acts, data):
        return body(params, acts, data), []

    def forward_stash(params, acts, data):
        outs, vjp = jax.vjp(lambda p, a: body(p, a, data), params, acts)
        residuals.out_dtypes = {t: v.dtype for t, v in outs.items()}
        leaves, residuals.treedef = jax.tree_util.tree_flatten(vjp)
        inputs = {id(v): (kind, n) for kind, tree in (("param", params), ("act", acts), ("data", data))
                  for n, v in tree.items()}
        residuals.sources, res = [], []
        for v in leaves:
            residuals.sources.append(inputs.get(id(v)) or ("res", len(res)))
            if id(v) not in inputs:
                res.append(v)
        return outs, res

    def pullback(params, acts, data, res):
        if remat:
            outs, vjp = jax.vjp(lambda p, a: body(p, a, data), params, acts)
            return {t: v.dtype for t, v in outs.items()}, vjp
        given = {"param": params, "act": acts, "data": data, "res": res}
        vjp = jax.tree_util.tree_unflatten(residuals.treedef, [given[kind][n] for kind, n in residuals.sources])
        return residuals.out_dtypes, vjp

    def backward(params, acc, acts, data, res, cts):
        # Each microbatch's loss is seeded with 1 and its gradients weighted 1/B in the
        # accumulation dtype (module doc): the loss is the mean over microbatches.
        seed = {**cts, **({part.loss: jnp.asarray(1.0, jnp.float32)} if part.loss else {})}
        dtypes, vjp = pullback(params, acts, data, res)
        g_params, g_acts = vjp({t: seed[t].astype(dtypes[t]) for t in dtypes})
        scale = 1.0 / microbatches
        return {p: acc[p] + g_params[p].astype(acc[p].dtype) * jnp.asarray(scale, acc[p].dtype) for p in acc}, g_acts

    def update(params, acc, states):
        params, states = dict(params), dict(states)
        for p, op in adam.items():
            new = eval_op(op, [params[p], acc[p], *(states[t] for t in op.inputs[2:])])
            params[p] = new[0]
            states.update(zip(op.inputs[2:], new[1:]))
        return params, states, {p: jnp.zeros_like(v) for p, v in acc.items()}

    p_sh = {p: shardings[p] for p in part.params}
    g_sh = {p: shardings[f"{p}:grad"] for p in part.params}
    a_sh = {t: shardings[t] for t in part.acts_in}
    d_sh = {t: shardings[t] for t in part.data}
    ct_sh = {t: shardings[t] for t in part.acts_out}
    o_sh = dict(ct_sh)
    if part.loss is not None:
        o_sh[part.loss] = NamedSharding(mesh, PartitionSpec())
    s_sh = {t: shardings[t] for op in adam.values() for t in op.inputs[2:]}
    # Residual layouts are XLA's choice (None: propagated, no mesh context is active); the
    # backward takes them as the compiled forward gives them (`lower_stage`). Unused
    # arguments are kept: the stage holds them anyway, and each program's memory
    # analysis then counts every buffer it is handed (`_memory`).
    return {
        "forward": jax.jit(forward_remat if remat else forward_stash, in_shardings=(p_sh, a_sh, d_sh),
                           out_shardings=(o_sh, None), keep_unused=True),
        "backward": jax.jit(backward, out_shardings=(g_sh, a_sh), keep_unused=True),
        "update": jax.jit(update, in_shardings=(p_sh, g_sh, s_sh), out_shardings=(p_sh, s_sh, g_sh),
                          keep_unused=True),
    }

"""`IntraOpPlan`: a decoded intra-op choice, costed from the graph itself.

`realize(problem, choice)` walks the graph once with the chosen strategies and never
reads the ILP's matrices: each op pays its own collectives (and compute), each operand
read in another layout than it is stored in pays its resharding, and each updated
parameter pays the trip back to its stored layout. Memory is recomputed the same way:
parameters, gradients and optimizer states by their layouts, plus the peak of live
activations along the op order. So a test can hold the solver's objective to this
independent sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import CostModel, fuse
from alpasim.graphs import OpGraph

from ._intra_problem import IntraOpProblem, accumulator_factor, kept_gradient_factor, partial_bytes, reshard_key
from ._mesh import LogicalMesh
from ._resharding import Collective, resharding_collectives
from ._spec import ShardingSpec
from ._strategies import Strategy


@dataclass(frozen=True, slots=True)
class PlacedCollective:
    """A collective with where it happens: inside an op, or resharding a tensor for one."""

    collective: Collective
    op: str
    tensor: str | None = None     # set for resharding
    per_iteration: bool = False   # gradient sync / update: once per iteration, not per microbatch

    def to_json(self, mesh: LogicalMesh) -> dict:
        d = self.collective.to_json()
        d.update(op=self.op, time_s=self.collective.time_s(mesh), per_iteration=self.per_iteration)
        if self.tensor is not None:
            d["tensor"] = self.tensor
        return d


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """Per-device bytes of one stage under a plan."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_peak_bytes: float
    stash_bytes: float = 0.0            # activations one microbatch keeps from forward to backward
    update_bytes: float = 0.0           # the optimizer step's working set beyond the persistent state

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_peak_bytes

    @property
    def persistent_bytes(self) -> float:
        """Held for the whole step: parameters, gradients and optimizer states."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def with_inflight(self, microbatches: float) -> float:
        """Bytes with `microbatches` microbatches in flight on the stage (seed eq. 5 by
        liveness, `costmodels.stage_memory`): one at its peak, the others holding only
        their stash. What the memory-bounded ILP constrains."""
        return self.persistent_bytes + self.activations_peak_bytes + max(microbatches - 1, 0) * self.stash_bytes

    def pipelined_bytes(self, inflight: int) -> float:
        """`with_inflight` for an integer number of microbatches in flight."""
        return self.with_inflight(inflight)

    def to_json(self) -> dict:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activations_peak_bytes": self.activations_peak_bytes,
                "stash_bytes": self.stash_bytes, "update_bytes": self.update_bytes, "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class IntraOpPlan:
    """Per-op strategy, per-tensor spec, collectives, predicted time and memory.

    Times split the way gradient accumulation runs a stage: `compute_s` and
    `communication_s` are per microbatch (forward and backward), `sync_s` and `update_s`
    once per iteration (weight-gradient synchronisation and the optimizer).
    """

    mesh: LogicalMesh
    strategies: dict[str, Strategy]
    specs: dict[str, ShardingSpec]           # layout each tensor is stored/produced in
    collectives: tuple[PlacedCollective, ...]
    communication_s: float
    compute_s: float
    memory: MemoryUse
    choice: tuple[int, ...]
    sync_s: float = 0.0
    update_s: float = 0.0
    forward_s: float = 0.0                   # the forward ops' share of compute + communication

    @property
    def backward_s(self) -> float:
        """Per-microbatch time of the backward ops (with any recomputation)."""
        return self.time_s - self.forward_s

    @property
    def time_s(self) -> float:
        """Per-microbatch compute plus communication, without overlap."""
        return self.compute_s + self.communication_s

    def amortized_communication_s(self, microbatches: int = 1) -> float:
        """Communication per microbatch with the gradient sync spread over `microbatches`."""
        return self.communication_s + self.sync_s / microbatches

    def iteration_s(self, microbatches: int) -> float:
        """One iteration of this stage alone: B microbatches, then sync and update."""
        return microbatches * self.time_s + self.sync_s + self.update_s

    def collective_bytes(self) -> dict[str, float]:
        """The bytes its collectives move on the mesh's live axes, by kind: one
        microbatch's forward and backward and the iteration's sync, what the compiled
        programs are compared with (`backends.compare_collectives`)."""
        out: dict[str, float] = {}
        for pc in self.collectives:
            if self.mesh.axis_size(pc.collective.axes) > 1:
                out[pc.collective.kind] = out.get(pc.collective.kind, 0.0) + pc.collective.nbytes
        return out

    def partition_specs(self, params: list[str], axis_names: tuple[str, str] = ("x", "y")) -> dict[str, tuple]:
        """`jax.sharding.PartitionSpec` arguments of each parameter's stored layout."""
        return {p: self.specs[p].partition_spec(axis_names) for p in params if p in self.specs}


def realize(problem: IntraOpProblem, choice: tuple[int, ...]) -> IntraOpPlan:
    graph, mesh = problem.graph, problem.mesh
    strategies: dict[str, Strategy] = {}
    specs: dict[str, ShardingSpec] = {}
    for v, node in enumerate(problem.nodes):
        i = choice[v]
        strategies.update(node.choices[i])
        specs.update(node.specs[i])
    placed: list[PlacedCollective] = []
    compute_s = update_s = forward_s = 0.0
    stored: dict[str, ShardingSpec] = {t: specs[t] for t in specs if t not in graph.producer}
    node_of = problem.node_of_tensor
    made: set[tuple] = set()      # reshardings already paid, shared by readers across nodes (`reshard_key`)
    for op in graph.ops:
        s = strategies[op.name]
        update = op.phase == "update"
        if update:
            update_s += s.compute_s
        else:
            compute_s += s.compute_s
        forward = op.phase == "forward"
        if forward:
            forward_s += s.compute_s
        for t, need in zip(op.inputs, s.in_specs):
            have = stored.get(t)
            if have is None:  # an optimizer state first read here: stored as needed
                stored[t] = need
                continue
            if have != need and node_of.get(t) != node_of[op.outputs[0]]:
                key = (node_of.get(t), *reshard_key(graph, t, op.name), need)
                if key in made:
                    continue
                made.add(key)
            for c in resharding_collectives(have, need, graph.tensors[t].nbytes, mesh):
                placed.append(PlacedCollective(c, op.name, t, update))
                forward_s += c.time_s(mesh) if forward else 0.0
        sync = s.sync or (False,) * len(s.collectives)
        placed += [PlacedCollective(c, op.name, None, x) for c, x in zip(s.collectives, sync)]
        if forward:
            forward_s += sum(c.time_s(mesh) for c, x in zip(s.collectives, sync) if not x)
        for t, spec in zip(op.outputs, s.out_specs):
            stored[t] = spec
    for new, param in problem.loop_backs:
        for c in resharding_collectives(stored[new], stored[param], graph.tensors[new].nbytes, mesh):
            placed.append(PlacedCollective(c, f"loop-back:{param}", new, True))
    comm = sum(p.collective.time_s(mesh) for p in placed if not p.per_iteration)
    sync_s = sum(p.collective.time_s(mesh) for p in placed if p.per_iteration)
    specs.update(stored)
    return IntraOpPlan(mesh, strategies, specs, tuple(placed), comm, compute_s,
                       memory_use(problem, stored, strategies), tuple(choice), sync_s, update_s, forward_s)


def reprice(plan: IntraOpPlan, graph: OpGraph, cost_model: CostModel, mesh: LogicalMesh | None = None) -> IntraOpPlan:
    """The same shardings and collectives priced by another cost model (on `mesh`, e.g.
    the same devices with profiled links; default the plan's own).

    Time is accounted as `realize` does (forward ops' compute and per-microbatch
    collectives make forward_s, update ops' compute update_s, per-iteration collectives
    sync_s), with each op's shard timed by `cost_model.op_time_s` and each collective by
    `cost_model.collective_time_s` (so a profiled model's per-kind fits apply, not only
    its link). What runs is unchanged: strategies, specs, collectives and memory.
    """
    mesh = mesh or plan.mesh
    if mesh.shape != plan.mesh.shape:
        raise ValueError(f"reprice: a {plan.mesh} plan cannot be priced on a {mesh} mesh")
    compute_s = update_s = forward_s = 0.0
    fusion = fuse(graph)
    for op in graph.ops:
        s = plan.strategies[op.name]
        split = {c: mesh.axis_size(axes) for c, axes in s.loops}
        t = cost_model.op_time_s(op, graph.tensors, num_shards=math.prod(split.values()), access=fusion.of(op.name),
                                 split=split)
        if op.phase == "update":
            update_s += t
        else:
            compute_s += t
            forward_s += t if op.phase == "forward" else 0.0

    phase = {op.name: op.phase for op in graph.ops}
    comm = sync_s = 0.0
    for p in plan.collectives:  # each collective priced once, then booked where realize books it
        c = p.collective
        t = cost_model.collective_time_s(c.kind, c.nbytes, [mesh.axes[a] for a in c.axes])
        if p.per_iteration:
            sync_s += t
        else:
            comm += t
            forward_s += t if phase.get(p.op) == "forward" else 0.0
    return dataclasses.replace(plan, mesh=mesh, communication_s=comm, compute_s=compute_s, sync_s=sync_s,
                               update_s=update_s, forward_s=forward_s)


def memory_use(problem: IntraOpProblem, specs: dict[str, ShardingSpec],
               strategies: dict[str, Strategy] | None = None) -> MemoryUse:
    graph, mesh = problem.graph, problem.mesh
    sizes: dict[str, float] = {}        # a tensor is in many live sets: size it once

    def per_device(t: str) -> float:
        size = sizes.get(t)
        if size is None:
            op = problem.partials.get(t)
            if op is not None:   # an op's unreduced result, by the strategy it runs
                size = partial_bytes(strategies[op]) if strategies else 0.0
            else:
                size = graph.tensors[t].nbytes / specs[t].num_shards(mesh)
            sizes[t] = size
        return size

    by_role = {"param": 0.0, "grad": 0.0, "optimizer_state": 0.0}
    for t in problem.persistent:
        role = graph.tensors[t].role
        by_role[role] += per_device(t) * (accumulator_factor(graph, mesh, (strategies or {}).get, t)
                                          * kept_gradient_factor(graph, t) if role == "grad" else 1)

    def total(tensors: Sequence[str]) -> float:   # the brute-force oracles call this ~10^5 times a test
        s = 0.0
        for t in tensors:
            size = sizes.get(t)
            s += per_device(t) if size is None else size
        return s

    peak = max(map(total, problem.live_sets), default=0.0)
    stash = total(problem.stash)
    return MemoryUse(by_role["param"], by_role["grad"], by_role["optimizer_state"], peak, stash,
                     update_working_bytes(graph, mesh, specs, strategies or {}))


def update_working_bytes(graph: OpGraph, mesh: LogicalMesh, specs: dict[str, ShardingSpec],
                         strategies: dict[str, Strategy]) -> float:
    """The optimizer step's largest working set: an Adam op that reads a tensor in
    another layout than it is stored in (weight-update sharding reads a replicated
    gradient as a slice, an all-gather brings the updated slice back) holds the copies
    in its own layouts next to the persistent state. Adam ops run one after another."""
    most = 0.0
    for op in graph.ops:
        s = strategies.get(op.name)
        if op.prim != "adam" or s is None:
            continue
        held = 0.0
        for t, need in zip(op.inputs, s.in_specs):
            if t in specs and specs[t] != need:
                held += graph.tensors[t].nbytes / need.num_shards(mesh)
        for t, out in zip(op.outputs, s.out_specs):
            home = specs.get(t.removesuffix(":new"))          # the buffer the new value replaces
            if home is not None and home != out:
                held += graph.tensors[t].nbytes / out.num_shards(mesh)
        most = max(most, held)
    return most


def objective_s(plan: IntraOpPlan, with_compute: bool, microbatches: int = 1) -> float:
    """What the ILP minimises, recomputed from a realised plan: seconds per microbatch
    with the once-per-iteration work amortised over the microbatches."""
    compute = plan.compute_s + plan.update_s / microbatches if with_compute else 0.0
    return plan.communication_s + plan.sync_s / microbatches + compute

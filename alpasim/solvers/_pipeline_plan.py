"""`PipelinePlan`: stages on submeshes, microbatches, predictions — plain data with a JSON form.

The JSON (`schema` "alpasim.plan/1") is the contract other tools read; docs/planning.md
lists its fields. A plan round-trips exactly through `to_json`/`plan_from_json`, and
`partition_specs()` gives, per stage, the `jax.sharding.PartitionSpec` arguments of
every parameter (mesh axis names "x" and "y").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from alpasim.graphs import read_json_file

from ._records import PlanFormatError, Record
from ._schedule import SCHEDULES
from ._spec import ShardingSpec

PLAN_SCHEMA = "alpasim.plan/1"
TRANSFER_DIRECTIONS = ("forward", "backward")
# The schedules a plan may name: those of the one table, which the simulator builds.
PLAN_SCHEDULES = tuple(SCHEDULES)
# Per-stage numbers that are seconds or bytes: finite and never negative.
_STAGE_AMOUNTS = ("time_s", "memory_bytes", "compute_s", "sync_s", "params_bytes", "activation_bytes", "forward_s",
                  "backward_s", "stash_bytes", "boundary_s", "grad_sync_s", "exposed_sync_s", "backward_weight_s",
                  "weight_stash_bytes", "gather_exposed_s", "param_gather_s", "grad_scatter_s")


@dataclass(frozen=True, slots=True)
class PlanModel(Record):
    """What was planned: the model's source (to rebuild the priced graph anywhere), its
    size, and the training recipe it was priced with. An infeasible plan records only
    the first three fields."""

    name: str
    family: str
    global_batch: int
    params: int | None = None
    flops_per_iteration: float | None = None   # einsum + conv FLOPs per iteration, recomputation included
    microbatch_size: int | None = None
    layers: int | None = None                  # planning units the stages' layer ranges index
    remat: bool = True
    recompute: str = "none"                    # graphs.RECOMPUTE_POLICIES
    precision: str | None = None               # None: a plan from before recipes (the default one)
    dtype: str | None = None
    bytes_per_param: float | None = None
    source: dict[str, Any] | None = None       # graphs.ModelSource.record(); None: `name` is a zoo spec
    loss_kernel: str | None = None             # graphs.LOSS_KERNELS: how the cross-entropy was priced
    kernels: str = "per-op"                    # graphs.KERNEL_STASHES: elementwise chains op by op or fused
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanCluster(Record):
    """The cluster planned for: its summary (name, nodes, devices per node, device,
    links and memory, the fields the plan file promises), and its full `spec`
    (`costmodels.Cluster.to_json`) so a plan file simulates on its own."""

    name: str
    nodes: int
    devices_per_node: int
    device: str | None = None
    inter_node_gbps: float | None = None
    device_memory_bytes: float | None = None
    spec: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Prediction(Record):
    """The planner's prediction for one iteration; all None (null) for an infeasible plan
    but `needed_memory_bytes`: there, where the planner knows it to exceed the device's,
    the memory per device its layouts need (the 1F1B search's lower bound, or what the
    interleaved slicing that comes closest needs; the plan's notes say by term)."""

    omit_none: ClassVar[bool] = False

    iteration_s: float | None = None
    tflops_per_device: float | None = None
    throughput_pflops: float | None = None
    peak_memory_bytes: float | None = None
    bubble_fraction: float | None = None
    needed_memory_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CostModelRef(Record):
    """The cost model a plan was priced with: its name and content digest."""

    name: str
    digest: str


@dataclass(frozen=True, slots=True)
class SearchStats(Record):
    """How the plan was found."""

    seconds: float = 0.0
    ilp_solves: int = 0                        # intra-op jobs solved (not taken from the cache)
    cache_hits: int = 0
    microbatch_candidates: tuple[int, ...] = ()
    dp_bottlenecks_evaluated: int = 0
    cost_model: CostModelRef | None = None     # None: the analytic model
    megatron: dict[str, Any] | None = None     # the Megatron-LM configuration (`MegatronConfig` fields)
    megatron_grid: tuple[dict[str, Any], ...] | None = None   # every configuration tried, when grid-searched
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunnerUp(Record):
    """The best plan at another microbatch count: its stages as [first, last, submesh]."""

    microbatches: int
    iteration_s: float | None
    stages: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PlanTransfer(Record):
    """A tensor one stage produces and another reads, with the layout the sender's plan
    makes it in and the layout the receiver's plan reads it in (None when unknown).
    `per_iteration`: it moves once per iteration (a sum over microbatches), not once
    per microbatch. `nbytes` is the whole, unsharded tensor."""

    tensor: str
    nbytes: float
    src_stage: int
    dst_stage: int
    shape: tuple[int, ...] = ()
    dtype: str = ""
    direction: str = ""                        # "" in old files: from the stage order
    per_iteration: bool = False
    src_spec: str | None = None
    dst_spec: str | None = None

    def __post_init__(self) -> None:
        if self.src_stage == self.dst_stage or min(self.src_stage, self.dst_stage) < 0:
            raise ValueError(f"stages {self.src_stage} -> {self.dst_stage} are not two stages")
        if not self.direction:
            object.__setattr__(self, "direction", "forward" if self.dst_stage > self.src_stage else "backward")
        if self.direction not in TRANSFER_DIRECTIONS:
            raise ValueError(f"direction {self.direction!r} is not one of {', '.join(TRANSFER_DIRECTIONS)}")


@dataclass(frozen=True, slots=True)
class PipelineStage(Record):
    """One pipeline stage: its layers, devices, meshes, intra-op choices and costs."""

    layers: tuple[int, int]                 # first, last (inclusive)
    devices: tuple[int, ...]
    submesh: tuple[int, int]
    logical_mesh: tuple[int, int]
    time_s: float                           # forward + backward per microbatch (sync amortised)
    memory_bytes: float                     # per device, with 1F1B's in-flight activations
    inflight_microbatches: int
    compute_s: float = 0.0                  # per microbatch, without the amortised sync
    sync_s: float = 0.0                     # gradient sync + update, once per iteration
    params_bytes: float = 0.0               # persistent per device (params, grads, states)
    activation_bytes: float = 0.0           # one microbatch
    option: int = 0                         # which Pareto plan of the layers
    param_specs: dict[str, str] = field(default_factory=dict)
    heavy_ops: tuple[dict[str, Any], ...] = ()   # {op, equation, strategy, output}
    forward_s: float = 0.0                  # per microbatch: the forward share of compute_s
    backward_s: float = 0.0                 # per microbatch: backward (with recomputation)
    stash_bytes: float = 0.0                # per device: what each further microbatch in flight holds
    boundary_s: float = 0.0                 # per microbatch: the DP's estimate of receiving its inputs
    # Per device, by term (`costmodels.StageMemory.to_json`): params_bytes, grads_bytes,
    # optimizer_bytes, stash_bytes (per microbatch), inflight, transient_bytes,
    # buffer_bytes, total_bytes (= memory_bytes). Empty for plans from before it existed.
    memory: dict[str, Any] = field(default_factory=dict)
    # Per layer of the stage, in order: every training-graph tensor the layer's ops read
    # or write -> the layout it was priced in (a tensor crossing layers has one entry in
    # each). Executors run these layouts as they are; empty for plans from before.
    layer_specs: tuple[dict[str, str], ...] = ()
    # The weight gradients' collectives (inside sync_s, one per gradient after the
    # backward) and, when they overlap the last backward in buckets, each bucket as
    # (ready, seconds) from that backward's start and what the buckets leave exposed
    # after it (`costmodels._overlap`; empty buckets: no overlap, exposed = grad_sync_s).
    grad_sync_s: float = 0.0
    sync_buckets: tuple[tuple[float, float], ...] = ()
    exposed_sync_s: float = 0.0
    # Of backward_s, the weight gradients' compute (what a zero-bubble schedule defers),
    # and of stash_bytes, what those weight gradients still read once the input
    # gradients have run (their activations and cotangents). 0: not priced (a schedule
    # that splits the backward then takes half of each, `split_backward`).
    backward_weight_s: float = 0.0
    weight_stash_bytes: float = 0.0
    # With Megatron-core's --overlap-param-gather: of exposed_sync_s, what the next
    # forward waits for the parameters' all-gathers, and of sync_s, the after-step
    # all-gathers that moved into that forward (0 where the buckets' all-reduces are
    # split into their reduce-scatter and all-gather halves instead, `costmodels._overlap`).
    gather_exposed_s: float = 0.0
    param_gather_s: float = 0.0
    # Per microbatch: the weight gradients' reduce-scatters of a sharded-gradient plan
    # (ZeRO-2, Llama 3's FSDP) that run on the mesh's gradient stream beside the next
    # work, one microbatch's of them inside sync_s (the stream's tail after the last
    # backward); 0 where they run inline in the backward (`LayerOption.busy_s`).
    grad_scatter_s: float = 0.0
    # What its layers' plans' collectives move, by kind (`LayerOption.collective_bytes`:
    # one microbatch's forward and backward and the iteration's sync): what `alpasim run`
    # compares the compiled programs with. None: a plan from before it was recorded.
    collective_bytes: dict[str, float] | None = None
    # Per layer of the stage, each op's strategy in the layer's op order
    # (`LayerOption.strategy_names`): with `layer_specs`, the priced plan an executor
    # rebuilds without a solve. Empty: a plan from before it was recorded.
    layer_strategies: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.layers[0] > self.layers[1] or self.layers[0] < 0:
            raise ValueError(f"layers {list(self.layers)} are not a range [first, last]")


@dataclass(frozen=True, slots=True)
class PipelinePlan(Record):
    """Stages on submeshes, microbatches, what was predicted and how it was found.

    `chunks` (v) > 1: an interleaved plan (Megatron-LM's virtual stages). `stages` then
    lists the S x v model chunks in pipeline order, and chunk j runs on mesh j mod S:
    stages j and j mod S share devices and submesh (each chunk may view them as its own
    logical mesh). `transfers` index those chunks. With v = 1 every stage is its own mesh, as in the paper.
    """

    model: PlanModel
    cluster: PlanCluster
    method: str
    feasible: bool
    microbatches: int
    stages: tuple[PipelineStage, ...]
    predicted: Prediction
    search: SearchStats
    schedule: str = "1f1b"
    runner_ups: tuple[RunnerUp, ...] = ()
    notes: tuple[str, ...] = ()
    transfers: tuple[PlanTransfer, ...] = ()    # tensors that cross stages
    chunks: int = 1                             # model chunks per mesh (interleaved; see above)
    # The system profile it was priced as (`_systems.SystemRecord.to_json`: name,
    # settings, overridden, unpriced); empty for plans from before profiles existed.
    system: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, v = len(self.stages), self.chunks
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {v!r}")
        if v > 1:
            if n % v or n // v < 2:
                raise ValueError(f"an interleaved plan of {v} chunks per mesh needs a multiple of {v} stages on "
                                 f"at least 2 meshes, got {n} stages")
            meshes = n // v
            for j in range(meshes, n):
                a, b = self.stages[j], self.stages[j % meshes]
                if (tuple(a.devices), tuple(a.submesh)) != (tuple(b.devices), tuple(b.submesh)):
                    raise ValueError(f"stages[{j}] is chunk {j // meshes} of mesh {j % meshes}: its devices and "
                                     f"submesh must be stages[{j % meshes}]'s")
        if self.system and not (isinstance(self.system.get("name"), str) and all(
                isinstance(self.system.get(k), dict) for k in ("settings", "overridden", "unpriced"))):
            raise ValueError(f"system must hold a profile name and its settings, overridden and unpriced entries "
                             f"(`solvers._systems.SystemRecord`), got {self.system!r}")
        for i, t in enumerate(self.transfers):
            if max(t.src_stage, t.dst_stage) >= n:
                raise ValueError(f"transfers[{i}]: stages {t.src_stage} -> {t.dst_stage} are not two of the "
                                 f"plan's {n}")

    @property
    def loss_kernel(self) -> str:
        """The cross-entropy kernel the plan was priced with (`graphs.LOSS_KERNELS`): its
        model's record; for a plan file from before that field, what its system profile
        priced (the kernel the profile ran, or the one priced instead where the cost
        model could not); for one from before profiles, the fused kernel, then the only one."""
        if self.model.loss_kernel is not None:
            return self.model.loss_kernel
        priced = {**self.system.get("settings", {}), **self.system.get("unpriced", {})}
        return priced.get("cross_entropy", "fused")

    @property
    def num_meshes(self) -> int:
        """S: the meshes the stages run on (one per stage unless interleaved)."""
        return len(self.stages) // self.chunks

    @property
    def meshes(self) -> tuple[PipelineStage, ...]:
        """One stage per mesh (its first chunk): devices, submesh and logical mesh."""
        return self.stages[:self.num_meshes]

    def mesh_chunks(self, k: int) -> tuple[PipelineStage, ...]:
        """The stages (model chunks) mesh k runs, chunk 0 first."""
        return self.stages[k::self.num_meshes]

    @property
    def num_devices(self) -> int:
        return sum(len(s.devices) for s in self.meshes)

    def partition_specs(self) -> list[dict[str, list]]:
        """Per stage: parameter -> PartitionSpec arguments (None | 'x' | ['x', 'y'] per dim)."""
        out = []
        for st in self.stages:
            specs = {}
            for p, text in st.param_specs.items():
                specs[p] = _spec_to_partition(text)
            out.append(specs)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, **Record.to_json(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def plan_cluster_info(cluster) -> PlanCluster:
    """The plan's `cluster` field for a `costmodels.Cluster`."""
    return PlanCluster(cluster.name, cluster.nodes, cluster.devices_per_node, cluster.device.name,
                       cluster.inter_node.bandwidth_gbps, cluster.device.memory_bytes, cluster.to_json())


def _spec_to_partition(text: str) -> list:
    from ._spec import ShardingSpec

    if text in ("", "scalar"):
        return []
    return [list(p) if isinstance(p, tuple) else p for p in ShardingSpec.parse(text).partition_spec()]


def plan_from_json(data: Any, source: str = "<plan JSON>") -> PipelinePlan:
    """A plan read from JSON, its types checked field by field and its values by
    `validate_plan`: every error names the file and the field path."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"{source}: top level must be a JSON object")
    if data.get("schema") != PLAN_SCHEMA:
        raise PlanFormatError(f"{source}: field 'schema' is {data.get('schema')!r}, expected {PLAN_SCHEMA!r}")
    body = {k: v for k, v in data.items() if k != "schema"}
    plan = PipelinePlan.from_json(body, f"{source}:")
    validate_plan(plan, source)
    return plan


def validate_plan(plan: PipelinePlan, source: str = "plan") -> None:
    """What a plan file must hold beyond its types, so that nothing downstream runs on a
    silently wrong plan: a schedule the simulator knows; every stage's seconds and
    bytes finite and >= 0; layer ranges that cover the model's planning units in order,
    without gap or overlap; devices inside the cluster, each on one mesh, as many as the
    submesh and the logical mesh say; parameter layouts that parse. Raises
    `PlanFormatError` with the field path ("plan.json: stages[1].layers: ...")."""
    def bad(where: str, message: str) -> PlanFormatError:
        return PlanFormatError(f"{source}: {where}: {message}")

    if plan.schedule not in PLAN_SCHEDULES:
        raise bad("schedule", f"{plan.schedule!r} is not one of {', '.join(PLAN_SCHEDULES)}")
    if not plan.feasible:
        return
    if plan.microbatches < 1:
        raise bad("microbatches", f"must be >= 1, got {plan.microbatches}")
    total = plan.cluster.nodes * plan.cluster.devices_per_node
    owner: dict[int, int] = {}
    parsed: set[str] = set()
    expect = 0
    for i, st in enumerate(plan.stages):
        here = f"stages[{i}]"
        for name in _STAGE_AMOUNTS:
            value = getattr(st, name)
            if not (math.isfinite(value) and value >= 0):
                raise bad(f"{here}.{name}", f"must be a finite number >= 0, got {value!r}")
        for kind, value in (st.collective_bytes or {}).items():
            if not (math.isfinite(value) and value >= 0):
                raise bad(f"{here}.collective_bytes.{kind}", f"must be a finite number >= 0, got {value!r}")
        if st.inflight_microbatches < 1:
            raise bad(f"{here}.inflight_microbatches", f"must be >= 1, got {st.inflight_microbatches}")
        first, last = st.layers
        if first != expect:
            what = "overlaps the stage before" if first < expect else f"leaves layers {expect}..{first - 1} to no stage"
            raise bad(f"{here}.layers", f"{[first, last]} {what} (stages cover the layers in order from 0)")
        expect = last + 1
        if not st.devices:
            raise bad(here, "field 'devices' is empty")
        for name in ("submesh", "logical_mesh"):
            n, m = getattr(st, name)
            if n * m != len(st.devices):
                raise bad(f"{here}.{name}", f"{n}x{m} does not cover the stage's {len(st.devices)} devices")
        for d in st.devices:
            if not 0 <= d < total:
                raise bad(f"{here}.devices", f"device {d} is outside the plan's cluster of {total} devices "
                                             f"(ids 0..{total - 1})")
            if i < plan.num_meshes:
                if d in owner:
                    raise bad(f"{here}.devices", f"device {d} is also in stages[{owner[d]}]")
                owner[d] = i
        for param, text in st.param_specs.items():
            if text in ("", "scalar") or text in parsed:
                continue
            try:
                ShardingSpec.parse(text)
            except ValueError as e:
                raise bad(f"{here}.param_specs[{param!r}]", str(e)) from None
            parsed.add(text)    # a plan repeats a handful of layouts: each is parsed once (simulate runs this)
    for j, t in enumerate(plan.transfers):
        if not (math.isfinite(t.nbytes) and t.nbytes >= 0):
            raise bad(f"transfers[{j}].nbytes", f"must be a finite number >= 0, got {t.nbytes!r}")


def load_plan(path: str | Path) -> PipelinePlan:
    return plan_from_json(read_json_file(path, PlanFormatError), str(path))

"""Planning methods: Alpa and the systems and ablations the paper compares it with.

Every method is the same search (`plan_pipeline`: stage cost table from per-layer
intra-op solves, then a stage DP) with part of the space taken away, so all of them are
priced by one cost model and one simulator, and a difference in throughput is a
difference in the plans, never in the accounting:

========================  ========================================================
method                    what is left of the search
========================  ========================================================
alpa                      everything (intra-op ILP inside stages, stage-mesh DP)
intra_only                one stage on all devices, full ILP
inter_only                pipeline only: one device per stage, operators
                          re-clustered so there are as many layers as devices
pp_dp                     pipeline + data parallelism (PipeDream / DAPPLE space)
equal_layer               the DP restricted to stages of equal layer counts
equal_operator            layers cut at equal operator counts instead of eq. 6
data_parallel, zero2,     one stage on all devices under that intra-op baseline
zero3, heuristic
deepspeed_moe             expert parallelism + ZeRO data parallelism, one stage
megatron                  Megatron-LM: tensor x pipeline x data degrees and the
                          microbatch size, equal blocks per stage; one explicit
                          configuration, or the best of its grid
========================  ========================================================

Infeasible is a result here, not an error: `plan_with_method` returns a plan with
`feasible` false and the reason in `notes`, so a sweep can mark the point out of memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster
from alpasim.graphs import (ModelSource, ModelSpecError, OpGraph, assign_layers, forward_graph, model_source,
                            resolve_model)

from ._inter_op import PlanInfeasible, plan_pipeline, planning_units
from ._pipeline_plan import PipelinePlan, plan_cluster_info
from ._submesh import SubmeshShape

METHODS: dict[str, str] = {
    "alpa": "intra-op ILP inside stages + stage-mesh DP (Alpa)",
    "intra_only": "one stage on all devices, intra-op ILP only",
    "inter_only": "pipeline only, one device per stage",
    "pp_dp": "pipeline + data parallelism (PipeDream/DAPPLE space)",
    "equal_layer": "stage-mesh DP with equal layers per stage",
    "equal_operator": "stage-mesh DP over layers of equal operator counts",
    "data_parallel": "data parallelism on all devices",
    "zero2": "ZeRO-2 data parallelism on all devices",
    "zero3": "ZeRO-3 data parallelism on all devices",
    "heuristic": "shard every tensor's largest dimension, propagate",
    "deepspeed_moe": "DeepSpeed-MoE: expert parallelism + ZeRO data parallelism",
    "megatron": "Megatron-LM: tensor x pipeline x data parallel grid",
}
SINGLE_STAGE_RESTRICTIONS = ("data_parallel", "zero2", "zero3", "heuristic", "deepspeed_moe")
DATA_PARALLEL_RESTRICTIONS = ("data_parallel", "zero2", "zero3", "deepspeed_moe")
# Megatron-LM's grid (Narayanan et al. 2021): tensor parallelism inside a node only,
# microbatch sizes per data-parallel replica.
MEGATRON_TP = (1, 2, 4, 8)
MEGATRON_MICROBATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class MegatronConfig:
    """One Megatron-LM configuration: degrees multiply to the device count."""

    tp: int
    pp: int
    dp: int
    microbatch_size: int              # per data-parallel replica

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "microbatch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Megatron {name} must be a positive integer, got {getattr(self, name)!r}")

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} mbs={self.microbatch_size}"


def plan_with_method(method: str, model: str, cluster: Cluster, *, microbatches: int | str = "auto",
                     megatron: MegatronConfig | None = None, **kw) -> PipelinePlan:
    """Plan `model` on `cluster` with `method` (see the module doc); `kw` goes to
    `plan_pipeline` (cache, map_fn, progress, remat, epsilon, max_stages)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    source = model_source(model)
    if method == "megatron" and source.config is None:
        raise ModelSpecError(f"{source.name}: Megatron-LM's layouts are written for the zoo's transformer blocks; "
                             f"a saved graph plans with the other methods")
    try:
        if method == "megatron":
            if megatron is not None:
                return megatron_plan(model, cluster, megatron, **kw)
            return megatron_grid(model, cluster, **kw)
        return plan_pipeline(source, cluster, microbatches=microbatches, method=method,
                             **_method_options(method, cluster), **kw)
    except PlanInfeasible as e:
        return infeasible_plan(source, cluster, method, str(e))


def _method_options(method: str, cluster: Cluster) -> dict:
    n = cluster.num_devices
    if method == "alpa":
        return {}
    if method == "intra_only":
        return {"max_stages": 1}
    if method in DATA_PARALLEL_RESTRICTIONS:
        # Every device takes whole samples of each microbatch (DeepSpeed's contract).
        return {"max_stages": 1, "restriction": method, "microbatch_multiple": n}
    if method in SINGLE_STAGE_RESTRICTIONS:
        return {"max_stages": 1, "restriction": method}
    if method == "pp_dp":
        return {"restriction": "data_parallel"}
    if method == "equal_layer":
        return {"equal_layers": True}
    if method == "inter_only":
        return {"shape_ok": lambda sh: sh.size == 1, "max_stages": n,
                "relabel": lambda fwd: _at_least_layers(fwd, n)}
    if method == "equal_operator":
        # Equal-operator cuts make every layer distinct (nothing to reuse), so each is
        # solved for its fastest plan only.
        return {"relabel": equal_operator_layers, "pareto": False}
    raise AssertionError(method)


def _at_least_layers(fwd: OpGraph, layers: int) -> OpGraph:
    """Planning units, or `layers` layers by the eq. 6 clustering if that is more."""
    units = planning_units(fwd)
    if units.num_layers >= layers:
        return units
    return assign_layers(fwd, layers)[0]


def equal_operator_layers(fwd: OpGraph) -> OpGraph:
    """As many layers as planning units, each the same number of consecutive forward
    operators (the paper's "equal operator" ablation: no clustering DP)."""
    layers = planning_units(fwd).num_layers
    n = len(fwd.ops)
    return fwd.replace(ops=[op.replace(layer=min(i * layers // n, layers - 1)) for i, op in enumerate(fwd.ops)])


def megatron_configs(num_devices: int, devices_per_node: int, num_blocks: int, global_batch: int,
                     microbatch_sizes: Sequence[int] = MEGATRON_MICROBATCH_SIZES) -> list[MegatronConfig]:
    """Megatron-LM's grid: tp inside a node, pp dividing the blocks, dp the rest, and a
    microbatch size that divides each replica's share of the batch."""
    out = []
    for tp in MEGATRON_TP:
        if tp > devices_per_node or num_devices % tp:
            continue
        for pp in range(1, num_devices // tp + 1):
            if (num_devices // tp) % pp or num_blocks % pp:
                continue
            dp = num_devices // (tp * pp)
            for mbs in microbatch_sizes:
                if global_batch % (mbs * dp) == 0:
                    out.append(MegatronConfig(tp, pp, dp, mbs))
    return out


def megatron_plan(model: str, cluster: Cluster, config: MegatronConfig, **kw) -> PipelinePlan:
    """One Megatron-LM configuration: `pp` stages of equal blocks (embedding with the
    first, head with the last), each on `dp x tp` devices viewed as a (dp, tp) mesh
    with Megatron's layouts (`megatron_restriction`), B = batch / (mbs x dp)."""
    name, cfg = resolve_model(model)
    n = cluster.num_devices
    if config.tp * config.pp * config.dp != n:
        raise ValueError(f"Megatron {config}: tp x pp x dp = {config.tp * config.pp * config.dp}, the cluster has "
                         f"{n} devices")
    if config.tp > cluster.devices_per_node:
        raise ValueError(f"Megatron {config}: tensor parallelism beyond one node ({cluster.devices_per_node} devices)")
    if cfg.batch % (config.microbatch_size * config.dp):
        raise ValueError(f"Megatron {config}: the global batch {cfg.batch} is not a multiple of mbs x dp")
    size = config.tp * config.dp
    b = cfg.batch // (config.microbatch_size * config.dp)

    def views_of(shape: SubmeshShape) -> list[tuple[int, int]]:
        return [(config.dp, config.tp)] if shape.size == size else []

    try:
        plan = plan_pipeline(model, cluster, microbatches=b, method="megatron", restriction="megatron",
                             shape_ok=lambda sh: sh.size == size, views_of=views_of, equal_layers=True,
                             num_stages=config.pp, relabel=lambda fwd: fwd, **kw)
    except PlanInfeasible as e:
        return infeasible_plan(ModelSource.zoo(name, cfg), cluster, "megatron", str(e),
                               {"megatron": _config_json(config)})
    search = dict(plan.search, megatron=_config_json(config))
    return dataclasses.replace(plan, search=search)


def megatron_grid(model: str, cluster: Cluster, *, progress: Callable | None = None, **kw) -> PipelinePlan:
    """The best configuration of Megatron-LM's grid (the paper grid-searches it too);
    every configuration tried is listed in `search.megatron_grid`."""
    name, cfg = resolve_model(model)
    blocks = forward_graph(dataclasses.replace(cfg, batch=1), name=name).num_layers
    grid = megatron_configs(cluster.num_devices, cluster.devices_per_node, blocks, cfg.batch)
    best: PipelinePlan | None = None
    tried = []
    for i, config in enumerate(grid):
        if progress is not None:
            progress(f"megatron {config}", i, len(grid))
        plan = megatron_plan(model, cluster, config, **kw)
        tried.append({**_config_json(config), "iteration_s": plan.predicted.get("iteration_s"),
                      "feasible": plan.feasible})
        if plan.feasible and (best is None or plan.predicted["iteration_s"] < best.predicted["iteration_s"]):
            best = plan
    if best is None:
        return infeasible_plan(ModelSource.zoo(name, cfg), cluster, "megatron",
                               f"no Megatron-LM configuration of {name} fits {cluster.num_devices} devices "
                               f"({len(grid)} tried)", {"megatron_grid": tried})
    return dataclasses.replace(best, search=dict(best.search, megatron_grid=tried))


def _config_json(config: MegatronConfig) -> dict:
    return dataclasses.asdict(config)


def infeasible_plan(source: ModelSource, cluster: Cluster, method: str, reason: str,
                    search: dict | None = None) -> PipelinePlan:
    """A plan that records why nothing fits (out of memory, usually)."""
    model = {"name": source.name, "family": source.family, "global_batch": source.global_batch}
    cl = plan_cluster_info(cluster)
    predicted = {"iteration_s": None, "tflops_per_device": None, "throughput_pflops": None,
                 "peak_memory_bytes": None}
    return PipelinePlan(model, cl, method, False, 0, (), predicted, dict(search or {}), notes=(reason,))


def throughput_pflops(plan: PipelinePlan) -> float | None:
    """The plan's predicted PFLOP/s, None when it is infeasible."""
    value = plan.predicted.get("throughput_pflops") if plan.feasible else None
    return None if value is None or not math.isfinite(value) else float(value)

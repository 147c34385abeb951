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

Each method is one `Method` record in `METHODS`: the restriction it solves layers
under, the stage and layer structure it imposes, and the options a user may set for it.
`plan_model` is the one entry, for every method and every model source.

Infeasible is a result here, not an error: `plan_model` returns a plan with `feasible`
false and the reason in `notes`, so a sweep can mark the point out of memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from alpasim.costmodels import DEFAULT_BUCKET_BYTES, Cluster
from alpasim.graphs import (ModelLike, ModelSource, ModelSpecError, OpGraph, assign_layers,
                            context_parallel_view,
                            expanding_contraction, forward_graph, get_recipe, model_source, read_json_file)

from ._interleave import DEFAULT_CHUNK_OPTIONS
from ._inter_op import PlanInfeasible, plan_pipeline
from ._planning_graph import planning_units
from ._plan_inputs import DEFAULT_MAX_STAGES, PlanOptions, RunOptions, SearchSpace, split_options
from ._preflight import check_megatron, check_megatron_interleaved, preflight
from ._pipeline_plan import PipelinePlan, PlanModel, Prediction, SearchStats, plan_cluster_info
from ._submesh import SubmeshShape
from ._systems import OptionConflict, SystemRecord, get_system, resolve

# Options every method takes (`plan_model` keywords, made into `plan_pipeline`'s
# records by `_plan_inputs.split_options`), and those only some do.
COMMON_OPTIONS = frozenset({"microbatches", "remat", "recompute", "precision", "cost_model", "epsilon", "cache",
                            "map_fn", "progress", "price_boundaries", "pareto", "bucket_bytes", "schedule",
                            "chunk_options", "tp_overlap", "gather_overlap", "loss_kernel", "kernels"})
METHOD_OPTIONS = ("layers", "max_stages", "megatron", "distributed_optimizer", "sequence_parallel")


class UnknownMethodError(ValueError):
    """A method name no registry record has."""


@dataclass(frozen=True, slots=True)
class Method:
    """One planning method: which part of the search it keeps (module doc) and which
    of `METHOD_OPTIONS` a user may set for it. Everything that is known about a method
    is here; the planner, the CLI and the experiments read it."""

    name: str
    summary: str
    restriction: str | None = None       # intra-op baseline every layer is solved under (None: the full ILP)
    single_stage: bool = False           # one stage on all devices
    whole_samples: bool = False          # every device takes whole samples of each microbatch (DeepSpeed)
    equal_layers: bool = False           # stages of equal layer counts
    one_device_stages: bool = False      # pipeline only: as many layers as devices, one device per stage
    equal_operator: bool = False         # layers of equal operator counts (no clustering)
    zoo_only: bool = False               # its layouts are written for the zoo's transformer blocks
    accepts: frozenset[str] = frozenset({"layers", "max_stages"})
    system: str = "alpa-osdi22"          # the system profile it is priced as (`_systems.SYSTEMS`)
    # Profile entries its own search chooses when the user leaves them to it (Megatron-
    # core's grid: the recomputation, and without an explicit configuration the optimizer
    # sharding); `plan_model` searches a "searched" recomputation for the others.
    own_search: frozenset[str] = frozenset()
    # A system or ablation Alpa is compared with: a plan of it that does not fit is a
    # result (an infeasible plan). Alpa's own search finding nothing is an error, and
    # only it searches the schedule (interleaved chunks, or "auto": the faster).
    baseline: bool = True

    @property
    def cli_name(self) -> str:
        return self.name.replace("_", "-")

    def refused(self, **given) -> str | None:
        """The first of `given` (`METHOD_OPTIONS` by name) that is set but not accepted."""
        return next((key for key, value in given.items() if value is not None and key not in self.accepts), None)

    def space(self, cluster: Cluster, **narrowing) -> SearchSpace:
        """This method's part of the search on `cluster` (module doc), priced as its
        system; `narrowing` (`SearchSpace` fields the user gave) where the method leaves
        them free."""
        kw: dict = dict(narrowing)
        if self.single_stage:
            kw["max_stages"] = 1
        if self.restriction is not None:
            kw["restriction"] = self.restriction
        if self.whole_samples:
            kw["microbatch_multiple"] = cluster.num_devices
        if self.equal_layers:
            kw["equal_layers"] = True
        if self.one_device_stages:
            n = cluster.num_devices
            kw.update(shape_ok=lambda sh: sh.size == 1, max_stages=n, relabel=lambda fwd: _at_least_layers(fwd, n))
        if self.equal_operator:
            # Equal-operator cuts make every layer distinct (nothing to reuse), so each is
            # solved for its fastest plan only.
            kw.update(relabel=equal_operator_layers, pareto=False)
        return SearchSpace(method=self.name, system=self.system, **kw)


_SINGLE = frozenset({"layers"})
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("alpa", "intra-op ILP inside stages + stage-mesh DP (Alpa)", baseline=False),
    Method("intra_only", "one stage on all devices, intra-op ILP only", single_stage=True, accepts=_SINGLE),
    Method("inter_only", "pipeline only, one device per stage", one_device_stages=True, accepts=frozenset()),
    Method("pp_dp", "pipeline + data parallelism (PipeDream/DAPPLE space)", restriction="data_parallel"),
    Method("equal_layer", "stage-mesh DP with equal layers per stage", equal_layers=True),
    Method("equal_operator", "stage-mesh DP over layers of equal operator counts", equal_operator=True,
           accepts=frozenset({"max_stages"})),
    Method("data_parallel", "data parallelism on all devices", restriction="data_parallel", single_stage=True,
           whole_samples=True, accepts=_SINGLE),
    Method("zero2", "ZeRO-2 data parallelism on all devices", restriction="zero2", single_stage=True,
           whole_samples=True, accepts=_SINGLE),
    Method("zero3", "ZeRO-3 data parallelism on all devices", restriction="zero3", single_stage=True,
           whole_samples=True, accepts=_SINGLE),
    Method("heuristic", "shard every tensor's largest dimension, propagate", restriction="heuristic",
           single_stage=True, accepts=_SINGLE),
    Method("deepspeed_moe", "DeepSpeed-MoE: expert parallelism + ZeRO data parallelism",
           restriction="deepspeed_moe", single_stage=True, whole_samples=True, accepts=_SINGLE,
           system="deepspeed"),
    Method("megatron", "Megatron-LM: tensor x pipeline x data parallel grid", restriction="megatron",
           equal_layers=True, zoo_only=True, system="megatron-lm-2021",
           accepts=frozenset({"megatron", "distributed_optimizer", "sequence_parallel"})),
    Method("megatron_core", "Megatron-core today: the grid also searches sequence parallelism, the distributed "
           "optimizer and full, selective or no recomputation", restriction="megatron", equal_layers=True,
           zoo_only=True, accepts=frozenset({"megatron", "distributed_optimizer", "sequence_parallel"}),
           system="megatron-core-0.8", own_search=frozenset({"recompute", "optimizer_sharding"})),
)}
MEGATRON_METHODS = frozenset({"megatron", "megatron_core"})
# Megatron-LM's grid (Narayanan et al. 2021): tensor parallelism inside a node only,
# microbatch sizes per data-parallel replica.
MEGATRON_TP = (1, 2, 4, 8)
MEGATRON_MICROBATCH_SIZES = (1, 2, 4, 8)


def get_method(name: str) -> Method:
    """The registry record of `name` ("equal-layer" and "equal_layer" alike)."""
    key = name.strip().lower().replace("-", "_")
    if key not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of "
                                 f"{', '.join(m.cli_name for m in METHODS.values())}")
    return METHODS[key]


@dataclass(frozen=True, slots=True)
class MegatronConfig:
    """One Megatron-LM configuration: degrees multiply to the device count."""

    tp: int
    pp: int
    dp: int
    microbatch_size: int              # per data-parallel replica
    # Megatron-core's distributed optimizer: Adam states and master weights on 1/dp
    # each (`_intra_baselines.megatron_distopt_restriction`); off in the paper's
    # Megatron-LM (2021).
    distributed_optimizer: bool = False
    # Sequence parallelism (Korthikanti et al. 2022): norms and residual adds split the
    # sequence over the tensor-parallel group (`_intra_baselines.megatron_restriction`).
    sequence_parallel: bool = False
    # The embedding and the loss head counted as layers of the pipeline split, each a
    # planning unit of its own (Megatron-core's --account-for-embedding-in-pipeline-split
    # and --account-for-loss-in-pipeline-split: "num_layers += 1" for each, in
    # transformer_block.py's layer offsets); else they join the first and last block.
    ends_as_layers: bool = False
    # The gradients sharded too (ZeRO-2; FSDP that keeps the gathered parameters, as
    # Llama 3 ran it): each microbatch's weight gradients reduce-scattered over dp and
    # added into the device's 1/dp shard (`_intra_baselines.megatron_distopt_restriction`
    # with `per_microbatch`). Needs the distributed optimizer.
    sharded_gradients: bool = False
    # Context parallelism (Megatron-core's --context-parallel-size; Llama 3's order
    # [TP, CP, PP, DP]): each sequence split over cp ranks, which all-gather K and V
    # for attention (`graphs.context_parallel_view`, `_context_parallel`). The data-
    # parallel mesh axis holds cp x dp ranks, cp consecutive ones a group; gradients
    # are reduced over all of them. `microbatch_size` stays in whole sequences.
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "microbatch_size", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Megatron {name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("distributed_optimizer", "sequence_parallel", "ends_as_layers", "sharded_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Megatron {name} must be true or false, got {getattr(self, name)!r}")
        if self.sharded_gradients and not self.distributed_optimizer:
            raise ValueError("Megatron sharded_gradients needs the distributed optimizer (the states are sharded "
                             "before the gradients are)")

    @property
    def restriction(self) -> str:
        """The intra-op baseline its stages are solved under (`_intra_baselines.BASELINES`)."""
        return "megatron" + ("_sp" if self.sequence_parallel else "") + \
            ("_zero2" if self.sharded_gradients else "_distopt" if self.distributed_optimizer else "")

    def __str__(self) -> str:
        return (f"tp={self.tp} " + (f"cp={self.cp} " if self.cp > 1 else "")
                + f"pp={self.pp} dp={self.dp} mbs={self.microbatch_size}"
                + (" sp" if self.sequence_parallel else "") + (" dist-opt" if self.distributed_optimizer else "")
                + (" sharded-grads" if self.sharded_gradients else "")
                + (" ends-as-layers" if self.ends_as_layers else ""))


def plan_model(model: ModelLike, cluster: Cluster, method: str = "alpa", *, layers: int | None = None,
               max_stages: int | None = None, megatron: MegatronConfig | None = None,
               distributed_optimizer: bool | None = None, sequence_parallel: bool | None = None,
               system: str | None = None, overlap: bool | None = None, attention: str | None = None,
               **options) -> PipelinePlan:
    """The one planner entry: `model` (a zoo name, spec string or graph file path, a
    `ModelSource`, an `OpGraph`, or a `graphs.JaxModel` — a JAX loss function with
    example arguments) on `cluster` with `method` (a `METHODS` name).

    `layers` (re-cluster into that many layers), `max_stages` and `megatron` (one
    explicit Megatron-LM configuration; without it the best of its grid) apply to the
    methods whose record accepts them, and are refused for the others. `options` are
    `COMMON_OPTIONS` (made into `plan_pipeline`'s records). A method that finds nothing that fits returns
    an infeasible plan whose `notes` say why. `recompute="auto"` searches what the
    backward recomputes (`RECOMPUTE_SEARCH`; `remat` is then the search's).

    `system` names the profile the plan is priced as (`_systems.SYSTEMS`; default: the
    method's). What the user does not give (`overlap`, `remat`/`recompute`, a Megatron
    configuration's `distributed_optimizer`) is the profile's; the plan's `system`
    records the settings, what was overridden and what is not modelled yet. `attention`
    ("explicit" or "fused", `graphs.ATTENTION_KERNELS`; a zoo spec's own `attention=`
    counts as given) rebuilds a zoo model with that kernel; a saved graph keeps its own
    ops, and the record says so where they differ from the system's."""
    m = get_method(method)
    unknown = set(options) - COMMON_OPTIONS
    if unknown:
        raise TypeError(f"plan_model: unknown option {sorted(unknown)[0]!r}; the options are "
                        f"{', '.join(sorted(COMMON_OPTIONS | set(METHOD_OPTIONS) | {'system', 'overlap'}))}")
    _refuse_options(m, layers=layers, max_stages=max_stages, megatron=megatron,
                    distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel)
    if megatron is not None and megatron.distributed_optimizer and distributed_optimizer is None:
        distributed_optimizer = True          # asked for in the configuration itself
    options, record, distributed_optimizer = system_options(m, system, overlap, distributed_optimizer, megatron,
                                                            options, attention=_attention_given(model, attention))
    if megatron is not None and record.settings["optimizer_sharding"] == "data-parallel-gradients":
        megatron = dataclasses.replace(megatron, distributed_optimizer=True, sharded_gradients=True)
    model, record = with_attention(model, record)
    kw = dict(layers=layers, max_stages=max_stages, megatron=megatron, distributed_optimizer=distributed_optimizer,
              sequence_parallel=sequence_parallel)
    if record.settings["recompute"] == "searched" and "recompute" not in m.own_search:
        plan = _best_recompute(m, model_source(model), cluster, kw, options)
    else:
        plan = _plan_method(m, model, cluster, **kw, **options)
    return with_system(plan, record)


def _plan_method(m: Method, model: ModelLike, cluster: Cluster, *, layers: int | None, max_stages: int | None,
                 megatron: MegatronConfig | None, distributed_optimizer: bool | None,
                 sequence_parallel: bool | None, **options) -> PipelinePlan:
    """`plan_model` once the options are the planner's own: the method's search space,
    narrowed as the user asks, and the options as records (`_plan_inputs`)."""
    source = _zoo_source(model) if m.zoo_only else model_source(model)
    _refuse_view(source)
    try:
        _run_preflight(m, source, cluster, layers=layers, max_stages=max_stages, megatron=megatron, **options)
        searched = "remat" not in options and "recompute" not in options
        narrowing, plan_options, run = split_options(options)
        if m.name in MEGATRON_METHODS:
            narrowing.pop("microbatches", None)     # Megatron's microbatch size sets the count
            given = {k: v for k, v in (("distributed_optimizer", distributed_optimizer),
                                       ("sequence_parallel", sequence_parallel)) if v is not None}
            if megatron is not None and m.name == "megatron":
                return megatron_plan(source, cluster, dataclasses.replace(megatron, **given), plan_options, run,
                                     method=m.name, **narrowing)
            return megatron_grid(source, cluster, plan_options, run, today=m.name == "megatron_core",
                                 config=megatron, search_recompute=searched, narrowing=narrowing, **given)
        space = dataclasses.replace(m.space(cluster, **narrowing),
                                    **{k: v for k, v in (("layers", layers), ("max_stages", max_stages))
                                       if v is not None})
        # No one data-parallel degree here: a system's least bucket.
        return plan_pipeline(source, cluster, space, plan_options.at_data_parallel(1, source.dtype), run)
    except PlanInfeasible as e:
        reason = str(e)
        if e.capped is not None and "max_stages" in m.accepts:
            reason += (f"; pipelines deeper than --max-stages {e.capped[0]} were not searched: raise it (up to "
                       f"{e.capped[1]}) to try them")
        return infeasible_plan(source, cluster, m.name, reason, needed_bytes=e.min_memory_bytes)


# The `bucket_bytes` option's value for "the system profile's buckets" (the default).
SYSTEM_BUCKETS = "system"


# A `recompute` entry (of a system profile, or a published run) as the planner's (remat,
# recompute) options.
RECOMPUTE_OPTIONS = {"full": (True, "none"), "selective": (False, "selective"), "fusible": (False, "fusible"),
                      "none": (False, "none")}


def _recompute_given(options: dict) -> str | None:
    """The `recompute` entry the user's `remat`/`recompute` options ask for; None when
    they ask nothing (`recompute="none"` alone is the planner's old default, not a
    request)."""
    remat, policy = options.get("remat"), options.get("recompute")
    if policy == "auto":
        return "searched"
    if remat is True:
        return "full"
    if remat is False:
        return policy or "none"
    return policy if policy not in (None, "none") else None


def system_options(m: Method, system: str | None, overlap: bool | None, distributed_optimizer: bool | None,
                   megatron: MegatronConfig | None, options: dict, attention: str | None = None
                   ) -> tuple[dict, SystemRecord, bool | None]:
    """The planner's options with the system profile's entries filled in where the
    user gave none, the record of what the plan is priced with, and the Megatron
    configuration's distributed optimizer (None: Megatron-core's grid searches it).

    `bucket_bytes=None` among `options` (the planner's old spelling of "no overlap")
    counts as `overlap=False`; `tp_overlap`, `gather_overlap`, `loss_kernel` and
    `kernels` among them override the profile's `tp_comm_overlap`,
    `param_gather_overlap`, `cross_entropy` and `kernels`. A searched recomputation
    leaves `remat`/`recompute` to the search (`plan_model`'s, or Megatron-core's grid)."""
    profile = get_system(system or m.system)
    options = dict(options)
    if overlap is None and "bucket_bytes" in options and options["bucket_bytes"] is None:
        overlap = False
    recompute = _recompute_given(options)
    gather_given = options.pop("gather_overlap", None)
    if gather_given and distributed_optimizer is None and "distributed_optimizer" in m.accepts \
            and "optimizer_sharding" in m.own_search and megatron is None:
        distributed_optimizer = True      # Megatron-core's grid, asked to overlap the gathers: they need it
    sharding = None if distributed_optimizer is None else \
        _sharding(distributed_optimizer, megatron is not None and megatron.sharded_gradients)
    record = resolve(profile, grad_overlap=overlap, recompute=recompute, optimizer_sharding=sharding,
                     attention=attention, tp_comm_overlap=options.pop("tp_overlap", None),
                     param_gather_overlap=gather_given, cross_entropy=options.pop("loss_kernel", None),
                     kernels=options.pop("kernels", None))
    distributed_optimizer = _profile_distributed_optimizer(m, megatron, distributed_optimizer, record.settings)
    recipe = get_recipe(options.get("precision"))
    if recipe.reduce_whole and not (megatron is not None and distributed_optimizer):
        raise OptionConflict("precision", f"{recipe.name} is DeepSpeed's BF16_Optimizer, which shards the optimizer "
                                          f"states over data parallelism (ZeRO-1) and all-reduces whole gradients: "
                                          f"it prices an explicit Megatron configuration (--tp, --pp, --dp) with "
                                          f"--distributed-optimizer")
    blocked = _gather_overlap_blocked(m, record.settings, distributed_optimizer)
    if record.settings["param_gather_overlap"] and blocked:
        if gather_given:
            raise OptionConflict("param_gather_overlap", blocked)
        record = record.without("param_gather_overlap", blocked)
    settings = record.settings
    given = options.get("bucket_bytes")
    options["bucket_bytes"] = ((profile.buckets or DEFAULT_BUCKET_BYTES) if given in (None, SYSTEM_BUCKETS)
                               else given) if settings["grad_overlap"] else None
    options["tp_overlap"] = settings["tp_comm_overlap"]
    options["gather_overlap"] = settings["param_gather_overlap"]
    options["loss_kernel"] = settings["cross_entropy"]
    options["kernels"] = settings["kernels"]
    if settings["recompute"] == "searched":
        options.pop("remat", None)
        options.pop("recompute", None)
    elif recompute is None:
        options["remat"], options["recompute"] = RECOMPUTE_OPTIONS[settings["recompute"]]
    return options, record, distributed_optimizer


def _profile_distributed_optimizer(m: Method, megatron: MegatronConfig | None, given: bool | None,
                                   settings: dict) -> bool | None:
    """A Megatron configuration's distributed optimizer: as given, else the profile's
    (None: Megatron-core's grid searches it)."""
    searches_sharding = "optimizer_sharding" in m.own_search and megatron is None
    if "distributed_optimizer" in m.accepts and given is None and not searches_sharding \
            and settings["optimizer_sharding"] != "searched":
        return settings["optimizer_sharding"] in ("data-parallel", "data-parallel-gradients")
    return given


def _gather_overlap_blocked(m: Method, settings: dict, distributed_optimizer: bool | None) -> str | None:
    """Why the parameters' all-gathers cannot overlap the next forward in this plan, or
    None. Megatron-core refuses `--overlap-param-gather` without the distributed
    optimizer and without `--overlap-grad-reduce` (megatron/training/arguments.py,
    validate_args), and the planner moves only the distributed optimizer's gathers
    (`_intra_baselines.DISTRIBUTED_OPTIMIZER`)."""
    if "distributed_optimizer" not in m.accepts:
        return f"needs a Megatron method's distributed optimizer, and method {m.cli_name} has none"
    if distributed_optimizer is False:
        return "needs the distributed optimizer (Megatron-core asserts --use-distributed-optimizer with it)"
    if not settings["grad_overlap"]:
        return "needs overlapped gradient reduction (Megatron-core asserts --overlap-grad-reduce with it)"
    return None


def _attention_given(model: ModelLike, attention: str | None) -> str | None:
    """The attention kernel the user asked for: `attention`, else the model's own where
    its description names one (a spec string's `attention=`, a model JSON's
    `"attention"` field, a config object): it names the model as the user wants it
    computed."""
    if attention is not None:
        return attention
    if hasattr(model, "attention") and not isinstance(model, (str, ModelSource)):
        return model.attention                                     # a ModelConfig
    if not isinstance(model, str):
        return None
    text = model.strip()
    if "attention=" in text:
        return model_source(text).config.attention
    if text.endswith(".json") and Path(text).is_file():
        try:
            data = read_json_file(text, ValueError)
        except ValueError:
            return None                                            # model_source says why, later
        if isinstance(data, dict) and "attention" in data:
            return str(data["attention"])
    return None


def with_attention(model: ModelLike, record: SystemRecord) -> tuple[ModelLike, SystemRecord]:
    """`model` computing attention with the record's kernel: a zoo model (and a saved
    graph of one, which is that model) is rebuilt with it; another graph's own ops are
    what is priced, and where they hold attention in the other form (a fused op, or
    explicit scores found by structure), the record lists the kernel as not modelled,
    priced as the graph's."""
    source = model_source(model)
    kernel = record.settings["attention"]
    if source.config is not None and hasattr(source.config, "attention"):
        if source.config.attention == kernel:
            return source, record
        return ModelSource.zoo(source.name, dataclasses.replace(source.config, attention=kernel)), record
    if source.config is not None:                  # a family without attention (Wide-ResNet)
        return source, record
    graph = source.graph
    # Explicit attention found by structure, as selective recomputation finds it: a
    # contraction of two activations larger than both (the scores).
    ran = "fused" if any(op.prim == "attention" for op in graph.ops) else \
        "explicit" if any(expanding_contraction(op, graph.tensors) for op in graph.ops) else None
    if ran is None or ran == kernel:               # no attention to speak of, or the profile's
        return source, record
    return source, dataclasses.replace(record, unpriced={**record.unpriced, "attention": ran})


def plan_restriction(plan: PipelinePlan) -> str | None:
    """The intra-op baseline `plan`'s stages were solved under (`_intra_baselines.
    BASELINES`): its Megatron configuration's, else its method record's (ZeRO's, data
    parallelism's, PP-DP's), else None (a searched plan)."""
    config = plan.search.megatron
    if config is not None:
        return MegatronConfig(**config).restriction
    return METHODS[plan.method].restriction if plan.method in METHODS else None


def _sharding(distributed_optimizer: bool, sharded_gradients: bool = False) -> str:
    """The `optimizer_sharding` entry of a Megatron configuration's flags."""
    return ("data-parallel-gradients" if sharded_gradients else "data-parallel") if distributed_optimizer else "none"


def with_system(plan: PipelinePlan, record: SystemRecord) -> PipelinePlan:
    """`plan` recording the system it was priced as; a Megatron plan's chosen
    configuration decides its optimizer sharding where the grid searched it."""
    config = plan.search.megatron
    if config is not None and "optimizer_sharding" not in record.overridden:
        chosen = _sharding(config.get("distributed_optimizer"), config.get("sharded_gradients", False))
        if record.settings["optimizer_sharding"] == "data-parallel-gradients" and chosen == "data-parallel":
            # Megatron-core's grid searches the distributed optimizer, not sharded gradients.
            record = dataclasses.replace(record, unpriced={**record.unpriced, "optimizer_sharding": chosen})
        else:
            record = dataclasses.replace(record, settings={**record.settings, "optimizer_sharding": chosen})
        if record.settings["param_gather_overlap"] and not config.get("distributed_optimizer"):
            record = record.without("param_gather_overlap", "needs the distributed optimizer, which the "
                                                            "configuration chosen does not use")
    return dataclasses.replace(plan, system=record.to_json(), notes=(*plan.notes, *record.notes()))


def check_before_planning(model: ModelLike, cluster: Cluster, method: str = "alpa", *, layers: int | None = None,
                          max_stages: int | None = None, megatron: MegatronConfig | None = None,
                          distributed_optimizer: bool | None = None, sequence_parallel: bool | None = None,
                          **options) -> ModelSource:
    """What `plan_model` checks before it prices anything, in well under a second
    (`_preflight`): options the method does not take, an explicit Megatron-LM
    configuration that cannot be, a model whose states fit no device, an interleaved
    plan that cannot exist. Raises `ValueError` for a user error and `PlanInfeasible`
    when nothing can fit; returns the model's source. The CLI calls it before it starts
    a worker pool, so a refusal costs no pool either."""
    m = get_method(method)
    _refuse_options(m, layers=layers, max_stages=max_stages, megatron=megatron,
                    distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel)
    if megatron is not None and megatron.distributed_optimizer and distributed_optimizer is None:
        distributed_optimizer = True
    resolved, record, _ = system_options(m, options.get("system"), options.get("overlap"), distributed_optimizer,
                                         megatron, {k: v for k, v in options.items() if k in COMMON_OPTIONS},
                                         attention=_attention_given(model, options.get("attention")))
    split_options(resolved)          # the records refuse what cannot be priced, before any work
    source = _zoo_source(model) if m.zoo_only else model_source(model)
    _refuse_view(source)
    _run_preflight(m, source, cluster, layers=layers, max_stages=max_stages, megatron=megatron, **options)
    if megatron is not None and megatron.cp > 1:   # the view `megatron_plan` builds, with the kernel it will run
        context_parallel_view(dataclasses.replace(source.config, attention=record.settings["attention"]), megatron.cp)
    return source


def _refuse_view(source: ModelSource) -> None:
    """A model given as a context-parallel view (`context_parallel` in its spec): only a
    Megatron configuration's `cp` builds one, since only its layout prices the KV
    exchange (`_context_parallel`)."""
    cp = getattr(source.config, "context_parallel", 1)
    if cp != 1:
        raise ValueError(f"{source.name}: context_parallel={cp} is set by a Megatron configuration's cp "
                         f"(plan --cp), not in the model; give the whole-sequence model")


def _refuse_options(m: Method, **given) -> None:
    refused = m.refused(**given)
    if refused is not None:
        raise ValueError(f"{refused} does not apply to method {m.cli_name} (its search sets it)")


def _run_preflight(m: Method, source: ModelSource, cluster: Cluster, *, layers: int | None, max_stages: int | None,
                   megatron: MegatronConfig | None, **options) -> None:
    """`_preflight.preflight` with the method's part of the search (an explicit Megatron
    configuration, the schedule and chunks asked for) on the cluster that prices it."""
    cost_model = options.get("cost_model")
    preflight(source, cost_model.cluster if cost_model is not None else cluster,
              precision=options.get("precision"), layers=layers,
              max_stages=max_stages if max_stages is not None else DEFAULT_MAX_STAGES,
              schedule=options.get("schedule", "1f1b"),
              chunk_options=options.get("chunk_options", DEFAULT_CHUNK_OPTIONS),
              megatron=megatron if m.name in MEGATRON_METHODS else None)


# What `recompute="auto"` tries, as Megatron-core's --recompute-granularity offers it:
# (label, remat, recompute) for full, selective (attention's core only) and no recomputation.
RECOMPUTE_SEARCH: tuple[tuple[str, bool, str], ...] = tuple(
    (label, *RECOMPUTE_OPTIONS[label]) for label in ("full", "selective", "none"))


def _best_recompute(m: Method, source: ModelSource, cluster: Cluster, kw: dict, options: dict) -> PipelinePlan:
    """The fastest feasible plan over `RECOMPUTE_SEARCH`: recomputation costs compute, so
    it wins only where the memory it frees buys a faster plan (larger microbatches,
    fewer devices a stage, or a plan that fits at all). Its notes give every policy's
    predicted iteration; with none feasible, full recomputation's infeasible plan."""
    tried = []
    for label, remat, policy in RECOMPUTE_SEARCH:
        plan = _plan_method(m, source, cluster, **kw, **{**options, "remat": remat, "recompute": policy})
        tried.append((label, plan))
    feasible = [(label, p) for label, p in tried if p.feasible]
    label, best = min(feasible, key=lambda lp: lp[1].predicted.iteration_s) if feasible else tried[0]
    seen = "; ".join(f"{lab} {p.predicted.iteration_s:.3f} s" if p.feasible else f"{lab} infeasible"
                     for lab, p in tried)
    return dataclasses.replace(best, notes=(*best.notes, f"recompute auto chose {label} ({seen})"))


def plan_with_method(method: str, model: ModelLike, cluster: Cluster, **kw) -> PipelinePlan:
    """`plan_model` with the method first (the older spelling)."""
    return plan_model(model, cluster, method, **kw)


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


def zoo_blocks(fwd: OpGraph) -> OpGraph:
    """The zoo's own layer labels (embedding with the first block, head with the last):
    Megatron-LM's stages. A named function, so that graphs built with it are memoised."""
    return fwd


def megatron_space(source: ModelSource, cluster: Cluster, config: MegatronConfig, method: str = "megatron",
                   **narrowing) -> SearchSpace:
    """The search space of one Megatron-LM configuration of `source` (each rank's view
    under context parallelism): `pp` stages of equal blocks (embedding with the first, head with the last,
    or layers of their own under `config.ends_as_layers`), each on `dp x tp` devices
    viewed as a (dp, tp) mesh with Megatron's layouts, B = batch / (mbs x dp x cp)."""
    data = config.dp * config.cp
    size = config.tp * data
    b = source.config.batch // (config.microbatch_size * data)

    def views_of(shape: SubmeshShape) -> list[tuple[int, int]]:
        return [(data, config.tp)] if shape.size == size else []

    return dataclasses.replace(METHODS["megatron"].space(cluster, **narrowing), method=method,
                               system=METHODS[method].system, restriction=config.restriction, microbatches=b,
                               shape_ok=lambda sh: sh.size == size, views_of=views_of, num_stages=config.pp,
                               max_stages=config.pp, relabel=None if config.ends_as_layers else zoo_blocks)


def megatron_plan(model: ModelLike, cluster: Cluster, config: MegatronConfig, options: PlanOptions = PlanOptions(),
                  run: RunOptions = RunOptions(), method: str = "megatron", **narrowing) -> PipelinePlan:
    """One Megatron-LM configuration (`megatron_space`) priced with `options`; under
    context parallelism each rank's view, whose batch counts chunks (graphs.
    context_parallel_view), over a data axis of cp x dp ranks."""
    source = _zoo_source(model)
    check_megatron(source, cluster, config)
    whole = source
    if config.cp > 1:
        source = ModelSource.zoo(source.name, context_parallel_view(source.config, config.cp))
    # Megatron refuses --tp-comm-overlap without sequence parallelism (arguments.py:
    # "Tensor parallel communication/GEMM overlap can happen only when sequence
    # parallelism is enabled"), and without tensor parallelism it has nothing to overlap.
    dropped = options.tp_overlap and not (config.sequence_parallel and config.tp > 1)
    if dropped:
        options = dataclasses.replace(options, tp_overlap=False)
    options = options.at_data_parallel(config.dp * config.cp, source.config.dtype)
    try:
        plan = plan_pipeline(source, cluster, megatron_space(source, cluster, config, method, **narrowing), options,
                             run)
    except PlanInfeasible as e:
        return infeasible_plan(whole, cluster, method, str(e), SearchStats(megatron=_config_json(config)),
                               needed_bytes=e.min_memory_bytes)
    notes = plan.notes + (("tp_comm_overlap priced off: Megatron overlaps tensor-parallel communication only "
                           "with sequence parallelism at tp > 1",) if dropped and config.tp > 1 else ())
    return dataclasses.replace(plan, search=dataclasses.replace(plan.search, megatron=_config_json(config)),
                               notes=notes)


def megatron_grid(model: ModelLike, cluster: Cluster, options: PlanOptions = PlanOptions(),
                  run: RunOptions = RunOptions(), *, distributed_optimizer: bool | None = None,
                  sequence_parallel: bool | None = None, today: bool = False, config: MegatronConfig | None = None,
                  search_recompute: bool = True, narrowing: dict | None = None) -> PipelinePlan:
    """The best configuration of Megatron-LM's grid (the paper grid-searches it too):
    a loop over the configurations' search spaces; every configuration priced is listed
    in `search.megatron_grid`.

    The paper's grid (2021) runs without sequence parallelism or the distributed
    optimizer unless asked, under the recomputation `options` give. `today` (Megatron-
    core) also searches both (where tp > 1 and dp > 1 give them something to do), each
    unless given, and with `search_recompute` the recomputation: none, then selective,
    then full (`RECOMPUTE_SEARCH` backwards), stopping at the first that fits, since
    recomputing only adds work to the same configuration. `config` fixes the degrees and
    microbatch size (what is left is searched).

    Pruned, not priced: each degree/microbatch point first tries its least-memory form
    (sequence parallel and distributed optimizer where searched); if even full
    recomputation does not fit there, no form does, and the other forms start their
    recomputation ladder where the least-memory form first fit (neither option adds
    memory: `tests/solvers/test_sequence_parallel.py`)."""
    source = _zoo_source(model)
    name, cfg = source.name, source.config
    blocks = forward_graph(dataclasses.replace(cfg, batch=1), name=name).num_layers
    base = [config] if config is not None else \
        megatron_configs(cluster.num_devices, cluster.devices_per_node, blocks, cfg.batch)
    searched = today and search_recompute
    ladder = list(reversed(RECOMPUTE_SEARCH)) if searched else [(None, options.remat, options.recompute)]
    method = "megatron_core" if today else "megatron"
    quiet = dataclasses.replace(run, progress=None)    # the grid reports its configurations, not their jobs
    best: PipelinePlan | None = None
    tried = []
    for i, c in enumerate(base):
        if run.progress is not None:
            run.progress(f"{method} {c}", i, len(base))
        if options.schedule == "interleaved" and _cannot_interleave(source, c, options.chunk_options):
            continue
        sps = (sequence_parallel,) if sequence_parallel is not None else (True, False) if today and c.tp > 1 \
            else (False,)
        dos = (distributed_optimizer,) if distributed_optimizer is not None else (True, False) \
            if today and c.dp * c.cp > 1 else (False,)
        floor = 0
        for k, config in enumerate(dataclasses.replace(c, sequence_parallel=x, distributed_optimizer=y)
                                   for x in sps for y in dos):    # the least-memory form first
            plan = None
            for step, (label, remat, policy) in enumerate(ladder[floor:], floor):
                priced = dataclasses.replace(options, remat=remat, recompute=policy)
                plan = megatron_plan(source, cluster, config, priced, quiet, method=method, **(narrowing or {}))
                tried.append({**_config_json(config), **({"recompute": label} if searched else {}),
                              "iteration_s": plan.predicted.iteration_s, "feasible": plan.feasible})
                if plan.feasible:
                    floor = step if k == 0 else floor
                    break
            if plan.feasible and (best is None or plan.predicted.iteration_s < best.predicted.iteration_s):
                best = plan
            if k == 0 and not plan.feasible:
                break
    if best is None:
        return infeasible_plan(source, cluster, method,
                               f"no Megatron-LM configuration of {name} fits {cluster.num_devices} devices "
                               f"({len(tried)} tried)", SearchStats(megatron_grid=tuple(tried)))
    return dataclasses.replace(best, search=dataclasses.replace(best.search, megatron_grid=tuple(tried)))


def _zoo_source(model: ModelLike) -> ModelSource:
    source = model_source(model)
    if source.config is None:
        raise ModelSpecError(f"{source.name}: Megatron-LM's layouts are written for the zoo's transformer blocks; "
                             f"a saved graph plans with the other methods")
    return source


def _cannot_interleave(source: ModelSource, config: MegatronConfig, chunk_options: Sequence[int]) -> bool:
    """Whether Megatron-LM's interleaved schedule refuses `config` (`_preflight.
    check_megatron_interleaved`): the grid leaves such a point out, as Megatron would."""
    try:
        check_megatron_interleaved(source, config, chunk_options)
    except ValueError:
        return True
    return False


def _config_json(config: MegatronConfig) -> dict:
    return dataclasses.asdict(config)


def infeasible_plan(source: ModelSource, cluster: Cluster, method: str, reason: str,
                    search: SearchStats | None = None, needed_bytes: float | None = None) -> PipelinePlan:
    """A plan that records why nothing fits (out of memory, usually), and the memory per
    device its layouts need where the planner knows it to be more than the device has
    (`needed_bytes`: the 1F1B search's lower bound, or what the interleaved slicing that
    comes closest needs; a bound at or below the device's memory says nothing)."""
    model = PlanModel(source.name, source.family, source.global_batch)
    needed = float(needed_bytes) if needed_bytes is not None and math.isfinite(needed_bytes) \
        and needed_bytes > cluster.device.memory_bytes else None
    return PipelinePlan(model, plan_cluster_info(cluster), method, False, 0, (),
                        Prediction(needed_memory_bytes=needed), search or SearchStats(), notes=(reason,))


def throughput_pflops(plan: PipelinePlan) -> float | None:
    """The plan's predicted PFLOP/s, None when it is infeasible."""
    value = plan.predicted.throughput_pflops if plan.feasible else None
    return None if value is None or not math.isfinite(value) else float(value)

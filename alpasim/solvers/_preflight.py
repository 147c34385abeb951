"""What can be known before planning, checked before any stage is priced.

Planning a large model takes minutes; some answers follow from the model's size and the
cluster's shape alone. `preflight` checks them from one forward graph of one sample (a
zoo model: well under a second even for Llama 3 405B) or a saved graph's training graph,
so that a refusal comes first and names
its real cause, instead of a search that runs for a minute and then blames memory:

- **Model states.** Every plan keeps each trained parameter's states somewhere: the
  weight, its gradient accumulator, the fp32 master copy and Adam's two moments, the
  precision recipe's bytes per parameter (`graphs.PrecisionRecipe.bytes_per_param`, 18 B
  for Megatron-LM's mixed precision). Sharding only divides them among devices and
  pipelining only places them, so the devices hold at least S bytes of states between
  them and one device at least S / N (no plan offloads to the host). More than a device
  holds, and nothing fits. S is the planner's own accounting at its most favourable:
  ZeRO-3, which shards every state over every device, holds exactly S
  (`tests/solvers/test_preflight.py`). A saved graph's S comes from its training graph
  (`model_states`), which leaves out parameters nothing reads or differentiates.
- **Interleaved 1F1B** needs S >= 2 meshes of one submesh shape, S at most
  `max_stages`, and S x v chunks out of the model's layers.
- **An explicit Megatron-LM configuration**: tp x pp x dp is the device count, tensor
  parallelism stays inside a node, pp at most the model's blocks (two more where the
  embedding and the head are layers of their own), and the global batch
  a multiple of microbatch size x dp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster
from alpasim.graphs import ModelSource, build_training_graph, context_parallel_refusal, get_recipe
from alpasim.units import format_bytes

from ._inter_op import PlanInfeasible
from ._planning_graph import default_graph_layers, planning_units
from ._interleave import interleaved_cannot_exist
from ._intra_problem import kept_gradient_factor
from ._submesh import submesh_shapes


@dataclass(frozen=True, slots=True)
class ModelStates:
    """A model's trained parameters and the bytes their training states take in all."""

    params: int
    total_bytes: float
    recipe: str

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / self.params if self.params else 0.0


@dataclass(frozen=True, slots=True)
class _ZooFacts:
    """What the preflight reads off a zoo model's one-sample forward graph."""

    params: int
    blocks: int


# Zoo models' facts by (name, config): the CLI's preflight, plan_model's and every
# configuration of Megatron's grid ask for the same model, and a forward graph of Llama 3
# 405B takes a third of a second to build.
_ZOO: dict[tuple, _ZooFacts] = {}


def _zoo_facts(source: ModelSource) -> _ZooFacts:
    key = (source.name, source.config)
    if key not in _ZOO:
        fwd = source.forward(1)
        _ZOO[key] = _ZooFacts(fwd.num_params(), fwd.num_layers)
    return _ZOO[key]


def model_states(source: ModelSource, precision: str | None = None) -> ModelStates:
    """The training states of `source` under the recipe `precision`, as the planner
    counts them (module doc). A zoo model trains every parameter in its own dtype: P x
    the recipe's bytes per parameter. A graph may hold parameters nothing reads, or
    reads without a gradient, and parameters of several dtypes: its training graph says
    which states exist (weights read by some op, gradient accumulators, master copies
    and Adam moments, each in its dtype), as the planner's memory model takes them."""
    recipe = get_recipe(precision)
    if source.config is not None:
        params = _zoo_facts(source).params
        return ModelStates(params, float(params) * recipe.bytes_per_param(recipe.weight_dtype(source.dtype)),
                           recipe.name)
    train = build_training_graph(source.graph, precision=recipe.name).graph
    read = {t for op in train.ops for t in op.inputs}
    weights = sum(p.nbytes for p in train.params if p.name in read)
    grads = sum(t.nbytes * kept_gradient_factor(train, t.name) for t in train.tensors.values() if t.role == "grad")
    optimizer = sum(t.nbytes for t in train.tensors.values()
                    if t.role == "optimizer_state" and t.name not in train.producer)
    return ModelStates(sum(p.size for p in train.params if p.name in read), float(weights + grads + optimizer),
                       recipe.name)


def check_states_fit(source: ModelSource, cluster: Cluster, precision: str | None = None) -> ModelStates:
    """`PlanInfeasible` when the model's states alone, spread over every device, exceed a
    device's memory; the states otherwise."""
    states = model_states(source, precision)
    n, memory = cluster.num_devices, cluster.device.memory_bytes
    per_device = states.total_bytes / n
    if per_device > memory:
        need = math.ceil(states.total_bytes / memory)
        raise PlanInfeasible(
            f"does not fit: {source.name}'s {states.params:,} parameters keep {states.bytes_per_param:.3g} B each of "
            f"weights, gradients and optimizer states ({states.recipe}), {format_bytes(states.total_bytes)} in all: "
            f"at least {format_bytes(per_device)} per device on {n:,} device{'s' if n > 1 else ''}, more than the "
            f"{format_bytes(memory)} a device ({cluster.device.name}) holds; the states alone need {need:,} such "
            f"devices",
            per_device)
    return states


def planning_layers(source: ModelSource, layers: int | None = None) -> int:
    """How many layers the Alpa search cuts the model into: `layers` if given, else the
    planning units of a zoo model or a labelled graph, else an imported graph's default
    clustering (`default_graph_layers`)."""
    if layers is not None:
        return layers
    fwd = source.graph if source.graph is not None else source.forward(1)
    if source.graph is not None and fwd.num_layers <= 1:
        return default_graph_layers(fwd)
    return planning_units(fwd).num_layers


def check_interleaved(name: str, layers: int, cluster: Cluster, max_stages: int, chunk_options: Sequence[int]) -> None:
    """`PlanInfeasible` when no interleaved plan can exist (`interleaved_cannot_exist`
    over every submesh shape of the cluster)."""
    why = interleaved_cannot_exist(layers, submesh_shapes(cluster.nodes, cluster.devices_per_node), cluster,
                                   max_stages, chunk_options)
    if why:
        raise PlanInfeasible(f"no interleaved plan of {name} with {', '.join(map(str, chunk_options))} chunks per "
                             f"mesh can exist: {why}", float("nan"))


def check_megatron(source: ModelSource, cluster: Cluster, config) -> None:
    """`ValueError` naming the first rule an explicit Megatron-LM `config` (a
    `MegatronConfig`) breaks on `cluster` (module doc)."""
    cfg = source.config
    n = cluster.num_devices
    cp = getattr(config, "cp", 1)
    if config.tp * config.pp * config.dp * cp != n:
        raise ValueError(f"Megatron {config}: tp x {'cp x ' if cp > 1 else ''}pp x dp = "
                         f"{config.tp * config.pp * config.dp * cp}, the cluster has {n} devices")
    why = context_parallel_refusal(cfg, cp) if cp > 1 else ""
    if why:
        raise ValueError(f"Megatron {config}: {why}")
    if config.tp > cluster.devices_per_node:
        raise ValueError(f"Megatron {config}: tensor parallelism beyond one node ({cluster.devices_per_node} devices)")
    layers, what = megatron_layers(source, config)
    if config.pp > layers:
        raise ValueError(f"Megatron {config}: {config.pp} pipeline stages, but {source.name} has {what} "
                         f"(at least one a stage)")
    if cfg.batch % (config.microbatch_size * config.dp):
        raise ValueError(f"Megatron {config}: the global batch {cfg.batch} is not a multiple of mbs x dp")


def preflight(source: ModelSource, cluster: Cluster, *, precision: str | None = None, layers: int | None = None,
              max_stages: int, schedule: str = "1f1b", chunk_options: Sequence[int] = (),
              megatron=None) -> None:
    """Every check of the module doc that applies, cheapest first; raises
    `PlanInfeasible` (nothing fits: a result) or `ValueError` (a configuration that
    cannot be: a user error)."""
    if megatron is not None:
        check_megatron(source, cluster, megatron)
    check_states_fit(source, cluster, precision)
    if schedule == "interleaved" and megatron is not None:
        check_megatron_interleaved(source, megatron, chunk_options)
    elif schedule == "interleaved":
        check_interleaved(source.name, planning_layers(source, layers), cluster, max_stages, chunk_options)


def check_megatron_interleaved(source: ModelSource, config, chunk_options: Sequence[int]) -> None:
    """`ValueError` when Megatron-LM's interleaved 1F1B cannot run `config`: it needs at
    least 2 pipeline stages, microbatches a multiple of pp, and a model chunk of at least
    one layer (a block, or the embedding or the head under `ends_as_layers`) for each of
    the pp x v virtual stages, for some v of `chunk_options` (Narayanan et al. 2021,
    sec. 2.2)."""
    layers, what = megatron_layers(source, config)
    if config.pp < 2:
        raise ValueError(f"Megatron {config}: interleaving needs at least 2 pipeline stages")
    # Megatron-LM refuses it otherwise (schedules.py, forward_backward_pipelining_with_
    # interleaving: "number of microbatches ... is not divisible by pipeline-model-
    # parallel-size ... when using interleaved schedule"), from 2021 through Megatron-
    # core 0.8; later versions take any count of at least pp with a microbatch group
    # size set, which no system profile here runs.
    microbatches = source.config.batch // (config.microbatch_size * config.dp)
    if microbatches % config.pp:
        raise ValueError(f"Megatron {config}: interleaving needs the microbatches ({microbatches}) to be a "
                         f"multiple of pp ({config.pp})")
    if not any(config.pp * v <= layers for v in chunk_options):
        raise ValueError(f"Megatron {config}: {config.pp} stages x {min(chunk_options)} chunks is more virtual "
                         f"stages than {source.name}'s {what}")


def megatron_layers(source: ModelSource, config) -> tuple[int, str]:
    """The layers a Megatron `config` splits over its pipeline, and a phrase for them:
    the blocks, with the embedding and the head joining the end blocks, or, where the
    configuration counts them as layers (`ends_as_layers`), two more."""
    blocks = _zoo_facts(source).blocks
    if config.ends_as_layers:
        return blocks + 2, f"{blocks + 2} layers ({blocks} blocks, the embedding and the head)"
    return blocks, f"{blocks} blocks"

"""`PipelinePlan`: stages on submeshes, microbatches, predictions — plain data with a JSON form.

The JSON (`schema` "alpasim.plan/1") is the contract other tools read; DESIGN.md lists
its fields. A plan round-trips exactly through `to_json`/`plan_from_json`, and
`partition_specs()` gives, per stage, the `jax.sharding.PartitionSpec` arguments of
every parameter (mesh axis names "x" and "y").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from alpasim.graphs import read_json_file

PLAN_SCHEMA = "alpasim.plan/1"


class PlanFormatError(ValueError):
    """A plan file that is not valid JSON, has the wrong schema or a bad field."""


@dataclass(frozen=True)
class PipelineStage:
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
    heavy_ops: tuple[dict, ...] = ()
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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"], d["devices"] = list(self.layers), list(self.devices)
        d["submesh"], d["logical_mesh"] = list(self.submesh), list(self.logical_mesh)
        d["heavy_ops"] = list(self.heavy_ops)
        d["layer_specs"] = [dict(x) for x in self.layer_specs]
        return d


@dataclass(frozen=True)
class PipelinePlan:
    model: dict[str, Any]                   # name, params, flops_per_iteration, global batch
    cluster: dict[str, Any]                 # name, nodes, devices_per_node
    method: str
    feasible: bool
    microbatches: int
    stages: tuple[PipelineStage, ...]
    predicted: dict[str, Any]               # iteration_s, tflops_per_device, throughput_pflops, peak_memory_bytes
    search: dict[str, Any]                  # seconds, ilp_solves, cache_hits, ...
    schedule: str = "1f1b"
    runner_ups: tuple[dict, ...] = ()
    notes: tuple[str, ...] = ()
    # Tensors that cross stages: {tensor, shape, dtype, nbytes, src_stage, dst_stage,
    # direction ("forward" | "backward"), per_iteration, src_spec, dst_spec}.
    transfers: tuple[dict, ...] = ()

    @property
    def num_devices(self) -> int:
        return sum(len(s.devices) for s in self.stages)

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
        return {
            "schema": PLAN_SCHEMA, "model": self.model, "cluster": self.cluster, "method": self.method,
            "feasible": self.feasible, "microbatches": self.microbatches, "schedule": self.schedule,
            "stages": [s.to_json() for s in self.stages], "predicted": self.predicted, "search": self.search,
            "runner_ups": list(self.runner_ups), "notes": list(self.notes), "transfers": list(self.transfers),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def plan_cluster_info(cluster) -> dict[str, Any]:
    """The plan's `cluster` field: the summary DESIGN.md lists plus the full `spec`, so a
    plan file can be simulated on its own."""
    return {"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
            "device": cluster.device.name, "inter_node_gbps": cluster.inter_node.bandwidth_gbps,
            "device_memory_bytes": cluster.device.memory_bytes, "spec": cluster.to_json()}


def _spec_to_partition(text: str) -> list:
    from ._spec import ShardingSpec

    if text in ("", "scalar"):
        return []
    return [list(p) if isinstance(p, tuple) else p for p in ShardingSpec.parse(text).partition_spec()]


def plan_from_json(data: Any, source: str = "<plan JSON>") -> PipelinePlan:
    if not isinstance(data, dict):
        raise PlanFormatError(f"{source}: top level must be a JSON object")
    if data.get("schema") != PLAN_SCHEMA:
        raise PlanFormatError(f"{source}: field 'schema' is {data.get('schema')!r}, expected {PLAN_SCHEMA!r}")
    try:
        stages = []
        for i, s in enumerate(data["stages"]):
            try:
                stages.append(PipelineStage(
                    tuple(s["layers"]), tuple(s["devices"]), tuple(s["submesh"]), tuple(s["logical_mesh"]),
                    float(s["time_s"]), float(s["memory_bytes"]), int(s["inflight_microbatches"]),
                    float(s.get("compute_s", 0.0)), float(s.get("sync_s", 0.0)), float(s.get("params_bytes", 0.0)),
                    float(s.get("activation_bytes", 0.0)), int(s.get("option", 0)), dict(s.get("param_specs", {})),
                    tuple(s.get("heavy_ops", ())), float(s.get("forward_s", 0.0)), float(s.get("backward_s", 0.0)),
                    float(s.get("stash_bytes", 0.0)), float(s.get("boundary_s", 0.0)), dict(s.get("memory", {})),
                    tuple(dict(x) for x in s.get("layer_specs", ()))))
            except KeyError as e:
                raise PlanFormatError(f"{source}: stages[{i}]: missing field {e.args[0]!r}") from None
            except (TypeError, ValueError) as e:
                raise PlanFormatError(f"{source}: stages[{i}]: {e}") from None
        return PipelinePlan(dict(data["model"]), dict(data["cluster"]), str(data["method"]), bool(data["feasible"]),
                            int(data["microbatches"]), tuple(stages), dict(data["predicted"]), dict(data["search"]),
                            str(data.get("schedule", "1f1b")), tuple(data.get("runner_ups", ())),
                            tuple(data.get("notes", ())), tuple(data.get("transfers", ())))
    except KeyError as e:
        raise PlanFormatError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise PlanFormatError(f"{source}: {e}") from None


def load_plan(path: str | Path) -> PipelinePlan:
    return plan_from_json(read_json_file(path, PlanFormatError), str(path))

"""`CostModel`: the small protocol solvers and the simulator depend on.

A cost model answers two questions in seconds: how long one (shard of an) operator
takes on a device, and how long a collective takes over some mesh axes. The analytic
model below answers from datasheet numbers; a profiled model, fitted from the timings
the backend records, offers the same methods and can replace it anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from alpasim.graphs import Op, Tensor

from ._collectives import MeshAxis, collective_time_s, mesh_axes
from ._compute import op_time_s
from ._fusion import OpAccess
from ._hardware import Cluster, ClusterError, Device


@runtime_checkable
class CostModel(Protocol):
    """What planning needs to know about time on a cluster."""

    @property
    def cluster(self) -> Cluster: ...

    @property
    def device(self) -> Device: ...

    def op_time_s(self, op: Op, tensors: Mapping[str, Tensor], num_shards: int = 1,
                  access: OpAccess | None = None, split: Mapping[str, int] | None = None) -> float:
        """Seconds of one shard of `op` when it is split evenly `num_shards` ways;
        `access`: its charge inside a fused kernel (`fuse`), None when priced alone;
        `split`: the shards of each letter of its dimension map (a GEMM's shape)."""
        ...

    def collective_time_s(self, kind: str, nbytes: float, axes: Sequence[MeshAxis]) -> float:
        """Seconds of collective `kind` on a tensor of `nbytes` over `axes`."""
        ...


@dataclass(frozen=True, slots=True)
class AnalyticCostModel:
    """Roofline compute (`op_time_s`) and alpha-beta ring collectives on a `Cluster`."""

    cluster: Cluster

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, Cluster):
            raise ClusterError(f"AnalyticCostModel: cluster must be a Cluster, got {self.cluster!r}")

    @property
    def device(self) -> Device:
        return self.cluster.device

    def op_time_s(self, op: Op, tensors: Mapping[str, Tensor], num_shards: int = 1,
                  access: OpAccess | None = None, split: Mapping[str, int] | None = None) -> float:
        return op_time_s(op, tensors, self.cluster.device, num_shards, access, split)

    def collective_time_s(self, kind: str, nbytes: float, axes: Sequence[MeshAxis]) -> float:
        return collective_time_s(kind, nbytes, axes)

    def mesh_axes(self, shape: Sequence[int]) -> tuple[MeshAxis, ...]:
        """Axes of a logical mesh of `shape` placed on the first devices of the cluster."""
        return mesh_axes(self.cluster, shape)

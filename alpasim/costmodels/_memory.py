"""Training memory of a whole graph run as one step: parameters, gradients, optimizer
states, live activations.

    params      = sum of the parameters entering the step (`OpGraph.params`)
    grads       = sum of tensors with role ``grad`` (the accumulators Adam reads)
    optimizer   = sum of optimizer states entering the step (fp32 masters, Adam m, v)
    activations = the peak of live activation bytes of one forward + backward pass,
                  by the liveness rules of `_stage_memory` (what a pipeline stage uses)

Update ops write ``<param>:new`` and ``<state>:new``; these alias the buffers they
replace (Adam updates in place) and add nothing.

Per device, every term is multiplied by `shard_fraction`, the fraction of each tensor
one device holds — a placeholder until the solvers pass a real sharding.

Ignored: allocator fragmentation and workspace, framework and CUDA context memory and
temporary buffers inside an op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from alpasim.graphs import OpGraph

from ._stage_memory import layer_memory


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Per-device bytes of one training step, by kind; `total_bytes` is their sum."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_peak_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_peak_bytes", "total_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MemoryBreakdown: {name} must be an integer >= 0, got {value!r}")
        parts = self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_peak_bytes
        if self.total_bytes != parts:
            raise ValueError(f"MemoryBreakdown: total_bytes {self.total_bytes} != sum of the parts {parts}")

    def fits(self, memory_bytes: int) -> bool:
        return self.total_bytes <= memory_bytes


def activation_peak_bytes(graph: OpGraph) -> int:
    """Peak live activation bytes of one pass of `graph` (its forward, then its backward),
    by the liveness rules of `_stage_memory` (the same the planner's stages use)."""
    return int(layer_memory(graph).peak_bytes)


def training_memory(graph: OpGraph, shard_fraction: float = 1.0) -> MemoryBreakdown:
    """Per-device `MemoryBreakdown` of one training step (formulas: module docstring)."""
    if isinstance(shard_fraction, bool) or not isinstance(shard_fraction, (int, float)) \
            or not 0 < shard_fraction <= 1:
        raise ValueError(f"shard_fraction must be in (0, 1], got {shard_fraction!r}")
    producer = graph.producer
    params = sum(t.nbytes for t in graph.params)
    grads = sum(t.nbytes for t in graph.tensors.values() if t.role == "grad")
    optimizer = sum(t.nbytes for t in graph.tensors.values()
                    if t.role == "optimizer_state" and t.name not in producer)
    activations = activation_peak_bytes(graph)
    part = [math.ceil(b * shard_fraction) for b in (params, grads, optimizer, activations)]
    return MemoryBreakdown(*part, total_bytes=sum(part))

"""Training memory of a graph: parameters, gradients, optimizer states, live activations.

    params      = sum of the parameters entering the step (`OpGraph.params`)
    grads       = sum of tensors with role ``grad``, all held at once (the update ops
                  run after the whole backward, as `training_graph` orders them)
    optimizer   = sum of optimizer states entering the step (fp32 masters, Adam m, v)
    activations = max over the op order of the live activation bytes

An activation (role ``activation``, or a graph input) is live from the op that writes
it (the start of the step for inputs) to its last reader, inclusive; a graph output
stays live to the end. Update ops write ``<param>:new`` and ``<state>:new``; these
alias the buffers they replace (Adam updates in place) and add nothing.

Per device, every term is multiplied by `shard_fraction`, the fraction of each tensor
one device holds — a placeholder until the solvers pass a real sharding.

Ignored: allocator fragmentation and workspace, framework and CUDA context memory,
temporary buffers inside an op, and gradients freed before the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from alpasim.graphs import OpGraph


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
    """Peak live activation bytes along `graph.ops` (liveness rule: module docstring).

    One pass over the ops and one over the tensors: O(ops + tensors).
    """
    n = len(graph.ops)
    start: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            last_use[t] = i
        if op.phase == "update":
            continue
        for t in op.outputs:
            start[t] = i
    outputs = set(graph.outputs)
    inputs = set(graph.inputs)
    producer = graph.producer
    delta = [0] * (n + 1)
    base = 0
    for name, t in graph.tensors.items():
        if name in producer:
            if name not in start or t.role != "activation":
                continue  # written by an update op, or a gradient / updated state
            s = start[name]
        elif t.role == "input" or name in inputs:
            s = 0
        else:
            continue  # parameters and optimizer states are counted elsewhere
        if n == 0:
            base += t.nbytes
            continue
        e = n - 1 if name in outputs else max(last_use.get(name, s), s)
        delta[s] += t.nbytes
        delta[e + 1] -= t.nbytes
    peak, live = base, 0
    for i in range(n):
        live += delta[i]
        peak = max(peak, live)
    return peak


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

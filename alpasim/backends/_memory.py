"""A stage's memory as measured from its compiled programs, composed as it runs under 1F1B.

XLA reports, per compiled program, the bytes of its arguments, outputs and temporaries
and how many output bytes alias (reuse) an argument (`Compiled.memory_analysis()`).
The programs are SPMD over the stage's mesh, so every figure is one device's: a
(256, 512) float32 argument sharded 1x2 counts 256 KiB, not 512 KiB (checked on the
CPU in `tests/backends/test_memory.py`). `stage_memory` composes the stage's peak per
device from them the way a microbatch's life under 1F1B holds memory
(Korthikanti et al. 2022, section 4; the plan's `stages[i].memory` composes its
prediction alike):

    measured = state + inflight x stash + max over programs p of (temp_p + boundary_p)

- state: parameters + gradient accumulators + optimizer states (fp32 master, Adam
  moments), all resident for the whole iteration: the update program's arguments,
  which are exactly those (split into the three by the arrays' per-device shard sizes).
- stash: what one microbatch keeps from its forward to its backward. Under remat the
  stage inputs (received activations and the data), i.e. the forward's arguments less
  the parameters; without remat the forward's residual outputs (sized from the
  compiled outputs' shapes and layouts: XLA's output figure also counts the output
  tuple's 8-byte index entries) plus the stage inputs the residuals refer to.
  `inflight` is the plan's `stages[i].inflight_microbatches` (1F1B: S - i, at most B).
- temp_p: XLA's temporaries of program p (the running layer's working set; under remat
  the backward's includes the recomputed forward).
- boundary_p: the per-microbatch buffers p reads or writes that are neither state nor
  stash — the forward's outgoing activations and loss (and, without remat, the inputs
  it does not stash), the backward's incoming cotangents and outgoing input cotangents.

What it ignores: an output that replaces state (the backward's new accumulators, the
update's new parameters and states) is counted in place, as a run that donates those
buffers holds them; this runtime does not donate, so for the moment of a call it holds
both (the raw `programs` figures show the outputs). Also the executable code, a
microbatch's data before it is placed, and fragmentation. On a GPU the device's own
`peak_bytes_in_use` (`device_peak_bytes`, max over the stage's devices) is the figure
that includes all of it; the CPU reports none.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax


@dataclass(frozen=True, slots=True)
class ProgramMemory:
    """XLA's memory analysis of one compiled program, per device."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int

    @classmethod
    def of(cls, compiled) -> ProgramMemory:
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                   int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes))


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Measured per-device memory of one stage (module doc for the composition)."""

    stage: int
    programs: dict[str, ProgramMemory]      # "forward" | "backward" | "update"
    params_bytes: int
    grads_bytes: int                        # the gradient accumulators
    optimizer_bytes: int
    stash_bytes: int                        # one microbatch, forward to backward
    inflight: int
    temp_bytes: int                         # of the program with the largest temp + boundary
    buffer_bytes: int                       # that program's boundary buffers
    peak_program: str
    device_peak_bytes: int | None = None    # the device's own peak (GPU), max over the stage's devices

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.inflight * self.stash_bytes + self.temp_bytes + self.buffer_bytes

    def to_json(self) -> dict[str, Any]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "state_bytes": self.state_bytes,
                "stash_bytes": self.stash_bytes, "inflight": self.inflight, "temp_bytes": self.temp_bytes,
                "buffer_bytes": self.buffer_bytes, "peak_program": self.peak_program,
                "total_bytes": self.total_bytes, "device_peak_bytes": self.device_peak_bytes,
                "programs": {k: asdict(v) for k, v in self.programs.items()}}


def per_device_bytes(shape: tuple[int, ...], dtype, sharding) -> int:
    """Bytes one device holds of an array of `shape` laid out by `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape))) * jax.dtypes.canonicalize_dtype(dtype).itemsize


def _sum_bytes(arrays) -> int:
    return sum(per_device_bytes(a.shape, a.dtype, a.sharding) for a in arrays)


def stage_memory(stage, inflight: int) -> StageMemory:
    """The measured memory of a lowered stage (`StageExecutable`) with `inflight`
    microbatches between forward and backward; a Ray `RemoteStage` brings its own."""
    if not hasattr(stage, "compiled") or not hasattr(stage.compiled.get("forward"), "memory_analysis"):
        return stage.memory
    programs = {k: ProgramMemory.of(c) for k, c in stage.compiled.items()}
    fwd, bwd, upd = programs["forward"], programs["backward"], programs["update"]
    params = _sum_bytes(stage.params.values())
    grads = _sum_bytes(stage.acc.values())
    # The update's arguments are the state; its optimizer part is what is left of them.
    optimizer = upd.argument_bytes - params - grads
    # Output sizes from the compiled outputs' shapes and layouts: XLA's output figure also
    # counts the output tuple's index table (8 bytes per output buffer).
    outs, res = _outputs(stage.compiled["forward"])
    _, act_cts = _outputs(stage.compiled["backward"])
    kept_in = sum(per_device_bytes(a.shape, a.dtype, stage.shardings[t])
                  for t, a in ((t, _arg_info(stage, t)) for t in (*stage.kept_acts, *stage.kept_data)))
    inputs_in = fwd.argument_bytes - params          # every act and data input of one microbatch
    stash = inputs_in if stage.remat else res + kept_in
    forward_boundary = outs + inputs_in - (inputs_in if stage.remat else kept_in)
    # The backward reads state, the stash and the cotangents, writes the accumulators
    # (in place, module doc) and the input cotangents.
    backward_boundary = (bwd.argument_bytes - params - grads - stash) + act_cts
    candidates = {"forward": (fwd.temp_bytes, forward_boundary), "backward": (bwd.temp_bytes, backward_boundary),
                  "update": (upd.temp_bytes, 0)}
    peak = max(candidates, key=lambda k: sum(candidates[k]))
    temp, boundary = candidates[peak]
    return StageMemory(stage.index, programs, params, grads, optimizer, stash, inflight, temp, boundary, peak,
                       device_peak_bytes(stage.mesh))


def _outputs(compiled) -> tuple[int, int]:
    """Per-device bytes of a stage program's two outputs (forward: boundary outputs,
    residuals; backward: accumulators, input cotangents)."""
    return tuple(sum(per_device_bytes(i.shape, i.dtype, sh) for i, sh in zip(
        jax.tree.leaves(info), jax.tree.leaves(shardings), strict=True))
        for info, shardings in zip(compiled.out_info, compiled.output_shardings, strict=True))


def _arg_info(stage, t: str):
    """The forward's abstract argument `t` (a stage input activation or data tensor)."""
    (_, acts, data), _ = stage.compiled["forward"].args_info
    return acts[t] if t in acts else data[t]


def device_peak_bytes(mesh) -> int | None:
    """The most bytes any of the mesh's devices has had in use (None where the platform
    keeps no such count, as the CPU)."""
    peaks = []
    for d in mesh.devices.flat:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None

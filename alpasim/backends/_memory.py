"""A stage's memory as measured from its compiled programs, composed as it runs under 1F1B.

XLA reports, per compiled program, the bytes of its arguments, outputs and temporaries
and how many output bytes alias (reuse) an argument (`Compiled.memory_analysis()`).
The programs are SPMD over the stage's mesh, so every figure is one device's: a
(256, 512) float32 argument sharded 1x2 counts 256 KiB, not 512 KiB (checked on the
CPU in `tests/backends/test_memory.py`). `measured_memory` composes the stage's peak per
device from them the way a microbatch's life under 1F1B holds memory
(Korthikanti et al. 2022, section 4; the plan's `stages[i].memory` composes its
prediction alike):

    measured = state + max(inflight x stash + max over p in {forward, backward} of (temp_p + boundary_p),
                           temp_update + boundary_update)

(the optimizer step runs after the last microbatch's backward, when nothing is stashed)

- state: parameters + gradient accumulators + optimizer states (fp32 master, Adam
  moments), all resident for the whole iteration: the update program's arguments,
  which are exactly those (split into the three by the arrays' per-device shard sizes).
- stash: what one microbatch keeps from its forward to its backward: the tensors the
  stage's backward ops read of its forward (`StageExecutable.stash_spec`, in their
  layouts; under remat each layer's input, without it every forward value the
  backward reads). `inflight` is the plan's `stages[i].inflight_microbatches`
  (1F1B: S - i, at most B).
- temp_p: XLA's temporaries of program p (the running layer's working set; under remat
  the backward's includes the recomputed forward).
- boundary_p: the per-microbatch buffers p reads or writes that are neither state nor
  stash — the forward's incoming activations and data it does not stash and its
  outgoing activations and loss it does not stash; the backward's incoming
  cotangents and those of its outputs that XLA does not write into a donated
  argument (the cotangents it hands back); the update's outputs beyond its aliases.

The backward donates the accumulators, the stash and the cotangents, the update
everything it takes (`_executable`): XLA writes the new accumulators, parameters and
states into the old buffers (`alias_bytes`), so an output that replaces state is
counted once, as the run holds it. Ignored: the executable code, a microbatch's data
before it is placed, and fragmentation. On a GPU the device's own
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
class MeasuredMemory:
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
        stashed = 0 if self.peak_program == "update" else self.inflight * self.stash_bytes
        return self.state_bytes + stashed + self.temp_bytes + self.buffer_bytes

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


def measured_memory(stage, inflight: int) -> MeasuredMemory:
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
    stash_names = set(stage.stash_spec)
    stash = _sum_bytes(stage.stash_spec.values())
    # Sizes from the compiled signatures: XLA's output figure also counts the output
    # tuple's index table (8 bytes per output buffer).
    (_, acts, data), _ = stage.compiled["forward"].args_info
    outs, made = _named_outputs(stage.compiled["forward"])
    sh = stage.shardings
    forward_boundary = sum(per_device_bytes(a.shape, a.dtype, sh[t]) for t, a in (*acts.items(), *data.items())
                           if t not in stash_names) + sum(_bytes(a) for t, a in outs.items() if t not in stash_names)
    (_, _, _, cts), _ = stage.compiled["backward"].args_info
    acc_out, cts_out = _named_outputs(stage.compiled["backward"])
    backward_out = sum(_bytes(a) for a in (*acc_out.values(), *cts_out.values()))
    backward_boundary = sum(per_device_bytes(a.shape, a.dtype, sh[t]) for t, a in cts.items()) \
        + max(backward_out - bwd.alias_bytes, 0)
    update_out = sum(_bytes(a) for tree in stage.compiled["update"].out_info for a in jax.tree.leaves(tree))
    candidates = {"forward": (fwd.temp_bytes, forward_boundary), "backward": (bwd.temp_bytes, backward_boundary),
                  "update": (upd.temp_bytes, max(update_out - upd.alias_bytes, 0))}
    held = {"forward": inflight * stash, "backward": inflight * stash, "update": 0}   # no stash at the update
    peak = max(candidates, key=lambda k: sum(candidates[k]) + held[k])
    temp, boundary = candidates[peak]
    return MeasuredMemory(stage.index, programs, params, grads, optimizer, stash, inflight, temp, boundary, peak,
                       device_peak_bytes(stage.mesh))


def _bytes(info) -> int:
    return per_device_bytes(info.shape, info.dtype, info.sharding)


def _named_outputs(compiled) -> tuple[dict, dict]:
    """A stage program's two output dicts as name -> ShapeDtypeStruct with its layout."""
    return tuple({t: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=sh) for (t, i), sh in
                  zip(info.items(), (shardings[t] for t in info), strict=True)}
                 for info, shardings in zip(compiled.out_info[:2], compiled.output_shardings[:2], strict=True))


def device_peak_bytes(mesh) -> int | None:
    """The most bytes any of the mesh's devices has had in use (None where the platform
    keeps no such count, as the CPU)."""
    peaks = []
    for d in mesh.devices.flat:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None

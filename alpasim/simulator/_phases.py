"""How long each pass of a stage takes and what it holds: the numbers a schedule's
order is built from (`_schedules`) and the engine runs (`_engine`).

A backward pass computes input gradients (dX = dY W^T: what the previous stage waits
for) and weight gradients (dW = X^T dY: needed only by the optimizer step). Zero-bubble
schedules (Qi et al., ICLR 2024) run them as two passes, B and W, and defer W into
the bubbles. The planner prices the split per stage (`PipelineStage.backward_weight_s`,
`weight_stash_bytes`); a plan without it gets half of each: a matmul's two gradients
take the same FLOPs, and of what the backward reads, the weight gradients keep the
layer inputs and the cotangents, about half of a transformer layer's stash.
"""

from __future__ import annotations

from dataclasses import dataclass

from alpasim.solvers import PipelineStage

# The share of backward time and of the stash a stage without a priced split gets.
DEFAULT_WEIGHT_SHARE = 0.5


def stage_phase_s(stage: PipelineStage, microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on a stage.

    Old plans carry no split (both 0): backward is taken as twice the forward, the
    usual ratio for matmul-dominated layers (two matmuls per forward one).
    """
    if stage.forward_s > 0 or stage.backward_s > 0:
        return stage.forward_s, stage.backward_s
    compute = stage.compute_s if stage.compute_s > 0 else max(stage.time_s - stage.sync_s / microbatches, 0.0)
    return compute / 3, 2 * compute / 3


@dataclass(frozen=True, slots=True)
class PassTimes:
    """One microbatch on one stage: seconds of F, of B (input gradients) and of W
    (weight gradients; B + W = the whole backward), and the bytes its stash holds after
    F and, once B has run, until W."""

    forward_s: float
    input_s: float
    weight_s: float
    stash_bytes: float
    weight_stash_bytes: float

    @property
    def backward_s(self) -> float:
        return self.input_s + self.weight_s


def split_backward(stage: PipelineStage, microbatches: int) -> PassTimes:
    """The stage's passes for a schedule that splits the backward (module doc)."""
    f, b = stage_phase_s(stage, microbatches)
    w = min(stage.backward_weight_s, b) if stage.backward_weight_s > 0 else DEFAULT_WEIGHT_SHARE * b
    stash = min(stage.stash_bytes, stage.activation_bytes) if stage.stash_bytes > 0 else stage.activation_bytes
    # What W reads can exceed the stash: under recomputation it is recomputed in B.
    kept = stage.weight_stash_bytes if stage.weight_stash_bytes > 0 else DEFAULT_WEIGHT_SHARE * stash
    return PassTimes(f, b - w, w, stash, kept)

"""Alpa's stage profiling: time each compiled stage alone on its mesh.

The paper's intra-op pass does not trust an operator-level model for a stage's
latency: for every stage-mesh pair it solves the ILP, compiles the sharded executable,
*runs* it and reports the measured latency to the inter-op pass (§5, "compiles,
profiles, returns latency"). `profile_stage` is that step for a lowered stage: it
calls the stage's three compiled programs — forward, backward (the forward recomputed
first under remat, the forward's residuals applied without) and the Adam update — on inputs of the right shapes and layouts, times
each around `block_until_ready`, and keeps the median of `iters` calls after
warming up, as `alpasim profile` times its samples (`_profile._median_s`).

What a profiled stage time contains is what one `Run` / `Update` instruction of the
runtimes costs: the forward includes generating and placing the microbatch's data
(the runtimes' `Run` does both), every call includes its dispatch. It is measured on
the stage's own mesh with the other meshes idle — exactly how the one-process runtime
runs it — so what it leaves to the simulator is the schedule: how many runs, in
what order, the transfers between meshes and the pipeline's fill and drain.

The calls are pure: parameters, accumulators and optimizer states are read, never
replaced, so profiling a stage before a run does not change the run's numerics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax
import numpy as np

from alpasim.graphs import OpGraph

from ._executable import StageExecutable
from ._profile import _median_s, dispatch_s
from ._stages import microbatch_inputs


@dataclass(frozen=True)
class StageTimes:
    """Median seconds of one call of each compiled program of a stage (module doc)."""

    stage: int
    forward_s: float        # one microbatch, data generation and placement included
    backward_s: float       # one microbatch, recomputed forward included
    update_s: float         # once per iteration
    iters: int
    dispatch_s: float = 0.0  # a trivial jitted call on the stage's mesh, for pricing the calls' launch

    def to_json(self) -> dict:
        return asdict(self)


def _random_like(graph: OpGraph, names, shardings: dict, rng: np.random.Generator) -> dict[str, jax.Array]:
    """Inputs of the graph's shapes and dtypes in the stage's layouts (floats random, ints 0)."""
    out = {}
    for t in names:
        spec = graph.tensors[t]
        dtype = jax.dtypes.canonicalize_dtype(spec.dtype)
        if spec.is_float:
            value = rng.standard_normal(spec.shape).astype(dtype)
        else:
            value = np.zeros(spec.shape, dtype)
        out[t] = jax.device_put(value, shardings[t])
    return out


def profile_stage(stage: StageExecutable, graph: OpGraph, *, iters: int = 5, seed: int = 0) -> StageTimes:
    """Time `stage`'s forward, backward and update (`graph`: `planning_graph(plan.model)`)."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    part, sh, compiled = stage.part, stage.shardings, stage.compiled
    rng = np.random.default_rng(seed)
    acts = _random_like(graph, part.acts_in, sh, rng)
    cts = _random_like(graph, part.acts_out, sh, rng)
    placed = {t: jax.device_put(v, sh[t]) for t, v in microbatch_inputs(graph, seed, 0, 0).items() if t in part.data}

    def forward():
        data = microbatch_inputs(graph, seed, 0, 0)
        data = {t: jax.device_put(data[t], sh[t]) for t in part.data}
        return compiled["forward"](stage.params, acts, data)

    forward_s = _median_s(forward, (), iters)
    kept_acts, kept_data, res = stage.stash_entry(acts, placed, compiled["forward"](stage.params, acts, placed)[1])
    backward_s = _median_s(compiled["backward"], (stage.params, stage.acc, kept_acts, kept_data, res, cts), iters)
    update_s = _median_s(compiled["update"], (stage.params, stage.acc, stage.states), iters)
    return StageTimes(stage.index, forward_s, backward_s, update_s, iters, dispatch_s(stage.mesh, iters))


def profile_stages(stages, graph: OpGraph, *, iters: int = 5, seed: int = 0) -> list[StageTimes]:
    """`profile_stage` for each stage, one after another (the others idle)."""
    return [profile_stage(s, graph, iters=iters, seed=seed) for s in stages]

"""Alpa's stage profiling: time each compiled stage alone on its mesh.

The paper's intra-op pass does not trust an operator-level model for a stage's
latency: for every stage-mesh pair it solves the ILP, compiles the sharded executable,
*runs* it and reports the measured latency to the inter-op pass (§5, "compiles,
profiles, returns latency"). `profile_stage` is that step for a lowered stage: it
calls the stage's three compiled programs — forward, backward (the training graph's
backward ops, recomputation included under remat) and the Adam update — on inputs of
the right shapes and layouts, times each around `block_until_ready`, and keeps the
median of `iters` calls after warming up, as `alpasim profile` times its samples
(`_profile._median_s`).

What a profiled stage time contains is what one `Run` / `Update` instruction of the
runtimes costs: the forward includes generating and placing the microbatch's data
(the runtimes' `Run` does both), every call includes its dispatch. It is measured on
the stage's own mesh with the other meshes idle — exactly how the one-process runtime
runs it — so what it leaves to the simulator is the schedule: how many runs, in
what order, the transfers between meshes and the pipeline's fill and drain.

The backward and the update donate their buffers (`_executable`), so each call gets
fresh copies, made outside the timed region: the stage's own parameters,
accumulators and optimizer states are never handed over, and profiling a stage
before a run does not change the run's numerics.
"""

from __future__ import annotations

import time
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


def _random_like(infos: dict, shardings: dict, rng: np.random.Generator) -> dict[str, jax.Array]:
    """Arrays of the compiled arguments' shapes, dtypes and layouts (floats random, ints 0)."""
    out = {}
    for t, info in infos.items():
        dtype = np.dtype(info.dtype)
        value = rng.standard_normal(info.shape).astype(dtype) if np.issubdtype(dtype, np.floating) \
            else np.zeros(info.shape, dtype)
        out[t] = jax.device_put(value, shardings[t])
    return out


def _copies(tree):
    return jax.tree.map(lambda v: v.copy(), tree)


def _median_fresh_s(fn, args, iters: int) -> float:
    """`_median_s` of a donating program: every call on its own copy of `args`."""
    times = []
    for i in range(iters + 2):  # two warm-up calls, as `_median_s`
        fresh = _copies(args)
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*fresh))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def profile_stage(stage: StageExecutable, graph: OpGraph, *, iters: int = 5, seed: int = 0) -> StageTimes:
    """Time `stage`'s forward, backward and update (`graph`: `planning_graph(plan.model)`)."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    ops, sh, compiled = stage.ops, stage.shardings, stage.compiled
    rng = np.random.default_rng(seed)
    (_, a_info, _), _ = compiled["forward"].args_info
    (_, _, _, ct_info), _ = compiled["backward"].args_info
    acts, cts = _random_like(a_info, sh, rng), _random_like(ct_info, sh, rng)
    placed = {t: jax.device_put(v, sh[t]) for t, v in microbatch_inputs(graph, seed, 0, 0).items() if t in ops.data}

    def forward():
        data = microbatch_inputs(graph, seed, 0, 0)
        data = {t: jax.device_put(data[t], sh[t]) for t in ops.data}
        return compiled["forward"](stage.params, acts, data)

    forward_s = _median_s(forward, (), iters)
    stash = stage.stash_entry(acts, placed, *compiled["forward"](stage.params, acts, placed))
    backward_s = _median_fresh_s(lambda p, *rest: compiled["backward"](stage.params, *rest),
                                 (None, stage.acc, stash, cts), iters)
    update_s = _median_fresh_s(compiled["update"], (stage.params, stage.acc, stage.states), iters)
    return StageTimes(stage.index, forward_s, backward_s, update_s, iters, dispatch_s(stage.mesh, iters))


def profile_stages(stages, graph: OpGraph, *, iters: int = 5, seed: int = 0) -> list[StageTimes]:
    """`profile_stage` for each stage, one after another (the others idle)."""
    return [profile_stage(s, graph, iters=iters, seed=seed) for s in stages]

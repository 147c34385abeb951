"""Which pipeline schedule a plan should run: the fastest that fits.

The stage DP prices 1F1B (eq. 2, and its memory rule). Once it has chosen stages and
microbatches, each other schedule is a different order of the same passes, so its
iteration and its memory come from running that order (`simulate`: the same liveness
accounting the simulator reports, one rule per schedule, derived from the order). A
schedule fits when no device's simulated peak exceeds the device's memory, or 1F1B's
simulated peak on that device where that is higher: the planner fitted 1F1B by its
own rule, which leaves out what the simulator adds (receive buffers), and a schedule
is held to no stricter bound than 1F1B. Zero-bubble schedules pay
most with many stages and few microbatches, where 1F1B's (S - 1)(f + b + w) ramp is a
large part of the iteration, and cost the inputs each deferred W pass holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster
from alpasim.solvers import SCHEDULES, PipelinePlan

from ._engine import plan_cluster, simulate

# What `choose_schedule` considers by default: the schedules whose record says so
# (`solvers.Schedule.automatic`), each running one stage per mesh on the DP's stages
# (interleaving needs the model cut into S x v chunks: the planner's own search,
# `PlanOptions(schedule="interleaved")`, does that).
AUTO_SCHEDULES = tuple(name for name, s in SCHEDULES.items() if s.automatic)


@dataclass(frozen=True, slots=True)
class ScheduleOption:
    """One schedule of one plan: its simulated iteration and bubble, the peak memory of
    each device (by global device id), and whether those fit (module doc)."""

    schedule: str
    iteration_s: float
    bubble_fraction: float
    peak_memory_bytes: tuple[float, ...]
    fits: bool


def schedule_options(plan: PipelinePlan, schedules: Sequence[str] = AUTO_SCHEDULES,
                     cluster: Cluster | None = None, chunks: int = 2) -> list[ScheduleOption]:
    """Each of `schedules` for `plan`, simulated on `cluster` (default: the plan's);
    interleaved with `chunks` model chunks per mesh."""
    cluster = cluster or plan_cluster(plan)
    if cluster is None:
        raise ValueError(f"plan cluster {plan.cluster.name!r} is no preset and the plan records no 'spec'")
    runs = {name: simulate(plan, name, chunks=chunks, cluster=cluster) for name in dict.fromkeys(("1f1b", *schedules))}
    bound = [max(cluster.device.memory_bytes, p) for p in runs["1f1b"].peak_memory_bytes]
    return [ScheduleOption(name, runs[name].iteration_s, runs[name].bubble_fraction,
                           tuple(runs[name].peak_memory_bytes),
                           all(p <= b for p, b in zip(runs[name].peak_memory_bytes, bound, strict=True)))
            for name in schedules]


def choose_schedule(plan: PipelinePlan, schedules: Sequence[str] = AUTO_SCHEDULES,
                    cluster: Cluster | None = None) -> PipelinePlan:
    """`plan` with `schedule` set to the fastest of `schedules` that fits (ties to the
    first listed), and a note with what each one simulated to."""
    if not plan.feasible or not plan.stages:
        return plan
    options = schedule_options(plan, schedules, cluster)
    allowed = [o for o in options if o.fits] or options[:1]
    best = min(allowed, key=lambda o: o.iteration_s)
    said = "; ".join(f"{o.schedule} {o.iteration_s:.4g} s" + ("" if o.fits else " (does not fit)") for o in options)
    note = f"schedule {best.schedule}, the fastest that fits of: {said}"
    return dataclasses.replace(plan, schedule=best.schedule, notes=(*plan.notes, note))

"""Which pipeline schedule a plan should run: the fastest that fits.

The stage DP prices 1F1B (eq. 2, and its memory rule). Once it has chosen stages and
microbatches, each other schedule is a different order of the same passes, so its
iteration and its memory come from running that order (`simulate`: the same liveness
accounting the simulator reports, one rule per schedule, derived from the order). A
schedule is allowed when every stage's simulated peak stays within the device's
memory; 1F1B, which the planner already fitted, always is. Zero-bubble schedules pay
most with many stages and few microbatches, where 1F1B's (S - 1)(f + b + w) ramp is a
large part of the iteration, and cost the inputs each deferred W pass holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster
from alpasim.solvers import PipelinePlan

from ._engine import plan_cluster, simulate

# What `choose_schedule` considers by default: those the simulator runs with one stage
# per mesh (interleaving needs the model cut into S x v chunks, which a plan lacks).
AUTO_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


@dataclass(frozen=True, slots=True)
class ScheduleOption:
    """One schedule of one plan: its simulated iteration, each stage's peak memory per
    device, and whether those fit the device."""

    schedule: str
    iteration_s: float
    peak_memory_bytes: tuple[float, ...]
    fits: bool


def schedule_options(plan: PipelinePlan, schedules: Sequence[str] = AUTO_SCHEDULES,
                     cluster: Cluster | None = None) -> list[ScheduleOption]:
    """Each of `schedules` for `plan`, simulated on `cluster` (default: the plan's)."""
    cluster = cluster or plan_cluster(plan)
    if cluster is None:
        raise ValueError(f"plan cluster {plan.cluster.name!r} is no preset and the plan records no 'spec'")
    out = []
    for name in schedules:
        tl = simulate(plan, name, cluster=cluster)
        peaks = tuple(tl.peak_memory_bytes)
        fits = name == "1f1b" or all(p <= cluster.device.memory_bytes for p in peaks)
        out.append(ScheduleOption(name, tl.iteration_s, peaks, fits))
    return out


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

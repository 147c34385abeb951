"""Several methods on one (model, cluster): their simulated throughput side by side.

`compare` is the smallest experiment: one `Point` per method, run (and cached) by
`run_points`, each result read next to Alpa's. `plan_summary` is how any plan reads in
one line, here and in sweeps: stages with their layers, submesh and logical mesh, the
number of microbatches, and Megatron-LM's degrees when the method has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from alpasim.costmodels import Cluster
from alpasim.simulator import SCHEDULES, schedule_options
from alpasim.solvers import METHODS, SYSTEM_BUCKETS, PipelinePlan, plan_from_json

from ._points import Point, Result, run_points


def method_name(name: str) -> str:
    """The canonical name of a planning method; dashes and underscores are the same."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(m.replace('_', '-') for m in METHODS)}")
    return canonical


def plan_shape(plan: dict[str, Any]) -> dict[str, Any]:
    """What of a plan JSON a reader compares between points: the stages' layers,
    submeshes and logical meshes, the microbatches, and Megatron's configuration."""
    shape: dict[str, Any] = {
        "feasible": bool(plan.get("feasible")),
        "microbatches": plan.get("microbatches"),
        "stages": [{"layers": list(s["layers"]), "submesh": list(s["submesh"]),
                    "logical_mesh": list(s["logical_mesh"])} for s in plan.get("stages", ())],
    }
    if "megatron" in plan.get("search", {}):
        shape["megatron"] = dict(plan["search"]["megatron"])
    return shape


def plan_summary(plan: dict[str, Any]) -> str:
    """One line: `2 stages, B=16: 0..15 on 1x8 as 2x4 | 16..31 on 1x8 as 8x1`."""
    shape = plan_shape(plan)
    if not shape["feasible"]:
        notes = plan.get("notes") or ["infeasible"]
        return f"infeasible: {notes[0]}"
    stages = " | ".join(f"{s['layers'][0]}..{s['layers'][1]} on {s['submesh'][0]}x{s['submesh'][1]} as "
                        f"{s['logical_mesh'][0]}x{s['logical_mesh'][1]}" for s in shape["stages"])
    n = len(shape["stages"])
    head = f"{n} stage{'s' if n != 1 else ''}, B={shape['microbatches']}"
    if "megatron" in shape:
        m = shape["megatron"]
        head = f"tp={m['tp']} pp={m['pp']} dp={m['dp']} mbs={m['microbatch_size']}, " + head
    return f"{head}: {stages}"


@dataclass(frozen=True)
class Comparison:
    """Results of several methods on one (model, cluster), the first method the reference."""

    model: str
    cluster: Cluster
    results: tuple[Result, ...]
    # Per result (same order), each schedule's simulated iteration, bubble and peak
    # memory for the same plan (`schedule_rows`); empty when none were asked for.
    schedules: tuple[dict[str, dict[str, Any]], ...] = ()

    @property
    def reference(self) -> Result:
        return self.results[0]

    def ratio(self, result: Result) -> float | None:
        """`result`'s simulated throughput over the reference's (None if either is infeasible)."""
        ref = self.reference.throughput_pflops
        if not ref or result.throughput_pflops is None:
            return None
        return result.throughput_pflops / ref

    def rows(self) -> list[dict[str, Any]]:
        rows = [{"method": r.method, "feasible": r.feasible, "throughput_pflops": r.throughput_pflops,
                 "iteration_s": r.iteration_s, "ratio_to_" + self.reference.method: self.ratio(r),
                 "plan": plan_summary(r.plan), "plan_s": r.plan_s, "cached": r.cached} for r in self.results]
        for row, by_schedule in zip(rows, self.schedules):
            row["schedules"] = by_schedule
        return rows

    def to_json(self) -> dict[str, Any]:
        c = self.cluster
        return {"model": self.model, "gpus": c.num_devices,
                "cluster": {"name": c.name, "nodes": c.nodes, "devices_per_node": c.devices_per_node,
                            "inter_node_gbps": c.inter_node.bandwidth_gbps},
                "reference": self.reference.method, "rows": self.rows()}


def schedule_rows(plan: PipelinePlan, cluster: Cluster, schedules: Sequence[str],
                  chunks: int = 2) -> dict[str, dict[str, Any]]:
    """One plan under each of `schedules` (`simulator.schedule_options`): simulated
    iteration, bubble, the largest peak memory of any device and whether every device
    fits (the plan was priced for 1F1B's memory; GPipe and ZB-H2 hold more).
    Interleaved runs `chunks` chunks."""
    return {o.schedule: {"iteration_s": o.iteration_s, "bubble_fraction": o.bubble_fraction,
                         "peak_memory_bytes": max(o.peak_memory_bytes, default=0.0), "fits": o.fits}
            for o in schedule_options(plan, schedules, cluster, chunks)}


def compare(model: str, cluster: Cluster, methods: Sequence[str], *, cache: bool = True, workers: int | None = None,
            map_fn: Callable[[Callable, Iterable], Iterable] | None = None,
            progress: Callable[[int, int, Result], None] | None = None,
            bucket_bytes: float | str | None = SYSTEM_BUCKETS, schedules: Sequence[str] = ()) -> Comparison:
    """Plan and simulate `model` on `cluster` with each of `methods` (the first is the
    reference the others are divided by); `bucket_bytes` as `Point`'s. With
    `schedules` (names in `simulator.SCHEDULES`), every feasible plan is also simulated
    under each (`schedule_rows`)."""
    names = list(dict.fromkeys(method_name(m) for m in methods))
    if not names:
        raise ValueError("compare needs at least one method")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; choose from {', '.join(SCHEDULES)}")
    points = [Point(model, cluster, m, label=m, bucket_bytes=bucket_bytes) for m in names]
    results = run_points(points, cache=cache, workers=workers, map_fn=map_fn, progress=progress)
    by_schedule = tuple(schedule_rows(plan_from_json(r.plan), cluster, schedules) if r.feasible else {}
                        for r in results) if schedules else ()
    return Comparison(model, cluster, tuple(results), by_schedule)

"""Experiment points: (model, cluster, method) -> a priced, simulated result, cached.

Every figure and sweep is a list of `Point`s. `run_points` plans each with
`solvers.plan_with_method`, simulates the plan (the same 1F1B simulator the CLI uses),
and keeps a small JSON `Result`. Results are cached on disk by the point's full
description (model, cluster spec, method, options, `RESULT_VERSION`), so an interrupted
reproduction or sweep resumes where it stopped and a warm rerun takes seconds; the
layer solves underneath share the planner's own stage cache. Points run in parallel
through any map function: a local process pool by default, Ray tasks with `--ray`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from alpasim.costmodels import Cluster, get_cluster
from alpasim.graphs import ModelSpecError, graph_digest, graph_to_json, read_graph_file
from alpasim.simulator import simulate
from alpasim.solvers import (CACHE_VERSION, SYSTEM_BUCKETS, DiskCache, MegatronConfig, digest, plan_with_method,
                             worker_pool)

# 3: the DP prices stage-boundary transfers; 5: DP baselines' microbatches split over their devices
RESULT_VERSION = "points/14"  # 7: each method priced as its system profile ran (overlap per system);
#                              8: the parameter gathers overlapped where the system ran them so;
#                              9: the vocab-parallel loss, and Megatron's unfused fp32 loss priced;
#                             10: a flat buffer's overlapped gathers priced on its weights' bytes;
#                             11: gradients reduced in fp32 (the accumulator); a flat buffer scatters and gathers;
#                             12: an unevenly divisible gradient keeps its all-reduce under a sharded optimizer;
#                             13: norms, SwiGLU and RoPE as fused kernels under the Megatron and Llama 3 profiles;
#                             14: pipeline sends block the stage where the system's do (Alpa, Megatron, DeepSpeed)
DEFAULT_CLUSTER = "aws-p3.16xlarge"


def paper_cluster(gpus: int, name: str = DEFAULT_CLUSTER, **overrides) -> Cluster:
    """The paper's testbed cut to `gpus` devices: whole 8-GPU nodes, or part of one."""
    per_node = get_cluster(name).devices_per_node
    if gpus <= per_node:
        return get_cluster(name, nodes=1, devices_per_node=gpus, **overrides)
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    return get_cluster(name, nodes=gpus // per_node, **overrides)


@dataclass(frozen=True)
class Point:
    """One thing to plan: a model on a cluster with a method (and its options)."""

    model: str
    cluster: Cluster
    method: str
    microbatches: int | str = "auto"
    megatron: MegatronConfig | None = None
    cross_mesh: str = "local_all_gather"
    label: str = ""                                  # e.g. the swept value, for tables
    # The size of the gradient buckets where the method's system overlaps them with the
    # backward (`solvers._systems`); None: no overlap for any method (`--no-overlap`).
    bucket_bytes: float | str | None = SYSTEM_BUCKETS

    @property
    def gpus(self) -> int:
        return self.cluster.num_devices

    def key(self) -> str:
        return digest([RESULT_VERSION, CACHE_VERSION, model_key(self.model), self.cluster.to_json(), self.method,
                       str(self.microbatches), dataclasses.asdict(self.megatron) if self.megatron else None,
                       self.cross_mesh, self.bucket_bytes if self.bucket_bytes in (None, SYSTEM_BUCKETS)
                       else float(self.bucket_bytes)])


@dataclass(frozen=True)
class Result:
    """What a figure needs of a planned point; `plan` is the full plan JSON."""

    model: str
    gpus: int
    method: str
    label: str
    feasible: bool
    throughput_pflops: float | None          # from the simulated iteration time
    predicted_pflops: float | None           # from the planner's eq. 2
    iteration_s: float | None                # simulated
    predicted_iteration_s: float | None
    plan_s: float                            # planning wall time when first computed
    cached: bool = False
    notes: tuple[str, ...] = ()
    plan: dict[str, Any] = field(default_factory=dict, compare=False)
    refused: bool = False                    # the method does not take this model (notes say why)

    def to_json(self, with_plan: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        if not with_plan:
            d.pop("plan")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        """A result from its JSON, validated (TypeError/ValueError otherwise): the
        fields the class has, GPUs a positive integer, every time and throughput a
        finite number >= 0 (None where infeasible). The result cache reads through it."""
        r = cls(**{**d, "notes": tuple(d.get("notes", ()))})
        if isinstance(r.gpus, bool) or not isinstance(r.gpus, int) or r.gpus < 1:
            raise ValueError(f"a result's gpus is a positive integer, got {r.gpus!r}")
        for x in (r.throughput_pflops, r.predicted_pflops, r.iteration_s, r.predicted_iteration_s, r.plan_s):
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf):
                raise ValueError(f"a result's times and throughputs are finite numbers >= 0, got {x!r}")
        if r.feasible and r.iteration_s is None:
            raise ValueError("a feasible result has an iteration time")
        return r


def model_key(model: str) -> Any:
    """What a result's cache key records of its model: the spec string, or for a saved
    graph its content digest (a path says nothing of what the file holds now)."""
    graph = read_graph_file(model)
    return model if graph is None else ["graph", graph_digest(graph_to_json(graph))]


def run_point(point: Point, cache_enabled: bool = True) -> Result:
    """Plan and simulate one point (no result cache; see `run_points`). A method that
    does not take the model (Megatron-LM on a saved graph) is an infeasible row saying
    why, not an error that loses the other methods' rows."""
    t0 = time.perf_counter()
    try:
        plan = plan_with_method(point.method, point.model, point.cluster, microbatches=point.microbatches,
                                megatron=point.megatron, cache=DiskCache(enabled=cache_enabled),
                                bucket_bytes=point.bucket_bytes)
    except ModelSpecError as e:
        return Result(point.model, point.gpus, point.method, point.label, False, None, None, None, None,
                      time.perf_counter() - t0, notes=(str(e),), plan={"feasible": False, "notes": [str(e)]},
                      refused=True)
    plan_s = time.perf_counter() - t0
    if not plan.feasible:
        return Result(point.model, point.gpus, point.method, point.label, False, None, None, None, None, plan_s,
                      notes=plan.notes, plan=plan.to_json())
    timeline = simulate(plan, plan.schedule, cluster=point.cluster, cross_mesh=point.cross_mesh)
    flops = plan.model.flops_per_iteration
    return Result(point.model, point.gpus, point.method, point.label, True, flops / timeline.iteration_s / 1e15,
                  plan.predicted.throughput_pflops, timeline.iteration_s, plan.predicted.iteration_s, plan_s,
                  notes=plan.notes, plan=plan.to_json())


def _job(args: tuple[Point, bool]) -> dict[str, Any]:
    point, cache_enabled = args
    return run_point(point, cache_enabled).to_json(with_plan=True)


def run_points(points: Sequence[Point], *, cache: bool = True, workers: int | None = None,
               map_fn: Callable[[Callable, Iterable], Iterable] | None = None,
               progress: Callable[[int, int, Result], None] | None = None) -> list[Result]:
    """Results of `points` in order: cached ones first-hand, the rest planned in
    parallel (`map_fn`, else a pool of `workers` processes, else in this process)."""
    store = DiskCache(enabled=cache, namespace="points")
    results: list[Result | None] = [None] * len(points)
    todo = []
    for i, p in enumerate(points):
        hit = store.get(p.key(), read=Result.from_json)
        if hit is not None:
            results[i] = dataclasses.replace(hit, cached=True, label=p.label)
        else:
            todo.append(i)
    done = len(points) - len(todo)
    # Largest clusters first: they plan longest, so the pool ends with the short jobs
    # filling in rather than one long job running alone at the end.
    todo.sort(key=lambda i: -points[i].gpus)
    jobs = [(points[i], cache) for i in todo]
    # A pool of our own, if needed; an exception or Ctrl-C kills its workers at once.
    with (worker_pool(workers) if map_fn is None and workers and workers > 1 and len(jobs) > 1
          else contextlib.nullcontext()) as pool:
        for i, d in zip(todo, (map_fn or (pool.map if pool is not None else map))(_job, jobs)):
            store.put(points[i].key(), d)
            results[i] = Result.from_json(d)
            done += 1
            if progress is not None:
                progress(done, len(points), results[i])
    return [r for r in results if r is not None]

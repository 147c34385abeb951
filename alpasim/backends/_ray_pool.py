"""A map over Ray tasks, for filling the stage cost table on a Ray cluster.

Solvers take any map-like executor; this one sends each job to a Ray task and yields
results in order. Locally `ray.init()` starts a one-machine cluster; on a real cluster
pass its address. Every wait has a time-out, so a lost worker fails loudly instead of
hanging the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Generous: one job is a handful of ILP solves.
RAY_TASK_TIMEOUT_S = 600.0


def ray_map_fn(address: str | None = None, num_cpus: int | None = None) -> Callable[[Callable, Iterable], Iterator]:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, num_cpus=num_cpus, ignore_reinit_error=True, log_to_driver=False,
                 include_dashboard=False)

    def map_fn(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        remote = ray.remote(fn)
        refs = [remote.remote(item) for item in items]
        for ref in refs:
            yield ray.get(ref, timeout=RAY_TASK_TIMEOUT_S)

    return map_fn


def ray_shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

"""A map over Ray tasks, for filling the stage cost table on a Ray cluster.

Solvers take any map-like executor; this one sends each job to a Ray task and yields
results in order. Locally `ray.init()` starts a one-machine cluster; on a real cluster
pass its address. Every wait has a time-out, so a lost worker fails loudly instead of
hanging the planner.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from alpasim._gc import relax_gc

# Generous: one job is a handful of ILP solves.
RAY_TASK_TIMEOUT_S = 600.0


def resolve_address(address: str | None) -> str | None:
    """The Ray cluster to join: `address`, else RAY_ADDRESS, else None (start a local one)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def ray_map_fn(address: str | None = None, workers: int | None = None, *,
               num_cpus: int | None = None) -> Callable[[Callable, Iterable], Iterator]:
    """A map over Ray tasks. Without an address (and no RAY_ADDRESS) it starts a local
    cluster of `workers` CPUs; with one it connects to that cluster, whose resources
    are its own, and `workers` caps the tasks in flight instead (None: all at once).
    `num_cpus` is the older name of `workers`."""
    import ray

    workers = workers if workers is not None else num_cpus

    address = resolve_address(address)
    if not ray.is_initialized():
        if address:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    in_flight = workers if address else None

    def map_fn(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        remote = ray.remote(_with_relaxed_gc(fn))
        items = list(items)
        limit = len(items) if in_flight is None else max(1, in_flight)
        refs = [remote.remote(item) for item in items[:limit]]
        for i in range(len(items)):
            if i + limit < len(items):
                refs.append(remote.remote(items[i + limit]))
            yield ray.get(refs[i], timeout=RAY_TASK_TIMEOUT_S)
            refs[i] = None          # let Ray free the result

    return map_fn


def _with_relaxed_gc(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fn`, run in a Ray worker whose collector is set as the command's (`relax_gc`):
    a job is a handful of layer ILPs, as in the local pool's forked workers."""
    def job(item: Any) -> Any:
        relax_gc()
        return fn(item)

    return job


def ray_shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

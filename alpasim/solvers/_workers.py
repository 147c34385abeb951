"""Local worker processes that never outlive the planner that started them.

A plain `ProcessPoolExecutor` leaves its workers behind when its parent is killed
(SIGKILL or SIGTERM end the parent without running Python's cleanup): each finishes
its job, then waits forever on a queue nobody writes, holding its memory. And on
Ctrl-C the executor's shutdown waits for the running jobs (tens of seconds of ILPs).

`worker_pool(n)` is an executor whose workers
- ask the kernel to kill them when their parent dies (Linux `PR_SET_PDEATHSIG`), and
  watch their parent in a daemon thread as well, for other systems and for the case
  the kernel signal misses (a parent that re-parented them);
- ignore SIGINT: a Ctrl-C in a terminal goes to the whole process group, and only the
  parent should act on it (one message, not one traceback per worker);
and whose `close(now=True)` (what an interrupted planner calls) cancels the queued
jobs and kills the running workers instead of waiting for them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

PR_SET_PDEATHSIG = 1
# How often a worker looks at its parent when the kernel cannot be asked (seconds).
PARENT_POLL_S = 0.5


def _die_with(parent: int) -> None:
    """Worker initializer: exit when `parent` goes away; leave SIGINT to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:      # the parent died before the kernel was asked
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="alpasim-parent-watch", daemon=True).start()


class WorkerPool:
    """A process pool for the planner's map functions (module doc)."""

    def __init__(self, workers: int) -> None:
        # Every job formulates an ILP, which needs scipy.sparse (imported lazily, so a
        # refusal need not pay for it): imported here once, the forked workers inherit
        # it instead of importing it each (0.15 s of CPU a worker on the 2-core machine).
        import scipy.sparse  # noqa: F401

        self.workers = workers
        self._pool = ProcessPoolExecutor(workers, initializer=_die_with, initargs=(os.getpid(),))

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return self._pool.map(fn, items)

    def close(self, now: bool = False) -> None:
        """Wait for the workers to finish (`now=False`), or cancel what is queued and
        kill what runs (`now=True`: an interrupt, an error)."""
        if not now:
            self._pool.shutdown(wait=True)
            return
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=2.0)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(now=kind is not None)


def worker_pool(workers: int) -> WorkerPool:
    return WorkerPool(workers)

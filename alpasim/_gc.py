"""CPython's cyclic garbage collector, set for a process that plans or traces.

Planning and tracing allocate millions of small containers (strategy tuples, op and
tensor records, JAX's tracers and MLIR handles) and keep a large heap alive (the op
graph, the stage-cost tables, JAX's modules). At CPython's default thresholds (700,
10, 10) a full collection, which walks that whole heap, runs every few seconds: in the
test suite's two workers it took 31.6 CPU-s of 384 (26.4 s of it in 83 full
collections of about 0.3 s each), and `alpasim plan --model gpt3-2.6b --nodes 1` spent
5 % of its 17.6 s collecting. Young objects are still collected (a cycle is found
within 10,000 allocations instead of 700); full collections become 20 x 100 young ones
apart, and CPython still defers each until a quarter of the long-lived heap is new. In
the suite this left 8.7 CPU-s of collecting (2,669 young, 15 full) and cut its wall
time by 10 s of 267; the plan took 16.8 s.

(Those are CPython 3.11-3.13's generational rules. 3.14's collector is incremental:
there the first threshold still spaces the collections and the second sets how much of
the old heap each one scans.) Only entry points call `relax_gc` (the command, its
planning jobs on Ray, the test session): a library imported by someone else's program
leaves their collector alone. The Ray mesh actors keep the defaults: a released
stage's cycles, device buffers included, must go before the actor takes the next one.
"""

from __future__ import annotations

import gc

THRESHOLDS = (10_000, 20, 100)


def relax_gc() -> None:
    """Collect young objects every 10,000 allocations and the whole heap rarely."""
    gc.set_threshold(*THRESHOLDS)

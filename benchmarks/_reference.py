"""A reference unit for the benchmarks' timings: the wall time of a fixed pure-Python loop.

Machines differ several-fold in speed, and a shared machine's speed moves with its load,
so a figure alone ("planning took 40 s") cannot be compared with one taken on another
machine or another day. Each benchmark therefore times the loop
`sum(i*i for i in range(10**7))` in its own process, right before its timed figures
(and once more at the end when it runs long, so that a change of load during the run
shows), prints it with `print_reference`, and where that is easy gives its figures in
this unit too: figure / reference, written "ref". Two machines' figures in ref are
comparable to within how much the workload, unlike the loop, leans on NumPy, HiGHS or
XLA rather than on the interpreter.

Scripts run as `python benchmarks/x.py` import it as a sibling (`from _reference
import ...`); run as `python -m benchmarks.x` from the repository root they import
`benchmarks._reference`.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

LOOP = "sum(i*i for i in range(10**7))"
RUNS = 3


def reference_loop_s(runs: int = RUNS) -> float:
    """Seconds of `sum(i*i for i in range(10**7))` on this machine now: the best of
    `runs` runs, which damps a neighbour's burst of load."""
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        sum(i * i for i in range(10 ** 7))
        best = min(best, time.perf_counter() - t0)
    return best


def print_reference(when: str = "", file: TextIO | None = None) -> float:
    """Measure the reference loop, print one line such as
    `reference loop: 0.38 s (sum(i*i for i in range(10**7)), best of 3)` (with
    `when`, e.g. "at the end", after "reference loop"), and return its seconds."""
    seconds = reference_loop_s()
    label = f"reference loop {when}" if when else "reference loop"
    print(f"{label}: {seconds:.2f} s ({LOOP}, best of {RUNS})", file=file or sys.stdout, flush=True)
    return seconds


def in_ref(seconds: float, reference_s: float) -> str:
    """`seconds` in reference units (seconds / reference loop), three significant digits."""
    return f"{seconds / reference_s:.3g}"

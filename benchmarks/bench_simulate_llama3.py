"""Simulating the largest published layout: Llama 3 405B on 16,384 H100s (its paper's
Table 4, the row `alpasim validate` keeps as llama3-405b-16384-cp1), tp 8 x pp 16 x
dp 128, interleaved over 8 chunks a stage, 16 microbatches.

Plans the row as its system ran (about ten seconds, not timed), then times one
simulated iteration: the network folded into one of its identical lanes
(`simulator._lanes`, the default) and, with `--unfolded`, every one of the 1,024
copies of each tensor as a flow of its own (it did not finish in 30 minutes on the
2-core development machine; on `--row megatron-core-462b`, 384 lanes, both give the
same iteration time, 14 times apart). Prints the reference loop beside each figure
(`_reference`).

    .venv/bin/python benchmarks/bench_simulate_llama3.py [--unfolded] [--row llama3-405b-8192-cp1]
"""

from __future__ import annotations

import argparse
import time

from alpasim import experiments as ex
from alpasim import simulator as sim
from alpasim.experiments._validate import _plan
from alpasim.simulator import _engine

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_simulate_llama3` from the repository root
    from benchmarks._reference import in_ref, print_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama3-405b-16384-cp1", help="a published run's id")
    parser.add_argument("--unfolded", action="store_true", help="also simulate every lane (minutes)")
    args = parser.parse_args()
    run = next(r for r in ex.PUBLISHED_RUNS if r.id == args.row)
    plan = _plan(run, run.cluster, None)
    if not plan.feasible:
        raise SystemExit(f"{run.id} does not fit: {'; '.join(plan.notes)}")
    ref = print_reference()
    kinds = [("folded", None)] + ([("unfolded", lambda *a: None)] if args.unfolded else [])
    for name, fold in kinds:
        real = _engine.fold_lanes
        if fold is not None:
            _engine.fold_lanes = fold
        try:
            t0 = time.perf_counter()
            tl = sim.simulate(plan, plan.schedule, chunks=plan.chunks)
            wall = time.perf_counter() - t0
        finally:
            _engine.fold_lanes = real
        print(f"{run.id} {name}: {tl.iteration_s:.4f} s simulated ({run.measured_iteration_s:.2f} s measured), "
              f"{tl.lanes} lanes, {len(tl.events):,} events, in {wall:.2f} s = {in_ref(wall, ref)} ref")


if __name__ == "__main__":
    main()

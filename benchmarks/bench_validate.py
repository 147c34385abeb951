"""`alpasim validate` as a benchmark: every published run priced, the error per row, MAPE
overall and per hardware generation, and how long the whole table took to price (in
seconds and in reference units, `_reference`), with a cold stage cache.

    .venv/bin/python benchmarks/bench_validate.py [--rows korthikanti] [--spans]

`--spans` also prices each row at its unpublished settings (`validate --spans`) and
prints each row's span of predictions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from alpasim import experiments as ex
from alpasim import solvers as sv
from alpasim._gc import relax_gc

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_validate` from the repository root
    from benchmarks._reference import in_ref, print_reference


def main() -> None:
    relax_gc()      # as `alpasim validate` runs (`alpasim._gc`): an entry point sets the collector
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only the rows whose id contains this text")
    parser.add_argument("--spans", action="store_true", help="also the span over each row's unpublished settings")
    args = parser.parse_args()
    runs = [r for r in ex.PUBLISHED_RUNS if args.rows in r.id]
    ref = print_reference()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cold:
        report = ex.validate(runs, sv.DiskCache(root=Path(cold)), spans=args.spans)
    wall = time.perf_counter() - t0
    print(f"{'row':34s} {'GPUs':>6s} {'measured s':>11s} {'predicted s':>12s}  error")
    for r in report["rows"]:
        predicted = f"{r['predicted_s']:12.2f}" if r["status"] == "priced" else f"{'-':>12s}"
        spanned = f"  span {ex.validation_span_cell(r)}" if args.spans else ""
        print(f"{r['id']:34s} {r['gpus']:6d} {r['measured_s']:11.2f} {predicted}  "
              f"{ex.validation_verdict(r)[:130]}{spanned}")
    for line in ex.validation_summary(report):
        print(line)
    print(f"priced in {wall:.1f} s = {in_ref(wall, ref)} ref (cold stage cache)")
    print_reference("at the end")


if __name__ == "__main__":
    main()

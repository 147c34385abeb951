"""`alpasim validate` as a benchmark: every published run priced, the error per row, MAPE
overall and per hardware generation, and how long the whole table took to price (in
seconds and in reference units, `_reference`), with a cold stage cache.

    .venv/bin/python benchmarks/bench_validate.py [--rows korthikanti]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from alpasim import experiments as ex
from alpasim import solvers as sv

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_validate` from the repository root
    from benchmarks._reference import in_ref, print_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only the rows whose id contains this text")
    args = parser.parse_args()
    runs = [r for r in ex.PUBLISHED_RUNS if args.rows in r.id]
    ref = print_reference()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cold:
        report = ex.validate(runs, sv.DiskCache(root=Path(cold)))
    wall = time.perf_counter() - t0
    print(f"{'row':34s} {'GPUs':>6s} {'measured s':>11s} {'predicted s':>12s} {'error':>8s}")
    for r in report["rows"]:
        if r["expressible"]:
            print(f"{r['id']:34s} {r['gpus']:6d} {r['measured_s']:11.2f} {r['predicted_s']:12.2f} "
                  f"{100 * r['error']:+7.1f}%")
        else:
            why = "predicted out of memory (it ran)" if r["status"] == "out of memory" else r["reason"][:90]
            print(f"{r['id']:34s} {r['gpus']:6d} {r['measured_s']:11.2f} {'-':>12s}  {why}")
    for gen, g in report["by_generation"].items():
        value = "-" if g["mape_percent"] is None else f"{g['mape_percent']:.1f} %"
        print(f"{gen}: MAPE {value} over {g['rows']} of {g['of']} rows; {g['out_of_memory']} predicted out of memory")
    value = "-" if report["mape_percent"] is None else f"{report['mape_percent']:.1f} %"
    print(f"all: MAPE {value} over {report['priced_rows']} of {report['rows_total']} rows; "
          f"{report['out_of_memory_rows']} predicted out of memory, though every row ran")
    print(f"priced in {wall:.1f} s = {in_ref(wall, ref)} ref (cold stage cache)")
    print_reference("at the end")


if __name__ == "__main__":
    main()

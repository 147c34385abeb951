"""Cold planning time of the issue's six configurations, and whether the plans moved.

For each configuration it plans from scratch (no disk cache unless --cache) on
aws-p3.16xlarge, with a process pool of its own (--workers, default one per CPU), and
prints the planning wall time, the CPU time of this process and its workers together,
the ILP solves and cache hits, the chosen microbatches and stages, and the predicted
iteration time. With a baseline file (default `benchmarks/plan_time_baseline.json`,
written by `--record` from an earlier commit) it also prints the baseline's predicted
iteration time and the change: a faster planner must not find worse plans. Alpa
reports 2,393 s for GPT-3 39B on 64 GPUs (its Table 5).

The reference loop (`_reference`) is timed before the first case and again after the
last; the last two columns give the wall and CPU times in reference units (seconds /
the first reference loop's), and `--record` writes the first as `reference_loop_s`
beside the cases' iteration times.

    .venv/bin/python benchmarks/plan_time.py [--cases gpt3-2.6b@8 ...] [--workers N]
        [--cache] [--record FILE] [--baseline FILE] [--profile]

`--profile` plans each case in this process under cProfile instead and prints where
its time goes (problem build, strategy enumeration, formulation, HiGHS, ...), in
seconds, shares and reference units.

The imported case is `tests/graphs/jax_models.flax_gpt_problem` with 32 layers of
hidden 1024 (GPT-3 350M's width), traced by `graphs.from_jax`; the trace is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "graphs"))

from alpasim.costmodels import get_cluster  # noqa: E402
from alpasim.solvers import DiskCache, PlanInfeasible, RunOptions, plan_pipeline  # noqa: E402

try:
    from _reference import in_ref, print_reference  # noqa: E402
except ModuleNotFoundError:  # run as `python -m benchmarks.plan_time` from the repository root
    from benchmarks._reference import in_ref, print_reference  # noqa: E402

CASES = ("gpt3-2.6b@8", "gpt3-6.7b@16", "gpt3-39b@64", "moe-10b@16", "wresnet-6.8b@32", "imported-gpt-32l@8")
BASELINE = HERE / "plan_time_baseline.json"


def model_source(name: str):
    if name != "imported-gpt-32l":
        return name
    from jax_models import flax_gpt_problem

    from alpasim.graphs import from_jax, model_source as source_of

    fn, params, batch = flax_gpt_problem(hidden=1024, layers=32, heads=16, seq=512, vocab=8192, batch_size=32,
                                         dtype="float16")
    return source_of(from_jax(fn, params, batch, name=name))


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# Where planning time goes: (label, function, module file) measured cumulatively.
PHASES = (("layer jobs (all)", "_options_job", "_stage_costs.py"),
          ("  problem build", "build_problem", "_intra_problem.py"),
          ("    strategy enumeration", "enumerate_strategies", "_strategies.py"),
          ("  ILP formulation", "formulate", "_intra_ilp.py"),
          ("  HiGHS runs", "_run_highs", "_intra_ilp.py"),
          ("  plan realisation", "realize", "_intra_plan.py"),
          ("training graphs", "build_training_graph", "_build.py"),
          ("stage DP", "stage_dp", "_stage_dp.py"),
          ("plan assembly", "assemble_plan", "_plan_assembly.py"))


def profile_case(case: str, ref_s: float) -> None:
    """One case planned serially in this process under cProfile; prints each phase's
    cumulative seconds, share of the whole and seconds / `ref_s` (reference units)."""
    import cProfile
    import pstats

    name, _, gpus_text = case.partition("@")
    gpus = int(gpus_text)
    cluster = get_cluster("aws-p3.16xlarge", nodes=max(1, gpus // 8), devices_per_node=min(gpus, 8))
    source = model_source(name)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    plan_pipeline(source, cluster, run=RunOptions(cache=DiskCache(enabled=False)))
    profiler.disable()
    total = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats
    print(f"{case}: {total:.1f} s in one process (profiled; load average {os.getloadavg()[0]:.2f}); "
          f"{in_ref(total, ref_s)} ref")
    for label, fn, file in PHASES:
        cum = sum(v[3] for (f, _, func), v in stats.items() if func == fn and f.endswith(file))
        print(f"  {label:<28}{cum:>8.1f} s {cum / total * 100:>5.0f} % {in_ref(cum, ref_s):>8} ref", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="MODEL@GPUS, e.g. gpt3-39b@64")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cache", action="store_true", help="use the disk cache (warm figures)")
    ap.add_argument("--record", type=Path, help="write the predicted iteration times here (a new baseline)")
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    ap.add_argument("--profile", action="store_true",
                    help="plan the cases in this process under cProfile and print where the time goes")
    args = ap.parse_args()
    if args.profile:
        ref_s = print_reference()
        for case in args.cases:
            profile_case(case, ref_s)
        print_reference("at the end")
        return
    before = json.loads(args.baseline.read_text()) if args.baseline.is_file() and not args.record else {}
    ref_s = print_reference()
    print(f"load average {os.getloadavg()[0]:.2f} at start; {args.workers} workers")
    print(f"{'case':<20}{'wall s':>8}{'CPU s':>8}{'ILPs':>6}{'hits':>6}{'B':>5}{'stages':>7}"
          f"{'iteration ms':>14}{'before ms':>11}{'change':>9}{'wall ref':>10}{'CPU ref':>9}")
    recorded = {}
    for case in args.cases:
        name, _, gpus_text = case.partition("@")
        gpus = int(gpus_text)
        cluster = get_cluster("aws-p3.16xlarge", nodes=max(1, gpus // 8), devices_per_node=min(gpus, 8))
        source = model_source(name)
        c0, t0 = cpu_s(), time.perf_counter()
        try:
            with ProcessPoolExecutor(args.workers) as pool:
                plan = plan_pipeline(source, cluster,
                                     run=RunOptions(cache=DiskCache(enabled=args.cache),
                                                    map_fn=lambda f, items: pool.map(f, items)))
        except PlanInfeasible as e:
            print(f"{case:<20}{time.perf_counter() - t0:>8.1f}  infeasible: {e}", flush=True)
            continue
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        s, it = plan.search, plan.predicted.iteration_s
        recorded[case] = it
        old = before.get(case)
        change = f"{(it / old - 1) * 100:+8.2f}%" if old else f"{'':>9}"
        print(f"{case:<20}{wall:>8.1f}{cpu:>8.1f}{s.ilp_solves:>6}{s.cache_hits:>6}{plan.microbatches:>5}"
              f"{len(plan.stages):>7}{it * 1e3:>14.2f}{old * 1e3 if old else float('nan'):>11.2f}{change}"
              f"{in_ref(wall, ref_s):>10}{in_ref(cpu, ref_s):>9}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print_reference("at the end")
    if args.record:
        args.record.write_text(json.dumps({**recorded, "reference_loop_s": round(ref_s, 3)}, indent=2) + "\n")
        print(f"wrote {args.record}")


if __name__ == "__main__":
    main()

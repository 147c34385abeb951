"""Planning time for the paper's weak-scaling points (Table 4 models on 1..64 GPUs).

For each (model, GPUs) of Figure 7 on aws-p3.16xlarge it plans from scratch (no disk
cache unless --cache) and prints planning seconds, intra-op jobs (each a few ILP
solves), cache hits, the chosen number of microbatches and stages, and the predicted
throughput. Alpa reports 2,393 s for GPT-3 39B on 64 GPUs (its Table 5).

    .venv/bin/python benchmarks/plan_time.py [--family gpt3|moe|wresnet|all] [--max-gpus N]
        [--microbatches auto|B] [--cache] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

from alpasim.costmodels import get_cluster
from alpasim.graphs import PAPER_GPUS
from alpasim.solvers import DiskCache, PlanInfeasible, plan_pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gpt3")
    ap.add_argument("--max-gpus", type=int, default=64)
    ap.add_argument("--microbatches", default="auto")
    ap.add_argument("--cache", action="store_true")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--models", nargs="*")
    args = ap.parse_args()
    names = args.models or [n for n, g in PAPER_GPUS.items()
                            if (args.family == "all" or n.startswith(args.family)) and g <= args.max_gpus]
    mb = args.microbatches if args.microbatches == "auto" else int(args.microbatches)
    print(f"{'model':<14}{'GPUs':>5}{'plan s':>9}{'jobs':>6}{'hits':>6}{'B':>6}{'stages':>7}{'PFLOP/s':>9}"
          f"{'TFLOP/s/GPU':>12}")
    with ProcessPoolExecutor(args.workers) as pool:
        for name in names:
            gpus = PAPER_GPUS[name]
            nodes, per_node = max(1, gpus // 8), min(gpus, 8)
            cluster = get_cluster("aws-p3.16xlarge", nodes=nodes, devices_per_node=per_node)
            t0 = time.perf_counter()
            try:
                plan = plan_pipeline(name, cluster, microbatches=mb, cache=DiskCache(enabled=args.cache),
                                     map_fn=lambda f, items: pool.map(f, items))
            except PlanInfeasible as e:
                print(f"{name:<14}{gpus:>5}{time.perf_counter() - t0:>9.1f}  infeasible: {e}")
                continue
            s, p = plan.search, plan.predicted
            print(f"{name:<14}{gpus:>5}{s.seconds:>9.1f}{s.ilp_solves:>6}{s.cache_hits:>6}"
                  f"{plan.microbatches:>6}{len(plan.stages):>7}{p.throughput_pflops:>9.3f}"
                  f"{p.tflops_per_device:>12.1f}", flush=True)


if __name__ == "__main__":
    main()

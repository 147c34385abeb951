"""Time and memory to build training graphs of the largest zoo models.

Prints, per model: forward-graph time, training-graph time (autodiff + Adam), with
full remat, and with re-clustering into L layers (eq. 6 DP), the liveness memory
estimate of the training graph (`costmodels.training_memory`), the op count, and the
process's peak resident memory (ru_maxrss, which only grows, so it bounds every build
above it). Acceptance for gpt3-39b: under 20 s and under 2 GiB.

    .venv/bin/python benchmarks/bench_graph_build.py [MODEL ...]
"""

from __future__ import annotations

import resource
import sys
import time

from alpasim.costmodels import training_memory
from alpasim.graphs import build_training_graph, forward_graph


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def main(models: list[str]) -> None:
    print(f"{'model':<14}{'forward s':>10}{'train s':>9}{'remat s':>9}{'L=16 s':>8}{'memory s':>9}{'ops':>8}"
          f"{'peak RSS':>10}")
    for name in models:
        t0 = time.perf_counter()
        fwd = forward_graph(name)
        t1 = time.perf_counter()
        g = build_training_graph(fwd).graph
        t2 = time.perf_counter()
        build_training_graph(fwd, remat=True)
        t3 = time.perf_counter()
        build_training_graph(fwd, layers=16)
        t4 = time.perf_counter()
        training_memory(g)
        t5 = time.perf_counter()
        print(f"{name:<14}{t1 - t0:>10.3f}{t2 - t1:>9.3f}{t3 - t2:>9.3f}{t4 - t3:>8.2f}{t5 - t4:>9.3f}{len(g.ops):>8}"
              f"{peak_rss_gib():>8.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt3-39b", "moe-70b", "wresnet-13b"])

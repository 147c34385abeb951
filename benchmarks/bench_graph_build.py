"""Time and memory to build training graphs of the largest zoo models.

Prints, per model: forward-graph time, training-graph time (autodiff + Adam), with
full remat, and with re-clustering into L layers (eq. 6 DP), the liveness memory
estimate of the training graph (`costmodels.training_memory`), the op count, and the
process's peak resident memory (ru_maxrss, which only grows, so it bounds every build
above it). Acceptance for gpt3-39b: under 20 s and under 2 GiB.
The reference loop (`_reference`) is timed before the builds and again after them; a
second table gives each time in reference units (seconds / the first reference loop's).

    .venv/bin/python benchmarks/bench_graph_build.py [MODEL ...]
"""

from __future__ import annotations

import resource
import sys
import time

from alpasim.costmodels import training_memory
from alpasim.graphs import build_training_graph, forward_graph

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_graph_build` from the repository root
    from benchmarks._reference import in_ref, print_reference


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def main(models: list[str]) -> None:
    ref_s = print_reference()
    print(f"{'model':<14}{'forward s':>10}{'train s':>9}{'remat s':>9}{'L=16 s':>8}{'memory s':>9}{'ops':>8}"
          f"{'peak RSS':>10}")
    times = {}
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
        times[name] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
        print(f"{name:<14}{t1 - t0:>10.3f}{t2 - t1:>9.3f}{t3 - t2:>9.3f}{t4 - t3:>8.2f}{t5 - t4:>9.3f}{len(g.ops):>8}"
              f"{peak_rss_gib():>8.2f} GiB", flush=True)
    print_reference("at the end")
    print("in reference units (seconds / the first reference loop):")
    print(f"{'model':<14}{'forward':>10}{'train':>9}{'remat':>9}{'L=16':>8}{'memory':>9}")
    for name, (fwd_s, train_s, remat_s, layers_s, memory_s) in times.items():
        print(f"{name:<14}{in_ref(fwd_s, ref_s):>10}{in_ref(train_s, ref_s):>9}{in_ref(remat_s, ref_s):>9}"
              f"{in_ref(layers_s, ref_s):>8}{in_ref(memory_s, ref_s):>9}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt3-39b", "moe-70b", "wresnet-13b"])

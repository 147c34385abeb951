"""Time to build cross-mesh resharding plans, and what they move (seed 3.4.10).

A (16, 2048, 4096) fp16 activation (256 MiB) goes from a 2x4 mesh on node 0 to a 4x2
mesh on node 1 of two aws-p3.16xlarge nodes, for a few spec pairs. Prints, per pair
and method: plan-build time (best of several runs), the number of copies and gathers,
the bytes between nodes, the plan's `time_s` estimate and the build time in reference
units (build time / the reference loop's, `_reference`, timed first and printed above
the table).

    .venv/bin/python benchmarks/bench_cross_mesh.py
"""

from __future__ import annotations

import time

from alpasim.costmodels import get_cluster
from alpasim.solvers import cross_mesh_plan

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_cross_mesh` from the repository root
    from benchmarks._reference import in_ref, print_reference

SHAPE, ITEMSIZE = (16, 2048, 4096), 2
SPEC_PAIRS = [("S0RS1", "S0RS1"), ("S0RS1", "S0RR"), ("RRS01", "RRR")]
REPEATS = 20


def main() -> None:
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    src_devices, dst_devices = list(range(8)), list(range(8, 16))
    ref_s = print_reference()
    print(f"tensor {SHAPE} fp16 = {ITEMSIZE * 16 * 2048 * 4096 / 2**20:.0f} MiB, 2x4 (node 0) -> 4x2 (node 1)")
    print(f"{'src -> dst':<16}{'method':<18}{'build ms':>9}{'copies':>8}{'gathers':>8}{'MiB between nodes':>19}"
          f"{'time_s':>9}{'build ref':>11}")
    for src_spec, dst_spec in SPEC_PAIRS:
        for method in ("send_recv", "local_all_gather"):
            best = float("inf")
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                plan = cross_mesh_plan(SHAPE, ITEMSIZE, src_devices, (2, 4), src_spec, dst_devices, (4, 2), dst_spec,
                                       method=method, node_of=cluster.node_of)
                best = min(best, time.perf_counter() - t0)
            between = plan.bytes_between_nodes(cluster.node_of) / 2**20
            print(f"{src_spec + ' -> ' + dst_spec:<16}{method:<18}{best * 1e3:>9.3f}{len(plan.transfers):>8}"
                  f"{len(plan.gathers):>8}{between:>19.0f}{plan.time_s(cluster):>9.3f}"
                  f"{in_ref(best, ref_s):>11}")


if __name__ == "__main__":
    main()

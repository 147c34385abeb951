"""Per-pass time of the stage-mesh DP (one fixed bottleneck) against a straightforward
reference, on a 32-layer table for 64 devices (8 nodes of 8).

The table is synthetic but shaped like a real one: a stage's time grows with its layers
and falls with its devices (with a parallel-efficiency loss), the entries of stages too
large for their devices' memory are infinite, and a boundary between stages on two
nodes costs ten times one inside a node. `--bottleneck` picks where in the sorted candidates the pass's t_max
sits (0.5: the median candidate). The reference is the recurrence of `_stage_dp` as
nested Python loops over (s, k, shape, i, d, run state), with no vectorisation and no
pruning; it checks the new DP's sum on every run.

The reference loop of `_reference` (a fixed pure-Python loop, not the reference pass
above) is timed before the passes and again at the end; a second table gives the DP's
fastest pass and the reference pass in its units (seconds / the first loop's).

    .venv/bin/python benchmarks/bench_stage_dp.py [--layers 32] [--nodes 8] [--repeat 20]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

from alpasim.solvers._stage_dp import StageBoundary, _bottleneck_candidates, _solve_fixed
from alpasim.solvers._submesh import submesh_shapes

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_stage_dp` from the repository root
    from benchmarks._reference import in_ref, print_reference

INF = math.inf


def synthetic_table(layers: int, nodes: int, per_node: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = np.array([s.size for s in submesh_shapes(nodes, per_node)])
    s_max = min(16, layers)
    per_layer = rng.uniform(0.8, 1.2, layers)
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    cost = np.full((layers, layers, len(sizes), s_max), INF)
    memory_limit = 6.0                                   # layers one device can hold
    for k in range(layers):
        for i in range(k, layers):
            work = prefix[i + 1] - prefix[k]
            for h, size in enumerate(sizes):
                if (i - k + 1) > memory_limit * size:
                    continue
                for s in range(s_max):
                    # deeper pipelines keep more microbatches in flight: less room
                    if (i - k + 1) * (1 + 0.05 * s) > memory_limit * size:
                        continue
                    cost[k, i, h, s] = work / size ** 0.9
    intra, inter = np.full(layers, 0.002), np.full(layers, 0.02)
    intra[0] = inter[0] = 0.0
    return cost, sizes, StageBoundary(intra, inter)


def reference_pass(cost, sizes, num_devices, s_max, t_max, boundary, per_node):
    """F(s, k, d, q) by nested loops: the least sum of layers k.. in s stages on exactly d
    devices, every stage and boundary at most t_max, where q is the size of the node
    group (run) the stage at k opens (per_node: a whole node or more, which nothing
    joins). Returns min_s min_q F(s, 0, D, q)."""
    layers = cost.shape[0]
    full = per_node
    intra = [b if b <= t_max else INF for b in boundary.intra] + [0.0]
    inter = [b if b <= t_max else INF for b in boundary.inter] + [0.0]
    prev = [[[INF] * (full + 1) for _ in range(num_devices + 1)] for _ in range(layers + 1)]
    prev[layers][0][full] = 0.0
    best = INF
    for s in range(1, s_max + 1):
        cur = [[[INF] * (full + 1) for _ in range(num_devices + 1)] for _ in range(layers + 1)]
        for k in range(layers):
            for h, size in enumerate(sizes):
                size = int(size)
                own = min(size, full)
                for i in range(k, layers):
                    c = cost[k, i, h, s - 1]
                    if c > t_max:
                        continue
                    for d in range(size, num_devices + 1):
                        rests = prev[i + 1][d - size]
                        row = cur[k][d]
                        for q in range(1, full + 1):
                            rest = rests[q]
                            if rest == INF:
                                continue
                            v = c + inter[i + 1] + rest            # the successor on another node
                            if v < row[own]:
                                row[own] = v
                            if size < full and i + 1 < layers and q + size <= full:
                                v = c + intra[i + 1] + rest        # ... or on this stage's node
                                if v < row[q + size]:
                                    row[q + size] = v
        best = min(best, min(cur[0][num_devices][1:]))
        prev = cur
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--bottleneck", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    args = ap.parse_args()
    cost, sizes, boundary = synthetic_table(args.layers, args.nodes, args.per_node)
    num_devices = args.nodes * args.per_node
    s_max = cost.shape[3]
    candidates = _bottleneck_candidates(cost, boundary)
    loop_s = print_reference()
    in_units = []
    print(f"{args.layers} layers, {num_devices} devices ({args.nodes} x {args.per_node}), {len(sizes)} submesh "
          f"sizes, up to {s_max} stages, {np.isfinite(cost).mean() * 100:.0f} % of entries finite; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'t_max at':>9}{'DP pass ms (min/median)':>26}{'reference ms':>14}{'speed-up':>10}  sums agree")
    for q in args.bottleneck:
        t_max = float(candidates[int(q * (len(candidates) - 1))])
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            total, _, _ = _solve_fixed(cost, sizes, num_devices, s_max, t_max, boundary, args.per_node)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = reference_pass(cost, sizes, num_devices, s_max, t_max, boundary, args.per_node)
        ref_s = time.perf_counter() - t0
        agree = (math.isinf(ref) and math.isinf(total)) or abs(ref - total) <= 1e-9 * max(1.0, abs(ref))
        print(f"{q:>9.2f}{min(times) * 1e3:>13.2f} / {np.median(times) * 1e3:<10.2f}{ref_s * 1e3:>14.0f}"
              f"{ref_s / min(times):>9.0f}x  {agree}", flush=True)
        in_units.append(f"{q:>9.2f}{in_ref(min(times), loop_s):>12}{in_ref(ref_s, loop_s):>16}")
    print_reference("at the end")
    print("in reference-loop units (seconds / the first reference loop):")
    print(f"{'t_max at':>9}{'DP pass min':>12}{'reference pass':>16}")
    print("\n".join(in_units))


if __name__ == "__main__":
    main()

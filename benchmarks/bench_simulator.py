"""Simulator speed: a synthetic 16-stage plan over 2 nodes of 8 GPUs, 512 microbatches.

Each stage is one V100 of aws-p3.16xlarge; adjacent stages pass a (4, 1024, 2560) fp16
hidden state forward and its cotangent backward, so the boundary 7 -> 8 crosses the
25 Gb/s network and the rest NVLink. Prints the wall time of one simulated iteration
per schedule (building the program included) and how many timeline events per second
the engine produced (target for 1F1B: under 5 s). With free communication 1F1B takes
exactly eq. 2; with the real links it is slower, because the 25 Gb/s hop adds to the
critical path of every 1F1B round trip that crosses it (GPipe and interleaved 1F1B keep
more microbatches in flight and hide it). Each wall time is also given in reference
units (seconds / the reference loop's, `_reference`, timed before the first schedule;
the whole script takes seconds, so once is enough).
"""

from __future__ import annotations

import time

from alpasim.costmodels import get_cluster
from alpasim.simulator import Run, build_program, simulate, synthetic_plan

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_simulator` from the repository root
    from benchmarks._reference import in_ref, print_reference

STAGES, MICROBATCHES = 16, 512


def main() -> None:
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    plan = synthetic_plan([0.010] * STAGES, [0.020] * STAGES, MICROBATCHES, cluster=cluster,
                          params_bytes=4e9, activation_bytes=50e6, sync_s=0.05, hidden_shape=(4, 1024, 2560),
                          specs=("RRR", "RRR"))
    ref_s = print_reference()
    print(f"{STAGES} stages on 2 x 8 GPUs, {MICROBATCHES} microbatches, eq. 2: "
          f"{plan.predicted.iteration_s:.3f} s")
    for schedule, free in (("1f1b", False), ("1f1b", True), ("gpipe", False), ("interleaved", False)):
        t0 = time.perf_counter()
        tl = simulate(plan, schedule, chunks=2, free_communication=free)  # program + routes + engine
        wall = time.perf_counter() - t0
        program = build_program(plan, schedule, chunks=2)
        label = schedule + (" (free comm)" if free else "")
        print(f"{label:20s} wall {wall:5.2f} s  simulated iteration {tl.iteration_s:7.3f} s  "
              f"bubble {tl.bubble_fraction:6.2%}  {program.count(Run)} runs, "
              f"{sum(map(len, program.meshes))} instructions, {len(tl.events)} events "
              f"({len(tl.events) / wall:,.0f} events/s); wall {in_ref(wall, ref_s)} ref", flush=True)

if __name__ == "__main__":
    main()

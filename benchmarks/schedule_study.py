"""Bubble and memory against microbatch count, for every schedule the simulator runs.

    .venv/bin/python benchmarks/schedule_study.py [--stages 4,8] [--microbatches 4,8,16,32,64]
        [--model gpt3:hidden=256,layers=8,heads=4,seq=128,vocab=512] [--gpus 8]

Part 1 is the setting of the schedules' closed forms: S balanced stages, forward,
input-gradient and weight-gradient passes of one unit each (f = b = w = 1, so 1F1B's
backward is 2), free communication, each microbatch stashing 1 unit of activations of
which its weight gradients keep 0.5 after B. For each (S, B) it prints every
schedule's bubble (1 - busy / (S x iteration)) and the first and last stage's peak
activations in stashes (a running microbatch counts 1). Part 2 plans `--model` once
per B on `--gpus` devices of aws-p3.16xlarge, one stage per device, and prints the
same for the planner's own pass times, memory and communication (there the
interleaved column imagines each stage as 2 chunks). Part 3 plans `--model` per B
twice with the full search (any submeshes): the DP's 1F1B plan and the planner's own
interleaved plan (`--schedule interleaved`, the model cut into S x v chunks), and
prints each one's simulated iteration and peak memory per device.

Every figure is simulated, so none moves with the machine; the script still times the
reference loop (`_reference`) once, before Part 1, and prints it under the load average
like every benchmark, which says how fast the machine that ran the study was.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from alpasim.costmodels import get_cluster
from alpasim.simulator import simulate, synthetic_plan
from alpasim.solvers import DiskCache, PlanOptions, RunOptions, SearchSpace, plan_pipeline

try:
    from _reference import print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.schedule_study` from the repository root
    from benchmarks._reference import print_reference

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")


def balanced(stages: int, microbatches: int):
    plan = synthetic_plan([1.0] * stages, [2.0] * stages, microbatches, activation_bytes=1.0)
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, stash_bytes=1.0, backward_weight_s=1.0, weight_stash_bytes=0.5)
        for s in plan.stages))


def row(plan, free: bool) -> list[str]:
    cells = []
    for name in SCHEDULES:
        tl = simulate(plan, name, free_communication=free)
        peaks = tl.peak_mesh_memory_bytes()
        base = [s.params_bytes for s in plan.stages]
        first, last = peaks[0] - base[0], peaks[-1] - base[-1]
        unit = plan.stages[0].activation_bytes or 1.0
        cells.append(f"{tl.bubble_fraction:.1%} / {first / unit:.3g}, {last / unit:.3g}")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--microbatches", default="4,8,16,32,64")
    ap.add_argument("--model", default="gpt3:hidden=256,layers=8,heads=4,seq=128,vocab=512")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    bs = [int(b) for b in args.microbatches.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}")
    print_reference()
    head = "| S | B | " + " | ".join(SCHEDULES) + " |\n|---:|---:|" + "---|" * len(SCHEDULES)
    print("\nPart 1: balanced stages, f = b = w = 1, free communication. "
          "Cells: bubble / peak activations of the first, last stage (stashes)\n")
    print(head)
    for s in (int(x) for x in args.stages.split(",")):
        for b in bs:
            print(f"| {s} | {b} | " + " | ".join(row(balanced(s, b), True)) + " |")
    if not args.model:
        return
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=args.gpus)
    print(f"\nPart 2: {args.model} planned on {args.gpus} devices, one stage each, no recomputation. "
          "Cells: bubble / peak activations of the first, last stage (in units of one microbatch's peak)\n")
    print(head)
    for b in bs:
        plan = plan_pipeline(f"{args.model},batch={8 * max(bs)}", cluster,
                             SearchSpace(microbatches=b, shape_ok=lambda sh: sh.size == 1,
                                         views_of=lambda sh: [(1, 1)]),
                             PlanOptions(remat=False), RunOptions(cache=DiskCache(enabled=False)))
        print(f"| {len(plan.stages)} | {b} | " + " | ".join(row(plan, False)) + " |")
    print(f"\nPart 3: {args.model} on {args.gpus} devices, the planner's 1F1B plan against its interleaved plan "
          "(simulated iteration, peak memory per device)\n")
    print("| B | 1F1B plan | interleaved plan | interleaved / 1F1B |\n|---:|---|---|---:|")
    for b in bs:
        cells, times = [], []
        for schedule in ("1f1b", "interleaved"):
            plan = plan_pipeline(f"{args.model},batch={8 * max(bs)}", cluster, SearchSpace(microbatches=b),
                                 PlanOptions(remat=False, schedule=schedule))
            tl = simulate(plan)
            times.append(tl.iteration_s)
            cells.append(f"{plan.num_meshes} meshes x {plan.chunks}: {tl.iteration_s * 1e3:.2f} ms, "
                         f"{max(tl.peak_mesh_memory_bytes()) / 2 ** 20:.1f} MiB")
        print(f"| {b} | {cells[0]} | {cells[1]} | {times[1] / times[0]:.3f} |")


if __name__ == "__main__":
    main()

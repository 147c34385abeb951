"""Llama-3 70B on 64 to 1,024 H100s: Alpa's plan against the best Megatron-core grid
point, and what each of Megatron-core's options contributes (docs/llama3-70b-h100.md).

Every plan is priced by the analytic model on `dgx-h100` nodes (8 H100 80GB on
NVLink4, 8 x 400 Gb/s NICs) and simulated (1F1B). Per scale:

* `alpa`: the planner, searching full, selective and no recomputation (`--recompute auto`;
  `--alpa-recompute selective` plans that one only, a third of the time);
* `megatron-core`: the grid of tp x pp x dp x microbatch, each point also searching
  sequence parallelism, the distributed optimizer and the recomputation;
* `megatron-lm 2021`: the paper's grid (none of those, full recomputation, gradients
  all-reduced after the backward);

and, at the scales in --ablate, the chosen Megatron-core configuration with one option
taken away at a time (what is left still searched), and both with no overlap.

    .venv/bin/python benchmarks/llama70b_h100.py [--gpus 64,128,256,512,1024] [--ablate 64,512]
        [--out out/llama70b.json]

Stage costs are cached on disk, so a rerun of a scale takes seconds.

The reference loop (`_reference`) is timed before the first plan and again after the
last; every row (the JSON lines printed and the `--out` file) carries the first in
`reference_loop_s`, so its `plan_s` can be read in reference units (plan_s /
reference_loop_s) and compared across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from alpasim.costmodels import get_cluster
from alpasim.graphs import forward_graph, resolve_model
from alpasim.simulator import simulate
from alpasim.solvers import RECOMPUTE_SEARCH, MegatronConfig, plan_model

try:
    from _reference import print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.llama70b_h100` from the repository root
    from benchmarks._reference import print_reference

MODEL = "llama3-70b"


def row(label: str, plan, t0: float) -> dict:
    out = {"label": label, "plan_s": round(time.perf_counter() - t0, 1), "feasible": plan.feasible}
    if not plan.feasible:
        return {**out, "notes": list(plan.notes)}
    sim = simulate(plan)
    flops = plan.model.flops_per_iteration
    stages = [f"{s.layers[0]}-{s.layers[1]}@{s.logical_mesh[0]}x{s.logical_mesh[1]}" for s in plan.stages]
    return {**out, "iteration_s": sim.iteration_s, "predicted_s": plan.predicted.iteration_s,
            "pflops": flops / sim.iteration_s / 1e15,
            "tflops_per_gpu": flops / sim.iteration_s / plan.num_devices / 1e12,
            "peak_gib": plan.predicted.peak_memory_bytes / 2 ** 30, "microbatches": plan.microbatches,
            "recompute": "full" if plan.model.remat else plan.model.recompute,
            "megatron": plan.search.megatron, "stages": stages}


def scale(gpus: int, ablate: bool, alpa_recompute: str = "auto", reference_loop_s: float | None = None) -> list[dict]:
    cluster = get_cluster("dgx-h100", nodes=gpus // 8)
    rows = []

    def add(label, **kw):
        t0 = time.perf_counter()
        plan = plan_model(MODEL, cluster, **kw)
        rows.append({"gpus": gpus, **row(label, plan, t0), "reference_loop_s": reference_loop_s})
        print(json.dumps(rows[-1]), flush=True)
        return plan

    ladder = {label: {"remat": remat, "recompute": policy} for label, remat, policy in RECOMPUTE_SEARCH}
    add("alpa", method="alpa", **ladder.get(alpa_recompute, {"recompute": "auto"}))
    core = add("megatron-core", method="megatron_core")
    add("megatron-lm 2021", method="megatron", remat=True, bucket_bytes=None)
    if ablate:
        add("alpa, no overlap", method="alpa", recompute="auto", bucket_bytes=None)
        if core.feasible:
            chosen = MegatronConfig(**core.search.megatron)
            degrees = MegatronConfig(chosen.tp, chosen.pp, chosen.dp, chosen.microbatch_size)
            add("megatron-core at its point", method="megatron_core", megatron=degrees)
            add("  - sequence parallelism", method="megatron_core", megatron=degrees, sequence_parallel=False)
            add("  - distributed optimizer", method="megatron_core", megatron=degrees, distributed_optimizer=False)
            add("  - overlap", method="megatron_core", megatron=degrees, bucket_bytes=None)
            for remat, policy, label in ((False, "none", "none"), (True, "none", "full")):
                add(f"  recompute {label} only", method="megatron", remat=remat, recompute=policy,
                    megatron=MegatronConfig(chosen.tp, chosen.pp, chosen.dp, chosen.microbatch_size,
                                            chosen.distributed_optimizer, chosen.sequence_parallel))
    return rows


def model_size() -> tuple[float, int]:
    """(parameters, tokens an iteration) of `MODEL`, from its graph and config."""
    name, cfg = resolve_model(MODEL)
    return float(forward_graph(dataclasses.replace(cfg, batch=1), name=name).num_params()), cfg.batch * cfg.seq


def markdown(rows: list[dict]) -> str:
    """One table: iteration, tokens/s, model TFLOP/s per GPU (6 x params x tokens, the
    usual MFU numerator: attention and recomputation left out), memory and the plan."""
    params, tokens = model_size()
    lines = ["| GPUs | plan | iteration (s) | tokens/s | model TFLOP/s/GPU | peak GiB | recompute | layout |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if not r["feasible"]:
            lines.append(f"| {r['gpus']} | {r['label']} | out of memory | | | | | |")
            continue
        m = r.get("megatron")
        layout = (f"tp {m['tp']} pp {m['pp']} dp {m['dp']} mbs {m['microbatch_size']}"
                  + (", SP" if m.get("sequence_parallel") else "") + (", dist-opt" if m.get("distributed_optimizer")
                                                                       else "")) if m else \
            f"{len(r['stages'])} stages: " + " ".join(r["stages"][:3]) + (" ..." if len(r["stages"]) > 3 else "")
        model_tflops = 6 * params * tokens / r["iteration_s"] / r["gpus"] / 1e12
        lines.append(f"| {r['gpus']} | {r['label']} | {r['iteration_s']:.2f} | {tokens / r['iteration_s']:,.0f} | "
                     f"{model_tflops:.0f} | {r['peak_gib']:.1f} | {r['recompute']} | {layout} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="64,128,256,512,1024")
    ap.add_argument("--ablate", default="64,512")
    ap.add_argument("--out", type=Path, default=Path("out/llama70b.json"))
    ap.add_argument("--table", type=Path, help="only print the markdown table of a JSON this script wrote")
    ap.add_argument("--alpa-recompute", default="auto", choices=("auto", *(label for label, _, _ in RECOMPUTE_SEARCH)),
                    help="what Alpa's plan recomputes; auto searches all three (three plans' time)")
    args = ap.parse_args()
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())))
        return
    ablate = {int(g) for g in args.ablate.split(",") if g}
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    ref_s = round(print_reference(), 3)
    rows = []
    for g in (int(x) for x in args.gpus.split(",")):
        rows += scale(g, g in ablate, args.alpa_recompute, ref_s)
    print_reference("at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows), flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()

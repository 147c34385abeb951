"""`alpasim run`: execute a plan file, check it against one device and its predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from alpasim import simulator as sim
from alpasim import solvers as sv
from alpasim.experiments import RAY_PLATFORMS, RUNTIMES, cpu_devices_for, run_report

from ._common import (
    CostModelOpt, JsonOpt, app, emit_json, ensure_cpu_devices, fail, fmt_bytes, load_cost_model, note, out,
    writable_file,
)


@app.command()
def run(
    plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `alpasim plan --out`.")],
    runtime: Annotated[str, typer.Option("--runtime", help="local (one process) or ray (an actor per mesh).")]
        = "local",
    steps: Annotated[int, typer.Option("--steps", help="Training steps; the median step time leaves out the "
                                       "first (warm-up) when there are more.")] = 5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of parameters and data.")] = 0,
    cost_model: CostModelOpt = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the measured Chrome trace JSON.")] = None,
    gantt: Annotated[Optional[Path], typer.Option("--gantt", help="Write the measured Gantt chart PNG.")] = None,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address (default: "
                                                       "start a local one).")] = None,
    platform: Annotated[str, typer.Option("--platform", help="--runtime ray: what the mesh actors run on: auto "
                                          "(the plan's GPUs where the Ray cluster has GPUs, else virtual CPU "
                                          "devices), gpu (num_gpus per mesh; fails if the cluster has too few) or "
                                          "cpu.")] = "auto",
    profile_iters: Annotated[int, typer.Option("--profile-iters", help="Time each compiled stage alone this many "
                                               "times before the run (Alpa's stage profiling); 0 skips it.")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Execute a plan on JAX and compare it with its prediction and a single-device step.

    Prints the measured step time (median), the predicted ones — the plan's analytic
    model; with `--cost-model` the op-level profile re-pricing each stage for this
    runtime; and the stages' own compiled programs timed alone (Alpa's stage
    profiling, `--profile-iters`), composed by the simulator — their ratios, the
    numerical check of loss and gradients, and per stage the predicted vs compiled
    (HLO) collective bytes and predicted vs measured memory per device (XLA's memory
    analysis of the compiled stage programs, composed as the stage runs under 1F1B:
    `alpasim.backends.measured_memory`). A numerics mismatch exits 1 after the report.
    On the CPU it asks for 8 virtual devices (or as many as the plan uses) unless
    XLA_FLAGS already sets a count."""
    if runtime not in RUNTIMES:
        fail(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if platform not in RAY_PLATFORMS:
        fail(f"--platform {platform!r}: choose one of {', '.join(RAY_PLATFORMS)}")
    if platform != "auto" and runtime != "ray":
        fail("--platform applies to --runtime ray (the local runtime runs on the devices JAX sees)")
    if steps < 1:
        fail(f"--steps must be at least 1, got {steps}")
    if profile_iters < 0:
        fail(f"--profile-iters must be 0 or more, got {profile_iters}")
    if seed < 0:      # numpy's generators take none, and would refuse only after every stage compiled
        fail(f"--seed must be 0 or more, got {seed}")
    writable_file(trace, "--trace")
    writable_file(gantt, "--gantt")
    p = sv.load_plan(plan_file)
    if not p.feasible or not p.stages:
        why = "; ".join(p.notes) or ("it has no stages" if not p.stages else "it is marked feasible: false")
        fail(f"{plan_file}: the plan is infeasible ({why}); nothing to run")
    model = None
    if cost_model is not None:
        base = sim.plan_cluster(p)
        if base is None:
            fail(f"{plan_file}: the plan records no cluster spec to bind --cost-model to")
        model = load_cost_model(cost_model, base)
    ensure_cpu_devices(cpu_devices_for(p))
    report = run_report(p, runtime=runtime, steps=steps, seed=seed, cost_model=model, ray_address=ray_address,
                        ray_platform=platform, log=note,
                        trace=trace, gantt=gantt, profile_iters=profile_iters)
    if as_json:
        emit_json(report)
    else:
        print_run(report, title=f"{plan_file}: {p.model.name}")
    if not report["numerics_ok"]:
        fail(f"numerics mismatch against one device: worst gradient rel. error {report['max_rel_grad_err']:.2e} "
             f"({report['worst_param']}) > {report['grad_tol']:.1e} or loss error {report['max_abs_loss_err']:.2e} "
             f"> {report['loss_tol']:.1e}", code=1)


def print_run(r: dict[str, Any], title: str = "run") -> None:
    ms = 1e3
    out.print(f"{title} — {r['runtime']} runtime, {r['steps']} steps on {r['devices']} {r['platform']} devices")
    out.print(f"measured step {r['measured_step_s'] * ms:.2f} ms (median; steps "
              f"{', '.join(f'{t * ms:.1f}' for t in r['step_times_s'])} ms)")
    out.print(f"predicted (plan, analytic) {r['predicted_step_s_analytic'] * ms:.2f} ms — ratio predicted/measured "
              f"{r['ratio_analytic']:.2f}")
    if r["predicted_step_s_profiled"] is not None:
        out.print(f"predicted (profiled, {r['runtime']} runtime: one executor, {r['dispatch_s'] * 1e6:.0f} us "
                  f"dispatch per call) {r['predicted_step_s_profiled'] * ms:.2f} ms — ratio predicted/measured "
                  f"{r['ratio_profiled']:.2f}")
    if r["predicted_step_s_stage_profiled"] is not None:
        out.print(f"predicted (stages profiled alone, {r['runtime']} runtime's schedule simulated, "
                  f"{r['stage_dispatch_s'] * 1e6:.0f} us dispatch per call) "
                  f"{r['predicted_step_s_stage_profiled'] * ms:.2f} ms — ratio predicted/measured "
                  f"{r['ratio_stage_profiled']:.2f}")
    verdict = "ok" if r["numerics_ok"] else "MISMATCH"
    out.print(f"numerics vs one device: {verdict} (loss error {r['max_abs_loss_err']:.2e} <= {r['loss_tol']:.1e}, "
              f"worst gradient rel. error {r['max_rel_grad_err']:.2e} <= {r['grad_tol']:.1e})")
    if r["collectives"]:
        t = Table(title="collective bytes per stage: predicted (the plan's) / measured (compiled HLO)")
        for col in ("stage", "mesh", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "total ratio"):
            t.add_column(col)
        for row in r["collectives"]:
            cells = [f"{fmt_bytes(row['predicted'][k]) if row['predicted'] is not None else '-'} / "
                     f"{fmt_bytes(row['measured'][k])}" for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                                  "all_to_all")]
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            t.add_row(str(row["stage"]), "x".join(map(str, row["mesh"])), *cells, ratio)
        out.print(t)
    _print_run_memory(r["stages"])
    for key, path in r["outputs"].items():
        out.print(f"wrote {key}: {path}", soft_wrap=True)


def _print_run_memory(rows: list[dict[str, Any]]) -> None:
    """Per stage, predicted (plan) against measured (compiled programs) memory per device,
    term by term: state, stash x in flight, transient (temporaries + boundary buffers)."""
    t = Table(title="memory per device: predicted (plan) / measured (compiled stage, XLA memory analysis)")
    for col in ("stage", "mesh", "state", "stash x inflight", "transient", "total", "ratio", "device peak"):
        t.add_column(col)
    for row in rows:
        mem, m = row["memory"], row["memory"]["measured"]
        if m is None:
            continue
        pred = mem["predicted"] or {}

        def pair(predicted: float | None, measured: float) -> str:
            return f"{fmt_bytes(predicted) if predicted is not None else '-'} / {fmt_bytes(measured)}"

        p_state = (sum(pred.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
                   if pred else None)
        p_stash = pred["stash_bytes"] * pred.get("inflight", m["inflight"]) if "stash_bytes" in pred else None
        p_trans = pred.get("transient_bytes", 0.0) + pred.get("buffer_bytes", 0.0) if pred else None
        ratio = f"{mem['ratio']:.2f}" if mem["ratio"] is not None else "-"
        peak = fmt_bytes(m["device_peak_bytes"]) if m["device_peak_bytes"] is not None else "-"
        t.add_row(str(row["stage"]), "x".join(map(str, row["mesh"])), pair(p_state, m["state_bytes"]),
                  f"{pair(p_stash, m['stash_bytes'] * m['inflight'])} ({m['inflight']})",
                  pair(p_trans, m["temp_bytes"] + m["buffer_bytes"]), pair(mem["predicted_bytes"], m["total_bytes"]),
                  ratio, peak)
    out.print(t)

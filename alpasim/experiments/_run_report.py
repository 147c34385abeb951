"""What `alpasim simulate` and `alpasim run` report: a plan's simulated iteration, and
a plan executed on this machine's devices beside its predictions and one device."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alpasim import costmodels as cm
from alpasim import simulator as sim
from alpasim import solvers as sv
from alpasim.units import format_bytes

from ._errors import ReportError


def simulation_report(p: sv.PipelinePlan, schedule: str | None = None, *, chunks: int = 2,
                      cross_mesh: str = "local_all_gather", trace: Path | None = None, gantt: Path | None = None,
                      memory_png: Path | None = None, cluster: cm.Cluster | None = None,
                      overlap: bool = True, blocking_sends: bool | None = None) -> dict[str, Any]:
    """Simulate one iteration of a plan under `schedule` (default the plan's own) on
    `cluster` (default the plan's own; `overlap=False` runs its gradient buckets after
    the backward; `blocking_sends` as `simulator.simulate`, default the plan's system's);
    the timeline metrics as one JSON-ready dict."""
    tl = sim.simulate(p, schedule, chunks=chunks, cross_mesh=cross_mesh, cluster=cluster, overlap=overlap,
                      blocking_sends=blocking_sends)
    report = tl.to_json()
    report["plan_chunks"] = p.chunks
    report["outputs"] = write_outputs((("trace", trace, tl.chrome_trace), ("gantt", gantt, tl.gantt_png),
                                        ("memory_png", memory_png, tl.memory_png)))
    return report


def write_outputs(outputs) -> dict[str, str]:
    """Write each (key, path, writer) whose path is given; {key: path} of those written.
    A path that cannot be written is one line and exit 2."""
    written = {}
    for key, path, write in outputs:
        if path is not None:
            try:
                write(path)
            except OSError as e:
                raise ReportError(f"cannot write {path}: {e.strerror or e}") from None
            written[key] = str(path)
    return written


RUNTIMES = ("local", "ray")
# What `run --runtime ray` puts its mesh actors on (`backends._ray_runtime.PLATFORMS`,
# spelled here so the CLI checks it before importing JAX).
RAY_PLATFORMS = ("auto", "gpu", "cpu")


# Of the host's RAM, what a run on virtual CPU devices may plan to use (the single-device
# reference step and the Python process need the rest).
HOST_MEMORY_SHARE = 0.6


def cpu_devices_for(p: sv.PipelinePlan) -> int:
    """Virtual CPU devices a plan needs (at least 8, what `alpasim profile` measures with)."""
    return max(8, 1 + max((d for st in p.stages for d in st.devices), default=0))


def run_report(p: sv.PipelinePlan, *, runtime: str = "local", steps: int = 5, seed: int = 0,
               cost_model: cm.CostModel | None = None, ray_address: str | None = None, ray_platform: str = "auto",
               trace: Path | None = None, gantt: Path | None = None, profile_iters: int = 5,
               log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Execute a plan, check it against one device, and compare it with its predictions
    (analytic; op-profiled with `cost_model`; stage-profiled with `profile_iters`);
    `log` hears one line as each phase starts."""
    import jax

    from alpasim import backends

    need = 1 + max(d for st in p.stages for d in st.devices)
    have, platform = len(jax.devices()), jax.devices()[0].platform
    if have < need:
        raise ReportError(f"the plan uses {need} devices; JAX sees {have} ({platform}). On the CPU set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before starting")
    _check_host_memory(p, platform)
    t0 = time.perf_counter()
    log(f"run: lowering and compiling {len(p.stages)} stages on {need} {platform} devices ({runtime} runtime), "
        + (f"timing each alone {profile_iters} times, " if profile_iters else "") + f"then {steps} steps")
    if runtime == "ray":
        try:
            result = backends.run_ray(p, steps=steps, seed=seed, address=ray_address, profile_iters=profile_iters,
                                      platform=ray_platform)
        except backends.RayRuntimeError as e:
            raise ReportError(f"--runtime ray: {e}") from None
    else:
        result = backends.run_local(p, steps=steps, seed=seed, profile_iters=profile_iters)
    run_s = time.perf_counter() - t0
    # Read before the reference step runs on device 0 (a GPU's peak counter would count it).
    memory = [backends.measured_memory(s, st.inflight_microbatches) for s, st in zip(result.stages, p.stages)]
    log(f"run: {steps} steps in {run_s:.1f} s; the single-device reference step")
    check = backends.check_numerics(result.losses[0], result.grads, backends.reference_step(p, seed=seed))
    # The op-level re-pricing of a profiled cost model reads each stage's op strategies
    # (replayed from the plan's record, `stage_intra_plan`); the collectives are the
    # plan's own record too.
    intra = [s.intra_plan for s in result.stages] if cost_model is not None and runtime == "local" else None
    prediction = backends.predict_run(p, cost_model=cost_model, runtime=runtime, intra_plans=intra,
                                      stage_times=result.stage_profile or None)
    collectives = backends.compare_collectives(p, result.stages) if len(result.stages) == len(p.stages) else []
    measured = result.measured_step_s
    timeline = result.timeline
    written = write_outputs((("trace", trace, timeline.chrome_trace), ("gantt", gantt, timeline.gantt_png)))
    stages = _stage_rows(p, memory, prediction.get("stages"))
    return {"runtime": runtime, "steps": steps, "seed": seed, "devices": need, "platform": platform,
            "actor_platform": result.actor_platform,
            **{k: check[k] for k in ("numerics_ok", "max_abs_loss_err", "max_rel_grad_err", "worst_param",
                                      "loss_tol", "grad_tol")},
            "losses": result.losses, "step_times_s": result.step_times_s, "measured_step_s": measured,
            **prediction,
            **{f"ratio{which}": _ratio(prediction[f"predicted_step_s{which}"], measured)
               for which in ("", "_analytic", "_profiled", "_stage_profiled")},
            "collectives": collectives, "stages": stages, "run_s": run_s, "outputs": written}


def _stage_rows(p: sv.PipelinePlan, memory: list, priced: list[dict] | None) -> list[dict[str, Any]]:
    """Per stage: the predicted memory (the plan's, with its breakdown when the plan has
    one) beside the measured (compiled programs, `backends.measured_memory`), merged into
    the profiled prediction's rows when there are any."""
    rows = [dict(r) for r in priced] if priced else [{"stage": k, "mesh": list(st.logical_mesh)}
                                                      for k, st in enumerate(p.stages)]
    for row, st, m in zip(rows, p.stages, memory, strict=True):
        breakdown = getattr(st, "memory", None)
        if breakdown is not None and not isinstance(breakdown, dict):
            breakdown = breakdown.to_json() if hasattr(breakdown, "to_json") else dict(vars(breakdown))
        measured = m.to_json() if m is not None else None
        total = measured["total_bytes"] if measured else None
        row["memory"] = {"predicted_bytes": st.memory_bytes, "measured_bytes": total,
                         "ratio": _ratio(st.memory_bytes, total) if total else None,
                         "predicted": breakdown or None, "measured": measured}
    return rows


def _check_host_memory(p: sv.PipelinePlan, platform: str) -> None:
    """Virtual CPU devices share the host's RAM: refuse a plan whose per-device memory,
    summed over its devices, exceeds it (a GPU plan of billions of parameters would
    otherwise be killed by the OS mid-run, or swap for hours)."""
    have = cm.host_memory_bytes()
    if platform != "cpu" or have is None:
        return
    need = sum(st.memory_bytes * len(st.devices) for st in p.stages)   # a mesh's chunks add up
    if need > HOST_MEMORY_SHARE * have:
        raise ReportError(f"the plan needs about {format_bytes(need)} on its {p.num_devices} devices (memory per "
                          f"device, summed: virtual CPU devices share the host's RAM); this host has "
                          f"{format_bytes(have)}. Plan a smaller configuration to run here")


def _ratio(predicted: float | None, measured: float) -> float | None:
    return predicted / measured if predicted is not None and measured > 0 else None

"""What the simulator predicts for a *measured* run: the plan's times, or a profiled re-pricing.

`predict_run(plan)` is the plan's own prediction: its stage times, simulated on its
cluster with free-running meshes (what a GPU cluster would do). Two profiled
predictions of the run on this machine can come with it:

- stage-profiled (`stage_times`, from `run_local/run_ray(profile_iters=...)`): each
  stage's compiled forward, backward and update timed alone on its mesh before the
  run (`profile_stage`), as Alpa's intra-op pass profiles every compiled stage-mesh
  pair. The simulator composes them: the runtime's instruction lists with one shared
  executor, a dispatch per call and the transfers on the profile's link (step 3). On
  this host it lands within 20 % of the measured median for the pipelined GPT, MoE and
  Wide-ResNet plans of `benchmarks/bench_run.py` (0.83-1.16 over the runs made on the idle
  machine; 0.76-1.10 under the Ray runtime, whose object store it does not price).
- op-profiled (`cost_model`, `alpasim profile`), no compilation needed, built as
  follows; on those plans it read 0.80-1.27 of the measured time for GPT, 0.37-0.96
  for MoE and 0.26-0.36 for Wide-ResNet over three to five runs, each with a fresh
  profile (gaps below):

1. Each stage's intra-op plan — the priced one, replayed from the plan's records
   (`stage_intra_plan`, or the run's own `StageExecutable.intra_plan`) — is re-priced op by op and collective
   by collective with the profiled model on the profile's host cluster
   (`alpasim.solvers.reprice`): forward_s, backward_s per microbatch, and the gradient
   sync plus Adam update once per iteration.
2. CPU sharing. The profile times each op shard with *all* `concurrency` virtual
   devices busy at once, and a runtime that runs one mesh of n devices at a time
   leaves the others idle. How much faster a shard runs then is measured, not
   assumed: the profile re-times the largest case of each op class (and an
   all-reduce) with only n devices busy (`meta.concurrency_scale`, n = 1, 2, 4, ...)
   and each stage is re-priced with its mesh size's factors (`ProfiledCostModel.scaled`).
   They are far from the n / N a fair share of the cores would give: on this 2-core
   host with 8 devices, 4 busy devices ran matmuls at 0.7-1.0x their all-busy time,
   not 0.5x, and that alone moved the GPT prediction below from 0.50 to 0.80 of the
   measured step. Profiles without the table fall back to the fair-share formula:
   ops take max(n, C) / max(concurrency, C) of the profiled time on C cores
   (`core_share`).
3. The runtime. `run_local` is one driver process that walks every mesh and blocks on
   each instruction, so nothing overlaps: the simulator runs the program with one
   shared executor (`simulate(..., executors=1)`), which makes the iteration the sum
   of all instruction times. Each jitted call — every Run, every Update, every
   cross-mesh `device_put` — also pays the profile's measured `dispatch_s` (launch
   and `block_until_ready`, which the profiled op times leave out on purpose).
   The Ray runtime runs each mesh in its own process, but here those processes share
   the same 2 cores: compute cannot overlap in throughput, so the same serial model
   applies (one executor; a pipeline bubble costs nothing when the cores are the
   bottleneck), and its transfers additionally go through Ray's object store, which
   the model does not price (expect Ray's measurement above the prediction).

Convolutions are priced by their own profiled classes (conv, conv_input_grad,
conv_filter_grad; `alpasim.costmodels.ProfiledCostModel`): XLA:CPU runs the backward's
transposed convolutions 3-50x slower per FLOP than the forward at a few dozen channels,
which the matmul rate used before missed. Same-run comparison on the small Wide-ResNet
(`benchmarks/bench_run.py` sizes, 2x2+2x2, a shared and loaded 2-core host): predicted /
measured 0.37-0.50 with the conv classes against 0.21-0.33 with convs at the matmul
rate (two runs). The filter-gradient fit stays rough (RMS relative error ~0.8 over the
grid: XLA:CPU's rate for it ranges 0.2-9 GFLOP/s with the shape, fastest at 2x2-4x4
images), so a linear form per class is only a first cut.

Known gaps, measured on this host (all from the same run as the profile):
- Wide-ResNet stays ~3x short: the plan shards channels, so each conv of a stage runs
  on 16-128 channels and tiny images (2x2, 4x4) next to an all-gather, and in-stage
  forward convs take ~0.15-0.3 ms where the fit (C -> C convs, no collective) says
  0.03-0.07 ms.
- MoE ~0.4-0.7: the expert einsums whose operands or output are not in XLA's
  canonical dot order (batch dims leading, e.g. EGCH,EHM->GECM or GECM,EMH->EGCH) run
  1.7-2.5x slower than the same FLOPs in canonical order (4.2 ms vs 1.7 ms on one
  device), which a per-class rate cannot see; timed alone on the stage's 2x2 mesh with
  the plan's shardings the stage's einsums sum to ~3x their prediction (resharding
  included). The backward's "involuntary full rematerialization" (replicate, then
  repartition, of a (8, 1, 32, 128) tensor) is work the plan does not list.
  Timed one by one on one device at a microbatch's full shapes (bench sizes), the
  fit is within 20 % for the projections and MLP einsums, but attention's batched
  einsums take 1.6-2.5x the fit, EGCH,EHM->GECM 2.1x and the gating einsum 6.6x;
  summed, MoE's einsums take 1.37x their fit. The rest of MoE's gap, about 1.5x, is
  in the sharded program.
- Everything syncs: on a host loaded by other jobs a stage's devices wait for each
  other at every collective, while the profile's loops run each device on its own;
  under load the same GPT plan has measured 0.28-0.97 of the prediction.

Ignored: XLA fusion across ops (the profile times ops one by one; fused elementwise
chains run faster than predicted), Python work around each call (generating a
microbatch's inputs, pytree flattening), host memory effects of large tensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from alpasim.costmodels import CostModel
from alpasim.graphs import stage_graph
from alpasim.simulator import build_program, simulate
from alpasim.solvers import IntraOpPlan, PipelinePlan, logical_mesh, planning_graph, reprice

from ._executable import plan_training_graph
from ._stage_profile import StageTimes
from ._stages import stage_intra_plan

RUNTIMES = ("local", "ray")


def core_share(mesh_devices: int, concurrency: int, cores: int) -> float:
    """Factor from a profiled op time (all `concurrency` devices busy) to the same op on
    a mesh of `mesh_devices` running alone on `cores` cores (module doc, step 2)."""
    return max(mesh_devices, cores) / max(concurrency, cores)


def predict_run(plan: PipelinePlan, *, cost_model: CostModel | None = None, runtime: str = "local",
                intra_plans: Sequence[IntraOpPlan] | None = None, cores: int | None = None,
                stage_times: Sequence[StageTimes] | None = None) -> dict:
    """Predicted step seconds of `plan` as run by `runtime` (module doc).

    Returns `predicted_step_s_analytic` (the plan's stage times, meshes concurrent, on
    the plan's cluster); with `cost_model`: `predicted_step_s_profiled` (op-level
    re-pricing), `dispatch_s`, `core_share` and per-stage re-priced times; with
    `stage_times` (`profile_stage`, Alpa's stage profiling): `predicted_step_s_stage_profiled`.
    `predicted_step_s` is the most informed of the three: stage-profiled, else
    op-profiled, else analytic. `intra_plans` skips the per-stage re-solve of the
    op-level re-pricing (pass `[s.intra_plan for s in run.stages]` of a local run, whose
    stages keep theirs); `cores` defaults to this host's.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: choose one of {RUNTIMES}")
    if stage_times is not None and len(stage_times) != len(plan.stages):
        raise ValueError(f"{len(stage_times)} stage profiles for a plan of {len(plan.stages)} stages")
    # Our runtimes, not the system the plan was priced as: their sends do not hold the
    # sender's program (`_ray_worker`), as the analytic prediction always assumed.
    analytic = simulate(plan, plan.schedule, blocking_sends=False).iteration_s
    out = {"runtime": runtime, "predicted_step_s_analytic": analytic, "predicted_step_s": analytic,
           "predicted_step_s_profiled": None, "predicted_step_s_stage_profiled": None, "stage_profile": None}
    meta = dict(getattr(cost_model, "meta", {}) or {})
    dispatch_s = float(meta.get("dispatch_s", 0.0))
    cluster = cost_model.cluster if cost_model is not None else None
    if cost_model is not None:
        concurrency = int(meta.get("concurrency", meta.get("num_devices", 1)))
        cores = cores or os.cpu_count() or 1
        train = plan_training_graph(plan, planning_graph(plan.model))
        times, rows = [], []
        for k, st in enumerate(plan.stages):
            intra = intra_plans[k] if intra_plans is not None else stage_intra_plan(plan, train, k)
            mesh = logical_mesh(cluster, list(st.devices), tuple(st.logical_mesh))
            factors = _measured_scale(meta.get("concurrency_scale"), len(st.devices), concurrency)
            model = cost_model.scaled(factors) if factors else cost_model
            priced = reprice(intra, stage_graph(train, *st.layers), model, mesh)
            share = 1.0 if factors is not None else core_share(len(st.devices), concurrency, cores)
            times.append((priced.forward_s * share, priced.backward_s * share, (priced.sync_s + priced.update_s) * share))
            rows.append({"stage": k, "mesh": list(st.logical_mesh), "core_share": share, "scale": factors,
                         "forward_s": times[-1][0], "backward_s": times[-1][1], "update_s": times[-1][2]})
        profiled = _serial_step_s(plan, times, cluster, dispatch_s)
        out.update(predicted_step_s=profiled, predicted_step_s_profiled=profiled, dispatch_s=dispatch_s, cores=cores,
                   concurrency=concurrency, stages=rows)
    if stage_times is not None:
        for k, st in enumerate(stage_times):
            if st.stage != k:
                raise ValueError(f"stage profile {k} is of stage {st.stage}; pass them in stage order")
        # A profiled call already paid its dispatch; the serial simulation adds it back
        # per call (and per send). Without an op profile, the stages' own measured
        # dispatch is used, and transfers are priced on the plan's cluster.
        if cost_model is None:
            dispatch_s = max(st.dispatch_s for st in stage_times)
        times = [tuple(max(0.0, t - dispatch_s) for t in (s.forward_s, s.backward_s, s.update_s))
                 for s in stage_times]
        measured = _serial_step_s(plan, times, cluster, dispatch_s)
        out.update(predicted_step_s=measured, predicted_step_s_stage_profiled=measured,
                   stage_profile=[s.to_json() for s in stage_times], stage_dispatch_s=dispatch_s)
    return out


def _measured_scale(table, mesh_devices: int, concurrency: int) -> dict[str, float] | None:
    """The profile's measured per-class factors for a mesh of `mesh_devices` running
    alone (`meta.concurrency_scale`, module doc step 2); {} for a mesh of exactly the
    profiled devices; None when the profile has no measurement for that size, e.g. a
    mesh larger than the profile's (the `core_share` formula prices it then, and the
    stage's row reports that share; with measured factors its `core_share` is 1)."""
    if mesh_devices == concurrency:
        return {}
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ValueError(f"profile meta 'concurrency_scale' must be an object, got {table!r}")
    entry = table.get(str(mesh_devices))
    if entry is not None and not isinstance(entry, dict):
        raise ValueError(f"profile meta 'concurrency_scale.{mesh_devices}' must be an object, got {entry!r}")
    return dict(entry) if entry is not None else None


def _serial_step_s(plan: PipelinePlan, times: Sequence[tuple[float, float, float]], cluster,
                   dispatch_s: float) -> float:
    """The program's iteration with these (forward, backward, per-iteration update) seconds
    per stage, run by one shared executor paying `dispatch_s` a call (module doc, step 3);
    transfers priced on `cluster` (the profile's host), else on the plan's own cluster."""
    # The measured backward holds a sharded-gradient plan's scatters already (no stream).
    stages = [dataclasses.replace(st, forward_s=f, backward_s=b, compute_s=f + b, sync_s=u,
                                  time_s=f + b + u / plan.microbatches, grad_scatter_s=0.0)
              for st, (f, b, u) in zip(plan.stages, times, strict=True)]
    priced = dataclasses.replace(plan, stages=stages)
    if cluster is not None:
        priced = dataclasses.replace(priced, cluster=dataclasses.replace(plan.cluster, spec=cluster.to_json()))
    program = build_program(priced, plan.schedule)
    return simulate(priced, program, cluster=cluster, executors=1, dispatch_s=dispatch_s).iteration_s

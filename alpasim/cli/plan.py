"""`alpasim plan`: stages, submeshes and shardings of a model on a cluster, by any method."""

from __future__ import annotations

import contextlib
import math

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from alpasim import costmodels as cm
from alpasim import graphs as gr
from alpasim import solvers as sv
from alpasim.experiments import simulation_report

from ._common import (
    AttentionOpt, BucketOpt, ClusterOpt, CostModelOpt, CrossEntropyOpt, DpnOpt, GatherOverlapOpt, GbpsOpt, JsonOpt,
    KernelsOpt, MemOpt, NodesOpt, OverlapOpt, PrecisionOpt, SystemOpt, TpOverlapOpt, app, bucket_bytes, check_precision, check_recompute, emit_json, err, fail, fmt_bytes,
    fmt_count, load_cluster, load_cost_model, out, parse_microbatches, plan_map, RayAddressOpt, RayOpt, TaskProgress,
    writable_file, writing,
)
from .simulate import print_simulation


def parse_chunks(text: str) -> tuple[int, ...]:
    """`--chunks` "2,3,4" -> (2, 3, 4); anything else is a one-line error."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 2 for v in values):
        fail(f"--chunks {text!r}: give chunk counts per mesh, each at least 2, separated by commas (e.g. 2,3,4)")
    return values


def make_plan(model: str, cluster: cm.Cluster, method: str = "alpa", *, microbatches: str = "auto",
              layers: int | None = None, max_stages: int | None = None, megatron: sv.MegatronConfig | None = None,
              cache: bool = True, workers: int | None = None, ray: bool = False, ray_address: str | None = None,
              **options) -> sv.PipelinePlan:
    """`solvers.plan_model` with progress on stderr (`TaskProgress`) and the chosen worker
    pool; `options` are the planner's common options (remat, epsilon, cost_model,
    precision, recompute). An option the method's record does not accept is a one-line
    error."""
    m = sv.get_method(method)
    refused = m.refused(layers=layers, max_stages=max_stages)
    if refused is not None:
        fail(f"--{refused.replace('_', '-')} does not apply to --method {m.cli_name} (its search sets it)")
    mb = parse_microbatches(microbatches)
    try:        # what is known before planning is refused before a pool starts
        sv.check_before_planning(model, cluster, m.name, layers=layers, max_stages=max_stages, megatron=megatron,
                                 **options)
        pool = plan_map(workers, ray, ray_address)
    except sv.PlanInfeasible:   # plan_model returns its infeasible plan at once
        pool = contextlib.nullcontext(map)
    except sv.OptionConflict as e:
        fail(f"--{e.entry.replace('_', '-')} {e.why}")
    with pool as map_fn, TaskProgress(f"{m.cli_name}: ") as progress:
        # The model as given (not its source): a spec's own settings, `attention=`, count.
        return sv.plan_model(model, cluster, m.name, microbatches=mb, layers=layers, max_stages=max_stages,
                             megatron=megatron, map_fn=map_fn, cache=sv.DiskCache(enabled=cache),
                             progress=progress.update, **options)


@app.command()
def plan(
    model: Annotated[str, typer.Option("--model", help="Zoo name, spec string or model JSON.")],
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    microbatches: Annotated[str, typer.Option("--microbatches", help="Number of microbatches B, or 'auto' to "
                                              "search B jointly.")] = "auto",
    layers: Annotated[Optional[int], typer.Option("--layers", help="Re-cluster into L layers (eq. 6 DP).")] = None,
    remat: Annotated[Optional[bool], typer.Option("--remat/--no-remat", help="Activation rematerialisation "
                                                  "(full recomputation; default: as the method's system "
                                                  "ran).")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Write the plan JSON here.")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk stage-cost cache.")] = False,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Local processes filling the table.")] = None,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    max_stages: Annotated[Optional[int], typer.Option("--max-stages", help="Deepest pipeline considered "
                                                      f"(default {sv.DEFAULT_MAX_STAGES}).")] = None,
    epsilon: Annotated[float, typer.Option("--epsilon", help="Relative width of the bottleneck windows the "
                                               "stage DP evaluates: the plan is within (1 + epsilon) of the "
                                               "optimum over the stage cost table.")] = 1e-3,
    run_simulation: Annotated[bool, typer.Option("--simulate", help="Also simulate the plan (1F1B) and show "
                                                 "the timeline metrics.")] = False,
    method: Annotated[str, typer.Option("--method", help="alpa, or a baseline: " + ", ".join(
        m.cli_name for m in sv.METHODS.values() if m.baseline) + ".")] = "alpa",
    tp: Annotated[Optional[int], typer.Option("--tp", help="Megatron tensor-parallel degree.")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="Megatron pipeline-parallel degree.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", help="Megatron data-parallel degree.")] = None,
    microbatch_size: Annotated[Optional[int], typer.Option("--microbatch-size", help="Megatron microbatch "
                                                           "size per data-parallel replica.")] = None,
    distributed_optimizer: Annotated[Optional[bool], typer.Option(
        "--distributed-optimizer/--no-distributed-optimizer", help="Megatron-core's distributed optimizer: Adam "
        "states and master weights on 1/dp of the devices each (the explicit configuration, or every one of the "
        "grid; default: as the method's system ran, and megatron-core's grid searches it).")] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="Megatron-LM's sequence "
                                                    "parallelism: norms and residual adds split the sequence "
                                                    "over the tensor-parallel group, partial sums "
                                                    "reduce-scattered (the explicit configuration, or every "
                                                    "one of the grid).")] = False,
    ends_as_layers: Annotated[bool, typer.Option("--ends-as-layers", help="The explicit Megatron configuration "
                                                 "counts the embedding and the loss head as pipeline layers of "
                                                 "their own (Megatron-core's --account-for-embedding-in-pipeline-"
                                                 "split and --account-for-loss-in-pipeline-split).")] = False,
    sharded_gradients: Annotated[bool, typer.Option("--sharded-gradients", help="The explicit Megatron "
                                                    "configuration shards the gradients over dp too (ZeRO-2, as "
                                                    "Llama 3's FSDP ran it: each microbatch's weight gradients "
                                                    "reduce-scattered; implies the distributed optimizer).")] = False,
    cp: Annotated[Optional[int], typer.Option("--cp", help="The explicit Megatron configuration's context-"
                                              "parallel degree (Llama models, fused attention): each sequence "
                                              "split over cp ranks that all-gather K and V, as Llama 3 ran "
                                              "it; tp x cp x pp x dp is the cluster.")] = None,
    cost_model: CostModelOpt = None,
    precision: PrecisionOpt = gr.DEFAULT_RECIPE,
    recompute: Annotated[Optional[str], typer.Option("--recompute", help="What the backward recomputes besides "
                                                     "--remat: none, fusible, selective, or auto (the fastest of "
                                                     "full remat, selective and none that fits); default: as the "
                                                     "method's system ran.")] = None,
    overlap: OverlapOpt = None,
    tp_comm_overlap: TpOverlapOpt = None,
    param_gather_overlap: GatherOverlapOpt = None,
    cross_entropy: CrossEntropyOpt = None,
    kernels: KernelsOpt = None,
    system: SystemOpt = None,
    attention: AttentionOpt = None,
    bucket_mb: BucketOpt = None,
    schedule: Annotated[str, typer.Option("--schedule", help="The pipeline schedule the plan runs: 1f1b (the "
                                          "stage DP's); interleaved (the model cut into S x v chunks, chunk j "
                                          "on mesh j mod S, v from --chunks); or 'auto': with --method alpa "
                                          "the faster of the two plans, and on a 1F1B plan the fastest of "
                                          "1f1b, zb-h1 and zb-h2 that fits, simulated on its stages (both "
                                          "runtimes execute each).")] = "1f1b",
    chunks: Annotated[str, typer.Option("--chunks", help="Model chunks per mesh an interleaved plan may take "
                                        "(comma-separated, each >= 2).")] = "2,3,4",
    as_json: JsonOpt = False,
) -> None:
    """Plan pipeline stages, submeshes and intra-op shardings for a model on a cluster.

    `--method` picks Alpa (default) or a baseline; `--method megatron --tp T --pp P --dp D
    --microbatch-size K` prices one explicit Megatron-LM configuration (without them, the
    best of Megatron's grid). A baseline that does not fit is a result, not an error:
    the table output prints why and exits 2, `--json` prints the plan with `feasible`
    false and exits 0 (Alpa finding no plan stays an error: exit 2 either way)."""
    writable_file(out_path, "--out")
    if schedule not in sv.PLANNER_SCHEDULES:
        fail(f"--schedule {schedule!r}: choose {', '.join(sv.PLANNER_SCHEDULES)} (simulate another with "
             "`alpasim simulate --schedule`)")
    chunk_options = parse_chunks(chunks)
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb)
    model_costs = load_cost_model(cost_model, c)
    check_precision(precision)
    if recompute is not None:
        check_recompute(recompute, search=True)
    if cross_entropy is not None and cross_entropy not in gr.LOSS_KERNELS:
        fail(f"--cross-entropy must be one of {', '.join(gr.LOSS_KERNELS)}, got {cross_entropy!r}")
    if kernels is not None and kernels not in gr.KERNEL_STASHES:
        fail(f"--kernels must be one of {', '.join(gr.KERNEL_STASHES)}, got {kernels!r}")
    if recompute == "none" and remat is None:
        remat = False                # asked for: nothing recomputed, whatever the system's default
    buckets = bucket_bytes(False, bucket_mb)
    if system is not None:
        try:
            sv.get_system(system)
        except sv.UnknownSystemError as e:
            fail(f"--system: {e}")
    if attention is not None and attention not in gr.ATTENTION_KERNELS:
        fail(f"--attention {attention!r}: choose {' or '.join(gr.ATTENTION_KERNELS)}")
    if max_stages is not None and max_stages < 1:
        fail(f"--max-stages {max_stages}: must be at least 1")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        fail(f"--epsilon {epsilon}: must be a finite number >= 0")
    try:
        m = sv.get_method(method)
    except sv.UnknownMethodError:
        fail(f"--method {method!r}: choose one of {', '.join(x.cli_name for x in sv.METHODS.values())}")
    name = m.name
    degrees = {"--tp": tp, "--pp": pp, "--dp": dp, "--microbatch-size": microbatch_size}
    given = [k for k, v in degrees.items() if v is not None]
    interleaves = not m.baseline or ("megatron" in m.accepts and bool(given))
    if schedule == "interleaved" and not interleaves:
        fail(f"--schedule interleaved plans with --method alpa, or a Megatron configuration given by --tp, --pp, "
             f"--dp and --microbatch-size, not --method {m.cli_name} alone")
    if given and "megatron" not in m.accepts:
        fail(f"{', '.join(given)} only apply to --method megatron or megatron-core")
    if given and len(given) != len(degrees):
        fail(f"--method megatron takes all of --tp, --pp, --dp and --microbatch-size together (missing "
             f"{', '.join(k for k in degrees if k not in given)})")
    if distributed_optimizer is not None and "distributed_optimizer" not in m.accepts:
        fail("--distributed-optimizer only applies to --method megatron or megatron-core")
    if sequence_parallel and "sequence_parallel" not in m.accepts:
        fail("--sequence-parallel only applies to --method megatron or megatron-core")
    if cp is not None and cp < 1:
        fail(f"--cp {cp}: must be a positive integer")
    for flag, option in ((ends_as_layers, "--ends-as-layers"), (sharded_gradients, "--sharded-gradients"),
                         (cp is not None, "--cp")):
        if flag and not given:
            fail(f"{option} applies to an explicit Megatron configuration (--tp, --pp, --dp and --microbatch-size)")
    if sharded_gradients and distributed_optimizer is False:
        fail("--sharded-gradients needs the distributed optimizer (drop --no-distributed-optimizer)")
    config = sv.MegatronConfig(tp, pp, dp, microbatch_size, ends_as_layers=ends_as_layers,
                               distributed_optimizer=sharded_gradients,
                               sharded_gradients=sharded_gradients, cp=cp or 1) if given else None
    p = make_plan(model, c, name, microbatches=microbatches, layers=layers, max_stages=max_stages, megatron=config,
                  distributed_optimizer=distributed_optimizer,
                  sequence_parallel=sequence_parallel or None, cache=not no_cache, workers=workers, ray=ray,
                  ray_address=ray_address, epsilon=epsilon, cost_model=model_costs, precision=precision,
                  bucket_bytes=buckets, system=system, overlap=overlap, attention=attention,
                  **{k: v for k, v in (("remat", remat), ("recompute", recompute), ("tp_overlap", tp_comm_overlap),
                                       ("gather_overlap", param_gather_overlap), ("loss_kernel", cross_entropy),
                                       ("kernels", kernels))
                     if v is not None},
                  **({"schedule": schedule, "chunk_options": chunk_options}
                     if (not m.baseline and schedule != "1f1b") or (interleaves and schedule == "interleaved")
                     else {}))
    if not p.feasible and not m.baseline:   # Alpa finding nothing is an error, with or without --json
        fail("; ".join(p.notes) or "infeasible")
    if schedule == "auto" and p.feasible and p.chunks == 1:
        from alpasim import simulator as sim

        p = sim.choose_schedule(p, cluster=model_costs.cluster if model_costs is not None else c)
    if out_path is not None:
        with writing(out_path, "--out"):
            p.save(out_path)
        err.print(f"wrote {out_path}", soft_wrap=True)
    if not p.feasible:
        if as_json:
            emit_json(p.to_json())
            return
        fail(f"{name}: no feasible plan: {'; '.join(p.notes) or 'infeasible'}")
    report = simulation_report(p, p.schedule) if run_simulation else None
    if as_json:
        emit_json(p.to_json() if report is None else {**p.to_json(), "simulation": report})
        return
    print_plan(p)
    if m.baseline:
        config = p.search.megatron
        out.print(f"method {name}: {m.summary}" + (
            f"; tp={config['tp']}" + (f" cp={config['cp']}" if config.get("cp", 1) > 1 else "")
            + f" pp={config['pp']} dp={config['dp']} microbatch size {config['microbatch_size']}" + (", sequence parallel" if config.get("sequence_parallel") else "")
            + (", distributed optimizer" if config.get("distributed_optimizer") else "")
            + (", sharded gradients" if config.get("sharded_gradients") else "")
            + (", embedding and head as layers" if config.get("ends_as_layers") else "")
            + (f", recompute {p.model.recompute}, remat {'on' if p.model.remat else 'off'}"
               if "recompute" in m.own_search else "")
            if config else ""))
    if report is not None:
        print_simulation(report)


def _microbatch(p: sv.PipelinePlan) -> str:
    """A microbatch in sequences; under context parallelism also in the chunks the
    plan's model (each rank's view) counts."""
    cp = (p.search.megatron or {}).get("cp", 1)
    size = p.model.microbatch_size
    return str(size) if cp == 1 or size is None else f"{size // cp} ({size} chunks of 1/{cp} sequence)"


def print_plan(p: sv.PipelinePlan) -> None:
    m, c, pr = p.model, p.cluster, p.predicted
    title = (f"{m.name} ({fmt_count(m.params)} params) on {c.nodes} x {c.devices_per_node} "
             f"{c.device} — " + (f"{len(p.stages)} stages" if p.chunks == 1 else
                                 f"{p.num_meshes} meshes x {p.chunks} chunks (interleaved; stage j on mesh j mod "
                                 f"{p.num_meshes})") + f", {p.microbatches} microbatches of {_microbatch(p)}")
    t = Table(title=title)
    for col in ("stage", "layers", "submesh", "devices", "logical mesh", "time / microbatch", "memory / device",
                "in flight"):
        t.add_column(col)
    for i, s in enumerate(p.stages):
        devs = f"{s.devices[0]}..{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
        t.add_row(str(i), f"{s.layers[0]}..{s.layers[1]}", f"{s.submesh[0]}x{s.submesh[1]}", devs,
                  f"{s.logical_mesh[0]}x{s.logical_mesh[1]}", f"{s.time_s * 1e3:.1f} ms", fmt_bytes(s.memory_bytes),
                  str(s.inflight_microbatches))
    out.print(t)
    if all(s.memory for s in p.stages):
        mt = Table(title=f"memory per device by term ({m.precision or gr.DEFAULT_RECIPE}: "
                         f"{m.bytes_per_param if m.bytes_per_param is not None else '?'} B/param; "
                         f"stash x microbatches in flight)")
        for col in ("stage", "params", "grads", "optimizer", "stash", "working set", "buffers", "total"):
            mt.add_column(col)
        for i, s in enumerate(p.stages):
            mem = s.memory
            mt.add_row(str(i), *(fmt_bytes(mem[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")),
                       f"{fmt_bytes(mem['stash_bytes'])} x {mem['inflight']}", fmt_bytes(mem["transient_bytes"]),
                       fmt_bytes(mem["buffer_bytes"]), fmt_bytes(mem["total_bytes"]))
        out.print(mt)
    ht = Table(title="heaviest ops of each distinct layer kind in a stage")
    for col in ("stage", "op", "equation", "loops", "output spec"):
        ht.add_column(col)
    for i, s in enumerate(p.stages):
        for h in s.heavy_ops[:3]:
            ht.add_row(str(i), h["op"], h["equation"], h["strategy"], h["output"])
    out.print(ht)
    out.print(f"predicted iteration {pr.iteration_s:.2f} s, {pr.tflops_per_device:.1f} TFLOP/s per device, "
              f"{pr.throughput_pflops:.3f} PFLOP/s in all, peak memory {fmt_bytes(pr.peak_memory_bytes)} "
              f"per device, bubble {pr.bubble_fraction or 0.0:.1%}")
    sr = p.search
    out.print(f"search: {sr.seconds:.1f} s, {sr.ilp_solves} intra-op jobs, {sr.cache_hits} cache hits, "
              f"B tried {list(sr.microbatch_candidates)}")
    for r in p.runner_ups:
        when = f"{r.iteration_s:.2f} s" if r.iteration_s is not None else "no plan fits"
        out.print(f"  runner-up B={r.microbatches}: {when} ({len(r.stages)} stages)")
    for note in p.notes:
        out.print(note)

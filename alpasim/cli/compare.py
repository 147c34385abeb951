"""`alpasim compare`: every method on one model and cluster, side by side."""

from __future__ import annotations

import time
from typing import Annotated, Any, Optional

import typer

from alpasim import graphs as gr

from ._common import (
    BucketOpt, ClusterOpt, DpnOpt, GbpsOpt, JsonOpt, MemOpt, NodesOpt, NoOverlapOpt, RayAddressOpt, RayOpt, app,
    bucket_bytes, emit_json, err, fail, fmt_bytes, load_cluster, method_list, out, points_map,
)


@app.command()
def compare(
    model: Annotated[str, typer.Option("--model", help="Zoo name, spec string, model JSON or saved graph.")],
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods; the first is the "
                                         "reference.")] = "alpa,megatron,intra-only",
    workers: Annotated[Optional[int], typer.Option("--workers", help="Methods planned in parallel "
                                                   "(processes).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    no_overlap: NoOverlapOpt = False,
    bucket_mb: BucketOpt = None,
    schedules: Annotated[Optional[str], typer.Option(
        "--schedules", help="Also simulate each plan under these schedules, e.g. gpipe,1f1b,interleaved,zb-h1,"
        "zb-h2: iteration, bubble and peak memory side by side.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Several methods on one model and cluster: simulated throughput, plan, ratio to the first."""
    from alpasim import experiments as ex

    names = method_list(methods)
    wanted = [s.strip() for s in (schedules or "").split(",") if s.strip()]
    if schedules is not None and not wanted:
        fail("--schedules: name at least one schedule")     # an unknown one: `ex.compare`, before planning
    buckets = bucket_bytes(no_overlap, bucket_mb)
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb)
    gr.model_source(model)          # an unknown model or a bad graph file: one line, before planning
    t0 = time.perf_counter()

    def progress(done: int, total: int, r: Any) -> None:
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.method} planned in {r.plan_s:.1f} s",
                  markup=False, highlight=False)

    with points_map(workers, ray, ray_address) as map_fn:
        cmp = ex.compare(model, c, names, cache=not no_cache, workers=workers, progress=progress, map_fn=map_fn,
                         bucket_bytes=buckets, schedules=wanted)
    if as_json:
        emit_json(cmp.to_json())
        return
    ref = cmp.reference.method
    out.print(f"{model} on {c.nodes} x {c.devices_per_node} {c.device.name} ({c.name}), simulated:", soft_wrap=True)
    for row in cmp.rows():
        ratio = row["ratio_to_" + ref]
        if row["feasible"]:
            head = f"{row['throughput_pflops']:.3f} PFLOP/s, {row['iteration_s']:.2f} s / iteration"
            head += f", {ratio:.2f}x {ref}" if ratio is not None else ""
        else:
            head = "not planned"       # out of memory, or a method that does not take the model: the plan says
        out.print(f"  {row['method']:<12} {head} — {row['plan']}", markup=False, highlight=False, soft_wrap=True)
        for name, r in row.get("schedules", {}).items():
            fits = "" if r["fits"] else " (over the device's memory)"
            out.print(f"      {name:<12} {r['iteration_s']:.3f} s, bubble {r['bubble_fraction']:.1%}, peak "
                      f"{fmt_bytes(r['peak_memory_bytes'])} / device{fits}", markup=False, highlight=False)

"""`alpasim sweep`: one option swept against methods, as a table, CSV, markdown and plot."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from alpasim import costmodels as cm
from alpasim import graphs as gr

from ._common import (
    BucketOpt, JsonOpt, NoOverlapOpt, RayAddressOpt, RayOpt, app, bucket_bytes, check_workers, emit_json, err, fail,
    method_list,
    number_list, out, points_map, writable_dir, writable_file, write_text,
)


def _point_progress(t0: float):
    def progress(done: int, total: int, r: Any) -> None:
        what = f"{r.throughput_pflops:.3f} PFLOP/s" if r.feasible else "out of memory"
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.method} at {r.label}: {what} "
                  f"(planned in {r.plan_s:.1f} s)", markup=False, highlight=False)
    return progress


@app.command()
def sweep(
    model: Annotated[str, typer.Option("--model", help="Zoo name, spec string or model JSON (a spec or a "
                                                   "saved graph).")],
    gpus: Annotated[int, typer.Option("--gpus", help="Devices in all (whole nodes, or part of one).")],
    cluster: Annotated[str, typer.Option("--cluster", help="Preset the sweep starts from.")] = "aws-p3.16xlarge",
    inter_node_gbps: Annotated[Optional[str], typer.Option("--inter-node-gbps", help="Sweep the inter-node "
                                                           "bandwidth per NIC, e.g. 10,25,50,100.")] = None,
    devices_per_node: Annotated[Optional[str], typer.Option("--devices-per-node", help="Sweep devices per "
                                                            "node, e.g. 2,4,8.")] = None,
    memory_gb: Annotated[Optional[str], typer.Option("--memory-gb", help="Sweep device memory (GiB), "
                                                     "e.g. 16,32,80.")] = None,
    device_preset: Annotated[Optional[str], typer.Option("--device-preset", help="Sweep the cluster preset, "
                                                         "e.g. aws-p3.16xlarge,dgx-a100.")] = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods (dashes or underscores).")] = (
        "alpa,intra-only,inter-only,megatron"),
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Directory for the CSV, markdown and PNG.")] = Path(
        "out/sweep"),
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write the JSON report (what --json "
                                                     "prints) to this file.")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Points planned in parallel "
                                                   "(processes; default: one per CPU).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    no_overlap: NoOverlapOpt = False,
    bucket_mb: BucketOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What-if sweep of one cluster parameter x methods: table, CSV, markdown and a plot."""
    from alpasim import experiments as ex

    given = {"inter_node_gbps": ("--inter-node-gbps", inter_node_gbps, float),
             "devices_per_node": ("--devices-per-node", devices_per_node, int),
             "memory_gb": ("--memory-gb", memory_gb, float), "device": ("--device-preset", device_preset, str)}
    axes = [a for a, (_, text, _) in given.items() if text is not None]
    if len(axes) != 1:
        names = ", ".join(opt for opt, _, _ in given.values())
        fail(f"sweep exactly one axis: give one of {names}" + (f" (got {len(axes)})" if axes else ""))
    axis = axes[0]
    option, text, kind = given[axis]
    if kind is str:
        values: list = [v.strip() for v in text.split(",")]
        for v in values:
            cm.get_cluster(v)  # unknown preset: one line, exit 2
    else:
        values = number_list(option, text, kind)
    names = method_list(methods)
    buckets = bucket_bytes(no_overlap, bucket_mb)
    if gpus < 1:
        fail(f"--gpus must be at least 1, got {gpus}")
    check_workers(workers)
    writable_dir(out_dir, "--out-dir")
    writable_file(out_path, "--out")
    gr.model_source(model)  # an unknown model or a bad graph file fails before any point is planned
    for v in values:
        ex.sweep_cluster(axis, v, gpus, cluster)  # a GPU count that is no whole number of nodes
    n = workers if workers is not None else min(os.cpu_count() or 1, len(values) * len(names))
    with points_map(n, ray, ray_address) as map_fn:
        report = ex.sweep(model, gpus, axis, values, names, cluster_name=cluster, workers=n, cache=not no_cache,
                          map_fn=map_fn, progress=_point_progress(time.perf_counter()), bucket_bytes=buckets)
    try:
        files = report.write(out_dir)
    except OSError as e:
        fail(f"cannot write {out_dir}: {e.strerror or e}")
    if out_path is not None:
        files["json"] = str(out_path)
    doc = {**report.to_json(), "files": files}
    if out_path is not None:
        write_text(out_path, json.dumps(doc, indent=2) + "\n", "--out")
    if as_json:
        emit_json(doc)
        return
    _print_sweep(report, files)


_SWEEP_HEADERS = {"inter_node_gbps": "Gb/s", "devices_per_node": "GPUs/node", "memory_gb": "GiB",
                  "device": "preset"}


def _print_sweep(report: Any, files: dict[str, str]) -> None:
    from alpasim import experiments as ex

    gap = "alpa" in report.methods and "intra_only" in report.methods
    t = Table(title=f"{report.title()}, simulated PFLOP/s")
    t.add_column(_SWEEP_HEADERS[report.axis], no_wrap=True)
    for m in report.methods:
        t.add_column(m, justify="right")
    if gap:
        t.add_column("alpa / intra_only", justify="right")
    for v in report.values:
        cells = [ex.sweep_cell(report.result(v, m)) for m in report.methods]
        if gap:
            g = report.gap(v)
            cells.append("" if g is None else f"{g:.2f}x")
        t.add_row(ex.value_label(v), *cells)
    out.print(t)
    plans = report.alpa_plans()
    if plans:
        pt = Table(title="Alpa's plan at each value (stage layers on submesh as logical mesh)")
        for col in ("value", "plan", "change"):
            pt.add_column(col)
        for p in plans:
            pt.add_row(ex.value_label(p["value"]), p["summary"], p["change"])
        out.print(pt)
    cached = sum(r.cached for r in report.results)
    out.print(f"{len(report.results)} points ({cached} cached); wrote " + ", ".join(files.values()))

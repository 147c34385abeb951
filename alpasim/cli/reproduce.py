"""`alpasim reproduce`: one of the paper's figures or tables, in simulation."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ._common import (
    JsonOpt, RayAddressOpt, RayOpt, app, emit_json, err, fail, out, points_map, writable_dir, writable_file,
    write_text,
)


@app.command()
def reproduce(
    name: Annotated[str, typer.Argument(help="fig7a, fig7b, fig7c, fig8, fig9, fig11 or table5.")],
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Directory for <name>.csv, .png and .md.")] = Path(
        "out/reproduce"),
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write the JSON report (what --json "
                                                     "prints) to this file.")] = None,
    workers: Annotated[int, typer.Option("--workers", help="Points planned in parallel (processes).")] = 2,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    max_gpus: Annotated[Optional[int], typer.Option("--max-gpus", help="Only the points on at most N GPUs.")] = None,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reproduce one of the paper's figures or tables in simulation (CSV + PNG + markdown)."""
    from alpasim import experiments as ex

    if name not in ex.FIGURES:
        fail(f"unknown figure {name!r}; choose one of {', '.join(ex.FIGURES)}")
    if workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    if max_gpus is not None and max_gpus < 1:
        fail(f"--max-gpus must be at least 1, got {max_gpus}")
    points = ex.figure_points(name, max_gpus)
    if not points:
        fail(f"{name} has no points on at most {max_gpus} GPUs")
    writable_dir(out_dir, "--out-dir")
    writable_file(out_path, "--out")
    t0 = time.perf_counter()

    def progress(done: int, total: int, r: ex.Result) -> None:
        what = f"{r.throughput_pflops:.3f} PFLOPS" if r.feasible else "out of memory"
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.model} on {r.gpus} GPUs, "
                  f"{r.label or r.method}: {what} (planned in {r.plan_s:.1f} s)", markup=False, highlight=False,
                  soft_wrap=True)

    try:
        with points_map(workers, ray, ray_address) as map_fn:
            report = ex.reproduce(name, out_dir, workers=workers, cache=not no_cache, map_fn=map_fn,
                                  progress=progress, points=points)
    except OSError as e:
        fail(f"cannot write {out_dir}: {e.strerror or e}")
    doc = report.to_json()
    if out_path is not None:
        write_text(out_path, json.dumps(doc, indent=2) + "\n", "--out")
    if as_json:
        emit_json(doc)
        return
    _print_reproduction(report)


def _print_reproduction(report) -> None:
    plan_time = report.name == "table5"
    t = Table(title=report.title)
    for col in ("model", "GPUs", "method", "planning time" if plan_time else "PFLOPS"):
        t.add_column(col)
    for p in report.points_json():
        value = (f"{p['plan_s']:.1f} s" if plan_time else
                 f"{p['throughput_pflops']:.3f}" if p["feasible"] else "× (out of memory)")
        t.add_row(p["model"], str(p["gpus"]), p.get("label") or p["method"], value)
    out.print(t)
    s = Table(title="summary (ours vs the paper)")
    for col in ("ratio", "ours", "paper"):
        s.add_column(col)
    for row in report.summary_rows():
        s.add_row(*row)
    out.print(s)
    cached = sum(r.cached for r in report.results)
    out.print(f"{len(report.results)} points ({cached} cached) in {report.wall_s:.1f} s; wrote "
              + ", ".join(report.files.values()))

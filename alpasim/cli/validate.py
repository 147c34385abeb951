"""`alpasim validate`: predictions against published training runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from alpasim import experiments as ex
from alpasim import solvers as sv

from ._common import JsonOpt, TaskProgress, app, emit_json, fail, fmt_bytes, out


@app.command()
def validate(
    rows: Annotated[Optional[str], typer.Option("--rows", help="Only the rows whose id contains this text "
                                                "(e.g. korthikanti, h100 rows: megatron-core).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk stage-cost cache.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Price every published run alpasim keeps (Korthikanti et al. 2022, BLOOM-176B,
    Megatron-core on H100, Llama 3 405B) as its system ran, and print predicted against
    measured seconds per iteration, with the mean absolute percentage error overall and
    per hardware generation, and each priced plan's peak memory per device (predicted:
    no source publishes a row's)."""
    runs = [r for r in ex.PUBLISHED_RUNS if rows is None or rows.lower() in r.id]
    if not runs:
        fail(f"--rows {rows!r} matches no row; the ids are {', '.join(r.id for r in ex.PUBLISHED_RUNS)}")
    with TaskProgress("validate: ") as progress:
        report = ex.validate(runs, sv.DiskCache(enabled=not no_cache), progress=progress.update)
    if as_json:
        emit_json(report)
        return
    t = Table(title="predicted against published iteration times")
    t.add_column("row", no_wrap=True)
    for col in ("GPUs", "system", "measured s", "predicted s", "error"):
        t.add_column(col, overflow="fold")
    t.add_column("peak of memory")
    for r in report["rows"]:
        priced = r["status"] == "priced"
        peak = f"{fmt_bytes(r['predicted_peak_bytes'])} of {fmt_bytes(r['device_memory_bytes'])}" if priced else "-"
        t.add_row(r["id"], f"{r['gpus']:,}", r["system"], f"{r['measured_s']:.2f}",
                  f"{r['predicted_s']:.2f}" if priced else "-", ex.validation_verdict(r), peak)
    out.print(t)
    for line in ex.validation_summary(report):
        out.print(line)
    out.print(f"({report['seconds']:.0f} s of planning)")

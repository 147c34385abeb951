"""`alpasim validate`: predictions against published training runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from alpasim import experiments as ex
from alpasim import solvers as sv

from ._common import JsonOpt, TaskProgress, app, emit_json, err, fail, fmt_bytes, out, writable_file, write_text


@app.command()
def validate(
    rows: Annotated[Optional[str], typer.Option("--rows", help="Only the rows whose id contains this text "
                                                "(e.g. korthikanti, h100 rows: megatron-core).")] = None,
    runs_file: Annotated[Optional[Path], typer.Option(
        "--runs", help="Price the rows of this runs file (schema alpasim.runs/1, e.g. a held-out set) instead of "
                       "the built-in ones.")] = None,
    save_runs: Annotated[Optional[Path], typer.Option(
        "--save-runs", help="Write the rows chosen (built-in, or from --runs) as a runs file, a template with "
                            "every field, and price nothing.")] = None,
    spans: Annotated[bool, typer.Option("--spans", help="Also price each row at every value its unpublished "
                                        "settings could have had (microbatch size 1, 2, 4; recompute none, "
                                        "selective, full) and show the span of predictions, and whether the "
                                        "measured time lies in it (never in the MAPE).")] = False,
    breakdown: Annotated[bool, typer.Option("--breakdown", help="Also show where each predicted iteration goes, "
                                            "as shares of it averaged over the meshes: the stages' passes (their "
                                            "exposed collectives in them), waits on the pipeline's transfers, the "
                                            "sync after the last backward, and idle (the bubble); --json always "
                                            "has it.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk stage-cost cache.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Price every published run alpasim keeps (Korthikanti et al. 2022, BLOOM-176B,
    Megatron-core on H100, Llama 3 405B), or the rows of a runs file (--runs: a
    held-out set), as its system ran, and print predicted against
    measured seconds per iteration, with the mean absolute percentage error overall and
    per hardware generation, and each priced plan's peak memory per device (predicted:
    no source publishes a row's)."""
    try:
        every = ex.PUBLISHED_RUNS if runs_file is None else ex.read_runs_file(runs_file)
    except ex.RunsFileError as e:
        fail(f"--runs {e}")
    runs = [r for r in every if rows is None or rows.lower() in r.id.lower()]
    if not runs:
        fail(f"--rows {rows!r} matches no row; the ids are {', '.join(r.id for r in every)}")
    if save_runs is not None:
        writable_file(save_runs, "--save-runs")
        write_text(save_runs, json.dumps(ex.runs_to_json(runs), indent=2) + "\n", "--save-runs")
        err.print(f"wrote {len(runs)} runs to {save_runs}")
        return
    with TaskProgress("validate: ") as progress:
        report = ex.validate(runs, sv.DiskCache(enabled=not no_cache), progress=progress.update, spans=spans)
    if as_json:
        emit_json(report)
        return
    t = Table(title="predicted against published iteration times")
    t.add_column("row", no_wrap=True)
    for col in ("GPUs", "system", "measured s", "predicted s", "error"):
        t.add_column(col, overflow="fold")
    t.add_column("peak of memory")
    if spans:
        t.add_column("span")               # of the predictions over the unpublished settings
    if breakdown:
        for col in ("passes", "pipeline", "sync", "idle"):
            t.add_column(col, justify="right")
    for r in report["rows"]:
        priced = r["status"] == "priced"
        peak = f"{fmt_bytes(r['predicted_peak_bytes'])} of {fmt_bytes(r['device_memory_bytes'])}" if priced else "-"
        system = r["system"] if r["method"] == "megatron" else f"{r['system']} ({r['method']} search)"
        cells = [r["id"], f"{r['gpus']:,}", system, f"{r['measured_s']:.2f}",
                 f"{r['predicted_s']:.2f}" if priced else "-", ex.validation_verdict(r), peak]
        if spans:
            cells.append(ex.validation_span_cell(r))
        if breakdown:
            cells += ex.validation_breakdown_cells(r)
        t.add_row(*cells)
    out.print(t)
    for line in ex.validation_summary(report):
        out.print(line)
    out.print(f"({report['seconds']:.0f} s of planning)")

"""A reproduced figure's records (`Figure`: what to run and draw; `Report`: its results),
and writing one: CSV of the points, a markdown table, a PNG in the paper's style.

The PNG follows the paper's figures: aggregate throughput (PFLOPS) against GPUs on a
log2 axis, one line per system, a point that ran out of memory drawn as an x (in its system's colour) on
the axis; the ablations of Figures 9 and 11 as grouped bars. Matplotlib is driven through
`Figure` + `FigureCanvasAgg`, never pyplot, so nothing global changes.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._points import Point, Result


@dataclass(frozen=True)
class Figure:
    """One figure or table: what to run, how to summarise it, how to draw it."""

    name: str
    title: str
    points: Callable[[], list[Point]]
    summary: Callable[[list[Result]], dict[str, float | None]]
    paper: dict[str, float]                     # summary key -> the paper's value
    series: tuple[str, ...]                     # plot/table columns, in order
    kind: str = "lines"                         # "lines" (throughput vs GPUs), "bars", "plan_time"
    panels: tuple[str, ...] = ("",)             # model-name prefixes, one panel each
    notes: str = ""


@dataclass
class Report:
    """A reproduced figure: its results, summary ratios, the paper's, and the files."""

    name: str
    title: str
    results: list[Result]
    summary: dict[str, float | None]
    paper: dict[str, float]
    files: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def points_json(self) -> list[dict[str, Any]]:
        return [point_json(r) for r in self.results]

    def summary_rows(self) -> list[tuple[str, str, str]]:
        """(key, ours, paper) for every summary entry, the paper's where it states one."""
        return [(k, fmt_value(k, v), fmt_value(k, self.paper[k]) if k in self.paper else "")
                for k, v in self.summary.items()]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "points": self.points_json(), "summary": self.summary,
                "paper": self.paper, "files": self.files, "wall_s": self.wall_s}


def series_of(r: Result) -> str:
    """The column a result belongs to: its label (a cross-mesh variant) or its method."""
    return r.label or r.method


def point_json(r: Result) -> dict[str, Any]:
    search = r.plan.get("search", {}) if r.plan else {}
    d = {"model": r.model, "gpus": r.gpus, "method": r.method,
         "throughput_pflops": r.throughput_pflops if r.feasible else None, "feasible": r.feasible}
    if r.label:
        d["label"] = r.label
    d["plan_s"] = r.plan_s
    d["ilp_solves"] = search.get("ilp_solves")
    d["cache_hits"] = search.get("cache_hits")
    if not r.feasible and r.notes:
        d["reason"] = r.notes[0]
    return d


CSV_COLUMNS = ("model", "gpus", "method", "label", "feasible", "throughput_pflops", "predicted_pflops",
               "iteration_s", "plan_s", "ilp_solves", "cache_hits", "reason")
OOM = "×"
MARKERS = "osv^D"   # distinct markers keep coinciding curves (alpa = intra_only on one GPU) visible


def write_report(report: Report, fig: Figure, out_dir: Path) -> dict[str, str]:
    """Write `<name>.csv`, `.md` and `.png` under `out_dir`; their paths by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / f"{report.name}.csv", "markdown": out_dir / f"{report.name}.md",
             "png": out_dir / f"{report.name}.png"}
    write_csv(report, paths["csv"])
    paths["markdown"].write_text(markdown(report, fig, png_name=paths["png"].name))
    write_png(report, fig, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def write_csv(report: Report, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r, d in zip(report.results, report.points_json()):
            w.writerow({**{k: d.get(k) for k in CSV_COLUMNS}, "label": r.label,
                        "predicted_pflops": r.predicted_pflops, "iteration_s": r.iteration_s,
                        "reason": d.get("reason", "")})


def fmt_value(key: str, value: float | None) -> str:
    """A summary value for people: ratios as 1.23x, efficiencies as %, seconds, GPUs."""
    if value is None:
        return "n/a"
    if "efficiency" in key:
        return f"{value:.0%}"
    if key.startswith("plan_s"):
        return f"{value:,.1f} s"
    if key.endswith("gpus") or "_gpus_" in key:
        return f"{value:.0f} GPUs"
    return f"{value:.2f}x"


def _cell(r, kind: str) -> str:
    if kind == "plan_time":
        search = r.plan.get("search", {}) if r.plan else {}
        return f"{r.plan_s:.1f} s ({search.get('ilp_solves', '?')} solves)"
    return f"{r.throughput_pflops:.3f}" if r.feasible else OOM


def markdown(report: Report, fig: Figure, png_name: str | None = None) -> str:
    """The figure as markdown: throughput per (model, GPUs) x system, then the summary."""
    series = [s for s in fig.series if any(series_of(r) == s for r in report.results)]
    unit = "planning time" if fig.kind == "plan_time" else "simulated throughput, PFLOPS"
    lines = [f"### {report.title}", "", f"{unit}; {OOM} = out of memory", ""]
    lines.append("| model | GPUs | " + " | ".join(series) + " |")
    lines.append("|---|---:|" + "---:|" * len(series))
    rows: dict[tuple[str, int], dict[str, str]] = {}
    for r in report.results:
        rows.setdefault((r.model, r.gpus), {})[series_of(r)] = _cell(r, fig.kind)
    for (model, gpus), cells in rows.items():
        lines.append(f"| {model} | {gpus} | " + " | ".join(cells.get(s, "") for s in series) + " |")
    lines += ["", "| summary | ours | paper |", "|---|---:|---:|"]
    lines += [f"| {k} | {ours} | {paper} |" for k, ours, paper in report.summary_rows()]
    if fig.notes:
        lines += ["", fig.notes]
    if png_name:
        lines += ["", f"![{report.name}]({png_name})"]
    return "\n".join(lines) + "\n"


def write_png(report: Report, fig: Figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    panels = [p for p in fig.panels if any(r.model.startswith(p) for r in report.results)] or [""]
    mfig = MplFigure(figsize=(4.2 * len(panels), 3.4), dpi=100)
    FigureCanvasAgg(mfig)
    axes = mfig.subplots(1, len(panels), squeeze=False)[0]
    for ax, prefix in zip(axes, panels):
        rs = [r for r in report.results if r.model.startswith(prefix)]
        gpus = sorted({r.gpus for r in rs})
        series = [s for s in fig.series if any(series_of(r) == s for r in rs)]
        if fig.kind == "bars":
            width = 0.8 / max(1, len(series))
            for i, s in enumerate(series):
                for j, g in enumerate(gpus):
                    r = next((r for r in rs if r.gpus == g and series_of(r) == s), None)
                    x = j + (i - (len(series) - 1) / 2) * width
                    if r is not None and r.feasible:
                        ax.bar(x, r.throughput_pflops, width, color=f"C{i}", label=s if j == 0 else None)
                    elif r is not None:
                        ax.plot([x], [0], "x", color=f"C{i}", markersize=10, markeredgewidth=2.5,
                                clip_on=False)
                if not any(series_of(r) == s and r.feasible for r in rs):
                    ax.bar([], [], color=f"C{i}", label=s)
            ax.set_xticks(range(len(gpus)), [str(g) for g in gpus])
        else:
            for i, s in enumerate(series):
                pts = sorted((r for r in rs if series_of(r) == s), key=lambda r: r.gpus)
                y = [r.plan_s if fig.kind == "plan_time" else (r.throughput_pflops if r.feasible else math.nan)
                     for r in pts]
                ax.plot([r.gpus for r in pts], y, MARKERS[i % len(MARKERS)] + "-", color=f"C{i}", label=s,
                        alpha=0.85)
                oom = [r.gpus for r in pts if not r.feasible and fig.kind != "plan_time"]
                if oom:
                    ax.plot(oom, [0] * len(oom), "x", color=f"C{i}", markersize=10, markeredgewidth=2.5,
                            clip_on=False)
            ax.set_xscale("log", base=2)
            ax.set_xticks(gpus, [str(g) for g in gpus])
            ax.set_ylim(bottom=0)
        ax.set_xlabel("#GPUs")
        ax.set_ylabel("planning time (s)" if fig.kind == "plan_time" else "throughput (PFLOPS)")
        ax.set_title(prefix or report.name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    mfig.suptitle(report.title, fontsize=10)
    mfig.tight_layout()
    mfig.savefig(path)

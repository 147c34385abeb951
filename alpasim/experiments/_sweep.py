"""What-if sweeps: one cluster parameter varied, several methods planned at each value.

The seed's follow-up 2 asks how the gap between Alpa and intra-op only moves with
cross-node bandwidth, and whether Alpa's plan adapts. A sweep answers it for any axis:

=================  ==========================================================
axis               what one value changes
=================  ==========================================================
inter_node_gbps    the bandwidth of each node's network card (Gbit/s)
devices_per_node   GPUs per node, the GPU count kept (more nodes when fewer)
memory_gb          device memory (GiB)
device             the cluster preset, hence device, links and node size
=================  ==========================================================

Every (value, method) is a `Point` labelled with the value and run by `run_points`, so
points run in parallel and are cached on disk: an interrupted sweep resumes. The
report keeps, per value, Alpa's chosen plan (stages, submeshes, logical meshes,
microbatches) and says where it changes between neighbouring values.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpasim.costmodels import Cluster, get_cluster
from alpasim.solvers import SYSTEM_BUCKETS

from ._compare import method_name, plan_shape, plan_summary
from ._points import DEFAULT_CLUSTER, Point, Result, run_points

AXES: dict[str, str] = {
    "inter_node_gbps": "inter-node bandwidth per NIC (Gbit/s)",
    "devices_per_node": "devices per node",
    "memory_gb": "device memory (GiB)",
    "device": "cluster preset (device and links)",
}
# Colours and markers per method in the plot, so a method keeps its look across sweeps.
_STYLE = {"alpa": ("tab:red", "o"), "intra_only": ("tab:blue", "s"), "inter_only": ("tab:green", "^"),
          "megatron": ("tab:purple", "D"), "megatron_core": ("tab:brown", "v")}


def sweep_value(axis: str, value: Any) -> float | int | str:
    """`value` as the type the axis takes (float GB/s and GiB, int devices, str preset)."""
    try:
        if axis in ("inter_node_gbps", "memory_gb"):
            v = float(value)
            if not math.isfinite(v) or v <= 0:
                raise ValueError
            return v
        if axis == "devices_per_node":
            v = int(value)
            if v < 1 or str(value).strip() not in (str(v), f"{v}.0"):
                raise ValueError
            return v
        if axis == "device":
            return str(value).strip()
    except ValueError:
        raise ValueError(f"sweep {axis}: {value!r} is not a positive number") from None
    raise ValueError(f"unknown sweep axis {axis!r}; choose one of {', '.join(AXES)}")


def value_label(value: float | int | str) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def sweep_cluster(axis: str, value: Any, gpus: int, cluster_name: str = DEFAULT_CLUSTER,
                  devices_per_node: int | None = None) -> Cluster:
    """The `gpus`-device cluster at one value of the axis: whole nodes of the preset's
    size (or `devices_per_node`), or part of one node."""
    v = sweep_value(axis, value)
    if axis == "device":
        cluster_name = str(v)
    per_node = v if axis == "devices_per_node" else devices_per_node or get_cluster(cluster_name).devices_per_node
    overrides = {axis: v} if axis in ("inter_node_gbps", "memory_gb") else {}
    if gpus <= per_node:
        return get_cluster(cluster_name, nodes=1, devices_per_node=gpus, **overrides)
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    return get_cluster(cluster_name, nodes=gpus // per_node, devices_per_node=per_node, **overrides)


def _plan_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What differs between two of Alpa's plans, in words ('' when nothing does)."""
    if before["feasible"] != after["feasible"]:
        return "becomes feasible" if after["feasible"] else "becomes infeasible"
    parts = []
    n0, n1 = len(before["stages"]), len(after["stages"])
    if n0 != n1:
        parts.append(f"{n0} -> {n1} stages")
    if before["microbatches"] != after["microbatches"]:
        parts.append(f"B {before['microbatches']} -> {after['microbatches']}")
    if n0 == n1:
        for key, what in (("layers", "layer cuts"), ("submesh", "submeshes"), ("logical_mesh", "logical meshes")):
            if [s[key] for s in before["stages"]] != [s[key] for s in after["stages"]]:
                parts.append(f"{what} change")
    return ", ".join(parts)


@dataclass(frozen=True)
class SweepReport:
    """The results of a sweep, value-major: `results[i * len(methods) + j]` is value i, method j."""

    model: str
    gpus: int
    axis: str
    values: tuple[float | int | str, ...]
    methods: tuple[str, ...]
    cluster_name: str
    results: tuple[Result, ...]

    def result(self, value: Any, method: str) -> Result:
        return self.results[self.values.index(value) * len(self.methods) + self.methods.index(method)]

    def rows(self) -> list[dict[str, Any]]:
        """One row per (value, method); throughput and iteration time None when infeasible."""
        return [{"value": v, "method": m, "feasible": r.feasible, "throughput_pflops": r.throughput_pflops,
                 "iteration_s": r.iteration_s, "predicted_pflops": r.predicted_pflops, "plan": plan_summary(r.plan),
                 "plan_s": r.plan_s, "cached": r.cached}
                for v in self.values for m, r in zip(self.methods, self._at(v))]

    def _at(self, value: Any) -> list[Result]:
        i = self.values.index(value) * len(self.methods)
        return list(self.results[i:i + len(self.methods)])

    def gap(self, value: Any, method: str = "alpa", baseline: str = "intra_only") -> float | None:
        """`method`'s throughput over `baseline`'s at `value` (None if either is missing or OOM)."""
        if method not in self.methods or baseline not in self.methods:
            return None
        a, b = self.result(value, method).throughput_pflops, self.result(value, baseline).throughput_pflops
        return a / b if a is not None and b else None

    def alpa_plans(self) -> list[dict[str, Any]]:
        """Alpa's plan at each value, and what changed from the previous value."""
        if "alpa" not in self.methods:
            return []
        out: list[dict[str, Any]] = []
        for v in self.values:
            r = self.result(v, "alpa")
            shape = plan_shape(r.plan)
            change = _plan_change(out[-1]["shape"], shape) if out else ""
            out.append({"value": v, "summary": plan_summary(r.plan), "shape": shape, "change": change,
                        "gap_over_intra_only": self.gap(v)})
        return out

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpus": self.gpus, "axis": self.axis, "cluster": self.cluster_name,
                "values": list(self.values), "methods": list(self.methods), "rows": self.rows(),
                "alpa_plans": self.alpa_plans()}

    # --------------------------------------------------------------- outputs
    def title(self) -> str:
        where = "each preset" if self.axis == "device" else self.cluster_name
        return f"{self.model} on {self.gpus} GPUs ({where})"

    def stem(self) -> str:
        name = Path(self.model).stem if self.model.endswith(".json") else self.model   # a saved graph: its name
        model = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
        return f"sweep-{model}-{self.axis}"

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """Write `<out>/sweep-<model>-<axis>.csv`, `.md` and `.png`; their paths by kind."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {"csv": out / f"{self.stem()}.csv", "md": out / f"{self.stem()}.md", "png": out / f"{self.stem()}.png"}
        self.write_csv(files["csv"])
        files["md"].write_text(self.markdown())
        self.plot(files["png"])
        return {k: str(p) for k, p in files.items()}

    def write_csv(self, path: Path) -> None:
        cols = ("value", "method", "feasible", "throughput_pflops", "iteration_s", "predicted_pflops", "plan")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow((self.axis, *cols[1:]))
            for row in self.rows():
                w.writerow(["" if row[c] is None else row[c] for c in cols])

    def markdown(self) -> str:
        gap = "alpa" in self.methods and "intra_only" in self.methods
        head = [self.axis, *self.methods, *(["alpa / intra_only"] if gap else [])]
        lines = [f"# {self.title()}: {AXES[self.axis]}", "",
                 "Simulated throughput, PFLOP/s (OOM: no plan fits in memory; n/a: the method does not "
                 "take this model).", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for v in self.values:
            cells = [value_label(v)] + [sweep_cell(r) for r in self._at(v)]
            if gap:
                g = self.gap(v)
                cells.append("" if g is None else f"{g:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
        plans = self.alpa_plans()
        if plans:
            lines += ["", "Alpa's plan at each value (stage layers on submesh as logical mesh):", ""]
            for p in plans:
                change = f" — *{p['change']}*" if p["change"] else ""
                lines.append(f"- {value_label(p['value'])}: {p['summary']}{change}")
        return "\n".join(lines) + "\n"

    def plot(self, path: Path) -> None:
        """Throughput vs the swept value, one line per method, OOM as x on the axis;
        a second panel with Alpa's gain over intra-op only when both were swept."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        gap = "alpa" in self.methods and "intra_only" in self.methods
        fig = Figure(figsize=(7.0, 6.5 if gap else 4.2))
        canvas = FigureCanvasAgg(fig)
        axes = fig.subplots(2 if gap else 1, 1, sharex=True, squeeze=False)[:, 0]
        numeric = self.axis != "device"
        xs = list(self.values) if numeric else list(range(len(self.values)))
        ax = axes[0]
        for j, m in enumerate(self.methods):
            color, marker = _STYLE.get(m, (f"C{j}", "o"))
            ys = [self.result(v, m).throughput_pflops for v in self.values]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker=marker, color=color, label=m)
            oom = [x for x, y, v in zip(xs, ys, self.values) if y is None and not self.result(v, m).refused]
            if oom:
                ax.plot(oom, [0.0] * len(oom), linestyle="none", marker="x", markersize=9, color=color,
                        clip_on=False, label=f"{m} OOM")
        ax.set_ylabel("throughput (PFLOP/s)")
        ax.set_ylim(bottom=0)
        ax.set_title(self.title())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if gap:
            g = [self.gap(v) for v in self.values]
            axes[1].plot(xs, [math.nan if y is None else y for y in g], marker="o", color="black")
            axes[1].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            axes[1].set_ylabel("alpa / intra-op only")
            axes[1].grid(True, alpha=0.3)
        bottom = axes[-1]
        if self.axis == "inter_node_gbps":
            bottom.set_xscale("log")
            bottom.set_xticks(xs, [value_label(v) for v in self.values])
            bottom.minorticks_off()
        elif not numeric:
            bottom.set_xticks(xs, [value_label(v) for v in self.values])
        bottom.set_xlabel(AXES[self.axis])
        fig.tight_layout()
        canvas.print_png(str(path))


def sweep_cell(r: Result) -> str:
    """A table cell: throughput, OOM, or n/a for a method that does not take the model."""
    if r.throughput_pflops is not None:
        return f"{r.throughput_pflops:.3f}"
    return "n/a" if r.refused else "OOM"


def sweep(model: str, gpus: int, axis: str, values: Sequence[Any], methods: Sequence[str], *,
          cluster_name: str = DEFAULT_CLUSTER, devices_per_node: int | None = None,
          microbatches: int | str = "auto", workers: int | None = None, cache: bool = True,
          map_fn: Callable[[Callable, Iterable], Iterable] | None = None,
          progress: Callable[[int, int, Result], None] | None = None,
          bucket_bytes: float | str | None = SYSTEM_BUCKETS) -> SweepReport:
    """Plan and simulate `model` on `gpus` devices with each method at each value of
    `axis` (see the module doc) on whole nodes of `cluster_name` (of `devices_per_node`
    devices when given); `microbatches` fixes B for the methods that search it (Megatron's
    grid sets its own); `bucket_bytes` as `Point`'s. Points run in parallel and are cached."""
    if axis not in AXES:
        raise ValueError(f"unknown sweep axis {axis!r}; choose one of {', '.join(AXES)}")
    vals = tuple(dict.fromkeys(sweep_value(axis, v) for v in values))
    names = tuple(dict.fromkeys(method_name(m) for m in methods))
    if not vals or not names:
        raise ValueError("a sweep needs at least one value and one method")
    clusters = {v: sweep_cluster(axis, v, gpus, cluster_name, devices_per_node) for v in vals}
    points = [Point(model, clusters[v], m, microbatches=microbatches, label=value_label(v), bucket_bytes=bucket_bytes)
              for v in vals for m in names]
    results = run_points(points, cache=cache, workers=workers, map_fn=map_fn, progress=progress)
    return SweepReport(model, gpus, axis, vals, names, cluster_name, tuple(results))

"""Timeline outputs: Chrome trace JSON and matplotlib charts (Agg, no pyplot state)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._timeline import Timeline

COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "backward_input": "#55A868", "backward_weight": "#64B5CD",
           "recv": "#C44E52", "allgather": "#DD8452", "sync": "#8172B3", "idle": "#E5E5E5"}
# A run's trace label: its pass letter (zero-bubble papers' F, B, W) and microbatch.
LETTERS = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
LINK_TID_BASE = 1_000_000  # link tracks sort after device tracks (tid = device id) within a node


def write_chrome_trace(tl: Timeline, path: Path) -> Path:
    """Trace Event Format: "X" events, pid per node, one tid per device (a mesh's
    devices run the same SPMD program, so each shows its mesh's events) and per link,
    plus a memory counter per mesh. Times are in microseconds."""
    trace: list[dict[str, Any]] = []
    mesh_tracks: dict[str, list[tuple[int, int]]] = {}     # mesh -> (pid, tid) of each device
    named: set[int] = set()

    def process(pid: int) -> None:
        if pid not in named:
            named.add(pid)
            trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"node {pid}"}})

    for m in tl.meshes:
        nodes = m.device_nodes or (0,) * len(m.devices)
        mesh_tracks[f"mesh{m.stage}"] = list(zip(nodes, m.devices))
        for pid, d in zip(nodes, m.devices):
            process(pid)
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": d,
                          "args": {"name": f"device {d} (mesh {m.stage})"}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": d,
                          "args": {"sort_index": d}})
    link_at: dict[str, tuple[int, int]] = {}
    for i, (name, node) in enumerate(tl.links):
        process(node)
        link_at[name] = (node, LINK_TID_BASE + i)
        trace.append({"ph": "M", "name": "thread_name", "pid": node, "tid": LINK_TID_BASE + i,
                      "args": {"name": name}})
    for e in tl.events:
        label = e.name if e.kind != "compute" else f"{LETTERS.get(e.name, e.name[:1].upper())}{e.microbatch}"
        if e.kind == "compute" and tl.chunks > 1:
            label += f".{e.chunk}"
        args = {"stage": e.stage, "microbatch": e.microbatch, "bytes": e.nbytes}
        base = {"ph": "X", "name": label, "cat": e.kind, "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6,
                "args": args}
        if e.track in mesh_tracks:
            for pid, tid in mesh_tracks[e.track]:
                trace.append({**base, "pid": pid, "tid": tid})
        else:
            pid, tid = link_at[e.track]
            trace.append({**base, "pid": pid, "tid": tid})
    for m, samples in zip(tl.meshes, tl.memory):
        pid = (list(m.nodes) or [0])[0]
        for t, b in samples:
            trace.append({"ph": "C", "name": f"memory mesh {m.stage} (GiB/device)", "pid": pid, "ts": t * 1e6,
                          "args": {"GiB": b / 2**30}})
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms",
                                "otherData": {"schedule": tl.schedule, "iteration_s": tl.iteration_s}}))
    return path


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_gantt_png(tl: Timeline, path: Path) -> Path:
    """One row per mesh; forward, backward, communication, sync and idle in colours."""
    from matplotlib.patches import Patch

    rows = tl.num_meshes
    fig = _figure(12, 1.6 + 0.45 * rows)
    ax = fig.add_subplot()
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in list(tl.events) + tl.idle_events():
        if not e.track.startswith("mesh"):
            continue
        key = e.name if e.kind == "compute" else e.kind
        bars.setdefault((int(e.track[4:]), key), []).append((e.start_s, e.duration_s))
    for (row, key), spans in sorted(bars.items()):
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS.get(key, "#999999"), linewidth=0)
    ax.set_yticks(range(rows), [f"mesh {k}" for k in range(rows)])
    ax.invert_yaxis()
    ax.set_xlim(0, max(tl.iteration_s, 1e-12))
    ax.set_xlabel("time (s)")
    ax.set_title(f"{tl.schedule}: {tl.microbatches} microbatches, iteration {tl.iteration_s:.4g} s, "
                 f"bubble {tl.bubble_fraction:.1%}")
    shown = {key for _, key in bars}
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k in shown],
               loc="outside lower center", ncol=len(COLOURS), frameon=False)
    fig.savefig(path, dpi=110)
    return path


def write_memory_png(tl: Timeline, path: Path) -> Path:
    """Per-device memory (GiB) over the iteration, one step line per mesh."""
    fig = _figure(10, 4.5)
    ax = fig.add_subplot()
    for m, samples in zip(tl.meshes, tl.memory):
        last: dict[float, float] = {}
        for t, b in samples:  # the state after each instant, not the steps within it
            last[t] = b / 2**30
        ts, bs = list(last) + [tl.iteration_s], list(last.values())
        bs.append(bs[-1])
        ax.step(ts, bs, where="post", label=f"mesh {m.stage}", linewidth=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory per device (GiB)")
    ax.set_title(f"{tl.schedule}: memory per device")
    ax.legend(fontsize="small", ncol=max(1, tl.num_meshes // 8))
    fig.savefig(path, dpi=110)
    return path

"""`alpasim simulate`: one iteration of a plan file in the discrete-event simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from alpasim import simulator as sim
from alpasim import solvers as sv
from alpasim.experiments import simulation_report

from ._common import CostModelOpt, JsonOpt, app, emit_json, err, fail, fmt_bytes, load_cost_model, out, writable_file


@app.command()
def simulate(
    plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `alpasim plan --out`.")],
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="1f1b, gpipe, interleaved, zb-h1 or "
                                                                      "zb-h2 (zero bubble: the backward split "
                                                                      "into input and weight gradients); "
                                                                      "default: the plan's.")] = None,
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Model chunks per mesh the interleaved "
                                                  "schedule imagines each stage cut into (default 2; a plan "
                                                  "planned interleaved runs its own).")] = None,
    cross_mesh: Annotated[str, typer.Option("--cross-mesh", help="Cross-mesh resharding: local_all_gather, "
                                            "send_recv or signal.")] = "local_all_gather",
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write a Chrome trace JSON (Perfetto).")] = None,
    gantt: Annotated[Optional[Path], typer.Option("--gantt", help="Write a Gantt chart PNG.")] = None,
    memory_png: Annotated[Optional[Path], typer.Option("--memory-png", help="Write memory over time PNG.")] = None,
    cost_model: CostModelOpt = None,
    no_overlap: Annotated[bool, typer.Option("--no-overlap", help="Run the plan's gradient buckets after the "
                                             "last backward instead of overlapped with it.")] = False,
    p2p: Annotated[Optional[str], typer.Option("--p2p", help="Pipeline sends: overlapped (a stage runs on while "
                                               "its output is on the wire) or blocking (it waits until the "
                                               "output has landed, as DeepSpeed's and Megatron's pipelines do); "
                                               "default: as the plan's system ran.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate one training iteration of a plan: iteration time, bubbles, memory, traffic.

    With `--cost-model`, transfers between meshes use the profile's measured link
    inside a node; stage compute and sync times stay those the plan was priced with
    (re-plan with `--cost-model` to re-price them; a note says when the plan's model
    differs)."""
    if schedule is not None and schedule not in sim.SCHEDULES:
        fail(f"--schedule {schedule!r}: choose one of {', '.join(sim.SCHEDULES)}")
    if cross_mesh not in sim.CROSS_MESH_METHODS:
        fail(f"--cross-mesh {cross_mesh!r}: choose one of {', '.join(sim.CROSS_MESH_METHODS)}")
    if chunks is not None and chunks < 1:
        fail(f"--chunks must be at least 1, got {chunks}")
    if p2p is not None and p2p not in sv.P2P_MODES:
        fail(f"--p2p {p2p!r}: choose {' or '.join(sv.P2P_MODES)}")
    for path, option in ((trace, "--trace"), (gantt, "--gantt"), (memory_png, "--memory-png")):
        writable_file(path, option)
    p = sv.load_plan(plan_file)
    if chunks is not None and p.chunks > 1 and chunks != p.chunks:
        fail(f"--chunks {chunks}: the plan is cut into {p.chunks} chunks per mesh, which it runs (re-plan with "
             f"`alpasim plan --schedule interleaved --chunks {chunks}` for another count)")
    chunks = chunks if chunks is not None else 2
    if sim.SCHEDULES[schedule or p.schedule].chunked and p.chunks == 1:
        i, st = min(enumerate(p.stages), key=lambda x: x[1].layers[1] - x[1].layers[0])
        if chunks > st.layers[1] - st.layers[0] + 1:
            fail(f"--chunks {chunks}: stage {i} holds {st.layers[1] - st.layers[0] + 1} layer(s); a stage cannot be "
                 "cut into more chunks than it has layers")
    cluster, model_note = None, None
    if cost_model is not None:
        base = sim.plan_cluster(p)
        if base is None:
            fail(f"{plan_file}: the plan records no cluster spec to bind --cost-model to")
        model = load_cost_model(cost_model, base)
        cluster = model.cluster
        priced_by = p.search.cost_model
        if priced_by is None or priced_by.digest != model.digest:
            model_note = (f"stage times come from the plan (priced by "
                          f"{priced_by.name if priced_by else 'the analytic model'}); only cross-mesh "
                          f"links use {cost_model}")
    report = simulation_report(p, schedule, chunks=chunks, cross_mesh=cross_mesh, trace=trace, gantt=gantt,
                               memory_png=memory_png, cluster=cluster, overlap=not no_overlap,
                               blocking_sends=None if p2p is None else p2p == "blocking")
    if model_note is not None:
        report["notes"] = [*report["notes"], model_note]
    if as_json:
        emit_json(report)
        return
    print_simulation(report, title=f"{plan_file}: {p.model.name}")


def print_simulation(r: dict[str, Any], title: str = "simulation") -> None:
    chunked = sim.SCHEDULES[r["schedule"]].chunked
    sched = r["schedule"] + (f", {r['chunks']} chunks" if chunked else "")
    t = Table(title=f"{title} — {sched}, {r['microbatches']} microbatches, cross-mesh {r['cross_mesh']}")
    for col in ("mesh", "devices", "compute", "sync", "communication", "idle", "peak memory / device"):
        t.add_column(col)
    peaks = r["peak_memory_bytes"]
    for m in r["meshes"]:
        devs = m["devices"]
        t.add_row(str(m["stage"]), f"{devs[0]}..{devs[-1]}" if len(devs) > 1 else str(devs[0]),
                  f"{m['compute_s']:.3f} s", f"{m['sync_s']:.3f} s", f"{m['comm_s']:.3f} s", f"{m['idle_s']:.3f} s",
                  fmt_bytes(max(peaks[d] for d in devs)))
    out.print(t)
    pred = r["predicted_iteration_s"]
    basis = "eq. 2" if not chunked or r.get("plan_chunks", 1) == 1 else "its chunks' orders"
    vs = f" (plan predicted {pred:.3f} s, {basis})" if pred else ""
    out.print(f"simulated iteration {r['iteration_s']:.3f} s{vs}, bubble {r['bubble_fraction']:.1%}, "
              f"cross-mesh traffic {fmt_bytes(r['cross_mesh_bytes'])} ({fmt_bytes(r['inter_node_bytes'])} "
              f"between nodes); simulated in {r['wall_s']:.2f} s")
    for note in r["notes"]:
        err.print(f"note: {note}", markup=False)
    for key, path in r["outputs"].items():
        out.print(f"wrote {key.replace('_', ' ')}: {path}", soft_wrap=True)

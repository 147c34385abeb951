"""`alpasim graph`: a model's training graph — parameters, FLOPs, ops, layers, memory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from alpasim.experiments import graph_report

from ._common import (
    ModelArg, ModelOpt, one_model, DpnOpt, GbpsOpt, JsonOpt, MemOpt, NodesOpt, RecomputeOpt, app, check_recompute,
    emit_json, err, fmt_bytes, fmt_count, fmt_flops, load_cluster, out, writable_file, writing,
)


@app.command()
def graph(
    model_arg: ModelArg = None,
    model_opt: ModelOpt = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="Preset or JSON: add per-device view.")] = None,
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Re-cluster into L layers (eq. 6 DP).")] = None,
    remat: Annotated[bool, typer.Option("--remat", help="Full activation rematerialisation.")] = False,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Override the global batch.")] = None,
    save: Annotated[Optional[Path], typer.Option("--save", help="Write the model's forward graph JSON here: a "
                                                 "model file that plan, compare and sweep take as --model (a zoo "
                                                 "model's file plans exactly as its name does). The model as "
                                                 "given: --layers, --remat and --recompute shape this report's "
                                                 "training graph, not the file (plan takes them itself).")] = None,
    recompute: RecomputeOpt = "none",
    as_json: JsonOpt = False,
) -> None:
    """Parameters, FLOPs per iteration, op counts per phase and layers of a training graph."""
    model = one_model(model_arg, model_opt)
    check_recompute(recompute)
    writable_file(save, "--save")
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb) if cluster else None
    with writing(save, "--save"):
        report = graph_report(model, layers=layers, remat=remat, batch=batch, cluster=c, save=save,
                              recompute=recompute)
    if save is not None:
        err.print(f"wrote {save}", soft_wrap=True)
    if as_json:
        emit_json(report)
        return
    _print_graph(report)


def _print_graph(r: dict[str, Any]) -> None:
    t = Table(title=f"{r['name']} ({r['family']}, {r['dtype']})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
    t.add_row("configuration", cfg)
    t.add_row("parameters", f"{r['params']:,} ({fmt_count(r['params'])})")
    t.add_row("layers", str(r["layers"]))
    t.add_row("ops", ", ".join(f"{k} {v}" for k, v in r["ops"].items()))
    for label, key in (("FLOPs / iteration", "flops_without_remat"), ("  with remat", "flops_with_remat")):
        f = r[key]
        t.add_row(label, f"{fmt_flops(f['matmul'])} in contractions ({fmt_flops(f['total'])} in all)")
    m = r["memory"]
    t.add_row("model states", f"params {fmt_bytes(m['params_bytes'])}, grads {fmt_bytes(m['grads_bytes'])}, "
                              f"optimizer {fmt_bytes(m['optimizer_bytes'])}")
    t.add_row("activations (peak)", fmt_bytes(m["activations_peak_bytes"])
              + (" with remat" if r["remat"] else "") + " — whole batch in one pass, no microbatching")
    t.add_row("graph build", f"{r['build_s']:.2f} s")
    if "cluster" in r:
        c, v = r["cluster"], r["on_cluster"]
        t.add_row("cluster", f"{c['name']}: {c['nodes']} x {c['devices_per_node']} {c['device']['name']}")
        t.add_row("device memory", f"{fmt_bytes(v['device_memory_bytes'])}; whole step fits one device: "
                                   f"{'yes' if v['fits_one_device'] else 'no'}; model states alone need "
                                   f">= {v['min_devices_for_model_states']} devices")
        t.add_row("one device, roofline", f"{v['single_device_iteration_s']:.2f} s / iteration "
                                          f"({v['ideal_tflops_per_device']:.1f} TFLOP/s in contractions)")
        t.add_row("ideal on all devices", f"{v['ideal_iteration_s']:.3f} s / iteration (perfect scaling bound)")
    out.print(t)

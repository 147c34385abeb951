"""The `alpasim` command: models, clusters, graph (and, in later issues, plan/simulate/run).

Every subcommand takes `--json` to print exactly one JSON object on stdout; tables
and progress go to the terminal otherwise, logs to stderr. A user mistake (unknown
name, malformed spec or file, impossible cluster) prints one line on stderr and exits
with status 2 — never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from alpasim import costmodels as cm
from alpasim import graphs as gr

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and run Alpa-style parallel training.")
out = Console()
err = Console(stderr=True)

USER_ERRORS = (gr.UnknownModelError, gr.ModelSpecError, gr.GraphFormatError, gr.GraphError,
               cm.ClusterError, cm.UnknownPresetError)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="Preset name or cluster JSON file.")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Override the number of nodes.")]
DpnOpt = Annotated[Optional[int], typer.Option("--devices-per-node", help="Override devices per node.")]
GbpsOpt = Annotated[Optional[float], typer.Option("--inter-node-gbps", help="Override inter-node bandwidth.")]
MemOpt = Annotated[Optional[float], typer.Option("--memory-gb", help="Override device memory (GiB).")]


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"alpasim: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise SystemExit(code)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def load_cluster(spec: str, nodes: int | None = None, devices_per_node: int | None = None,
                 inter_node_gbps: float | None = None, memory_gb: float | None = None) -> cm.Cluster:
    """A preset by name or a cluster JSON file, with command-line overrides applied."""
    overrides = {"nodes": nodes, "devices_per_node": devices_per_node,
                 "inter_node_gbps": inter_node_gbps, "memory_gb": memory_gb}
    if spec.endswith(".json") or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise cm.ClusterError(f"{spec}: no such file")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise cm.ClusterError(f"{spec}: not valid JSON ({e})") from None
        try:
            cluster = cm.Cluster.from_json(data)
        except cm.ClusterError as e:
            raise cm.ClusterError(f"{spec}: {e}") from None
        return cluster.with_overrides(**overrides)
    return cm.get_cluster(spec, **overrides)


def model_with_batch(model: str, batch: int | None) -> tuple[str, Any]:
    """(name, config or graph) for a model, its batch overridden when asked."""
    if model.endswith(".json") and Path(model).is_file():
        fwd = gr.load_forward(model)
        if batch is not None:
            fail(f"--batch cannot resize a saved graph ({model}); rebuild it at the batch you want")
        return fwd.name, fwd
    name, cfg = gr.resolve_model(model)
    if batch is not None:
        try:
            cfg = dataclasses.replace(cfg, batch=batch)
        except ValueError as e:
            fail(f"--batch {batch}: {e}")
    return name, cfg


def _fmt_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _fmt_flops(x: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if x >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.3g} FLOP"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


# ---------------------------------------------------------------------- models
@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the model zoo (the paper's GPT-3, GShard MoE and Wide-ResNet sizes)."""
    rows = []
    for name in gr.model_names():
        _, cfg = gr.resolve_model(name)
        g = gr.forward_graph(name)
        rows.append({"name": name, "family": cfg.family, "params": g.num_params(),
                     "paper_gpus": gr.PAPER_GPUS.get(name), "config": dataclasses.asdict(cfg)})
    if as_json:
        emit_json({"models": rows})
        return
    t = Table(title="alpasim model zoo (global batch as in the paper)")
    for col in ("name", "family", "params", "paper GPUs", "configuration"):
        t.add_column(col)
    for r in rows:
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        t.add_row(r["name"], r["family"], _fmt_count(r["params"]), str(r["paper_gpus"] or ""), cfg)
    out.print(t)
    out.print("Custom sizes: a spec such as 'gpt3:hidden=4096,layers=32,heads=32' or 'gpt3-1.3b:batch=16'.")


# -------------------------------------------------------------------- clusters
def _cluster_json(c: cm.Cluster) -> dict[str, Any]:
    d = c.to_json()
    d["num_devices"] = c.num_devices
    return d


@app.command()
def clusters(as_json: JsonOpt = False) -> None:
    """List the cluster presets with their devices and links."""
    presets = [cm.get_cluster(n) for n in cm.list_presets()]
    if as_json:
        emit_json({"clusters": [_cluster_json(c) for c in presets]})
        return
    t = Table(title="alpasim cluster presets")
    for col in ("name", "nodes x devices", "device", "memory", "fp16 peak", "intra-node", "inter-node"):
        t.add_column(col)
    for c in presets:
        d = c.device
        t.add_row(c.name, f"{c.nodes} x {c.devices_per_node}", d.name, _fmt_bytes(d.memory_bytes),
                  f"{d.peak_flops_per_s('float16') / 1e12:.0f} TFLOP/s",
                  f"{c.intra_node.bandwidth_gbps:g} Gb/s", _inter_node_text(c))
    out.print(t)
    out.print("Override any of them: --nodes, --devices-per-node, --inter-node-gbps, --memory-gb.")


def _inter_node_text(c: cm.Cluster) -> str:
    nics = getattr(c, "nics_per_node", 1)
    return f"{nics} x {c.inter_node.bandwidth_gbps:g} Gb/s per node"


# ----------------------------------------------------------------------- graph
def graph_report(model: str, *, layers: int | None, remat: bool, batch: int | None,
                 cluster: cm.Cluster | None) -> dict[str, Any]:
    """Everything `alpasim graph` shows, as one JSON-ready dict."""
    t0 = time.perf_counter()
    name, source = model_with_batch(model, batch)
    fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
    built = gr.build_training_graph(fwd, layers=layers, remat=remat)
    build_s = time.perf_counter() - t0
    g = built.graph
    other = gr.build_training_graph(fwd, layers=layers, remat=not remat).graph
    flops = gr.flops_by_kind(g)
    flops_other = gr.flops_by_kind(other)
    mem = cm.training_memory(g)
    report: dict[str, Any] = {
        "name": name,
        "family": fwd.meta.get("family", "imported"),
        "config": fwd.meta.get("config", {}),
        "dtype": fwd.meta.get("dtype"),
        "params": g.num_params(),
        "flops": flops,
        "flops_without_remat": flops_other if remat else flops,
        "flops_with_remat": flops if remat else flops_other,
        "remat": remat,
        "ops": gr.ops_by_phase(g),
        "layers": g.num_layers,
        "clustering": None if built.clustering is None else {
            "delta": built.clustering.delta, "max_received_bytes": built.clustering.max_received_bytes},
        "memory": {"params_bytes": mem.params_bytes, "grads_bytes": mem.grads_bytes,
                   "optimizer_bytes": mem.optimizer_bytes, "activations_peak_bytes": mem.activations_peak_bytes,
                   "total_bytes": mem.total_bytes},
        "build_s": build_s,
    }
    if cluster is not None:
        report["cluster"] = _cluster_json(cluster)
        report["on_cluster"] = _cluster_view(g, mem, cluster)
    return report


def _cluster_view(g: gr.OpGraph, mem: cm.MemoryBreakdown, cluster: cm.Cluster) -> dict[str, Any]:
    """What one device of the cluster would need, and an ideal-scaling time bound."""
    model = cm.AnalyticCostModel(cluster)
    single_s = sum(model.op_time_s(op, g.tensors) for op in g.ops)
    device_mem = cluster.device.memory_bytes
    states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
    return {
        "device_memory_bytes": device_mem,
        "fits_one_device": mem.total_bytes <= device_mem,
        "min_devices_for_model_states": max(1, -(-states // device_mem)),
        "single_device_iteration_s": single_s,
        "ideal_iteration_s": single_s / cluster.num_devices,
        "ideal_tflops_per_device": gr_matmul(g) / single_s / 1e12 if single_s else 0.0,
    }


def gr_matmul(g: gr.OpGraph) -> float:
    return gr.flops_by_kind(g)["matmul"]


@app.command()
def graph(
    model: Annotated[str, typer.Argument(help="Zoo name, spec string, model JSON or graph JSON.")],
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="Preset or JSON: add per-device view.")] = None,
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Re-cluster into L layers (eq. 6 DP).")] = None,
    remat: Annotated[bool, typer.Option("--remat", help="Full activation rematerialisation.")] = False,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Override the global batch.")] = None,
    save: Annotated[Optional[Path], typer.Option("--save", help="Write the training graph JSON here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Parameters, FLOPs per iteration, op counts per phase and layers of a training graph."""
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb) if cluster else None
    report = graph_report(model, layers=layers, remat=remat, batch=batch, cluster=c)
    if save is not None:
        name, source = model_with_batch(model, batch)
        fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
        gr.save_graph(gr.build_training_graph(fwd, layers=layers, remat=remat).graph, save)
        err.print(f"wrote {save}")
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
    t.add_row("parameters", f"{r['params']:,} ({_fmt_count(r['params'])})")
    t.add_row("layers", str(r["layers"]))
    t.add_row("ops", ", ".join(f"{k} {v}" for k, v in r["ops"].items()))
    for label, key in (("FLOPs / iteration", "flops_without_remat"), ("  with remat", "flops_with_remat")):
        f = r[key]
        t.add_row(label, f"{_fmt_flops(f['matmul'])} in contractions ({_fmt_flops(f['total'])} in all)")
    m = r["memory"]
    t.add_row("model states", f"params {_fmt_bytes(m['params_bytes'])}, grads {_fmt_bytes(m['grads_bytes'])}, "
                              f"optimizer {_fmt_bytes(m['optimizer_bytes'])}")
    t.add_row("activations (peak)", _fmt_bytes(m["activations_peak_bytes"])
              + (" with remat" if r["remat"] else "") + " — whole batch in one pass, no microbatching")
    t.add_row("graph build", f"{r['build_s']:.2f} s")
    if "cluster" in r:
        c, v = r["cluster"], r["on_cluster"]
        t.add_row("cluster", f"{c['name']}: {c['nodes']} x {c['devices_per_node']} {c['device']['name']}")
        t.add_row("device memory", f"{_fmt_bytes(v['device_memory_bytes'])}; whole step fits one device: "
                                   f"{'yes' if v['fits_one_device'] else 'no'}; model states alone need "
                                   f">= {v['min_devices_for_model_states']} devices")
        t.add_row("one device, roofline", f"{v['single_device_iteration_s']:.2f} s / iteration "
                                          f"({v['ideal_tflops_per_device']:.1f} TFLOP/s in contractions)")
        t.add_row("ideal on all devices", f"{v['ideal_iteration_s']:.3f} s / iteration (perfect scaling bound)")
    out.print(t)


def main() -> None:
    """Console-script entry point: user errors become one line and exit status 2."""
    try:
        app()
    except USER_ERRORS as e:
        fail(str(e))
    except ValueError as e:  # validation errors from configs and specs
        fail(str(e))


if __name__ == "__main__":
    main()

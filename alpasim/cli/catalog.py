"""`alpasim models`, `alpasim clusters` and `alpasim methods`: what the zoo, the cluster presets and
the planning methods with their system profiles hold."""

from __future__ import annotations

import dataclasses

from rich.table import Table

from alpasim import costmodels as cm
from alpasim import graphs as gr
from alpasim import solvers as sv
from alpasim.experiments import cluster_json

from ._common import JsonOpt, app, emit_json, fmt_bytes, fmt_count, out


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
        t.add_row(r["name"], r["family"], fmt_count(r["params"]), str(r["paper_gpus"] or ""), cfg)
    out.print(t)
    out.print("Custom sizes: a spec such as 'gpt3:hidden=4096,layers=32,heads=32' or 'gpt3-1.3b:batch=16'.")


@app.command()
def clusters(as_json: JsonOpt = False) -> None:
    """List the cluster presets with their devices and links."""
    presets = [cm.get_cluster(n) for n in cm.list_presets()]
    if as_json:
        emit_json({"clusters": [cluster_json(c) for c in presets]})
        return
    t = Table(title="alpasim cluster presets")
    for col in ("name", "nodes x devices", "device", "memory", "fp16 peak", "intra-node", "inter-node"):
        t.add_column(col)
    for c in presets:
        d = c.device
        t.add_row(c.name, f"{c.nodes} x {c.devices_per_node}", d.name, fmt_bytes(d.memory_bytes),
                  f"{d.peak_flops_per_s('float16') / 1e12:.0f} TFLOP/s",
                  f"{c.intra_node.bandwidth_gbps:g} Gb/s", _inter_node_text(c))
    out.print(t)
    out.print("Override any of them: --nodes, --devices-per-node, --inter-node-gbps, --memory-gb.")


def _inter_node_text(c: cm.Cluster) -> str:
    text = f"{c.nics_per_node} x {c.inter_node.bandwidth_gbps:g} Gb/s per node"
    if c.spine is not None:
        text += f"; spine over {c.spine.nodes_per_leaf}-node leaves, {c.spine.oversubscription:g}:1"
    return text


@app.command()
def methods(as_json: JsonOpt = False) -> None:
    """List the planning methods and the system profile each is priced as (`--system`
    prices a method as another), with every profile entry's source."""
    systems = {name: {"summary": p.summary, "settings": p.settings(), "sources": dict(p.sources)}
               for name, p in sv.SYSTEMS.items()}
    rows = [{"method": m.cli_name, "summary": m.summary, "system": m.system} for m in sv.METHODS.values()]
    if as_json:
        emit_json({"methods": rows, "systems": systems})
        return
    t = Table(title="alpasim planning methods")
    for col in ("method", "system profile", "what it searches"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["method"], r["system"], r["summary"])
    out.print(t)
    st = Table(title="system profiles (sources: alpasim methods --json)")
    for col in ("system", *(entry.replace("_", " ") for entry in sv.SYSTEM_ENTRIES)):
        st.add_column(col)
    for name, p in systems.items():
        st.add_row(name, *(str(v) for v in p["settings"].values()))
    out.print(st)

"""What `alpasim graph` reports, as one JSON-ready dict: the training graph's size,
FLOPs, ops and memory, and with a cluster what one device of it would need."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from alpasim import costmodels as cm
from alpasim import graphs as gr

from ._errors import ReportError


def model_with_batch(model: str, batch: int | None, label: str | None = None) -> tuple[str, Any]:
    """(name, config or graph) for a model, its batch overridden when asked; `label`
    names the batch in errors (default "--batch N")."""
    label = label or f"--batch {batch}"
    if model.endswith(".json") and Path(model).is_file():
        fwd = gr.load_forward(model)
        if batch is not None and batch != gr.model_source(fwd).global_batch:
            try:
                fwd = gr.resize_batch(fwd, batch)
            except gr.BatchError as e:
                raise ReportError(f"{label}: {e}") from None
        return fwd.name, fwd
    name, cfg = gr.resolve_model(model)
    if batch is not None:
        try:
            cfg = dataclasses.replace(cfg, batch=batch)
        except ValueError as e:
            raise ReportError(f"{label}: {e}") from None
    return name, cfg


def cluster_json(c: cm.Cluster) -> dict[str, Any]:
    d = c.to_json()
    d["num_devices"] = c.num_devices
    d["tiers"] = c.tiers()
    return d


def graph_report(model: str, *, layers: int | None, remat: bool, batch: int | None,
                 cluster: cm.Cluster | None, save: Path | None = None, recompute: str = "none") -> dict[str, Any]:
    """Everything `alpasim graph` shows, as one JSON-ready dict."""
    t0 = time.perf_counter()
    name, source = model_with_batch(model, batch)
    fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
    built = gr.build_training_graph(fwd, layers=layers, remat=remat, recompute=recompute)
    build_s = time.perf_counter() - t0
    g = built.graph
    if save is not None:       # the model, as every --model takes it (not this report's training graph)
        gr.save_graph(fwd, save)
    other = gr.build_training_graph(fwd, layers=layers, remat=not remat, recompute=recompute).graph
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
        "recompute": recompute,
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
        report["cluster"] = cluster_json(cluster)
        report["on_cluster"] = _cluster_view(g, mem, cluster, flops["matmul"])
    return report


def _cluster_view(g: gr.OpGraph, mem: cm.MemoryBreakdown, cluster: cm.Cluster, matmul_flops: float) -> dict[str, Any]:
    """What one device of the cluster would need, and an ideal-scaling time bound."""
    model = cm.AnalyticCostModel(cluster)
    fusion = cm.fuse(g)
    single_s = sum(model.op_time_s(op, g.tensors, access=fusion.of(op.name)) for op in g.ops)
    device_mem = cluster.device.memory_bytes
    states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
    return {
        "device_memory_bytes": device_mem,
        "fits_one_device": mem.total_bytes <= device_mem,
        "min_devices_for_model_states": max(1, -(-states // device_mem)),
        "single_device_iteration_s": single_s,
        "ideal_iteration_s": single_s / cluster.num_devices,
        "ideal_tflops_per_device": matmul_flops / single_s / 1e12 if single_s else 0.0,
    }

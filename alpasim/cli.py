"""The `alpasim` command: models, clusters, graph (and, in later issues, plan/simulate/run).

Every subcommand takes `--json` to print exactly one JSON object on stdout; tables
and progress go to the terminal otherwise, logs to stderr. A user mistake (unknown
name, malformed spec or file, impossible cluster) prints one line on stderr and exits
with status 2 — never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from alpasim import costmodels as cm
from alpasim import graphs as gr
from alpasim import simulator as sim
from alpasim import solvers as sv

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and run Alpa-style parallel training.")
out = Console()
err = Console(stderr=True)

USER_ERRORS = (gr.UnknownModelError, gr.ModelSpecError, gr.GraphFormatError, gr.GraphError, gr.BatchError,
               cm.ClusterError, cm.UnknownPresetError, sv.IntraOpInfeasible, sv.ShardingError,
               sv.PlanInfeasible, sv.PlanFormatError, cm.ProfileFormatError)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="Preset name or cluster JSON file.")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Override the number of nodes.")]
DpnOpt = Annotated[Optional[int], typer.Option("--devices-per-node", help="Override devices per node.")]
GbpsOpt = Annotated[Optional[float], typer.Option("--inter-node-gbps", help="Override inter-node bandwidth.")]
MemOpt = Annotated[Optional[float], typer.Option("--memory-gb", help="Override device memory (GiB).")]
CostModelOpt = Annotated[Optional[Path], typer.Option("--cost-model", help="A profiled cost model JSON "
                                                      "(`alpasim profile`) instead of the analytic model.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="Mixed-precision recipe: mixed-fp32grad (fp16 "
                                           "weights, fp32 gradients, master and Adam: 18 B/param, Megatron-LM's "
                                           "default), mixed (fp16 gradients: 16 B/param) or fp32.")]


RecomputeOpt = Annotated[str, typer.Option("--recompute", help="What the backward recomputes besides --remat: "
                                           "none (keep every value a gradient reads, as eager frameworks and "
                                           "Megatron-LM do) or fusible (keep each layer's minimum cut, recompute "
                                           "elementwise, layout, norm and softmax ops in the backward).")]


def _check_recompute(name: str) -> None:
    if name not in gr.RECOMPUTE_POLICIES:
        fail(f"--recompute {name!r}: choose one of {', '.join(gr.RECOMPUTE_POLICIES)}")


def _check_precision(name: str) -> None:
    if name not in gr.RECIPES:
        fail(f"--precision {name!r}: choose one of {', '.join(gr.RECIPES)}")


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
        data = gr.read_json_file(spec, cm.ClusterError)
        try:
            cluster = cm.Cluster.from_json(data)
        except cm.ClusterError as e:
            raise cm.ClusterError(f"{spec}: {e}") from None
        return cluster.with_overrides(**overrides)
    return cm.get_cluster(spec, **overrides)


def load_cost_model(path: Path | None, cluster: cm.Cluster) -> cm.ProfiledCostModel | None:
    """The profile at `path` bound to `cluster` (its intra-node link becomes the measured one)."""
    return None if path is None else cm.ProfiledCostModel.load(path, cluster)


def model_with_batch(model: str, batch: int | None) -> tuple[str, Any]:
    """(name, config or graph) for a model, its batch overridden when asked."""
    if model.endswith(".json") and Path(model).is_file():
        fwd = gr.load_forward(model)
        if batch is not None and batch != gr.model_source(fwd).global_batch:
            try:
                fwd = gr.resize_batch(fwd, batch)
            except gr.BatchError as e:
                fail(f"--batch {batch}: {e}")
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
                 cluster: cm.Cluster | None, save: Path | None = None, recompute: str = "none") -> dict[str, Any]:
    """Everything `alpasim graph` shows, as one JSON-ready dict."""
    t0 = time.perf_counter()
    name, source = model_with_batch(model, batch)
    fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
    built = gr.build_training_graph(fwd, layers=layers, remat=remat, recompute=recompute)
    build_s = time.perf_counter() - t0
    g = built.graph
    if save is not None:
        gr.save_graph(g, save)
        err.print(f"wrote {save}", soft_wrap=True)
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
        report["cluster"] = _cluster_json(cluster)
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
    recompute: RecomputeOpt = "none",
    as_json: JsonOpt = False,
) -> None:
    """Parameters, FLOPs per iteration, op counts per phase and layers of a training graph."""
    _check_recompute(recompute)
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb) if cluster else None
    report = graph_report(model, layers=layers, remat=remat, batch=batch, cluster=c, save=save, recompute=recompute)
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


# ----------------------------------------------------------------------- intra
INTRA_METHODS = ("alpa", *sv.BASELINES)


def _parse_layers(text: str | None, num_layers: int) -> tuple[int, int]:
    if text is None:
        mid = num_layers // 2
        return mid, mid
    try:
        first, _, last = text.partition(":")
        a, b = int(first), int(last or first)
    except ValueError:
        fail(f"--layers {text!r}: expected 'i:j' (inclusive layer range) or 'i'")
    if not 0 <= a <= b < num_layers:
        fail(f"--layers {text!r}: the model has layers 0..{num_layers - 1}")
    return a, b


def _intra_solve(stage: gr.OpGraph, mesh: sv.LogicalMesh, model: cm.CostModel, method: str, budget: float,
                 solver: str, time_limit: float | None, compute: bool, microbatches: int) -> sv.IntraOpResult:
    kw: dict[str, Any] = {}
    if method != "alpa":
        kw["restrict"], kw["leaf_specs"] = sv.BASELINES[method](stage, mesh, model)
        kw["rewrite"] = sv.REWRITE_ALLOWED.get(method, False)
    return sv.solve_intra_op(stage, mesh, model, memory_budget_bytes=budget, solver=solver,
                             time_limit_s=time_limit, with_compute=compute, microbatches=microbatches, **kw)


def intra_report(model_name: str, mesh_shape: tuple[int, int], cluster: cm.Cluster, *, layers: str | None,
                 batch: int, method: str, solver: str, time_limit: float | None, compute: bool,
                 microbatches: int = 1, top: int = 12, recompute: str = "none") -> dict[str, Any]:
    """Solve one stage on one mesh and compare with the hand-designed assignments."""
    name, source = model_with_batch(model_name, batch)
    fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
    graph = gr.build_training_graph(fwd, recompute=recompute).graph
    first, last = _parse_layers(layers, graph.num_layers)
    stage = gr.stage_graph(graph, first, last)
    mesh = sv.LogicalMesh.on_cluster(cluster, mesh_shape)
    model = cm.AnalyticCostModel(cluster)
    budget = float(cluster.device.memory_bytes)
    result = _intra_solve(stage, mesh, model, method, budget, solver, time_limit, compute, microbatches)
    plan = result.plan
    compare: dict[str, Any] = {}
    for other in ("data_parallel", "megatron"):
        try:
            r = _intra_solve(stage, mesh, model, other, None, solver, time_limit, compute, microbatches)
        except (sv.IntraOpInfeasible, RuntimeError) as e:
            compare[other] = {"error": str(e)}
            continue
        compare[other] = {"communication_s": r.plan.amortized_communication_s(microbatches),
                          "microbatch_communication_s": r.plan.communication_s, "sync_s": r.plan.sync_s,
                          "compute_s": r.plan.compute_s,
                          "memory_bytes": r.plan.memory.total_bytes,
                          "fits": r.plan.memory.total_bytes <= budget}
    heavy = sorted((op for op in stage.ops if gr.is_heavy(op)), key=lambda o: -gr.op_flops(o, stage.tensors))
    return {
        "model": name, "layers": [first, last], "batch": batch, "mesh": list(mesh_shape),
        "cluster": cluster.name, "method": method, "solver": result.solver,
        "status": result.status, "time_limited": result.time_limited,
        "microbatches": microbatches, "objective_s": result.objective_s,
        "communication_s": plan.amortized_communication_s(microbatches),
        "microbatch_communication_s": plan.communication_s, "sync_s": plan.sync_s,
        "compute_s": plan.compute_s, "update_s": plan.update_s, "time_s": plan.time_s,
        "iteration_s": plan.iteration_s(microbatches),
        "memory_bytes": plan.memory.total_bytes, "memory": plan.memory.to_json(),
        "memory_budget_bytes": budget, "fits": plan.memory.total_bytes <= budget,
        "solve_s": result.solve_s, "build_s": result.build_s,
        "ilp": {"nodes": result.num_nodes, "edges": result.num_edges, "rewritten_groups": result.rewritten},
        "specs": {t: str(spec) for t, spec in plan.specs.items()},
        "partition_specs": {p: list(v) for p, v in plan.partition_specs([t.name for t in stage.params]).items()},
        "heavy_ops": [{"op": op.name, "equation": op.param("equation") or op.prim,
                       "strategy": plan.strategies[op.name].name,
                       "inputs": [str(x) for x in plan.strategies[op.name].in_specs],
                       "outputs": [str(x) for x in plan.strategies[op.name].out_specs],
                       "flops": gr.op_flops(op, stage.tensors)} for op in heavy[:top]],
        "collectives": [c.to_json(mesh) for c in plan.collectives],
        "compare": compare,
        "notes": result.problem.notes,
    }


@app.command()
def intra(
    model: Annotated[str, typer.Argument(help="Zoo name, spec string, model JSON or graph JSON.")],
    mesh: Annotated[Optional[str], typer.Option("--mesh", help="Logical mesh shape, e.g. 2x4 (default: one "
                                                "node, 1 x devices per node).")] = None,
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Layer range i:j (default: a middle layer).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Microbatch size the stage runs on.")] = 8,
    method: Annotated[str, typer.Option("--method", help="alpa (the ILP), data_parallel or megatron.")] = "alpa",
    solver: Annotated[str, typer.Option("--solver", help="highs or cbc.")] = "highs",
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="ILP time limit, seconds.")] = None,
    compute: Annotated[bool, typer.Option("--compute", help="Add compute time to the ILP objective.")] = False,
    microbatches: Annotated[int, typer.Option("--microbatches", help="Gradient-accumulation steps: weight "
                                              "gradients sync once per this many microbatches.")] = 1,
    recompute: RecomputeOpt = "none",
    as_json: JsonOpt = False,
) -> None:
    """Shard one stage (layers i..j, one microbatch) on one logical mesh with the ILP."""
    _check_recompute(recompute)
    if method not in INTRA_METHODS:
        fail(f"--method {method!r}: choose one of {', '.join(INTRA_METHODS)}")
    if solver not in sv.SOLVERS:
        fail(f"--solver {solver!r}: choose one of {', '.join(sv.SOLVERS)}")
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb)
    mesh = mesh or f"1x{c.devices_per_node}"
    try:
        shape = sv.parse_mesh_shape(mesh)
    except ValueError as e:
        fail(str(e))
    if shape[0] * shape[1] > c.num_devices:
        fail(f"--mesh {mesh} needs {shape[0] * shape[1]} devices; {c.name} has {c.num_devices}")
    if microbatches < 1:
        fail(f"--microbatches must be at least 1, got {microbatches}")
    report = intra_report(model, shape, c, layers=layers, batch=batch, method=method, solver=solver,
                          time_limit=time_limit, compute=compute, microbatches=microbatches, recompute=recompute)
    if as_json:
        emit_json(report)
        return
    _print_intra(report)


def _print_intra(r: dict[str, Any]) -> None:
    head = (f"{r['model']} layers {r['layers'][0]}..{r['layers'][1]}, microbatch {r['batch']}, "
            f"{r['mesh'][0]}x{r['mesh'][1]} mesh of {r['cluster']} — {r['method']} ({r['solver']}, {r['status']})")
    t = Table(title=head)
    for col in ("op", "loops", "inputs", "output", "GFLOP"):
        t.add_column(col)
    for h in r["heavy_ops"]:
        t.add_row(h["op"], h["strategy"], " ".join(h["inputs"]), " ".join(h["outputs"]), f"{h['flops'] / 1e9:.1f}")
    out.print(t)
    kinds: dict[str, list[float]] = {}
    for c in r["collectives"]:
        k = kinds.setdefault(f"{c['kind']} on axes {c['mesh_axes']}", [0, 0.0, 0.0])
        k[0] += 1
        k[1] += c["bytes"]
        k[2] += c["time_s"]
    ct = Table(title="collectives")
    for col in ("kind", "count", "bytes", "time"):
        ct.add_column(col)
    for k, (n, b, s) in sorted(kinds.items(), key=lambda kv: -kv[1][2]):
        ct.add_row(k, str(n), _fmt_bytes(b), f"{s * 1e3:.3f} ms")
    out.print(ct)
    m = r["memory"]
    out.print(f"communication {r['microbatch_communication_s'] * 1e3:.3f} ms per microbatch + gradient sync "
              f"{r['sync_s'] * 1e3:.3f} ms per iteration ({r['microbatches']} microbatches), "
              f"compute {r['compute_s'] * 1e3:.3f} ms, "
              f"memory {_fmt_bytes(m['total_bytes'])} per device (params {_fmt_bytes(m['params_bytes'])}, "
              f"grads {_fmt_bytes(m['grads_bytes'])}, optimizer {_fmt_bytes(m['optimizer_bytes'])}, "
              f"activations {_fmt_bytes(m['activations_peak_bytes'])}); ILP {r['ilp']['nodes']} nodes, "
              f"{r['ilp']['edges']} edges, solved in {r['solve_s']:.2f} s")
    if r["notes"]:
        err.print(f"note: {len(r['notes'])} heavy ops have no even split over every mesh axis "
                  f"(first: {r['notes'][0]})", markup=False)
    for name, c in r["compare"].items():
        if "error" in c:
            out.print(f"  {name}: {c['error']}")
        else:
            out.print(f"  {name}: communication {c['communication_s'] * 1e3:.3f} ms, memory "
                      f"{_fmt_bytes(c['memory_bytes'])} per device, {'fits' if c['fits'] else 'does NOT fit'}")


# ------------------------------------------------------------------------ plan
def _plan_map(workers: int | None, ray: bool, ray_address: str | None):
    """(map function, closer): a Ray map, a local process pool, or plain map."""
    if ray or ray_address:
        from alpasim import backends

        return backends.ray_map_fn(ray_address, workers), backends.ray_shutdown
    from concurrent.futures import ProcessPoolExecutor

    n = workers if workers is not None else (os.cpu_count() or 1)
    if n <= 1:
        return map, lambda: None
    pool = ProcessPoolExecutor(n)
    return (lambda fn, items: pool.map(fn, items)), (lambda: pool.shutdown(cancel_futures=True))


def _parse_microbatches(text: str) -> int | str:
    """--microbatches: a number, or 'auto' to search B jointly."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        fail(f"--microbatches {text!r}: a positive integer or 'auto'")


def make_plan(model: str, cluster: cm.Cluster, method: str = "alpa", *, microbatches: str = "auto",
              layers: int | None = None, max_stages: int | None = None, megatron: sv.MegatronConfig | None = None,
              cache: bool = True, workers: int | None = None, ray: bool = False, ray_address: str | None = None,
              quiet: bool = False, **options) -> sv.PipelinePlan:
    """`solvers.plan_model` with a progress display and the chosen worker pool;
    `options` are the planner's common options (remat, epsilon, cost_model, precision,
    recompute). An option the method's record does not accept is a one-line error."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    m = sv.get_method(method)
    for flag, key, value in (("--layers", "layers", layers), ("--max-stages", "max_stages", max_stages)):
        if value is not None and key not in m.accepts:
            fail(f"{flag} does not apply to --method {m.cli_name} (its search sets it)")
    mb = _parse_microbatches(microbatches)
    map_fn, close = _plan_map(workers, ray, ray_address)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=quiet)
    tasks: dict[str, Any] = {}

    def report(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = progress.add_task(f"{m.cli_name}: {label}", total=total)
        progress.update(tasks[label], completed=done)

    try:
        with progress:
            return sv.plan_model(model, cluster, m.name, microbatches=mb, layers=layers, max_stages=max_stages,
                                 megatron=megatron, map_fn=map_fn, cache=sv.DiskCache(enabled=cache),
                                 progress=report, **options)
    finally:
        close()


@app.command()
def plan(
    model: Annotated[str, typer.Option("--model", help="Zoo name, spec string or model JSON.")],
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    microbatches: Annotated[str, typer.Option("--microbatches", help="Number of microbatches B, or 'auto' to "
                                              "search B jointly.")] = "auto",
    layers: Annotated[Optional[int], typer.Option("--layers", help="Re-cluster into L layers (eq. 6 DP).")] = None,
    remat: Annotated[bool, typer.Option("--remat/--no-remat", help="Activation rematerialisation.")] = True,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Write the plan JSON here.")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk stage-cost cache.")] = False,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Local processes filling the table.")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Fill the stage-cost table with Ray tasks.")] = False,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address.")] = None,
    max_stages: Annotated[Optional[int], typer.Option("--max-stages", help="Deepest pipeline considered "
                                                      f"(default {sv.DEFAULT_MAX_STAGES}).")] = None,
    epsilon: Annotated[float, typer.Option("--epsilon", help="Relative gap between bottlenecks tried.")] = 1e-3,
    run_simulation: Annotated[bool, typer.Option("--simulate", help="Also simulate the plan (1F1B) and show "
                                                 "the timeline metrics.")] = False,
    method: Annotated[str, typer.Option("--method", help="alpa, or a baseline: " + ", ".join(
        m.cli_name for m in sv.METHODS.values() if m.name != "alpa") + ".")] = "alpa",
    tp: Annotated[Optional[int], typer.Option("--tp", help="Megatron tensor-parallel degree.")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="Megatron pipeline-parallel degree.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", help="Megatron data-parallel degree.")] = None,
    microbatch_size: Annotated[Optional[int], typer.Option("--microbatch-size", help="Megatron microbatch "
                                                           "size per data-parallel replica.")] = None,
    cost_model: CostModelOpt = None,
    precision: PrecisionOpt = gr.DEFAULT_RECIPE,
    recompute: RecomputeOpt = "none",
    as_json: JsonOpt = False,
) -> None:
    """Plan pipeline stages, submeshes and intra-op shardings for a model on a cluster.

    `--method` picks Alpa (default) or a baseline; `--method megatron --tp T --pp P --dp D
    --microbatch-size K` prices one explicit Megatron-LM configuration (without them, the
    best of Megatron's grid). A baseline that does not fit is a result, not an error:
    the table output prints why and exits 2, `--json` prints the plan with `feasible`
    false and exits 0 (Alpa finding no plan stays an error: exit 2 either way)."""
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb)
    model_costs = load_cost_model(cost_model, c)
    _check_precision(precision)
    _check_recompute(recompute)
    if (max_stages is not None and max_stages < 1) or epsilon < 0:
        fail("--max-stages must be at least 1 and --epsilon at least 0")
    try:
        m = sv.get_method(method)
    except sv.UnknownMethodError:
        fail(f"--method {method!r}: choose one of {', '.join(x.cli_name for x in sv.METHODS.values())}")
    name = m.name
    degrees = {"--tp": tp, "--pp": pp, "--dp": dp, "--microbatch-size": microbatch_size}
    given = [k for k, v in degrees.items() if v is not None]
    if given and "megatron" not in m.accepts:
        fail(f"{', '.join(given)} only apply to --method megatron")
    if given and len(given) != len(degrees):
        fail(f"--method megatron takes all of --tp, --pp, --dp and --microbatch-size together (missing "
             f"{', '.join(k for k in degrees if k not in given)})")
    config = sv.MegatronConfig(tp, pp, dp, microbatch_size) if given else None
    p = make_plan(model, c, name, microbatches=microbatches, layers=layers, max_stages=max_stages, megatron=config,
                  cache=not no_cache, workers=workers, ray=ray, ray_address=ray_address, quiet=as_json,
                  remat=remat, epsilon=epsilon, cost_model=model_costs, precision=precision, recompute=recompute)
    if not p.feasible:
        if name == "alpa":   # Alpa finding nothing is an error, with or without --json
            fail("; ".join(p.notes) or "infeasible")
        if out_path is not None:
            p.save(out_path)
            err.print(f"wrote {out_path}", soft_wrap=True)
        if as_json:
            emit_json(p.to_json())
            return
        fail(f"{name}: no feasible plan: {'; '.join(p.notes) or 'infeasible'}")
    if out_path is not None:
        p.save(out_path)
        err.print(f"wrote {out_path}", soft_wrap=True)
    report = simulation_report(p, p.schedule) if run_simulation else None
    if as_json:
        emit_json(p.to_json() if report is None else {**p.to_json(), "simulation": report})
        return
    print_plan(p)
    if name != "alpa":
        config = p.search.megatron
        out.print(f"method {name}: {m.summary}" + (
            f"; tp={config['tp']} pp={config['pp']} dp={config['dp']} microbatch size "
            f"{config['microbatch_size']}" if config else ""))
    if report is not None:
        print_simulation(report)


def print_plan(p: sv.PipelinePlan) -> None:
    m, c, pr = p.model, p.cluster, p.predicted
    title = (f"{m.name} ({_fmt_count(m.params)} params) on {c.nodes} x {c.devices_per_node} "
             f"{c.device} — {len(p.stages)} stages, {p.microbatches} microbatches of {m.microbatch_size}")
    t = Table(title=title)
    for col in ("stage", "layers", "submesh", "devices", "logical mesh", "time / microbatch", "memory / device",
                "in flight"):
        t.add_column(col)
    for i, s in enumerate(p.stages):
        devs = f"{s.devices[0]}..{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
        t.add_row(str(i), f"{s.layers[0]}..{s.layers[1]}", f"{s.submesh[0]}x{s.submesh[1]}", devs,
                  f"{s.logical_mesh[0]}x{s.logical_mesh[1]}", f"{s.time_s * 1e3:.1f} ms", _fmt_bytes(s.memory_bytes),
                  str(s.inflight_microbatches))
    out.print(t)
    if all(s.memory for s in p.stages):
        mt = Table(title=f"memory per device by term ({m.precision or gr.DEFAULT_RECIPE}: "
                         f"{m.bytes_per_param if m.bytes_per_param is not None else '?'} B/param; "
                         f"stash x microbatches in flight)")
        for col in ("stage", "params", "grads", "optimizer", "stash", "working set", "buffers", "total"):
            mt.add_column(col)
        for i, s in enumerate(p.stages):
            mem = s.memory
            mt.add_row(str(i), *(_fmt_bytes(mem[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")),
                       f"{_fmt_bytes(mem['stash_bytes'])} x {mem['inflight']}", _fmt_bytes(mem["transient_bytes"]),
                       _fmt_bytes(mem["buffer_bytes"]), _fmt_bytes(mem["total_bytes"]))
        out.print(mt)
    ht = Table(title="heaviest ops of each distinct layer kind in a stage")
    for col in ("stage", "op", "equation", "loops", "output spec"):
        ht.add_column(col)
    for i, s in enumerate(p.stages):
        for h in s.heavy_ops[:3]:
            ht.add_row(str(i), h["op"], h["equation"], h["strategy"], h["output"])
    out.print(ht)
    out.print(f"predicted iteration {pr.iteration_s:.2f} s, {pr.tflops_per_device:.1f} TFLOP/s per device, "
              f"{pr.throughput_pflops:.3f} PFLOP/s in all, peak memory {_fmt_bytes(pr.peak_memory_bytes)} "
              f"per device, bubble {pr.bubble_fraction or 0.0:.1%}")
    sr = p.search
    out.print(f"search: {sr.seconds:.1f} s, {sr.ilp_solves} intra-op jobs, {sr.cache_hits} cache hits, "
              f"B tried {list(sr.microbatch_candidates)}")
    for r in p.runner_ups:
        when = f"{r.iteration_s:.2f} s" if r.iteration_s is not None else "no plan fits"
        out.print(f"  runner-up B={r.microbatches}: {when} ({len(r.stages)} stages)")


# -------------------------------------------------------------------- simulate
def simulation_report(p: sv.PipelinePlan, schedule: str, *, chunks: int = 2, cross_mesh: str = "local_all_gather",
                      trace: Path | None = None, gantt: Path | None = None,
                      memory_png: Path | None = None, cluster: cm.Cluster | None = None) -> dict[str, Any]:
    """Simulate one iteration of a plan (on `cluster`, default the plan's own); the
    timeline metrics as one JSON-ready dict."""
    tl = sim.simulate(p, schedule, chunks=chunks, cross_mesh=cross_mesh, cluster=cluster)
    report = tl.to_json()
    report["outputs"] = _write_outputs((("trace", trace, tl.chrome_trace), ("gantt", gantt, tl.gantt_png),
                                        ("memory_png", memory_png, tl.memory_png)))
    return report


def _write_outputs(outputs) -> dict[str, str]:
    """Write each (key, path, writer) whose path is given; {key: path} of those written.
    A path that cannot be written is one line and exit 2."""
    written = {}
    for key, path, write in outputs:
        if path is not None:
            try:
                write(path)
            except OSError as e:
                fail(f"cannot write {path}: {e.strerror or e}")
            written[key] = str(path)
    return written


@app.command()
def simulate(
    plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `alpasim plan --out`.")],
    schedule: Annotated[str, typer.Option("--schedule", help="1f1b, gpipe or interleaved.")] = "1f1b",
    chunks: Annotated[int, typer.Option("--chunks", help="Model chunks per mesh (interleaved only).")] = 2,
    cross_mesh: Annotated[str, typer.Option("--cross-mesh", help="Cross-mesh resharding: local_all_gather, "
                                            "send_recv or signal.")] = "local_all_gather",
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write a Chrome trace JSON (Perfetto).")] = None,
    gantt: Annotated[Optional[Path], typer.Option("--gantt", help="Write a Gantt chart PNG.")] = None,
    memory_png: Annotated[Optional[Path], typer.Option("--memory-png", help="Write memory over time PNG.")] = None,
    cost_model: CostModelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate one training iteration of a plan: iteration time, bubbles, memory, traffic.

    With `--cost-model`, transfers between meshes use the profile's measured link
    inside a node; stage compute and sync times stay those the plan was priced with
    (re-plan with `--cost-model` to re-price them; a note says when the plan's model
    differs)."""
    if schedule not in sim.SCHEDULES:
        fail(f"--schedule {schedule!r}: choose one of {', '.join(sim.SCHEDULES)}")
    if cross_mesh not in sim.CROSS_MESH_METHODS:
        fail(f"--cross-mesh {cross_mesh!r}: choose one of {', '.join(sim.CROSS_MESH_METHODS)}")
    if chunks < 1:
        fail(f"--chunks must be at least 1, got {chunks}")
    p = sv.load_plan(plan_file)
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
                               memory_png=memory_png, cluster=cluster)
    if model_note is not None:
        report["notes"] = [*report["notes"], model_note]
    if as_json:
        emit_json(report)
        return
    print_simulation(report, title=f"{plan_file}: {p.model.name}")


def print_simulation(r: dict[str, Any], title: str = "simulation") -> None:
    sched = r["schedule"] + (f", {r['chunks']} chunks" if r["schedule"] == "interleaved" else "")
    t = Table(title=f"{title} — {sched}, {r['microbatches']} microbatches, cross-mesh {r['cross_mesh']}")
    for col in ("mesh", "devices", "compute", "sync", "communication", "idle", "peak memory / device"):
        t.add_column(col)
    peaks = r["peak_memory_bytes"]
    for m in r["meshes"]:
        devs = m["devices"]
        t.add_row(str(m["stage"]), f"{devs[0]}..{devs[-1]}" if len(devs) > 1 else str(devs[0]),
                  f"{m['compute_s']:.3f} s", f"{m['sync_s']:.3f} s", f"{m['comm_s']:.3f} s", f"{m['idle_s']:.3f} s",
                  _fmt_bytes(max(peaks[d] for d in devs)))
    out.print(t)
    pred = r["predicted_iteration_s"]
    vs = f" (plan predicted {pred:.3f} s, eq. 2)" if pred else ""
    out.print(f"simulated iteration {r['iteration_s']:.3f} s{vs}, bubble {r['bubble_fraction']:.1%}, "
              f"cross-mesh traffic {_fmt_bytes(r['cross_mesh_bytes'])} ({_fmt_bytes(r['inter_node_bytes'])} "
              f"between nodes); simulated in {r['wall_s']:.2f} s")
    for note in r["notes"]:
        err.print(f"note: {note}", markup=False)
    for key, path in r["outputs"].items():
        out.print(f"wrote {key.replace('_', ' ')}: {path}", soft_wrap=True)


# --------------------------------------------------------------------- profile
@app.command()
def profile(
    out_path: Annotated[Path, typer.Option("--out", help="Write the fitted cost model JSON here.")] = Path(
        "profile.json"),
    quick: Annotated[bool, typer.Option("--quick", help="A smaller benchmark grid (about 15 s on 2 CPU "
                                        "cores instead of about 30 s).")] = False,
    cpu_devices: Annotated[Optional[int], typer.Option("--cpu-devices", help="On the CPU: run as this many "
                                                       "virtual devices (default: XLA_FLAGS, else 8).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Microbenchmark ops and collectives on the current JAX backend and fit a cost model.

    The JSON it writes is what `plan --cost-model` and `simulate --cost-model` read.
    Collectives need at least two devices; on a CPU it asks XLA for 8 virtual devices
    unless XLA_FLAGS sets a count or `--cpu-devices` another."""
    if cpu_devices is None:
        _ensure_cpu_devices(8)
    else:
        if cpu_devices < 1:
            fail(f"--cpu-devices must be at least 1, got {cpu_devices}")
        import jax

        jax.config.update("jax_num_cpu_devices", cpu_devices)
    from alpasim import backends

    def log(line: str) -> None:
        if not as_json:
            err.print(line, markup=False, highlight=False)

    model = backends.profile_backend(quick=quick, log=log)
    try:
        model.save(out_path)
    except OSError as e:
        fail(f"cannot write {out_path}: {e.strerror or e}")
    if as_json:
        emit_json({"out": str(out_path), **model.to_json()})
        return
    t = Table(title=f"profile {model.name} ({model.meta['grid']} grid, {model.meta['profile_s']:.1f} s)")
    for col in ("op class", "launch", "GFLOP/s", "GB/s", "fit error (rms)"):
        t.add_column(col)
    errors = model.meta["rms_relative_error"]
    for c, f in model.ops.items():
        t.add_row(c, f"{f.launch_s * 1e6:.1f} us", f"{1e-9 / f.seconds_per_flop:.1f}" if f.seconds_per_flop else "-",
                  f"{1e-9 / f.seconds_per_byte:.1f}" if f.seconds_per_byte else "-", f"{errors[f'op:{c}']:.0%}")
    out.print(t)
    out.print(f"fitted link: {model.link.bandwidth_gbps:.1f} Gbit/s, {model.link.latency_s * 1e6:.1f} us latency; "
              f"jit dispatch {model.meta['dispatch_s'] * 1e6:.0f} us; wrote {out_path}")


# ------------------------------------------------------------------------- run
RUNTIMES = ("local", "ray")
# Of the host's RAM, what a run on virtual CPU devices may plan to use (the single-device
# reference step and the Python process need the rest).
HOST_MEMORY_SHARE = 0.6


def _cpu_devices_for(p: sv.PipelinePlan) -> int:
    """Virtual CPU devices a plan needs (at least 8, what `alpasim profile` measures with)."""
    return max(8, 1 + max((d for st in p.stages for d in st.devices), default=0))


def _ensure_cpu_devices(n: int) -> None:
    """Ask XLA for `n` virtual CPU devices — possible only before jax is imported; an
    XLA_FLAGS that already sets a count wins (the device check then says what is short)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def run_report(p: sv.PipelinePlan, *, runtime: str = "local", steps: int = 5, seed: int = 0,
               cost_model: cm.CostModel | None = None, ray_address: str | None = None,
               trace: Path | None = None, gantt: Path | None = None, profile_iters: int = 5) -> dict[str, Any]:
    """Execute a plan, check it against one device, and compare it with its predictions
    (analytic; op-profiled with `cost_model`; stage-profiled with `profile_iters`)."""
    import jax

    from alpasim import backends

    need = 1 + max(d for st in p.stages for d in st.devices)
    have, platform = len(jax.devices()), jax.devices()[0].platform
    if have < need:
        fail(f"the plan uses {need} devices; JAX sees {have} ({platform}). On the CPU set "
             f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before starting")
    _check_host_memory(p, platform)
    t0 = time.perf_counter()
    if runtime == "ray":
        try:
            result = backends.run_ray(p, steps=steps, seed=seed, address=ray_address, profile_iters=profile_iters)
        except backends.RayRuntimeError as e:
            fail(f"--runtime ray: {e}")
    else:
        result = backends.run_local(p, steps=steps, seed=seed, profile_iters=profile_iters)
    run_s = time.perf_counter() - t0
    # Read before the reference step runs on device 0 (a GPU's peak counter would count it).
    memory = [backends.stage_memory(s, st.inflight_microbatches) for s, st in zip(result.stages, p.stages)]
    check = backends.check_numerics(result.losses[0], result.grads, backends.reference_step(p, seed=seed))
    intra = [s.intra_plan for s in result.stages] if len(result.stages) == len(p.stages) else None
    prediction = backends.predict_run(p, cost_model=cost_model, runtime=runtime, intra_plans=intra,
                                      stage_times=result.stage_profile or None)
    collectives = backends.compare_collectives(result.stages) if intra is not None else []
    measured = result.measured_step_s
    timeline = result.timeline
    written = _write_outputs((("trace", trace, timeline.chrome_trace), ("gantt", gantt, timeline.gantt_png)))
    stages = _stage_rows(p, memory, prediction.get("stages"))
    return {"runtime": runtime, "steps": steps, "seed": seed, "devices": need, "platform": platform,
            **{k: check[k] for k in ("numerics_ok", "max_abs_loss_err", "max_rel_grad_err", "worst_param",
                                      "loss_tol", "grad_tol")},
            "losses": result.losses, "step_times_s": result.step_times_s, "measured_step_s": measured,
            **prediction,
            **{f"ratio{which}": _ratio(prediction[f"predicted_step_s{which}"], measured)
               for which in ("", "_analytic", "_profiled", "_stage_profiled")},
            "collectives": collectives, "stages": stages, "run_s": run_s, "outputs": written}


def _stage_rows(p: sv.PipelinePlan, memory: list, priced: list[dict] | None) -> list[dict[str, Any]]:
    """Per stage: the predicted memory (the plan's, with its breakdown when the plan has
    one) beside the measured (compiled programs, `backends.stage_memory`), merged into
    the profiled prediction's rows when there are any."""
    rows = [dict(r) for r in priced] if priced else [{"stage": k, "mesh": list(st.logical_mesh)}
                                                      for k, st in enumerate(p.stages)]
    for row, st, m in zip(rows, p.stages, memory, strict=True):
        breakdown = getattr(st, "memory", None)
        if breakdown is not None and not isinstance(breakdown, dict):
            breakdown = breakdown.to_json() if hasattr(breakdown, "to_json") else dict(vars(breakdown))
        measured = m.to_json() if m is not None else None
        total = measured["total_bytes"] if measured else None
        row["memory"] = {"predicted_bytes": st.memory_bytes, "measured_bytes": total,
                         "ratio": _ratio(st.memory_bytes, total) if total else None,
                         "predicted": breakdown or None, "measured": measured}
    return rows


def _check_host_memory(p: sv.PipelinePlan, platform: str) -> None:
    """Virtual CPU devices share the host's RAM: refuse a plan whose per-device memory,
    summed over its devices, exceeds it (a GPU plan of billions of parameters would
    otherwise be killed by the OS mid-run, or swap for hours)."""
    have = cm.host_memory_bytes()
    if platform != "cpu" or have is None:
        return
    need = sum(st.memory_bytes * len(st.devices) for st in p.stages)
    if need > HOST_MEMORY_SHARE * have:
        fail(f"the plan needs about {need / 2**30:.1f} GiB on its {sum(len(st.devices) for st in p.stages)} "
             f"devices (memory per device, summed: virtual CPU devices share the host's RAM); this host has "
             f"{have / 2**30:.1f} GiB. Plan a smaller configuration to run here")


def _ratio(predicted: float | None, measured: float) -> float | None:
    return predicted / measured if predicted is not None and measured > 0 else None


@app.command()
def run(
    plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `alpasim plan --out`.")],
    runtime: Annotated[str, typer.Option("--runtime", help="local (one process) or ray (an actor per mesh).")]
        = "local",
    steps: Annotated[int, typer.Option("--steps", help="Training steps; the median step time leaves out the "
                                       "first (warm-up) when there are more.")] = 5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of parameters and data.")] = 0,
    cost_model: CostModelOpt = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the measured Chrome trace JSON.")] = None,
    gantt: Annotated[Optional[Path], typer.Option("--gantt", help="Write the measured Gantt chart PNG.")] = None,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address (default: "
                                                       "start a local one).")] = None,
    profile_iters: Annotated[int, typer.Option("--profile-iters", help="Time each compiled stage alone this many "
                                               "times before the run (Alpa's stage profiling); 0 skips it.")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Execute a plan on JAX and compare it with its prediction and a single-device step.

    Prints the measured step time (median), the predicted ones — the plan's analytic
    model; with `--cost-model` the op-level profile re-pricing each stage for this
    runtime; and the stages' own compiled programs timed alone (Alpa's stage
    profiling, `--profile-iters`), composed by the simulator — their ratios, the
    numerical check of loss and gradients, and per stage the predicted vs compiled
    (HLO) collective bytes and predicted vs measured memory per device (XLA's memory
    analysis of the compiled stage programs, composed as the stage runs under 1F1B:
    `alpasim.backends.stage_memory`). A numerics mismatch exits 1 after the report.
    On the CPU it asks for 8 virtual devices (or as many as the plan uses) unless
    XLA_FLAGS already sets a count."""
    if runtime not in RUNTIMES:
        fail(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if steps < 1:
        fail(f"--steps must be at least 1, got {steps}")
    if profile_iters < 0:
        fail(f"--profile-iters must be 0 or more, got {profile_iters}")
    p = sv.load_plan(plan_file)
    if not p.feasible or not p.stages:
        why = "; ".join(p.notes) or ("it has no stages" if not p.stages else "it is marked feasible: false")
        fail(f"{plan_file}: the plan is infeasible ({why}); nothing to run")
    model = None
    if cost_model is not None:
        base = sim.plan_cluster(p)
        if base is None:
            fail(f"{plan_file}: the plan records no cluster spec to bind --cost-model to")
        model = load_cost_model(cost_model, base)
    _ensure_cpu_devices(_cpu_devices_for(p))
    report = run_report(p, runtime=runtime, steps=steps, seed=seed, cost_model=model, ray_address=ray_address,
                        trace=trace, gantt=gantt, profile_iters=profile_iters)
    if as_json:
        emit_json(report)
    else:
        print_run(report, title=f"{plan_file}: {p.model.name}")
    if not report["numerics_ok"]:
        fail(f"numerics mismatch against one device: worst gradient rel. error {report['max_rel_grad_err']:.2e} "
             f"({report['worst_param']}) > {report['grad_tol']:.1e} or loss error {report['max_abs_loss_err']:.2e} "
             f"> {report['loss_tol']:.1e}", code=1)


def print_run(r: dict[str, Any], title: str = "run") -> None:
    ms = 1e3
    out.print(f"{title} — {r['runtime']} runtime, {r['steps']} steps on {r['devices']} {r['platform']} devices")
    out.print(f"measured step {r['measured_step_s'] * ms:.2f} ms (median; steps "
              f"{', '.join(f'{t * ms:.1f}' for t in r['step_times_s'])} ms)")
    out.print(f"predicted (plan, analytic) {r['predicted_step_s_analytic'] * ms:.2f} ms — ratio predicted/measured "
              f"{r['ratio_analytic']:.2f}")
    if r["predicted_step_s_profiled"] is not None:
        out.print(f"predicted (profiled, {r['runtime']} runtime: one executor, {r['dispatch_s'] * 1e6:.0f} us "
                  f"dispatch per call) {r['predicted_step_s_profiled'] * ms:.2f} ms — ratio predicted/measured "
                  f"{r['ratio_profiled']:.2f}")
    if r["predicted_step_s_stage_profiled"] is not None:
        out.print(f"predicted (stages profiled alone, {r['runtime']} runtime's schedule simulated, "
                  f"{r['stage_dispatch_s'] * 1e6:.0f} us dispatch per call) "
                  f"{r['predicted_step_s_stage_profiled'] * ms:.2f} ms — ratio predicted/measured "
                  f"{r['ratio_stage_profiled']:.2f}")
    verdict = "ok" if r["numerics_ok"] else "MISMATCH"
    out.print(f"numerics vs one device: {verdict} (loss error {r['max_abs_loss_err']:.2e} <= {r['loss_tol']:.1e}, "
              f"worst gradient rel. error {r['max_rel_grad_err']:.2e} <= {r['grad_tol']:.1e})")
    if r["collectives"]:
        t = Table(title="collective bytes per stage: predicted (intra-op plan) / measured (compiled HLO)")
        for col in ("stage", "mesh", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "total ratio"):
            t.add_column(col)
        for row in r["collectives"]:
            cells = [f"{_fmt_bytes(row['predicted'][k])} / {_fmt_bytes(row['measured'][k])}"
                     for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")]
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            t.add_row(str(row["stage"]), "x".join(map(str, row["mesh"])), *cells, ratio)
        out.print(t)
    _print_run_memory(r["stages"])
    for key, path in r["outputs"].items():
        out.print(f"wrote {key}: {path}", soft_wrap=True)


def _print_run_memory(rows: list[dict[str, Any]]) -> None:
    """Per stage, predicted (plan) against measured (compiled programs) memory per device,
    term by term: state, stash x in flight, transient (temporaries + boundary buffers)."""
    t = Table(title="memory per device: predicted (plan) / measured (compiled stage, XLA memory analysis)")
    for col in ("stage", "mesh", "state", "stash x inflight", "transient", "total", "ratio", "device peak"):
        t.add_column(col)
    for row in rows:
        mem, m = row["memory"], row["memory"]["measured"]
        if m is None:
            continue
        pred = mem["predicted"] or {}

        def pair(predicted: float | None, measured: float) -> str:
            return f"{_fmt_bytes(predicted) if predicted is not None else '-'} / {_fmt_bytes(measured)}"

        p_state = (sum(pred.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
                   if pred else None)
        p_stash = pred["stash_bytes"] * pred.get("inflight", m["inflight"]) if "stash_bytes" in pred else None
        p_trans = pred.get("transient_bytes", 0.0) + pred.get("buffer_bytes", 0.0) if pred else None
        ratio = f"{mem['ratio']:.2f}" if mem["ratio"] is not None else "-"
        peak = _fmt_bytes(m["device_peak_bytes"]) if m["device_peak_bytes"] is not None else "-"
        t.add_row(str(row["stage"]), "x".join(map(str, row["mesh"])), pair(p_state, m["state_bytes"]),
                  f"{pair(p_stash, m['stash_bytes'] * m['inflight'])} ({m['inflight']})",
                  pair(p_trans, m["temp_bytes"] + m["buffer_bytes"]), pair(mem["predicted_bytes"], m["total_bytes"]),
                  ratio, peak)
    out.print(t)


# ------------------------------------------------------------------- reproduce
@app.command()
def reproduce(
    name: Annotated[str, typer.Argument(help="fig7a, fig7b, fig7c, fig8, fig9, fig11 or table5.")],
    out_dir: Annotated[Path, typer.Option("--out-dir", "--out", help="Directory for <name>.csv, .png and .md "
                                          "(--out: the older spelling).")] = Path("out/reproduce"),
    workers: Annotated[int, typer.Option("--workers", help="Points planned in parallel (processes).")] = 2,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    max_gpus: Annotated[Optional[int], typer.Option("--max-gpus", help="Only the points on at most N GPUs.")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Plan the points as Ray tasks.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Reproduce one of the paper's figures or tables in simulation (CSV + PNG + markdown)."""
    from alpasim import experiments as ex

    if name not in ex.FIGURES:
        fail(f"unknown figure {name!r}; choose one of {', '.join(ex.FIGURES)}")
    if workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    if max_gpus is not None and max_gpus < 1:
        fail(f"--max-gpus must be at least 1, got {max_gpus}")
    points = ex.figure_points(name, max_gpus)
    if not points:
        fail(f"{name} has no points on at most {max_gpus} GPUs")
    t0 = time.perf_counter()

    def progress(done: int, total: int, r: ex.Result) -> None:
        what = f"{r.throughput_pflops:.3f} PFLOPS" if r.feasible else "out of memory"
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.model} on {r.gpus} GPUs, "
                  f"{r.label or r.method}: {what} (planned in {r.plan_s:.1f} s)", markup=False, highlight=False,
                  soft_wrap=True)

    map_fn, close = _plan_map(workers, True, None) if ray else (None, lambda: None)
    try:
        report = ex.reproduce(name, out_dir, workers=workers, cache=not no_cache, map_fn=map_fn,
                              progress=progress, points=points)
    except OSError as e:
        fail(f"cannot write {out_dir}: {e.strerror or e}")
    finally:
        close()
    if as_json:
        emit_json(report.to_json())
        return
    _print_reproduction(report)


def _print_reproduction(report) -> None:
    from alpasim.experiments._report import summary_rows

    plan_time = report.name == "table5"
    t = Table(title=report.title)
    for col in ("model", "GPUs", "method", "planning time" if plan_time else "PFLOPS"):
        t.add_column(col)
    for p in report.points_json():
        value = (f"{p['plan_s']:.1f} s" if plan_time else
                 f"{p['throughput_pflops']:.3f}" if p["feasible"] else "× (out of memory)")
        t.add_row(p["model"], str(p["gpus"]), p.get("label") or p["method"], value)
    out.print(t)
    s = Table(title="summary (ours vs the paper)")
    for col in ("ratio", "ours", "paper"):
        s.add_column(col)
    for row in summary_rows(report):
        s.add_row(*row)
    out.print(s)
    cached = sum(r.cached for r in report.results)
    out.print(f"{len(report.results)} points ({cached} cached) in {report.wall_s:.1f} s; wrote "
              + ", ".join(report.files.values()))


# ----------------------------------------------------------------------- sweep
def _number_list(option: str, text: str, kind: type) -> list:
    """`10,25,50` as numbers of `kind`; a malformed list is a user error."""
    items = [t.strip() for t in text.split(",")]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        fail(f"{option} {text!r}: expected comma-separated {'integers' if kind is int else 'numbers'}, "
             "e.g. 10,25,50")
    if any(not v > 0 for v in values):
        fail(f"{option} {text!r}: every value must be positive")
    return values


def _method_list(text: str) -> list[str]:
    from alpasim import experiments as ex

    try:
        return list(dict.fromkeys(ex.method_name(m) for m in text.split(",")))
    except ValueError as e:
        fail(f"--methods: {e}")


def _point_progress(t0: float):
    def progress(done: int, total: int, r: Any) -> None:
        what = f"{r.throughput_pflops:.3f} PFLOP/s" if r.feasible else "out of memory"
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.method} at {r.label}: {what} "
                  f"(planned in {r.plan_s:.1f} s)", markup=False, highlight=False)
    return progress


@app.command()
def sweep(
    model: Annotated[str, typer.Option("--model", help="Zoo name or spec string.")],
    gpus: Annotated[int, typer.Option("--gpus", help="Devices in all (whole nodes, or part of one).")],
    cluster: Annotated[str, typer.Option("--cluster", help="Preset the sweep starts from.")] = "aws-p3.16xlarge",
    inter_node_gbps: Annotated[Optional[str], typer.Option("--inter-node-gbps", help="Sweep the inter-node "
                                                           "bandwidth per NIC, e.g. 10,25,50,100.")] = None,
    devices_per_node: Annotated[Optional[str], typer.Option("--devices-per-node", help="Sweep devices per "
                                                            "node, e.g. 2,4,8.")] = None,
    memory_gb: Annotated[Optional[str], typer.Option("--memory-gb", help="Sweep device memory (GiB), "
                                                     "e.g. 16,32,80.")] = None,
    device_preset: Annotated[Optional[str], typer.Option("--device-preset", help="Sweep the cluster preset, "
                                                         "e.g. aws-p3.16xlarge,dgx-a100.")] = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods (dashes or underscores).")] = (
        "alpa,intra-only,inter-only,megatron"),
    out_dir: Annotated[Path, typer.Option("--out-dir", "--out", help="Directory for the CSV, markdown and "
                                                                     "PNG (--out: the older spelling).")] = Path(
        "out/sweep"),
    workers: Annotated[Optional[int], typer.Option("--workers", help="Points planned in parallel "
                                                   "(processes; default: one per CPU).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    ray: Annotated[bool, typer.Option("--ray", help="Plan the points as Ray tasks.")] = False,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What-if sweep of one cluster parameter x methods: table, CSV, markdown and a plot."""
    from alpasim import experiments as ex

    given = {"inter_node_gbps": ("--inter-node-gbps", inter_node_gbps, float),
             "devices_per_node": ("--devices-per-node", devices_per_node, int),
             "memory_gb": ("--memory-gb", memory_gb, float), "device": ("--device-preset", device_preset, str)}
    axes = [a for a, (_, text, _) in given.items() if text is not None]
    if len(axes) != 1:
        names = ", ".join(opt for opt, _, _ in given.values())
        fail(f"sweep exactly one axis: give one of {names}" + (f" (got {len(axes)})" if axes else ""))
    axis = axes[0]
    option, text, kind = given[axis]
    if kind is str:
        values: list = [v.strip() for v in text.split(",")]
        for v in values:
            cm.get_cluster(v)  # unknown preset: one line, exit 2
    else:
        values = _number_list(option, text, kind)
    names = _method_list(methods)
    if gpus < 1:
        fail(f"--gpus must be at least 1, got {gpus}")
    if workers is not None and workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    gr.model_source(model)  # an unknown model or a bad graph file fails before any point is planned
    for v in values:
        ex.sweep_cluster(axis, v, gpus, cluster)  # a GPU count that is no whole number of nodes
    n = workers if workers is not None else min(os.cpu_count() or 1, len(values) * len(names))
    map_fn, close = _plan_map(n, True, ray_address) if ray or ray_address else (None, lambda: None)
    try:
        report = ex.sweep(model, gpus, axis, values, names, cluster_name=cluster, workers=n, cache=not no_cache,
                          map_fn=map_fn, progress=_point_progress(time.perf_counter()))
    finally:
        close()
    try:
        files = report.write(out_dir)
    except OSError as e:
        fail(f"cannot write {out_dir}: {e.strerror or e}")
    if as_json:
        emit_json({**report.to_json(), "files": files})
        return
    _print_sweep(report, files)


_SWEEP_HEADERS = {"inter_node_gbps": "Gb/s", "devices_per_node": "GPUs/node", "memory_gb": "GiB",
                  "device": "preset"}


def _print_sweep(report: Any, files: dict[str, str]) -> None:
    from alpasim import experiments as ex

    gap = "alpa" in report.methods and "intra_only" in report.methods
    t = Table(title=f"{report.title()}, simulated PFLOP/s")
    t.add_column(_SWEEP_HEADERS[report.axis], no_wrap=True)
    for m in report.methods:
        t.add_column(m, justify="right")
    if gap:
        t.add_column("alpa / intra_only", justify="right")
    for v in report.values:
        cells = [ex.sweep_cell(report.result(v, m)) for m in report.methods]
        if gap:
            g = report.gap(v)
            cells.append("" if g is None else f"{g:.2f}x")
        t.add_row(ex.value_label(v), *cells)
    out.print(t)
    plans = report.alpa_plans()
    if plans:
        pt = Table(title="Alpa's plan at each value (stage layers on submesh as logical mesh)")
        for col in ("value", "plan", "change"):
            pt.add_column(col)
        for p in plans:
            pt.add_row(ex.value_label(p["value"]), p["summary"], p["change"])
        out.print(pt)
    cached = sum(r.cached for r in report.results)
    out.print(f"{len(report.results)} points ({cached} cached); wrote " + ", ".join(files.values()))


# --------------------------------------------------------------------- compare
@app.command()
def compare(
    model: Annotated[str, typer.Option("--model", help="Zoo name, spec string, model JSON or saved graph.")],
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods; the first is the "
                                         "reference.")] = "alpa,megatron,intra-only",
    workers: Annotated[Optional[int], typer.Option("--workers", help="Methods planned in parallel "
                                                   "(processes).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the on-disk result and stage caches.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Several methods on one model and cluster: simulated throughput, plan, ratio to the first."""
    from alpasim import experiments as ex

    names = _method_list(methods)
    c = load_cluster(cluster, nodes, devices_per_node, inter_node_gbps, memory_gb)
    gr.model_source(model)          # an unknown model or a bad graph file: one line, before planning
    if workers is not None and workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    t0 = time.perf_counter()

    def progress(done: int, total: int, r: Any) -> None:
        err.print(f"[{done}/{total} {time.perf_counter() - t0:6.0f} s] {r.method} planned in {r.plan_s:.1f} s",
                  markup=False, highlight=False)

    cmp = ex.compare(model, c, names, cache=not no_cache, workers=workers, progress=progress)
    if as_json:
        emit_json(cmp.to_json())
        return
    ref = cmp.reference.method
    out.print(f"{model} on {c.nodes} x {c.devices_per_node} {c.device.name} ({c.name}), simulated:", soft_wrap=True)
    for row in cmp.rows():
        ratio = row["ratio_to_" + ref]
        if row["feasible"]:
            head = f"{row['throughput_pflops']:.3f} PFLOP/s, {row['iteration_s']:.2f} s / iteration"
            head += f", {ratio:.2f}x {ref}" if ratio is not None else ""
        else:
            head = "not planned"       # out of memory, or a method that does not take the model: the plan says
        out.print(f"  {row['method']:<12} {head} — {row['plan']}", markup=False, highlight=False, soft_wrap=True)


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

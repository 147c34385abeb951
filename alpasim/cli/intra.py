"""`alpasim intra`: the intra-op ILP (or a baseline) on one stage and one logical mesh."""

from __future__ import annotations

import math

from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from alpasim import solvers as sv
from alpasim.experiments import DEFAULT_MICROBATCH_SIZE, INTRA_METHODS, intra_report

from ._common import (
    ModelArg, ModelOpt, one_model,
    ClusterOpt, DpnOpt, GbpsOpt, JsonOpt, MemOpt, NodesOpt, RecomputeOpt, app, check_recompute, emit_json, err,
    fail, fmt_bytes, load_cluster, note, out,
)


@app.command()
def intra(
    model_arg: ModelArg = None,
    model_opt: ModelOpt = None,
    mesh: Annotated[Optional[str], typer.Option("--mesh", help="Logical mesh shape, e.g. 2x4 (default: one "
                                                "node, 1 x devices per node).")] = None,
    cluster: ClusterOpt = "aws-p3.16xlarge",
    nodes: NodesOpt = None,
    devices_per_node: DpnOpt = None,
    inter_node_gbps: GbpsOpt = None,
    memory_gb: MemOpt = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Layer range i:j (default: a middle layer).")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Global batch (default: the model's own); the "
                                                 "stage runs on one microbatch of it.")] = None,
    method: Annotated[str, typer.Option("--method", help="alpa (the ILP), data_parallel or megatron.")] = "alpa",
    solver: Annotated[str, typer.Option("--solver", help="highs or cbc.")] = "highs",
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="ILP time limit, seconds.")] = None,
    compute: Annotated[bool, typer.Option("--compute", help="Add compute time to the ILP objective.")] = False,
    microbatches: Annotated[Optional[int], typer.Option("--microbatches", help="Gradient-accumulation steps: "
                                                        "the stage runs on --batch / this many samples and weight "
                                                        "gradients sync once per this many microbatches (default: "
                                                        "the fewest that make microbatches of at most "
                                                        f"{DEFAULT_MICROBATCH_SIZE} samples).")] = None,
    recompute: RecomputeOpt = "none",
    as_json: JsonOpt = False,
) -> None:
    """Shard one stage (layers i..j, one microbatch of the global --batch) on one logical mesh with the ILP."""
    model = one_model(model_arg, model_opt)
    check_recompute(recompute)
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
    if batch is not None and batch < 1:
        fail(f"--batch must be at least 1, got {batch}")
    if microbatches is not None and microbatches < 1:
        fail(f"--microbatches must be at least 1, got {microbatches}")
    if time_limit is not None and not (math.isfinite(time_limit) and time_limit > 0):
        fail(f"--time-limit {time_limit}: must be a finite number of seconds > 0")
    report = intra_report(model, shape, c, layers=layers, batch=batch, method=method, solver=solver,
                          time_limit=time_limit, compute=compute, microbatches=microbatches, recompute=recompute,
                          log=note)
    if as_json:
        emit_json(report)
        return
    _print_intra(report)


def _print_intra(r: dict[str, Any]) -> None:
    head = (f"{r['model']} layers {r['layers'][0]}..{r['layers'][1]}, batch {r['batch']} as {r['microbatches']} "
            f"microbatches of {r['microbatch_size']}, "
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
        ct.add_row(k, str(n), fmt_bytes(b), f"{s * 1e3:.3f} ms")
    out.print(ct)
    m = r["memory"]
    out.print(f"communication {r['microbatch_communication_s'] * 1e3:.3f} ms per microbatch + gradient sync "
              f"{r['sync_s'] * 1e3:.3f} ms per iteration ({r['microbatches']} microbatches), "
              f"compute {r['compute_s'] * 1e3:.3f} ms, "
              f"memory {fmt_bytes(m['total_bytes'])} per device (params {fmt_bytes(m['params_bytes'])}, "
              f"grads {fmt_bytes(m['grads_bytes'])}, optimizer {fmt_bytes(m['optimizer_bytes'])}, "
              f"activations {fmt_bytes(m['activations_peak_bytes'])}); ILP {r['ilp']['nodes']} nodes, "
              f"{r['ilp']['edges']} edges, solved in {r['solve_s']:.2f} s")
    if r["notes"]:
        err.print(f"note: {len(r['notes'])} heavy ops have no even split over every mesh axis "
                  f"(first: {r['notes'][0]})", markup=False)
    for name, c in r["compare"].items():
        if "error" in c:
            out.print(f"  {name}: {c['error']}")
        else:
            out.print(f"  {name}: communication {c['communication_s'] * 1e3:.3f} ms, memory "
                      f"{fmt_bytes(c['memory_bytes'])} per device, {'fits' if c['fits'] else 'does NOT fit'}")

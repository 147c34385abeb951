"""What `alpasim intra` reports: one stage's intra-op plan on one logical mesh, by the
ILP or a baseline, with its costs and collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from alpasim import costmodels as cm
from alpasim import graphs as gr
from alpasim import solvers as sv

from ._errors import ReportError
from ._graph_report import model_with_batch


# `intra --method`: Alpa's ILP, or the ILP under a baseline's restriction.
INTRA_RESTRICTIONS: dict[str, str | None] = {"alpa": None, **{b: b for b in sv.BASELINES}}
INTRA_METHODS = tuple(INTRA_RESTRICTIONS)
# Samples per microbatch when `alpasim intra` is given no --microbatches: the
# microbatch `intra --batch` used to mean, small enough that one layer of the zoo's
# largest models fits one device.
DEFAULT_MICROBATCH_SIZE = 8


def split_batch(global_batch: int, microbatches: int | None) -> tuple[int, int]:
    """(microbatches, samples per microbatch) of a global batch: `microbatches` as given
    (it must divide the batch), or the fewest whose microbatch holds at most
    DEFAULT_MICROBATCH_SIZE samples."""
    if microbatches is None:
        microbatches = next(m for m in range(1, global_batch + 1)
                            if global_batch % m == 0 and global_batch // m <= DEFAULT_MICROBATCH_SIZE)
    if global_batch % microbatches:
        raise ReportError(f"--microbatches {microbatches} does not divide the global batch {global_batch}")
    return microbatches, global_batch // microbatches


def parse_layers(text: str | None, num_layers: int) -> tuple[int, int]:
    if text is None:
        mid = num_layers // 2
        return mid, mid
    try:
        first, _, last = text.partition(":")
        a, b = int(first), int(last or first)
    except ValueError:
        raise ReportError(f"--layers {text!r}: expected 'i:j' (inclusive layer range) or 'i'") from None
    if not 0 <= a <= b < num_layers:
        raise ReportError(f"--layers {text!r}: the model has layers 0..{num_layers - 1}")
    return a, b


def _intra_solve(stage: gr.OpGraph, mesh: sv.LogicalMesh, model: cm.CostModel, method: str, budget: float,
                 solver: str, time_limit: float | None, compute: bool, microbatches: int) -> sv.IntraOpResult:
    kw = sv.restricted_solve_kwargs(INTRA_RESTRICTIONS[method], stage, mesh, model)
    return sv.solve_intra_op(stage, mesh, model, memory_budget_bytes=budget, solver=solver,
                             time_limit_s=time_limit, with_compute=compute, microbatches=microbatches, **kw)


def intra_report(model_name: str, mesh_shape: tuple[int, int], cluster: cm.Cluster, *, layers: str | None,
                 batch: int | None, method: str, solver: str, time_limit: float | None, compute: bool,
                 microbatches: int | None = None, top: int = 12, recompute: str = "none",
                 log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Solve one stage, on one microbatch of the global `batch` (None: the model's own),
    on one mesh and compare with the hand-designed assignments; `log` hears one line
    as each solve starts."""
    if batch is None:
        batch = gr.model_source(model_name).global_batch
    microbatches, size = split_batch(batch, microbatches)
    name, source = model_with_batch(model_name, size, f"a microbatch of {size} (--batch {batch} over "
                                                      f"{microbatches} microbatches)")
    fwd = source if isinstance(source, gr.OpGraph) else gr.forward_graph(source, name=name)
    graph = gr.build_training_graph(fwd, recompute=recompute).graph
    first, last = parse_layers(layers, graph.num_layers)
    stage = gr.stage_graph(graph, first, last)
    mesh = sv.LogicalMesh.on_cluster(cluster, mesh_shape)
    model = cm.AnalyticCostModel(cluster)
    budget = float(cluster.device.memory_bytes)
    log(f"intra: layers {first}..{last} ({len(stage.ops)} ops) on a {mesh} mesh, {method}")
    result = _intra_solve(stage, mesh, model, method, budget, solver, time_limit, compute, microbatches)
    plan = result.plan
    compare: dict[str, Any] = {}
    for other in ("data_parallel", "megatron"):
        log(f"intra: {other} for comparison")
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
        "model": name, "layers": [first, last], "batch": batch, "microbatch_size": size, "mesh": list(mesh_shape),
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

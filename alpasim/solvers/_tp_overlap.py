"""Which GEMM each tensor-parallel collective of an intra-op plan runs beside, under
Transformer Engine's comm-GEMM overlap (`costmodels._tp_overlap` prices the pairs).

A collective is tensor-parallel when it runs once per microbatch (the gradient sync
runs once an iteration and has its own overlap model) on a GEMM (an einsum). Pairs, as
TE's `initialize_ub` assigns them:

* a forward GEMM (or one the backward recomputes) with its own collectives: the
  all-gather of an input it reads (`ring`, one chunk per rank of the collective's
  group: QKV and FC1) and the reduction of its output (`pipeline`, the projection
  and FC2);
* in the backward, the GEMMs that read the same output gradient (a layer's data- and
  weight-gradient GEMMs) form a group. Beside its data-gradient GEMMs run the output
  gradient's all-gather (`ring`: the projection's and FC2's dgrad) and the all-gather
  of the input the weight gradient re-reads (`bulk`: qkv_dgrad, fc1_dgrad); beside its
  weight-gradient GEMMs, the data gradient's reduction (`bulk`: qkv_wgrad, fc1_wgrad).

Collectives of other ops (a softmax's, a layer norm's) run in line as before.
"""

from __future__ import annotations

from alpasim.costmodels import PIPELINE_SPLITS, exposed_tp_s
from alpasim.graphs import Op, OpGraph, makes_weight_grad


def _backward_groups(layer: OpGraph) -> dict[str, str]:
    """Backward gradient GEMM name -> its group (the name of one of its GEMMs): GEMMs
    reading a common tensor that no forward (or recomputed forward) op made, an output
    gradient, share one (union-find)."""
    forward_made = {t for op in layer.ops if op.phase == "forward" or op.remat for t in op.outputs}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    readers: dict[str, str] = {}
    for op in layer.ops:
        if op.phase != "backward" or op.remat or op.prim != "einsum":
            continue
        find(op.name)
        for t in op.inputs:
            if t in forward_made or layer.tensors[t].role == "param":
                continue
            if t in readers:
                parent[find(op.name)] = find(readers[t])
            else:
                readers[t] = op.name
    return {x: find(x) for x in parent}


def tp_overlap_s(layer: OpGraph, plan) -> tuple[float, float]:
    """(seconds per microbatch that TE's overlap hides of `plan`'s tensor-parallel
    collectives on `layer`, of which in the forward)."""
    groups = _backward_groups(layer)
    # The GEMM time a collective of an op runs beside: a forward (or recomputed) GEMM's
    # own, (name,); in the backward its group's data- or weight-gradient GEMMs.
    pair = {op.name: (op.name,) if op.name not in groups else
            (groups[op.name], "weight" if makes_weight_grad(op, layer.tensors) else "data")
            for op in layer.ops if op.prim == "einsum" and op.phase in ("forward", "backward")}
    comm: dict[tuple, list[tuple[float, str, int]]] = {}
    gemm: dict[tuple, float] = {}
    for name, key in pair.items():
        gemm[key] = gemm.get(key, 0.0) + plan.strategies[name].compute_s
    for p in plan.collectives:
        key = pair.get(p.op)
        if p.per_iteration or key is None:
            continue
        if len(key) == 2 and key[1] == "weight" and p.tensor is None:
            # A weight gradient's own reduction every microbatch (sharded gradients:
            # ZeRO-2 over dp) is no TE pair: it runs on the gradient stream
            # (`LayerOption.grad_scatter_s`), not beside a GEMM.
            continue
        ranks = plan.mesh.axis_size(p.collective.axes)
        if len(key) == 1:                                   # a forward GEMM, or one recomputed
            method, chunks = ("ring", ranks) if p.tensor is not None else ("pipeline", PIPELINE_SPLITS)
        elif p.tensor is None:                              # a data gradient's reduction
            method, chunks, key = "bulk", 1, (key[0], "weight")
        else:                                               # an all-gather before a gradient GEMM
            method, chunks = ("ring", ranks) if key[1] == "data" else ("bulk", 1)
            key = (key[0], "data")
        comm.setdefault(key, []).append((p.collective.time_s(plan.mesh), method, chunks))
    hidden = forward = 0.0
    for key, collectives in comm.items():
        saved = sum(c for c, _, _ in collectives) - exposed_tp_s(collectives, gemm.get(key, 0.0))
        hidden += saved
        forward += saved if len(key) == 1 and layer.op_by_name[key[0]].phase == "forward" else 0.0
    return hidden, forward

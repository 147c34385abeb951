"""The KV exchange of context parallelism, priced per layer and microbatch.

Under context parallelism (`graphs.context_parallel_view`) each rank holds 1 / cp of
every sequence and its attention needs every chunk's keys and values. Llama 3 (Llama
Team 2024, sec. 3.3.2) and Transformer Engine's `AttnFuncWithCPAndKVAllGather`
(transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py), which
Megatron-core runs with `--cp-comm-type all_gather`, do it the same way:

* forward: all-gather K and V over the cp group (`gather_along_first_dim`), then the
  local query chunks' kernels;
* backward: all-gather K and V again (the forward saved only the local ones:
  `_attn_cp_kv_allgather_bwd_gather`), the kernels, then reduce-scatter dK and dV.

The gathers are on the critical path: the kernel waits for them (the paper: "the
all-gather latency is exposed", small beside attention at long context since grouped-
query attention makes K and V much smaller than Q). So they are priced serially, on
the group's own link: cp consecutive ranks of the data-parallel mesh axis (Megatron's
order [TP, CP, PP, DP] puts cp inside dp), which is `mesh_axes` of that axis split in
(dp, cp). The gathered K and V buffer (cp times the local ones, transient, one layer at
a time) is not in the activation memory.
"""

from __future__ import annotations

from alpasim.costmodels import Cluster, CostModel, MeshAxis, mesh_axes
from alpasim.graphs import OpGraph, attention_terms

from ._mesh import LogicalMesh


def cp_group_axis(cluster: Cluster, mesh: LogicalMesh, axis: int, cp: int) -> MeshAxis:
    """The `MeshAxis` of the cp groups along `axis` of `mesh` (laid as `LogicalMesh.
    on_cluster` lays it): `axis` split into (n / cp, cp), the inner part."""
    shape = list(mesh.shape)
    if shape[axis] % cp:
        raise ValueError(f"context parallelism {cp} does not divide mesh axis {axis} of {tuple(shape)}")
    split = shape[:axis] + [shape[axis] // cp, cp] + shape[axis + 1:]
    return mesh_axes(cluster, split)[axis + 1]


def cp_cache_key(layer: OpGraph, mesh: LogicalMesh, cluster: Cluster) -> list:
    """What a layer's price depends on beyond its mesh's axes: the links of its cp
    groups along each axis they divide (empty for a layer without context parallelism)."""
    degrees = sorted({op.attrs.get("context_parallel", 1) for op in layer.ops} - {1})
    return [[cp, a, cp_group_axis(cluster, mesh, a, cp).link.to_json()]
            for cp in degrees for a in (0, 1) if mesh.shape[a] % cp == 0]


def kv_exchange_s(layer: OpGraph, plan, mesh: LogicalMesh, cluster: Cluster,
                  model: CostModel) -> tuple[float, float]:
    """(forward, backward) seconds of `layer`'s KV exchanges per microbatch under
    `plan` (module doc): a forward all-gather of K and V per forward (or recomputed)
    attention op, and per backward op an all-gather of them and a reduce-scatter of
    their gradients, each over the cp group of the mesh axis its batch is split on."""
    forward = backward = 0.0
    for op in layer.ops:
        cp = op.attrs.get("context_parallel", 1)
        if cp == 1 or op.prim not in ("attention", "attention_grad"):
            continue
        k, v = op.inputs[1:3] if op.prim == "attention" else op.inputs[2:4]
        local = sum(layer.tensors[t].nbytes / plan.specs[t].num_shards(mesh) for t in (k, v))
        axis = _batch_axis(op, plan, mesh)
        group = [cp_group_axis(cluster, mesh, axis, cp)]
        gather = model.collective_time_s("all_gather", cp * local, group)
        if op.prim == "attention":
            if op.phase == "forward":
                forward += gather
            else:                     # recomputed in the backward
                backward += gather
        else:
            backward += gather + model.collective_time_s("reduce_scatter", cp * local, group)
    return forward, backward


def _batch_axis(op, plan, mesh: LogicalMesh) -> int:
    """The mesh axis the op's batch letter is split on: the chunks' axis, of which the
    cp groups are part."""
    batch_letter = attention_terms(op.attrs["equation"])[0][0]     # the zoo's batch comes first
    axes = dict(plan.strategies[op.name].loops).get(batch_letter, ())
    if len(axes) != 1:
        raise ValueError(f"context parallelism needs {op.name!r}'s batch on one mesh axis of {mesh.shape}, "
                         f"got axes {axes}")
    return axes[0]

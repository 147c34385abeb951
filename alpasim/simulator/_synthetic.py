"""`synthetic_plan`: a `PipelinePlan` with chosen stage times, for tests, benchmarks and
what-if questions that do not need the planner."""

from __future__ import annotations

from collections.abc import Sequence

from alpasim.costmodels import Cluster
from alpasim.solvers import (PipelinePlan, PipelineStage, PlanCluster, PlanModel, Prediction, SearchStats, PlanTransfer,
                             pipeline_latency_s)


def synthetic_plan(forward_s: Sequence[float], backward_s: Sequence[float], microbatches: int, *,
                   devices_per_stage: int = 1, cluster: Cluster | None = None,
                   params_bytes: float = 0.0, activation_bytes: float = 0.0, sync_s: float = 0.0,
                   hidden_shape: Sequence[int] = (), dtype: str = "float16",
                   specs: tuple[str | None, str | None] = (None, None), chunks: int = 1,
                   layers_per_stage: int = 1) -> PipelinePlan:
    """S = len(forward_s) stages on consecutive devices (stage i on devices
    i*d .. i*d + d - 1, logical mesh 1 x d). With `hidden_shape`, each boundary carries
    one activation of that shape forward and its cotangent backward, with `specs`
    (sender, receiver) for both; without, stages depend on each other through zero-byte
    control messages only. `chunks` v > 1: the stages are the S x v chunks of an
    interleaved plan, stage j on mesh j mod S (`PipelinePlan.chunks`). Each stage
    holds `layers_per_stage` nominal layers (what `--chunks` may cut it into)."""
    if len(forward_s) != len(backward_s) or not forward_s:
        raise ValueError(f"synthetic plan: need as many forward as backward times (>= 1), got "
                         f"{len(forward_s)} and {len(backward_s)}")
    d = devices_per_stage
    meshes = len(forward_s) // chunks
    stages = []
    for i, (f, b) in enumerate(zip(forward_s, backward_s)):
        compute = f + b
        k = i % meshes
        n = layers_per_stage
        stages.append(PipelineStage(
            (i * n, i * n + n - 1), tuple(range(k * d, (k + 1) * d)), (1, d), (1, d), compute + sync_s / microbatches,
            params_bytes + min(len(forward_s) - i, microbatches) * activation_bytes,
            min(len(forward_s) - i, microbatches), compute, sync_s, params_bytes, activation_bytes,
            forward_s=f, backward_s=b))
    transfers = []
    if hidden_shape:
        from alpasim.graphs import DTYPE_BYTES

        nbytes = float(DTYPE_BYTES[dtype])
        for n in hidden_shape:
            nbytes *= n
        for i in range(len(stages) - 1):
            for src, dst, direction in ((i, i + 1, "forward"), (i + 1, i, "backward")):
                transfers.append(PlanTransfer(f"boundary{i}/{direction}", nbytes, src, dst, tuple(hidden_shape), dtype,
                                          direction, False, specs[0], specs[1]))
    info = PlanCluster("synthetic", 1, d * meshes)
    if cluster is not None:
        info = PlanCluster(cluster.name, cluster.nodes, cluster.devices_per_node, spec=cluster.to_json())
    predicted = Prediction(pipeline_latency_s([s.time_s for s in stages], microbatches))
    return PipelinePlan(PlanModel("synthetic", "synthetic", microbatches), info, "synthetic", True, microbatches,
                        tuple(stages), predicted, SearchStats(), "interleaved" if chunks > 1 else "1f1b",
                        transfers=tuple(transfers), chunks=chunks)

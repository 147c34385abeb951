"""A gradient-accumulation pass after each backward, priced on the gradient it runs on.

DeepSpeed's BF16_Optimizer (`graphs.PrecisionRecipe.accumulation` "after-backward")
casts each microbatch's 16-bit gradient to fp32 and adds it into the fp32 accumulator
once the backward is done (`update_hp_grads`). The graph marks each gradient's cast
(`costmodels.accumulating_cast`), and the intra-op ILP prices it, like every op, on its
output's layout. But a weight gradient reduced once an iteration by a reduce-scatter
(ZeRO-1's slices) has that layout only after the scatter, which runs after the last
microbatch, and an all-reduced one's cast may be sliced for a sliced step; the pass runs
every microbatch, before either, on the whole unreduced gradient each device holds
(laid out as the cast's input, before any scatter). So a layer's price adds the
difference: the pass at its whole size, less the ILP's price. The memory model counts
the accumulator so for a scattered gradient (`accumulator_factor`), but an all-reduced
one whose cast is sliced for a sliced step (a bias's, a norm's: a few kB a layer) at the
slice, under every recipe.
"""

from __future__ import annotations

from alpasim.costmodels import CostModel, accumulating_cast
from alpasim.graphs import OpGraph

from ._intra_problem import accumulator_factor


def unreduced_accumulation_s(layer: OpGraph, plan, model: CostModel) -> float:
    """Seconds per microbatch the accumulating casts of `layer` cost under `plan` beyond
    what the plan priced them at (module doc): 0 where no cast accumulates, or where
    each runs on the gradient as the backward leaves it."""
    extra, mesh = 0.0, plan.mesh
    strategy_of = plan.strategies.get
    for op in layer.ops:
        if not accumulating_cast(op):
            continue
        shards = mesh.axis_size(tuple(a for _, axes in strategy_of(op.name).loops for a in axes))
        # The gradient as the backward leaves it on a device: its layout before any
        # once-an-iteration scatter (an all-reduced one is whole already).
        grad = op.inputs[0]
        held = plan.specs[grad].num_shards(mesh) / accumulator_factor(layer, mesh, strategy_of, grad)
        whole = max(1, round(held))
        if whole < shards:
            extra += (model.op_time_s(op, layer.tensors, num_shards=whole)
                      - model.op_time_s(op, layer.tensors, num_shards=shards))
    return extra

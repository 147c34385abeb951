"""Analytic roofline for one operator on one device, with an efficiency curve.

    time = max(F / (peak(dtype) * eff(F)), M / memory_bandwidth) + KERNEL_LAUNCH_OVERHEAD_S

F is the op's FLOPs and M the bytes it moves, both per shard when the op is split
`num_shards` ways. Matmul kinds (einsum, conv) run on tensor cores at the peak of
their dtype, derated by the device's GEMM curve (`_gemm`: fitted to a published GEMM
sweep of the device, else the former 0.7 / 8 us guess), or, for a GEMM whose shard's
shape is known on a device with a measured grid of shapes (H100), at the grid's rate
for that shape (`_gemm.SHAPE_TABLES`, `gemm_shape`); every other kind runs on the CUDA cores
(float32 peak, no derating) and is memory bound in practice — its elementwise FLOPs are
a handful per byte (Williams, Waterman and Patterson, "Roofline", CACM 2009).

Fused attention (kind "attention") is priced from its kernel's measured throughput
where the device has one (`_attention`), else as the GEMMs it runs.

Fusion (`_fusion`): an op inside a fused kernel is charged the HBM bytes the kernel
moves on its behalf (`OpAccess.nbytes`) instead of its own reads and writes, and only
the kernel's first op pays the launch.

Memory-bound kernels stream at the device's measured bandwidth where one is known
(`_gemm.STREAM_BANDWIDTH`, BabelStream), else the datasheet's.

Ignored: caches, wave quantisation, and overlap between consecutive kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from alpasim.graphs import (LOSS_LOGITS, MATMUL_KINDS, Op, Tensor, attention_geometry, op_bytes, op_dims, op_flops,
                            op_kind)

from ._attention import executed_flops, fused_attention_time_s
from ._fusion import VIEW_PRIMS, OpAccess, accumulating_cast, unfused_loss
from ._gemm import DEFAULT_CURVE, LAUNCH_S, GemmCurve, gemm_curve, gemm_table, memory_bandwidth
from ._hardware import Device

# Kinds that run on tensor cores: the contractions, and fused attention where no kernel
# measurement covers it (`_attention`), as the GEMMs it is made of.
TENSOR_CORE_KINDS = MATMUL_KINDS | {"attention"}
# One CUDA kernel launch plus its minimal run time (a few microseconds on V100-H100).
KERNEL_LAUNCH_OVERHEAD_S = LAUNCH_S
# The curve of a device without a sweep (`_gemm.DEFAULT_CURVE`): large cuBLAS GEMMs reach
# roughly 70-80% of the tensor-core peak, 0.7 the V100 end; a matmul reaches half of that
# when its ideal time at peak equals HALF_EFFICIENCY_TIME_S (small kernels cannot fill
# every SM and pay fixed pipeline fill and tail costs).
MAX_MATMUL_EFFICIENCY = DEFAULT_CURVE.max_efficiency
HALF_EFFICIENCY_TIME_S = DEFAULT_CURVE.half_time_s


def matmul_efficiency(flops: float, peak_flops_per_s: float, curve: GemmCurve = DEFAULT_CURVE) -> float:
    """Fraction of peak a matmul of `flops` attains: MAX * F / (F + F_half), F_half =
    peak * T_half of `curve`. The saturating form (one Michaelis-Menten curve) turns
    into a fixed cost: F / (peak * eff) = (F + F_half) / (peak * MAX). Ignores shape (a
    skinny GEMM is less efficient than a square one of equal FLOPs): where the shape is
    known and the device has a measured grid, `compute_time_s` prices from the grid."""
    return curve.efficiency(flops, peak_flops_per_s)


def compute_time_s(flops: float, nbytes: float, dtype: str, device: Device, matmul: bool,
                   launch: bool = True, shape: tuple[float, float, float] | None = None) -> float:
    """Roofline seconds for a kernel of `flops` FLOPs moving `nbytes` (module docstring);
    `launch=False`: a later member of a fused kernel, whose launch its first op paid;
    `shape`: a GEMM's (m, n, k), priced from the device's measured grid where it has
    one (`_gemm.SHAPE_TABLES`), else by its FLOPs on the device's curve.

    A kernel with neither FLOPs nor bytes (a view) costs nothing, not even a launch.
    """
    if flops < 0 or nbytes < 0 or not math.isfinite(flops) or not math.isfinite(nbytes):
        raise ValueError(f"compute_time_s: flops and nbytes must be finite and >= 0, got {flops!r}, {nbytes!r}")
    if flops == 0 and nbytes == 0:
        return 0.0
    if flops == 0:
        compute_s = 0.0
    elif matmul:
        table = gemm_table(device.name, dtype) if shape is not None else None
        if table is not None:    # a measured time holds its launch, which is added below (as `_gemm.fit_curve`)
            compute_s = max(flops / table.flops_per_s(*shape) - LAUNCH_S, 0.0)
        else:
            peak = device.peak_flops_per_s(dtype)
            compute_s = flops / (peak * matmul_efficiency(flops, peak, gemm_curve(device.name, dtype)))
    else:
        compute_s = flops / device.peak_flops_per_s("float32")
    memory_s = nbytes / memory_bandwidth(device.name, device.memory_bandwidth_bytes_per_s)
    return max(compute_s, memory_s) + (KERNEL_LAUNCH_OVERHEAD_S if launch else 0.0)


def loss_bytes(op: Op, tensors: Mapping[str, Tensor]) -> int:
    """HBM bytes of a cross-entropy run as Megatron-LM's unfused fp32 vocab-parallel loss
    (megatron/core/tensor_parallel/cross_entropy.py on `logits.float()`), per logit
    element of itemsize w: forward, the cast (w + 4, none for fp32 logits), the max (4),
    the subtraction (8), the exp (8), the sum (4) and the division into the softmax kept
    for the backward (8); backward, the scaling of that softmax by the loss's cotangent
    (8) and the cast of the gradient back (4 + w). The per-token work (the target's
    logit, the log) is negligible beside it. The op pays one launch, not its six and
    two kernels' (some 20 us a microbatch left out); the fp32 softmax it keeps for the
    backward (4 bytes a logit) is not in the stash, which keeps the logits instead."""
    logits = tensors[op.inputs[LOSS_LOGITS[op.prim]]]
    cast = 0 if logits.dtype == "float32" else logits.itemsize + 4
    return ((32 if op.prim == "softmax_cross_entropy" else 8) + cast) * logits.size


def accumulate_bytes(op: Op, tensors: Mapping[str, Tensor]) -> int:
    """HBM bytes of a gradient cast that adds into its accumulator after the backward
    (`_fusion.accumulating_cast`): the cast reads the 16-bit gradient and writes it in
    fp32 (`lp.grad.to(fp32)`), and the add reads that and the accumulator and writes the
    accumulator (`hp_grad.add_`): 2 + 4 + 3 x 4 bytes an element for bf16."""
    return op_bytes(op, tensors) + 3 * tensors[op.outputs[0]].nbytes


def traffic_bytes(op: Op, tensors: Mapping[str, Tensor]) -> int:
    """HBM bytes an op moves: `op_bytes`, except views (0), embedding lookups and slices.

    A lookup reads only the gathered rows, not the whole table: ids + 2 * output
    (read the rows, write the result). A slice likewise reads only the part it keeps
    (the fused QKV's q, k and v each read a third of it): 2 * output.
    """
    if op.prim in VIEW_PRIMS:
        return 0
    if op.prim == "embedding":
        _, ids = op.inputs
        return tensors[ids].nbytes + 2 * tensors[op.outputs[0]].nbytes
    if op.prim == "slice":
        return 2 * tensors[op.outputs[0]].nbytes
    if unfused_loss(op):
        return loss_bytes(op, tensors)
    if accumulating_cast(op):
        return accumulate_bytes(op, tensors)
    return op_bytes(op, tensors)


def compute_dtype(op: Op, tensors: Mapping[str, Tensor]) -> str:
    """The dtype an op computes in: its widest float input (fp16 x fp32 runs at fp32)."""
    # Fused attention's float32 log-sum-exp is a softmax statistic, not a GEMM operand.
    inputs = op.inputs[:5] if op.prim == "attention_grad" else op.inputs
    floats = [tensors[t].dtype for t in inputs if tensors[t].is_float]
    if not floats:
        return "float32"
    return "float32" if "float32" in floats else floats[0]


def gemm_shape(op: Op, tensors: Mapping[str, Tensor], split: Mapping[str, int] | None = None
               ) -> tuple[float, float, float] | None:
    """The (m, n, k) of one shard of a two-operand einsum split `split` (letter of its
    dimension map -> shards): k its contracted letters, m the left operand's kept ones
    with the batch letters both keep (a batched GEMM's batch spreads its tiles like m),
    n the right operand's; None for any other op, and for an einsum that is not one
    GEMM (a letter summed out of one operand alone: 2 m n k is not its FLOPs)."""
    if op.prim != "einsum" or len(op.inputs) != 2:
        return None
    dm = op_dims(op, tensors)
    (lhs, rhs), out = dm.inputs, set("".join(dm.outputs))
    size, split = dm.size_of, split or {}

    def extent(letters) -> float:
        return float(math.prod(size[c] / split.get(c, 1) for c in letters))

    if any(c not in out and (c in lhs) != (c in rhs) for c in lhs + rhs):
        return None
    m = extent(c for c in dict.fromkeys(lhs) if c in out)
    n = extent(c for c in dict.fromkeys(rhs) if c in out and c not in lhs)
    k = extent(c for c in dict.fromkeys(lhs) if c in rhs and c not in out)
    return m, n, k


def op_time_s(op: Op, tensors: Mapping[str, Tensor], device: Device, num_shards: int = 1,
              access: OpAccess | None = None, split: Mapping[str, int] | None = None) -> float:
    """Roofline seconds of `op` split evenly `num_shards` ways (one shard on `device`);
    `access`: what the op is charged inside its fused kernel (`_fusion.fuse`), None for
    an op priced on its own; `split`: how many ways each letter of the op's dimension
    map is split (the product is `num_shards`), which gives a GEMM's shard its shape
    (`gemm_shape`); without it a split GEMM is priced by its FLOPs alone.

    Formula and what it ignores: module docstring. Each shard pays the launch overhead.
    """
    check_shards(op, num_shards)
    kind, dtype = op_kind(op), compute_dtype(op, tensors)
    if kind == "attention":
        geometry, backward = attention_geometry(op, tensors), op.prim == "attention_grad"
        kernel_s = fused_attention_time_s(device.name, geometry, backward, num_shards, dtype)
        if kernel_s is not None:
            return kernel_s + KERNEL_LAUNCH_OVERHEAD_S
        flops = executed_flops(*geometry, backward) / num_shards
    else:
        flops = op_flops(op, tensors) / num_shards
    nbytes = (traffic_bytes(op, tensors) if access is None else access.nbytes) / num_shards
    second = KERNEL_LAUNCH_OVERHEAD_S if accumulating_cast(op) else 0.0      # the add's own kernel
    if split is not None and math.prod(split.values()) != num_shards:
        raise ValueError(f"op {op.name!r}: split {dict(split)} is not {num_shards} shards")
    # A shape only where a grid prices it (`_gemm.SHAPE_TABLES`): the planner asks this of
    # every strategy of every op.
    gridded = kind in TENSOR_CORE_KINDS and (split is not None or num_shards == 1) \
        and gemm_table(device.name, dtype) is not None
    shape = gemm_shape(op, tensors, split) if gridded else None
    return compute_time_s(flops, nbytes, dtype, device, kind in TENSOR_CORE_KINDS,
                          launch=access is None or access.launch, shape=shape) + second


def check_shards(op: Op, num_shards: int) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"op {op.name!r}: num_shards must be an integer >= 1, got {num_shards!r}")

"""Fused attention kernels: measured throughput by sequence length, per device.

A fused attention kernel (FlashAttention and its successors) is neither a GEMM nor a
memory-bound kernel: its throughput climbs with the sequence length (more tiles per
head fill the SMs and amortise the softmax rescaling) and a causal kernel runs less
efficiently than a full one (diagonal tiles, imbalanced blocks). So it is priced from
the kernels' own published benchmarks, not from the GEMM curve:

    time = F_kernel / rate(seqlen)

F_kernel counts FLOPs the way those benchmarks do (`benchmarks/benchmark_flash_attention.py`
in Dao-AILab/flash-attention): 4 * batch * heads * s^2 * d for the forward, halved when
causal; the backward 2.5 times the forward. `rate` interpolates the benchmark's
TFLOP/s linearly in log2(seqlen), clamped at the measured ends. Head dimension 128 (the
measured curves of most models we price; head dimension 64 runs 5-15 % slower, 256
slightly faster).

Sources, one per device (devices are matched by name; any other device, and a
sequence shorter than CAUSAL_TILE, is priced on the GEMM efficiency curve of
`_compute` with the FLOPs the kernel executes, `executed_flops`: the backward
recomputes Q K^T, 2.5 times the forward's matmuls (FlashAttention 2, section 3.1.2);
a causal kernel skips the tiles above the diagonal, so of T x T tiles (T = s /
CAUSAL_TILE) it runs T (T + 1) / 2):

* A100-SXM-80GB: FlashAttention 2 (Dao 2023, arXiv:2307.08691, Figure 4, "Attention
  forward + backward speed on A100 80GB SXM4", head dim 128, batch x seqlen = 16k,
  hidden 2048). Only forward + backward together is given there at head dim 128, so
  both passes are priced at that rate (their sum is what was measured).
* H100-SXM-80GB: cuDNN 9's fused attention, the kernel Transformer Engine (and so
  Megatron-core) selects on Hopper, as measured in the FlashAttention 3 paper (Shah et
  al. 2024, arXiv:2407.08608, Figures 5 and 6, head dim 128, BF16). The paper gives
  the causal backward only for FlashAttention 3, not cuDNN; ours is cuDNN's non-causal
  backward scaled by cuDNN's causal/non-causal forward ratio at each length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._gemm import HALF_DTYPES

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class AttentionKernel:
    """One kernel's measured TFLOP/s at `SEQLENS` (benchmark FLOP convention, module doc)."""

    name: str
    source: str
    forward: dict[bool, tuple[float, ...]]     # causal -> TFLOP/s
    backward: dict[bool, tuple[float, ...]]

    def tflops(self, backward: bool, causal: bool, seqlen: int) -> float:
        rates = (self.backward if backward else self.forward)[causal]
        x = math.log2(max(SEQLENS[0], min(SEQLENS[-1], seqlen)))
        i = min(int(x - math.log2(SEQLENS[0])), len(SEQLENS) - 2)
        frac = x - math.log2(SEQLENS[i])
        return rates[i] + frac * (rates[i + 1] - rates[i])


_FA2_A100_CAUSAL = (99.0, 133.0, 155.0, 173.0, 182.0, 189.0)
# Figure 4's non-causal head-dim-128 panel starts at 1k; 512 repeats 1k's rate less the
# causal curve's 512 -> 1k step (an estimate for the one point not measured).
_FA2_A100_FULL = (173.0 - (133.0 - 99.0), 173.0, 187.0, 196.0, 201.0, 203.0)
_CUDNN_H100_FWD_FULL = (497.0, 574.0, 617.0, 609.0, 600.0, 595.0)
_CUDNN_H100_FWD_CAUSAL = (315.0, 410.0, 484.0, 518.0, 529.0, 539.0)
_CUDNN_H100_BWD_FULL = (305.0, 408.0, 465.0, 499.0, 518.0, 516.0)
_CUDNN_H100_BWD_CAUSAL = tuple(round(b * c / f, 1) for b, c, f in
                               zip(_CUDNN_H100_BWD_FULL, _CUDNN_H100_FWD_CAUSAL, _CUDNN_H100_FWD_FULL))

KERNELS: dict[str, AttentionKernel] = {
    "A100-SXM-80GB": AttentionKernel(
        "FlashAttention 2", "Dao 2023 (arXiv:2307.08691) Figure 4, head dim 128",
        {True: _FA2_A100_CAUSAL, False: _FA2_A100_FULL}, {True: _FA2_A100_CAUSAL, False: _FA2_A100_FULL}),
    "H100-SXM-80GB": AttentionKernel(
        "cuDNN 9 fused attention", "Shah et al. 2024 (arXiv:2407.08608) Figures 5-6, head dim 128",
        {True: _CUDNN_H100_FWD_CAUSAL, False: _CUDNN_H100_FWD_FULL},
        {True: _CUDNN_H100_BWD_CAUSAL, False: _CUDNN_H100_BWD_FULL}),
}


# FlashAttention 2's forward tile on A100 and H100 at head dimension 128 is 128 x 64
# (csrc/flash_attn/src/flash_fwd_launch_template.h, run_mha_fwd_hdim128): masked work is
# skipped 128 query rows at a time.
CAUSAL_TILE = 128
# The backward's five matmuls (Q K^T again, dV, dP, dQ, dK) against the forward's two.
BACKWARD_FLOPS_RATIO = 2.5


def causal_fraction(q: int, k: int) -> float:
    """Share of the q x k score tiles a causal kernel computes (module doc)."""
    if q != k:
        return 1.0
    tiles = math.ceil(q / CAUSAL_TILE)
    return (tiles + 1) / (2 * tiles)


def _pass_flops(batch_heads: int, q: int, k: int, d: int, share: float, backward: bool) -> float:
    """`share` of the forward's two matmuls over all q x k scores; the backward's five."""
    fwd = 4.0 * batch_heads * q * k * d * share
    return fwd * BACKWARD_FLOPS_RATIO if backward else fwd


def executed_flops(batch_heads: int, q: int, k: int, d: int, causal: bool, backward: bool) -> float:
    """FLOPs a fused kernel executes (module doc), for devices without a measurement."""
    return _pass_flops(batch_heads, q, k, d, causal_fraction(q, k) if causal else 1.0, backward)


def kernel_flops(batch_heads: int, q: int, k: int, d: int, causal: bool, backward: bool) -> float:
    """FLOPs of one kernel call as the benchmarks count them: causal, half (module doc)."""
    return _pass_flops(batch_heads, q, k, d, 0.5 if causal else 1.0, backward)


def fused_attention_time_s(device_name: str, geometry: tuple[int, int, int, int, bool], backward: bool,
                           num_shards: int, dtype: str = "bfloat16") -> float | None:
    """Seconds of one shard of a fused attention kernel on a device with a measured
    kernel, or None (price it as a GEMM). Shards split batch and heads only. The
    kernels are half precision only (FlashAttention and cuDNN have no float32 path)."""
    kernel = KERNELS.get(device_name)
    batch_heads, q, k, d, causal = geometry
    if kernel is None or q < CAUSAL_TILE or dtype not in HALF_DTYPES:
        return None
    flops = kernel_flops(batch_heads, q, k, d, causal, backward) / num_shards
    return flops / (kernel.tflops(backward, causal, q) * 1e12)

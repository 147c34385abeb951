"""GEMM efficiency curves and streaming bandwidth per device, from published microbenchmarks.

The compute model prices a half-precision matmul of F FLOPs at

    t(F) = F / (peak * MAX) + T_half / MAX        (+ the kernel launch, `_compute`)

i.e. efficiency MAX * F / (F + peak * T_half): a saturating curve whose fixed cost
stands for what a small GEMM cannot fill (SMs idle, pipeline fill and tail, wave
quantisation). MAX and T_half are not guessed: each device's pair is the least-squares
fit (in relative time) of that line to a published sweep of its cuBLAS GEMMs, and the
sweep itself is kept here, so the constants can be re-derived and a test holds the fit
to it. Nothing here is fitted to a training run.

* A100-SXM-80GB, FP16: Azure's AI benchmarking guide, `Azure_Results/ND_A100_v4_results.md`
  (cuBLASLt): squares 1024-16384, 1024 x 2145 x 1024, 6144 x 12288 x 12288.
* H100-SXM-80GB, BF16: XLA's own H100 GEMM table (`xla/service/gpu/model/
  matmul_interpolator_data.h`, key sm_90): squares 512-4096 and 4096 x 4096 x K for K
  256-2048.

A device with no sweep (V100, B200, a user's device, float32 GEMMs) keeps the former
curve: MAX 0.7 (the V100 end of "large cuBLAS GEMMs reach 70-80 % of peak") and T_half
8 us. Shape is ignored beyond FLOPs: a skinny GEMM of the same FLOPs as a square one
runs at the same rate here (the sweeps' 4096 x 4096 x 256 is 20 % slower than the curve).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Kernel launch plus minimal run time (a few microseconds on V100-H100); `_compute` adds it.
LAUNCH_S = 3e-6
HALF_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class GemmCurve:
    """efficiency(F) = max_efficiency * F / (F + peak * half_time_s)."""

    max_efficiency: float
    half_time_s: float
    source: str

    def efficiency(self, flops: float, peak_flops_per_s: float) -> float:
        if flops <= 0:
            return 0.0
        # max / (1 + F_half / F): each step is monotone under IEEE rounding, so a larger
        # matmul never rounds to a lower efficiency (max * F / (F + F_half) can, by an ulp).
        return self.max_efficiency / (1.0 + peak_flops_per_s * self.half_time_s / flops)


DEFAULT_CURVE = GemmCurve(0.7, 8e-6, "no sweep: the V100 end of large cuBLAS GEMMs' 70-80 % of peak")

# (m, n, k) -> measured TFLOP/s, with the device's dense half-precision peak.
SWEEPS: dict[str, tuple[float, str, tuple[tuple[tuple[int, int, int], float], ...]]] = {
    "A100-SXM-80GB": (312e12, "Azure AI-benchmarking-guide ND_A100_v4, cuBLASLt FP16", (
        ((1024, 1024, 1024), 119.4), ((2048, 2048, 2048), 221.8), ((4096, 4096, 4096), 228.0),
        ((8192, 8192, 8192), 253.7), ((16384, 16384, 16384), 256.5), ((1024, 2145, 1024), 132.8),
        ((6144, 12288, 12288), 250.8))),
    "H100-SXM-80GB": (989e12, "XLA matmul_interpolator_data.h sm_90, BF16", (
        ((512, 512, 512), 40.7), ((1024, 1024, 1024), 236.3), ((2048, 2048, 2048), 632.0),
        ((4096, 4096, 4096), 783.3), ((4096, 4096, 256), 392.2), ((4096, 4096, 512), 543.1),
        ((4096, 4096, 1024), 677.4), ((4096, 4096, 2048), 738.7))),
}


def fit_curve(peak_flops_per_s: float, sweep, source: str) -> GemmCurve:
    """The curve whose times (plus `LAUNCH_S`) best match `sweep` in relative error."""
    flops = np.array([2.0 * m * n * k for (m, n, k), _ in sweep])
    seconds = flops / np.array([tflops * 1e12 for _, tflops in sweep])
    # time = a F + b; minimise sum((a F + b) / t - 1)^2
    (a, b), *_ = np.linalg.lstsq(np.stack([flops / seconds, 1.0 / seconds], axis=1), np.ones_like(seconds),
                                 rcond=None)
    max_efficiency = 1.0 / (a * peak_flops_per_s)
    return GemmCurve(float(max_efficiency), float((b - LAUNCH_S) * max_efficiency), f"fit to {source}")


CURVES: dict[str, GemmCurve] = {name: fit_curve(peak, sweep, source) for name, (peak, source, sweep) in SWEEPS.items()}


# Achievable HBM bandwidth, bytes/s: BabelStream's triad (two reads, one write: the
# elementwise kernels' pattern) as Azure's AI benchmarking guide measured it
# (`Azure_Results/ND_A100_v4_results.md`, `ND_H100_v5_results.md`): 1.70 of the A100's
# 2.04 TB/s datasheet, 2.97 of the H100's 3.35. Other devices: the datasheet's.
STREAM_BANDWIDTH: dict[str, float] = {"A100-SXM-80GB": 1.70e12, "H100-SXM-80GB": 2.97e12}


def memory_bandwidth(device_name: str, datasheet_bytes_per_s: float) -> float:
    """Bytes/s a memory-bound kernel streams on the device (`STREAM_BANDWIDTH`)."""
    return STREAM_BANDWIDTH.get(device_name, datasheet_bytes_per_s)


def gemm_curve(device_name: str, dtype: str) -> GemmCurve:
    """The curve of a device's half-precision GEMMs, else `DEFAULT_CURVE`."""
    return CURVES.get(device_name, DEFAULT_CURVE) if dtype in HALF_DTYPES else DEFAULT_CURVE

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
8 us.

The curve sees only FLOPs: a skinny GEMM of the same FLOPs as a square one runs at its
rate (the H100 grid's 4096 x 4096 x 256 reaches 399 TFLOP/s, the curve prices it at
500 with its launch, as it does 1625^3 of the same FLOPs, which the grid puts at 502). Where a
device has a measured grid of shapes (`SHAPE_TABLES`: H100's half-precision GEMMs over
m, n, k of 256-4096 each, XLA's own table), a GEMM whose shape is known is priced from
it instead, in the manner of XLA's GPU cost model (`xla/service/gpu/model/
matmul_interpolator.cc`): each dimension clamped into the grid, whose edges stand for
anything beyond them, and the rate interpolated between the 8 grid points around the
shape (here multilinearly in log2 of each dimension, on log FLOP/s; XLA weighs the same
corners by their distance). XLA keeps a batched GEMM's batch as a dimension of its own
(its grid has b = 1, 2, 4); here it is counted into m (the output tiles it spreads over
the SMs) and the b = 1 grid serves. A measured time holds the kernel's launch, as the
curve's fit takes it. The A100 and the other devices have no such table, and keep
their curve.
"""

from __future__ import annotations

import math
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

# XLA's default GEMM table for sm_90 (H100 SXM), "bf16xbf16->bf16", b = 1
# (xla/service/gpu/model/matmul_interpolator_data.h, `kDefaultMatmulPTable`, as of
# ROCm/xla ea2c45f2ca, 2026-07-31), in TFLOP/s: measured cuBLAS GEMMs on the grid below.
GRID = (256, 512, 1024, 2048, 4096)
H100_BF16_GRID = (
    # m = 256: n = 256 ... 4096, each k = 256 ... 4096
    (6.7, 11.5, 18.9, 31.9, 90.9),
    (12.4, 23.0, 41.1, 63.9, 93.1),
    (23.7, 43.8, 75.1, 119.6, 177.1),
    (43.8, 83.1, 141.6, 222.6, 296.3),
    (82.6, 146.2, 237.6, 345.9, 418.4),
    # m = 512: n = 256 ... 4096, each k = 256 ... 4096
    (12.3, 23.0, 41.5, 61.7, 92.8),
    (23.6, 43.6, 73.4, 116.3, 187.5),
    (45.7, 85.4, 146.5, 231.0, 300.9),
    (84.5, 147.5, 241.8, 342.8, 460.4),
    (141.3, 243.6, 381.3, 530.0, 661.6),
    # m = 1024: n = 256 ... 4096, each k = 256 ... 4096
    (23.6, 43.7, 69.8, 116.1, 187.2),
    (45.5, 84.3, 144.0, 235.5, 312.1),
    (80.9, 149.1, 252.8, 359.8, 472.6),
    (144.3, 244.0, 384.0, 529.5, 665.7),
    (219.7, 347.7, 494.4, 639.1, 751.9),
    # m = 2048: n = 256 ... 4096, each k = 256 ... 4096
    (45.3, 79.0, 142.8, 231.4, 333.9),
    (84.3, 150.1, 257.6, 354.1, 458.1),
    (145.6, 244.9, 386.8, 535.3, 663.6),
    (219.7, 348.6, 498.0, 641.0, 752.2),
    (303.3, 449.3, 596.5, 725.5, 752.3),
    # m = 4096: n = 256 ... 4096, each k = 256 ... 4096
    (84.5, 144.9, 229.0, 314.3, 398.9),
    (141.9, 240.1, 377.5, 531.0, 662.0),
    (223.0, 354.6, 497.6, 643.7, 751.7),
    (308.2, 449.6, 604.6, 727.5, 759.4),
    (398.6, 551.8, 685.2, 735.6, 780.2),
)


@dataclass(frozen=True)
class GemmTable:
    """Measured rates of a device's GEMMs on a grid of (m, n, k) (module doc):
    `tflops[i][j][l]` at (grid[i], grid[j], grid[l]), the grid powers of two."""

    grid: tuple[int, ...]
    tflops: tuple[tuple[tuple[float, ...], ...], ...]
    source: str

    def __post_init__(self) -> None:
        n = len(self.grid)
        logs = np.log2(self.grid)
        if n < 2 or not np.allclose(logs, logs[0] + np.arange(n)):
            raise ValueError(f"a GEMM table's grid must be consecutive powers of two, got {self.grid}")
        rates = np.asarray(self.tflops, dtype=float)
        if rates.shape != (n, n, n) or not (rates > 0).all():
            raise ValueError(f"a GEMM table holds a positive rate for every (m, n, k) of its grid, got {rates.shape}")
        object.__setattr__(self, "_log_rates", np.log(rates * 1e12))

    def measured(self, m: int, n: int, k: int) -> float:
        """The TFLOP/s measured at grid point (m, n, k)."""
        return self.tflops[self.grid.index(m)][self.grid.index(n)][self.grid.index(k)]

    def flops_per_s(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an m x n x k GEMM: clamped into the grid, multilinear in log2 of
        each dimension on log FLOP/s (module doc)."""
        lo, top = math.log2(self.grid[0]), len(self.grid) - 1
        index, frac = [], []
        for x in (m, n, k):
            p = min(max(math.log2(max(x, 1.0)) - lo, 0.0), float(top))
            i = min(int(p), top - 1)
            index.append(i)
            frac.append(p - i)
        cube = self._log_rates[index[0]:index[0] + 2, index[1]:index[1] + 2, index[2]:index[2] + 2]
        for f in frac:                 # contract one axis at a time: m, then n, then k
            cube = cube[0] * (1.0 - f) + cube[1] * f
        return float(math.exp(cube))


SHAPE_TABLES: dict[str, GemmTable] = {
    "H100-SXM-80GB": GemmTable(GRID, tuple(H100_BF16_GRID[i:i + len(GRID)] for i in range(0, len(H100_BF16_GRID),
                                                                                      len(GRID))),
                               "XLA matmul_interpolator_data.h sm_90, BF16 (ROCm/xla ea2c45f2ca)"),
}


# (m, n, k) -> measured TFLOP/s, with the device's dense half-precision peak.
SWEEPS: dict[str, tuple[float, str, tuple[tuple[tuple[int, int, int], float], ...]]] = {
    "A100-SXM-80GB": (312e12, "Azure AI-benchmarking-guide ND_A100_v4, cuBLASLt FP16", (
        ((1024, 1024, 1024), 119.4), ((2048, 2048, 2048), 221.8), ((4096, 4096, 4096), 228.0),
        ((8192, 8192, 8192), 253.7), ((16384, 16384, 16384), 256.5), ((1024, 2145, 1024), 132.8),
        ((6144, 12288, 12288), 250.8))),
    # Points of the grid below (`H100_BF16_GRID`): its squares and a K sweep at 4096 x 4096.
    "H100-SXM-80GB": (989e12, "XLA matmul_interpolator_data.h sm_90, BF16", tuple(
        ((m, n, k), SHAPE_TABLES["H100-SXM-80GB"].measured(m, n, k))
        for m, n, k in ((512,) * 3, (1024,) * 3, (2048,) * 3, (4096,) * 3, (4096, 4096, 256), (4096, 4096, 512),
                        (4096, 4096, 1024), (4096, 4096, 2048)))),
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


def gemm_table(device_name: str, dtype: str) -> GemmTable | None:
    """The measured shape grid of a device's half-precision GEMMs, if it has one."""
    return SHAPE_TABLES.get(device_name) if dtype in HALF_DTYPES else None


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

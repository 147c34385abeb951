"""Measured collective sweeps of NVSwitch nodes: nccl-tests' bus bandwidth per size.

Inside an NVSwitch node a collective's rate is far from the link's datasheet figure at
the sizes training moves: on 8 A100s a 100 MB all-reduce reaches 200 GB/s of bus
bandwidth, not the 300 GB/s of NVLink3, and an 8 MB one 91 GB/s (NCCL's pipelined ring
needs large messages to fill its channels; small ones pay its ~35 us launch). So the
presets' intra-node links carry the measured sweeps below (`BusSweep`), and
`_collectives` prices their all-reduce, all-gather and reduce-scatter from them rather
than from alpha-beta. Each table is one published nccl-tests run on one 8-GPU node,
out-of-place bus bandwidth (GB/s) from 64 KiB to 8 GiB; nothing here is fitted to a
training run.

* A100-SXM4 (NVLink3, NVSwitch; DGX A100 / Azure NDv4), NCCL's default algorithm:
  Microsoft SuperBench's nccl-tests fixtures, `microsoft/superbenchmark`
  `tests/data/nccl_allreduce.log` (f1f5c72), `nccl_allgather.log` (86e1415),
  `nccl_reducescatter.log` (020a63c), 8x A100-SXM4-40GB, `-b 1 -e 8G -f 2 -g 8`.
  The all-reduce agrees with SuperBench's 729-node NDm A100 v4 baseline
  (`microsoft/superbench-results` v0.4.0) within 3 % from 1 MB up.
* H100-SXM5 (NVLink4, NVSwitch; DGX H100), all-gather and reduce-scatter on rings:
  `togethercomputer/together-nccl-tests` `benchmarks/H100/results/20260305_220944/
  {all_gather,reduce_scatter}_ring.out` (6698e53), NCCL 2.26.2, `NCCL_ALGO=RING`
  (NCCL's choice for them on H100: NVLink SHARP all-gather is slower, NVIDIA/nccl#1083).
  Its reduce-scatter agrees with NVIDIA/nccl#1047's within 1 %.
* H100 all-reduce through NVLink SHARP (NCCL's default on NVSwitch 3 from 2.17):
  Azure's AI benchmarking guide, `Azure_Results/ND_H100_v5_results.md`, NCCL 2.18.5,
  in-place (the only column it gives).
"""

from __future__ import annotations

from ._hardware import BusSweep

_KIB = 1024
# 64 KiB, 128 KiB, ... 8 GiB: the sizes every table below lists.
_SIZES = tuple(64 * _KIB * 2**i for i in range(18))


def _table(**kinds: tuple[float, ...]) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    return tuple((kind, tuple(zip(_SIZES, rates, strict=True))) for kind, rates in kinds.items())


A100_NVSWITCH = BusSweep(
    "nccl-tests on 8x A100-SXM4 (microsoft/superbenchmark tests/data/nccl_*.log), out-of-place busbw",
    _table(
        all_reduce=(3.03, 5.57, 9.65, 15.21, 24.54, 39.26, 65.52, 90.63, 129.90, 156.89, 200.91, 202.11,
                    222.40, 223.68, 230.29, 231.76, 234.37, 235.26),
        all_gather=(1.58, 2.85, 4.94, 7.84, 12.58, 23.75, 36.43, 59.44, 87.52, 110.46, 154.65, 168.12,
                    197.01, 203.88, 212.88, 217.01, 220.85, 223.39),
        reduce_scatter=(1.56, 2.82, 4.77, 7.67, 12.68, 22.76, 33.72, 49.84, 96.34, 122.06, 164.89, 190.01,
                        211.84, 216.58, 223.54, 224.85, 229.15, 231.52)))

H100_NVSWITCH = BusSweep(
    "nccl-tests on 8x H100-SXM5: rings (togethercomputer/together-nccl-tests 20260305_220944), "
    "NVLS all-reduce (Azure AI-benchmarking-guide ND_H100_v5)",
    _table(
        all_reduce=(2.72, 5.40, 10.86, 21.35, 43.70, 81.93, 128.73, 172.13, 234.45, 295.53, 361.78, 400.61,
                    423.38, 438.46, 466.35, 472.36, 475.54, 478.87),
        all_gather=(1.62, 3.06, 6.23, 11.58, 22.88, 44.93, 87.85, 154.65, 207.54, 233.64, 277.79, 302.10,
                    320.47, 335.36, 344.57, 350.92, 355.04, 359.02),
        reduce_scatter=(1.64, 3.23, 6.33, 12.07, 22.48, 42.17, 88.39, 145.51, 204.25, 247.52, 283.71, 308.73,
                        326.35, 337.93, 345.79, 356.01, 358.33, 362.16)))

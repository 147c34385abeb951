"""Cluster presets with sourced numbers: the Alpa testbed, two DGX generations and a
GB200 NVL72 rack.

The DGX-style presets have 8 nodes of 8 GPUs (64 GPUs, the size of the Alpa paper's
testbed) so that a preset name alone reproduces a like-for-like comparison; the NVL72
preset is one rack, a 72-GPU NVLink domain (its "node"). Change the size with
`get_cluster(name, nodes=..., devices_per_node=...)`.

Conventions: memory capacities are binary (a "16 GB" V100 has 16 GiB of HBM2);
datasheet bandwidths in GB/s are decimal and per direction unless said otherwise;
links are stored in Gbit/s (1 GB/s = 8 Gbit/s). Peaks are dense (no 2:4 sparsity).

Latencies are per ring step, not datasheet numbers: NCCL's own tuning model
(src/graph/tuning.cc, `hwLat`, Simple protocol) charges about 3.4 us per step over
NVLink and about 14 us over an RDMA network. AWS p3 nodes talk over TCP (no EFA on
p3.16xlarge), where a step costs more; 30 us is our estimate. The DGX nodes' NVSwitch
links also carry their measured nccl-tests sweeps (`_bus_sweeps`), which price their
ring collectives in place of these figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ._bus_sweeps import A100_NVSWITCH, H100_NVSWITCH
from ._hardware import GIB, Cluster, Device, Link

NVLINK_STEP_LATENCY_S = 3.4e-6  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]
RDMA_STEP_LATENCY_S = 14e-6  # NCCL tuning.cc hwLat[NET][Ring][Simple]
TCP_STEP_LATENCY_S = 30e-6  # estimate: kernel TCP stack within an EC2 placement group


class UnknownPresetError(KeyError, ValueError):
    """A cluster preset name that does not exist; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


# NVIDIA Tesla V100 SXM2 datasheet: 125 TFLOP/s tensor (FP16), 15.7 TFLOP/s FP32,
# 16 GB HBM2 at 900 GB/s. Volta has no bfloat16 units; XLA computes bf16 in FP32, so
# bf16 gets the FP32 peak.
V100_SXM2_16GB = Device(
    "V100-SXM2-16GB",
    {"float16": 125e12, "bfloat16": 15.7e12, "float32": 15.7e12},
    memory_bytes=16 * GIB,
    memory_bandwidth_bytes_per_s=900e9,
)

# NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 TFLOP/s FP16/BF16 dense tensor,
# 19.5 TFLOP/s FP32 (156 TFLOP/s with TF32 tensor cores; we keep strict FP32, as
# float32 graphs ask for), 80 GB HBM2e at 2,039 GB/s.
A100_SXM_80GB = Device(
    "A100-SXM-80GB",
    {"float16": 312e12, "bfloat16": 312e12, "float32": 19.5e12},
    memory_bytes=80 * GIB,
    memory_bandwidth_bytes_per_s=2039e9,
)

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 1,979 TFLOP/s FP16/BF16 with
# sparsity = 989 dense, 67 TFLOP/s FP32, 80 GB HBM3 at 3.35 TB/s.
H100_SXM_80GB = Device(
    "H100-SXM-80GB",
    {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12},
    memory_bytes=80 * GIB,
    memory_bandwidth_bytes_per_s=3.35e12,
)

AWS_P3_16XLARGE = Cluster(
    "aws-p3.16xlarge",
    nodes=8,  # Alpa (OSDI'22) section 8: 8 p3.16xlarge instances, 64 V100s
    devices_per_node=8,  # AWS P3 instance page: p3.16xlarge has 8 V100 (16 GiB each)
    device=V100_SXM2_16GB,
    # DGX-1-style hybrid cube-mesh: each V100 has 6 NVLink2 links of 25 GB/s per
    # direction (V100 datasheet: 300 GB/s total), wired as three interwoven rings
    # (NVIDIA DGX-1 whitepaper), so NCCL's rings can use all six links: 150 GB/s per
    # direction at best. Not every pair is directly linked, so we model the node as
    # one ring at an effective 130 GB/s (~87% of 150, our estimate of the large-message
    # all-reduce bus bandwidth NCCL reaches there) rather than a full crossbar.
    intra_node=Link("NVLink2 cube-mesh (ring effective)", 130 * 8, NVLINK_STEP_LATENCY_S),
    # AWS P3 instance page: "Network Bandwidth 25 Gbps" for the whole instance, one
    # ENA card shared by 8 GPUs; Alpa section 8 quotes the same 25 Gbps cross-node.
    inter_node=Link("25 GbE (ENA, TCP)", 25.0, TCP_STEP_LATENCY_S),
    nics_per_node=1,
)

DGX_A100 = Cluster(
    "dgx-a100",
    nodes=8,
    devices_per_node=8,  # NVIDIA DGX A100 datasheet: 8x A100 80GB
    device=A100_SXM_80GB,
    # Third-generation NVLink through NVSwitch: 600 GB/s per GPU, both directions
    # together (A100 datasheet), i.e. 300 GB/s per direction to any other GPU.
    intra_node=Link("NVLink3 via NVSwitch", 300 * 8, NVLINK_STEP_LATENCY_S, A100_NVSWITCH),
    # DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU.
    inter_node=Link("HDR InfiniBand 200G", 200.0, RDMA_STEP_LATENCY_S),
    nics_per_node=8,
)

DGX_H100 = Cluster(
    "dgx-h100",
    nodes=8,
    devices_per_node=8,  # NVIDIA DGX H100 datasheet: 8x H100 80GB
    device=H100_SXM_80GB,
    # Fourth-generation NVLink through NVSwitch: 900 GB/s per GPU, both directions
    # together (H100 datasheet), i.e. 450 GB/s per direction.
    intra_node=Link("NVLink4 via NVSwitch", 450 * 8, NVLINK_STEP_LATENCY_S, H100_NVSWITCH),
    # DGX H100 datasheet: 8x single-port ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU.
    inter_node=Link("NDR InfiniBand 400G", 400.0, RDMA_STEP_LATENCY_S),
    nics_per_node=8,
)

# NVIDIA GB200 NVL72 specifications, per rack of 72 Blackwell GPUs: 360 PFLOP/s FP16/BF16
# tensor with sparsity (2.5 dense per GPU), 5,760 TFLOP/s FP32 (80 per GPU), 13.4 TB
# HBM3e (186 GB per GPU, binary by this module's convention) at 576 TB/s (8 TB/s).
B200_GB200 = Device(
    "B200-GB200-186GB",
    {"float16": 2.5e15, "bfloat16": 2.5e15, "float32": 80e12},
    memory_bytes=186 * GIB,
    memory_bandwidth_bytes_per_s=8e12,
)

GB200_NVL72 = Cluster(
    "gb200-nvl72",
    nodes=1,  # one rack; its NVLink domain is the "node" (72 GPUs), racks join over InfiniBand
    devices_per_node=72,
    device=B200_GB200,
    # Fifth-generation NVLink through the NVLink Switch System: 130 TB/s for the rack,
    # 1.8 TB/s per GPU both directions together, i.e. 900 GB/s per direction.
    intra_node=Link("NVLink5 via NVLink Switch", 900 * 8, NVLINK_STEP_LATENCY_S),
    # Our assumption, after NVIDIA's DGX GB200 reference design: one 400 Gb/s NDR
    # InfiniBand NIC (ConnectX-7) per GPU on rails (GB300 systems move to 800G).
    inter_node=Link("NDR InfiniBand 400G", 400.0, RDMA_STEP_LATENCY_S),
    nics_per_node=72,
)

PRESETS: Mapping[str, Cluster] = MappingProxyType({c.name: c for c in (AWS_P3_16XLARGE, DGX_A100, DGX_H100,
                                                                       GB200_NVL72)})


def list_presets() -> list[str]:
    """Names accepted by `get_cluster`, sorted."""
    return sorted(PRESETS)


def get_cluster(name: str, **overrides: float | int | None) -> Cluster:
    """The preset `name`, with `Cluster.with_overrides(**overrides)` applied."""
    try:
        cluster = PRESETS[name]
    except (KeyError, TypeError):
        raise UnknownPresetError(f"unknown cluster preset {name!r}; valid names: {', '.join(list_presets())}") from None
    return cluster.with_overrides(**overrides) if overrides else cluster

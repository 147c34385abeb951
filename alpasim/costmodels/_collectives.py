"""Collective communication costs in the alpha-beta model with ring factors.

A group of n devices joined by a link of bandwidth B (bytes/s per device and
direction) and per-step latency alpha, moving a tensor of S bytes:

    all_reduce      2(n-1) alpha + 2(n-1)/n * S/B    (ring reduce-scatter + all-gather)
    all_gather       (n-1) alpha +  (n-1)/n * S/B    S = the gathered (full) tensor
    reduce_scatter   (n-1) alpha +  (n-1)/n * S/B    S = the full tensor before scattering
    all_to_all       (n-1) alpha +  (n-1)/n * S/B    S = one device's whole buffer; it keeps
                                                     1/n and sends the rest in n-1 steps
    send_recv              alpha +          S/B      one point-to-point message

(Thakur, Rabenseifner and Gropp, "Optimization of collective communication operations
in MPICH", IJHPCA 2005; the same step counts as NCCL's ring tuning model.) A group of
one device costs nothing, and so does an empty message.

Several mesh axes: a collective over axes (n_1, L_1) ... (n_k, L_k) runs one axis at a
time, hierarchically. Order the axes fastest link first; then

    T(S) = sum_j T_1axis(S_j, n_j, L_j),   S_j = S / (n_1 * ... * n_{j-1})

for all-reduce (reduce-scatter on the fast axes, all-reduce of the 1/(n_1..n_{k-1})
piece on the slowest, all-gather back: a reduce-scatter plus an all-gather cost exactly
one all-reduce in this model), all-gather (gather the small pieces over the slow axes
first) and reduce-scatter (scatter on the fast axes first). An all-to-all over several
axes is one all-to-all per axis, each on the whole buffer: S_j = S. send_recv crosses
the slowest link among the axes of size > 1.

A link with a measured sweep (`Link.sweep`, nccl-tests' bus bandwidth per size: the
presets' NVSwitch nodes, `_bus_sweeps`) prices all-reduce, all-gather and
reduce-scatter as k(n-1)/n * S / busbw(S) instead, k = 2 for all-reduce and 1 for the
others: the measured rate folds in what alpha-beta leaves out at the sizes training
moves (NCCL's channel fill, protocol switches, NVLink SHARP's in-switch reduction).

Ignored: contention between different collectives, link asymmetry inside a ring, and
the compute of the reduction itself; on links without a sweep also tree and NVLS
algorithms and protocol (LL/LL128) switching for small messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._hardware import Cluster, ClusterError, Link, check_count

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True, slots=True)
class MeshAxis:
    """One mesh axis as communication sees it: how many devices, over which link.

    `link` is what its rings run over (`group_link`); `device_link`, where it differs,
    what one device's own messages get (an all-to-all's or a point-to-point's bytes
    leave through the device's own share of the cards, not the group's: they do not
    ring). None: the same as `link`."""

    size: int
    link: Link
    device_link: Link | None = None

    def __post_init__(self) -> None:
        check_count("mesh axis", "size", self.size)
        for name in ("link", "device_link"):
            value = getattr(self, name)
            if not isinstance(value, Link) and not (name == "device_link" and value is None):
                raise ClusterError(f"mesh axis: {name} must be a Link, got {value!r}")

    @property
    def message_link(self) -> Link:
        """The link of one device's own messages (all-to-all, send/recv)."""
        return self.device_link or self.link


def _check_bytes(nbytes: float) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"collective: nbytes must be a finite number >= 0, got {nbytes!r}")
    return float(nbytes)


def _ring_time_s(nbytes: float, n: int, link: Link, steps_per_peer: int, kind: str | None = None) -> float:
    """`steps_per_peer` ring passes: steps*(n-1) alpha + steps*(n-1)/n * S/B, or, where
    the link carries a measured sweep of `kind`, steps*(n-1)/n * S / busbw(S)."""
    nbytes = _check_bytes(nbytes)
    check_count("collective", "group size n", n)
    if n == 1 or nbytes == 0:
        return 0.0
    k = steps_per_peer * (n - 1)
    if kind is not None and link.sweep is not None:
        return k / n * link.sweep.bus_time_s(kind, nbytes, link.bytes_per_s)
    return k * link.latency_s + k / n * nbytes / link.bytes_per_s


def all_reduce_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an S-byte tensor: 2(n-1) alpha + 2(n-1)/n * S/B (see module doc)."""
    return _ring_time_s(nbytes, n, link, 2, "all_reduce")


def all_gather_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather producing an S-byte tensor: (n-1) alpha + (n-1)/n * S/B."""
    return _ring_time_s(nbytes, n, link, 1, "all_gather")


def reduce_scatter_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an S-byte tensor: (n-1) alpha + (n-1)/n * S/B."""
    return _ring_time_s(nbytes, n, link, 1, "reduce_scatter")


def all_to_all_time_s(nbytes: float, n: int, link: Link) -> float:
    """Pairwise all-to-all of an S-byte buffer per device: (n-1) alpha + (n-1)/n * S/B
    (a measured sweep of the ring collectives does not apply: it does not ring)."""
    return _ring_time_s(nbytes, n, link, 1)


def send_recv_time_s(nbytes: float, link: Link) -> float:
    """One point-to-point message: alpha + S/B (zero for an empty message)."""
    nbytes = _check_bytes(nbytes)
    return 0.0 if nbytes == 0 else link.latency_s + nbytes / link.bytes_per_s


_ONE_AXIS = {
    "all_reduce": all_reduce_time_s,
    "all_gather": all_gather_time_s,
    "reduce_scatter": reduce_scatter_time_s,
    "all_to_all": all_to_all_time_s,
}


def _as_axes(axes: MeshAxis | Sequence[MeshAxis | tuple[int, Link]]) -> list[MeshAxis]:
    if isinstance(axes, MeshAxis):
        return [axes]
    return [a if isinstance(a, MeshAxis) else MeshAxis(*a) for a in axes]


def collective_time_s(kind: str, nbytes: float,
                      axes: MeshAxis | Sequence[MeshAxis | tuple[int, Link]]) -> float:
    """Seconds for collective `kind` on S = `nbytes` over one or several mesh axes.

    Formula: the hierarchical sum in the module docstring; axes are ordered by link
    bandwidth, fastest first (ties keep the given order), and axes of size 1 add nothing.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")
    nbytes = _check_bytes(nbytes)
    group = [a for a in _as_axes(axes) if a.size > 1]
    if kind == "send_recv":
        if not group:
            return 0.0
        slowest = min(group, key=lambda a: (a.message_link.bytes_per_s, -a.message_link.latency_s))
        return send_recv_time_s(nbytes, slowest.message_link)
    one_axis = _ONE_AXIS[kind]
    link_of = (lambda a: a.message_link) if kind == "all_to_all" else (lambda a: a.link)  # noqa: E731
    total, piece = 0.0, nbytes
    for axis in sorted(group, key=lambda a: -link_of(a).bytes_per_s):
        total += one_axis(piece, axis.size, link_of(axis))
        if kind != "all_to_all":
            piece /= axis.size
    return total


# ------------------------------------------------------------- cluster topology
def group_link(cluster: Cluster, device_ids: Sequence[int], ring: bool = True) -> Link:
    """The link a group of devices communicates over.

    Inside one node: the intra-node link. Spanning nodes: the network, assuming every
    device of the node crosses nodes at the same time in some group, as the parallel
    groups of one mesh axis do. A group with k devices in each node then has k
    devices' share of the node's cards (`Cluster.inter_node_per_device` times k) for
    its rings: a ring enters and leaves each node once per channel, and NCCL runs one
    channel per card, so the k cards of its devices carry it side by side while the
    node's other groups use the other cards (NCCL's multi-node ring: nccl-tests'
    all_reduce bus bandwidth across DGX A100 nodes is about the 8 x 25 GB/s of their
    HDR cards, not one card's). `ring=False`: one device's own messages (all-to-all,
    send/recv), which leave through its own share whatever the group. Divided by the
    spine's oversubscription when the group spans leaf switches.
    """
    ids = list(device_ids)
    if not ids:
        raise ClusterError(f"cluster {cluster.name!r}: a device group needs at least one device")
    per_node: dict[int, int] = {}
    for d in ids:
        node = cluster.node_of(d)
        per_node[node] = per_node.get(node, 0) + 1
    if len(per_node) == 1:
        return cluster.intra_node
    share = cluster.inter_node_per_device
    k = min(per_node.values()) if ring else 1
    name = share.name if k == 1 else f"{cluster.inter_node.name} ({k} devices' share)"
    bandwidth = min(share.bandwidth_gbps * k, cluster.intra_node.bandwidth_gbps)
    # Of a ring's n steps per pass, one per node crosses the network; the others are
    # NVLink hops (NCCL tuning.cc prices them so: nInterSteps at the network's latency,
    # the rest at the intra-node one). The link's per-step latency is their mean.
    latency = (len(per_node) * share.latency_s + (len(ids) - len(per_node)) * cluster.intra_node.latency_s) / len(ids) \
        if ring else share.latency_s
    if cluster.spine is not None and len({cluster.leaf_of(n) for n in per_node}) > 1:
        # Across leaves every card's traffic also climbs the spine, which carries only
        # 1/oversubscription of it (`Cluster.route`).
        name, bandwidth = f"{name} over the spine", bandwidth / cluster.spine.oversubscription
    return Link(name, bandwidth, latency)


def mesh_axes(cluster: Cluster, shape: Sequence[int]) -> tuple[MeshAxis, ...]:
    """`MeshAxis` per axis of a logical mesh laid row-major over devices 0..prod(shape)-1.

    Device ids count node by node, so the last axis is the fastest-varying one: a 2x8
    mesh on 8-GPU nodes has axis 1 inside each node and axis 0 across the two nodes.
    An axis gets the intra-node link only if every one of its groups stays in a node.
    """
    shape = tuple(shape)
    for i, n in enumerate(shape):
        check_count("mesh", f"shape[{i}]", n)
    total = math.prod(shape)
    if total > cluster.num_devices:
        raise ClusterError(f"mesh shape {shape} needs {total} devices; cluster {cluster.name!r} has "
                           f"{cluster.num_devices}")
    ids = np.arange(total).reshape(shape)
    return tuple(axis_of_groups(cluster, n, np.moveaxis(ids, i, -1).reshape(-1, n).tolist())
                 for i, n in enumerate(shape))


def axis_of_groups(cluster: Cluster, size: int, groups: Sequence[Sequence[int]]) -> MeshAxis:
    """The `MeshAxis` of parallel groups that run at once: the slowest group's ring link
    (`group_link`), and where a group spans nodes, one device's own link for its
    messages."""
    def slowest(links):
        return min(links, key=lambda link: (link.bytes_per_s, -link.latency_s))

    ring = slowest({group_link(cluster, g) for g in groups})
    device = slowest({group_link(cluster, g, ring=False) for g in groups})
    return MeshAxis(size, ring, None if device == ring else device)

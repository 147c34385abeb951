"""Routes: how each cross-mesh tensor of a `Program` travels over the cluster's links.

For every `StageTransfer` the cross-mesh resharding planner (seed 3.4.10,
`alpasim.solvers.cross_mesh_plan`) gives point-to-point copies between devices and,
with ``local_all_gather``, ring all-gathers inside the receiver mesh. Each copy is
mapped onto the links it occupies, the same ports the resharding cost model charges:

    same node     the sender's NVLink port out, the receiver's NVLink port in
    across nodes  the sender node's network card out, the receiver node's card in
                  (device d drives card local_index * nics_per_node // devices_per_node)

Each port direction is a link of the fluid network (`_network`) with the link's
bandwidth; a copy first waits the link latency (alpha), then flows. A local
all-gather is charged its ring time on the receiver group's link (`all_gather_time_s`
on `group_link`) and does not enter the fluid network: it runs on fast local links
while the mesh waits for it, which is what the rewrite is for.

Fallback, used when a transfer has no sharding specs (synthetic and old plans, the
wrap-around tensors of an interleaved schedule) or the planner rejects them: receiver
device j gets nbytes / |receivers| from sender device j mod |senders| (an evenly
sharded receiver; under ``signal`` one byte each). Zero-byte control messages move
nothing and cost nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from alpasim.costmodels import Cluster, all_gather_time_s, group_link
from alpasim.graphs import DTYPE_BYTES
from alpasim.solvers import (
    CROSS_MESH_METHODS,
    SIGNAL_BYTES,
    PipelinePlan,
    cross_mesh_plan,
)

from ._program import Program, StageTransfer


@dataclass(frozen=True, slots=True)
class Copy:
    """One point-to-point message: `links` are fluid-network link ids (empty if local)."""

    src: int
    dst: int
    nbytes: float
    links: tuple[int, ...]
    latency_s: float


@dataclass(frozen=True, slots=True)
class Route:
    """Everything the engine needs to move one transfer once."""

    copies: tuple[Copy, ...]          # the non-local copies only
    gather_s: float                   # receiver-side all-gathers (concurrent groups: the slowest)
    wire_bytes: float                 # bytes on links between devices
    inter_node_bytes: float
    buffer_bytes: float               # the most any receiving device holds of it
    planned: bool                     # False: the even-split fallback was used


class LinkTable:
    """Fluid-network links, created on first use: one per port direction."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []
        self.capacities: list[float] = []
        self.nodes: list[int] = []
        self._ids: dict[tuple, int] = {}

    def _link(self, key: tuple, name: str, node: int, bytes_per_s: float) -> int:
        if key not in self._ids:
            self._ids[key] = len(self.names)
            self.names.append(name)
            self.capacities.append(bytes_per_s)
            self.nodes.append(node)
        return self._ids[key]

    def ports(self, src: int, dst: int) -> tuple[tuple[int, ...], float]:
        """(link ids, latency) of a copy from device `src` to device `dst` along
        `Cluster.route` (NVLink ports, network cards, spine uplinks)."""
        hops = self.cluster.route(src, dst)
        return (tuple(self._link(h.port, h.name, h.node, h.link.bytes_per_s) for h in hops),
                max(h.link.latency_s for h in hops))


def _pieces(t: StageTransfer, plan: PipelinePlan, method: str, node_of
            ) -> tuple[list[tuple[int, int, float, float]], list[tuple[tuple[int, ...], float]], bool]:
    """(copies as (src, dst, wire bytes, data bytes), gathers as (devices, bytes), planned)."""
    src, dst = _stage(plan, t.src_stage, t.src_chunk), _stage(plan, t.dst_stage, t.dst_chunk)
    itemsize = DTYPE_BYTES.get(t.dtype)
    p = _cross_mesh(t, src, dst, itemsize, method, node_of)
    if p is not None:
        copies = [(c.src, c.dst, c.nbytes, float(c.tile.nbytes(itemsize))) for c in p.transfers]
        return copies, [(g.devices, g.nbytes) for g in p.gathers], True
    share = t.nbytes / len(dst.devices)
    wire = SIGNAL_BYTES if method == "signal" else share
    copies = [(src.devices[j % len(src.devices)], d, wire, share) for j, d in enumerate(dst.devices)]
    return copies, [], False


def _stage(plan: PipelinePlan, mesh: int, chunk: int):
    """The plan stage that runs `chunk` on `mesh`: its own in a plan cut into chunks
    (each chunk may view the mesh's devices as another logical mesh), else the mesh's."""
    return plan.stages[chunk * plan.num_meshes + mesh] if plan.chunks > 1 else plan.stages[mesh]


def _cross_mesh(t: StageTransfer, src, dst, itemsize: int | None, method: str, node_of):
    """The tile-level plan of `t`, or None when it has no specs, or specs that do not
    fit these meshes (then the caller splits the bytes evenly over the receivers)."""
    if not (t.src_spec and t.dst_spec and t.shape and itemsize):
        return None
    try:
        return cross_mesh_plan(t.shape, itemsize, src.devices, src.logical_mesh, t.src_spec, dst.devices,
                               dst.logical_mesh, t.dst_spec, method=method, node_of=node_of)
    except ValueError:
        return None


def route_transfers(program: Program, plan: PipelinePlan, cluster: Cluster | None,
                    method: str = "local_all_gather") -> tuple[list[Route], LinkTable | None]:
    """A `Route` per `program.transfers` entry, and the links they use (None without a cluster)."""
    if method not in CROSS_MESH_METHODS:
        raise ValueError(f"unknown cross-mesh method {method!r}; choose one of {', '.join(CROSS_MESH_METHODS)}")
    links = LinkTable(cluster) if cluster is not None else None
    node_of = cluster.node_of if cluster is not None else None
    routes = []
    # An interleaved plan sends the same tensor between the same two meshes once per
    # chunk boundary (Llama 3's 405B layout: 254 transfers, 32 distinct, each a tile
    # plan over 1,024 devices): one route serves all of them.
    memo: dict[tuple, Route] = {}
    for t in program.transfers:
        if t.nbytes == 0:
            routes.append(Route((), 0.0, 0.0, 0.0, 0.0, True))
            continue
        src, dst = _stage(plan, t.src_stage, t.src_chunk), _stage(plan, t.dst_stage, t.dst_chunk)
        key = (t.nbytes, t.shape, t.dtype, t.src_spec, t.dst_spec, tuple(src.devices), tuple(src.logical_mesh),
               tuple(dst.devices), tuple(dst.logical_mesh))
        if key in memo:
            routes.append(memo[key])
            continue
        pieces, gathers, planned = _pieces(t, plan, method, node_of)
        copies, held = [], defaultdict(float)
        wire = inter = 0.0
        for s, d, nbytes, data in pieces:
            held[d] += data
            if s == d or nbytes <= 0:
                continue
            wire += nbytes
            if links is not None:
                ids, latency = links.ports(s, d)
                copies.append(Copy(s, d, nbytes, ids, latency))
                if node_of(s) != node_of(d):
                    inter += nbytes
            else:
                copies.append(Copy(s, d, nbytes, (), 0.0))
        gather_s = 0.0
        for devices, nbytes in gathers:
            for d in devices:
                held[d] = nbytes
            if cluster is not None:
                gather_s = max(gather_s, all_gather_time_s(nbytes, len(devices), group_link(cluster, devices)))
        routes.append(Route(tuple(copies), gather_s, wire, inter, max(held.values(), default=0.0), planned))
        memo[key] = routes[-1]
    return routes, links

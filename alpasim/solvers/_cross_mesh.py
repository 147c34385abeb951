"""Cross-mesh resharding: moving one tensor between two stages' meshes (seed 3.4.10).

Adjacent pipeline stages may sit on meshes of different shapes and want the tensor
between them under different specs, so a receiver device may need pieces of several
senders: a many-to-many multicast. Alpa plans it in two passes:

1. correspondence matching: each receiver's tile is cut into the pieces that sender
   tiles hold, and each piece is copied from one sender (method ``send_recv``);
2. replication rewriting: receivers that need the same tile (the receiver spec
   replicates over a mesh axis) fetch each piece across the slow path only once,
   spread over the group, then all-gather it inside the receiver mesh on the fast
   local links (``local_all_gather``; 2.0x on Wide-ResNet in the paper's sec. 8.5).

``signal`` keeps pass 1's messages but sends one byte each: the paper's upper bound,
as if the cross-mesh data were free.

A device's tile follows `_spec`: a dim sharded on axes (a, b) is cut into n_a * n_b
blocks and coordinate (i0, i1) holds block i_a * n_b + i_b (first axis major). Mesh
devices are listed row-major: coordinate (i, j) is ``devices[i * n1 + j]``. Tensors are
described by tile bounds only; nothing here allocates one. Like the paper's ("we defer
the development of the optimal cross-mesh resharding plan to future work"), the plan
is a greedy heuristic, deterministic in every tie.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alpasim.costmodels import Cluster, Link, all_gather_time_s, group_link

from ._mesh import LogicalMesh
from ._spec import ShardingSpec, check_spec

CROSS_MESH_METHODS = ("send_recv", "local_all_gather", "signal")
SIGNAL_BYTES = 1.0  # what one 'signal' message carries
_SHAPE_ONLY_LINK = Link("shape only", 1.0, 0.0)  # checking a spec reads axis sizes, never links


@dataclass(frozen=True, slots=True)
class Tile:
    """A hyper-rectangle of the global tensor: per dim a half-open [start, stop)."""

    bounds: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        bounds = tuple((int(lo), int(hi)) for lo, hi in self.bounds)
        if any(not 0 <= lo < hi for lo, hi in bounds):
            raise ValueError(f"tile {self.bounds!r}: every dim needs 0 <= start < stop")
        object.__setattr__(self, "bounds", bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.bounds)

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.shape) * itemsize

    def intersect(self, other: Tile) -> Tile | None:
        """The common part, or None when the two do not overlap."""
        bounds = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(self.bounds, other.bounds))
        return Tile(bounds) if all(lo < hi for lo, hi in bounds) else None

    def to_json(self) -> list[list[int]]:
        return [list(b) for b in self.bounds]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point copy from a sender device to a receiver device.

    src == dst happens when the meshes share a device that already holds the piece: a
    local copy, kept so the receiver's pieces are complete, but free in `time_s` and
    never counted between nodes.
    """

    src: int
    dst: int
    tile: Tile
    nbytes: float  # bytes on the wire: the tile's, or SIGNAL_BYTES under 'signal'

    def __post_init__(self) -> None:
        if not isinstance(self.tile, Tile):
            raise TypeError(f"transfer {self.src}->{self.dst}: tile must be a Tile, got {self.tile!r}")
        if not math.isfinite(self.nbytes) or self.nbytes < 0:
            raise ValueError(f"transfer {self.src}->{self.dst}: nbytes must be finite and >= 0, got {self.nbytes!r}")


@dataclass(frozen=True, slots=True)
class LocalGather:
    """A ring all-gather inside the receiver mesh after the transfers: every device
    of the group ends with the union of `tiles`, each of which arrived at the named
    device over the slow path."""

    devices: tuple[int, ...]
    nbytes: float  # bytes each device holds at the end (the all-gather's output size)
    tiles: tuple[tuple[int, Tile], ...]

    def __post_init__(self) -> None:
        if len(self.devices) < 2 or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"local gather: needs >= 2 distinct devices, got {self.devices!r}")
        if any(d not in self.devices for d, _ in self.tiles):
            raise ValueError(f"local gather over {self.devices}: a contribution comes from outside the group")


@dataclass(frozen=True, slots=True)
class CrossMeshPlan:
    """How one tensor moves from a sender mesh to a receiver mesh: copies, then gathers."""

    method: str
    shape: tuple[int, ...]
    itemsize: int
    transfers: tuple[Transfer, ...]
    gathers: tuple[LocalGather, ...]

    def __post_init__(self) -> None:
        _check_method(self.method)
        rank = len(self.shape)
        tiles = [t.tile for t in self.transfers] + [tile for g in self.gathers for _, tile in g.tiles]
        for tile in tiles:
            if len(tile.bounds) != rank or any(hi > n for (_, hi), n in zip(tile.bounds, self.shape)):
                raise ValueError(f"cross-mesh plan: tile {tile.bounds} lies outside tensor shape {self.shape}")

    def transfer_bytes(self) -> float:
        """Bytes of every transfer, local copies (src == dst) included."""
        return sum(t.nbytes for t in self.transfers)

    def bytes_between_nodes(self, node_of: Callable[[int], int]) -> float:
        """Transfer bytes whose sender and receiver sit on different nodes."""
        return sum(t.nbytes for t in self.transfers if node_of(t.src) != node_of(t.dst))

    def received(self) -> dict[int, list[Tile]]:
        """Per receiver device, every tile it holds once the transfers and gathers are done."""
        out: dict[int, list[Tile]] = defaultdict(list)
        for t in self.transfers:
            out[t.dst].append(t.tile)
        for g in self.gathers:
            for d in g.devices:
                out[d].extend(tile for src, tile in g.tiles if src != d)
        return dict(out)

    def time_s(self, cluster: Cluster) -> float:
        """Alpha-beta estimate: the transfer phase, then the gathers.

        Transfers run at once; each occupies the ports of its route (`Cluster.route`): a
        device's NVLink within a node, a node's network cards across nodes (device d uses
        card ``local_index * nics_per_node // devices_per_node``; full duplex), and the
        leaves' spine uplinks between leaf switches. A port's time
        is messages * alpha + bytes / bandwidth; the phase takes the slowest port. The
        gathers then run concurrently, each a ring all-gather on `group_link` of its
        group (`all_gather_time_s`), and the phase takes the slowest. Ignored: contention
        with compute and with other stages' traffic, overlap of the two phases, gathers
        sharing links, the PCIe hop to the card, and switch congestion.
        """
        port_bytes: dict[tuple, float] = defaultdict(float)
        port_msgs: dict[tuple, int] = defaultdict(int)
        port_link: dict[tuple, Link] = {}
        for t in self.transfers:
            if t.src == t.dst:
                continue
            for port, link in _ports(cluster, t.src, t.dst):
                port_bytes[port] += t.nbytes
                port_msgs[port] += 1
                port_link[port] = link
        copy_s = max((port_msgs[p] * link.latency_s + port_bytes[p] / link.bytes_per_s
                      for p, link in port_link.items()), default=0.0)
        gather_s = max((all_gather_time_s(g.nbytes, len(g.devices), group_link(cluster, g.devices))
                        for g in self.gathers), default=0.0)
        return copy_s + gather_s

    def to_json(self) -> dict:
        return {"method": self.method, "shape": list(self.shape), "itemsize": self.itemsize,
                "transfer_bytes": self.transfer_bytes(),
                "transfers": [{"src": t.src, "dst": t.dst, "tile": t.tile.to_json(), "bytes": t.nbytes}
                              for t in self.transfers],
                "gathers": [{"devices": list(g.devices), "bytes": g.nbytes,
                             "tiles": [{"device": d, "tile": tile.to_json()} for d, tile in g.tiles]}
                            for g in self.gathers]}


def _ports(cluster: Cluster, src: int, dst: int) -> list[tuple[tuple, Link]]:
    """The (port, link) pairs a copy occupies (`Cluster.route`)."""
    return [(h.port, h.link) for h in cluster.route(src, dst)]


def _check_method(method: str) -> None:
    if method not in CROSS_MESH_METHODS:
        raise ValueError(f"unknown cross-mesh method {method!r}; expected one of {CROSS_MESH_METHODS}")


def _device_tiles(role: str, shape: tuple[int, ...], devices: Sequence[int], mesh_shape: Sequence[int] | LogicalMesh,
                  spec: ShardingSpec | str) -> list[tuple[int, Tile]]:
    """(device, tile it holds) for every device of one mesh, in mesh order."""
    mesh = mesh_shape if isinstance(mesh_shape, LogicalMesh) else LogicalMesh.of(mesh_shape, _SHAPE_ONLY_LINK)
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    check_spec(spec, shape, mesh)
    devices = [int(d) for d in devices]
    if len(devices) != mesh.num_devices or len(set(devices)) != len(devices):
        raise ValueError(f"{role} mesh {mesh} needs {mesh.num_devices} distinct device ids, got {devices}")
    n1 = mesh.shape[1]
    out = []
    for flat, device in enumerate(devices):
        coord = divmod(flat, n1)
        bounds = []
        for n, axes in zip(shape, spec.dims):
            shards, index = 1, 0
            for a in axes:  # first axis major, as `_spec` orders S01 and S10
                shards *= mesh.shape[a]
                index = index * mesh.shape[a] + coord[a]
            size = n // shards
            bounds.append((index * size, (index + 1) * size))
        out.append((device, Tile(tuple(bounds))))
    return out


def _split(tile: Tile, parts: int) -> list[Tile]:
    """Cut `tile` into up to `parts` slabs along its first dim long enough (else its longest)."""
    if not tile.bounds:
        return [tile]
    extents = tile.shape
    dim = next((i for i, e in enumerate(extents) if e >= parts), extents.index(max(extents)))
    parts = min(parts, extents[dim])
    lo, hi = tile.bounds[dim]
    cuts = [lo + (hi - lo) * p // parts for p in range(parts + 1)]
    return [Tile(tile.bounds[:dim] + ((a, b),) + tile.bounds[dim + 1:]) for a, b in itertools.pairwise(cuts)]


class _SenderChoice:
    """Greedy choice of the sender of each piece, remembering what each sender has sent.

    Preference: the receiver itself (a free local copy), then a sender on its node
    (fast links), then the sender with the fewest bytes so far (spreads the slow-path
    load), then the lowest device id.
    """

    def __init__(self, node_of: Callable[[int], int], itemsize: int) -> None:
        self.node_of, self.itemsize = node_of, itemsize
        self.sent_bytes: dict[int, int] = defaultdict(int)

    def transfer(self, piece: Tile, holders: Sequence[int], dst: int) -> Transfer:
        node = self.node_of(dst)
        src = min(holders, key=lambda s: (s != dst, self.node_of(s) != node, self.sent_bytes[s], s))
        nbytes = piece.nbytes(self.itemsize)
        if src != dst:
            self.sent_bytes[src] += nbytes
        return Transfer(src, dst, piece, float(nbytes))


def cross_mesh_plan(shape: Sequence[int], itemsize: int,
                    src_devices: Sequence[int], src_mesh_shape: Sequence[int] | LogicalMesh,
                    src_spec: ShardingSpec | str,
                    dst_devices: Sequence[int], dst_mesh_shape: Sequence[int] | LogicalMesh,
                    dst_spec: ShardingSpec | str,
                    method: str = "local_all_gather",
                    node_of: Callable[[int], int] | None = None) -> CrossMeshPlan:
    """Plan the copy of a tensor of `shape` from `src_spec` on the sender mesh to
    `dst_spec` on the receiver mesh; `node_of` maps a device id to its node (default:
    every device on a node of its own)."""
    _check_method(method)
    shape = tuple(int(n) for n in shape)
    if any(n < 1 for n in shape):
        raise ValueError(f"cross-mesh plan: tensor shape {shape} has an empty dim")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"cross-mesh plan: itemsize must be an integer >= 1, got {itemsize!r}")
    senders = _device_tiles("sender", shape, src_devices, src_mesh_shape, src_spec)
    receivers = _device_tiles("receiver", shape, dst_devices, dst_mesh_shape, dst_spec)
    node_of = node_of or (lambda d: d)
    holders: dict[Tile, list[int]] = defaultdict(list)  # replicated senders share a tile
    for device, tile in senders:
        holders[tile].append(device)

    # A sender tile overlaps `tile` only if it does in every dim: candidates are the
    # product of each dim's overlapping intervals, not every sender tile (a 384-device
    # mesh to another was 147,000 intersections a tensor). Kept in the senders' order.
    by_bounds = {s.bounds: (i, s, hs) for i, (s, hs) in enumerate(holders.items())}
    intervals = [sorted({s.bounds[d] for s in holders}) for d in range(len(shape))]

    def pieces(tile: Tile) -> list[tuple[Tile, list[int]]]:
        """Pass 1: `tile` cut along the sender tiling, each piece with its holders."""
        near = [[iv for iv in intervals[d] if iv[0] < hi and lo < iv[1]] for d, (lo, hi) in enumerate(tile.bounds)]
        found = sorted(by_bounds[b] for b in itertools.product(*near) if b in by_bounds)
        cut = ((tile.intersect(s), hs) for _, s, hs in found)
        return [(p, hs) for p, hs in cut if p is not None]

    choice = _SenderChoice(node_of, itemsize)
    if method != "local_all_gather":
        transfers = [choice.transfer(p, hs, d) for d, tile in receivers for p, hs in pieces(tile)]
        if method == "signal":
            transfers = [Transfer(t.src, t.dst, t.tile, SIGNAL_BYTES) for t in transfers]
        return CrossMeshPlan(method, shape, itemsize, tuple(transfers), ())

    # Pass 2: one replica group per distinct receiver tile.
    groups: dict[Tile, list[int]] = defaultdict(list)
    for device, tile in receivers:
        groups[tile].append(device)
    transfers, gathers = [], []
    received_bytes: dict[int, float] = defaultdict(float)
    for tile, members in groups.items():
        parts = pieces(tile)
        # A member that holds the whole tile as a sender copies it locally and skips the gather.
        rest = [m for m in members if not all(m in hs for _, hs in parts)]
        for m in members:
            if m not in rest or len(rest) == 1:
                transfers += [choice.transfer(p, hs, m) for p, hs in parts]
        if len(rest) < 2:
            continue
        if len(parts) < len(rest):  # cut finer so each member can fetch about 1/k of the tile
            times = len(rest) // math.gcd(len(rest), len(parts))
            parts = [(sub, hs) for p, hs in parts for sub in _split(p, times)]
        contributions = []
        for piece, hs in parts:
            # The fetching member: one holding the piece, else one on a holder's node,
            # else the one that has fetched least (round-robin on equal pieces).
            nodes = {node_of(s) for s in hs}
            m = min(rest, key=lambda c: (c not in hs, node_of(c) not in nodes, received_bytes[c], c))
            t = choice.transfer(piece, hs, m)
            if t.src != m:
                received_bytes[m] += t.nbytes
            transfers.append(t)
            contributions.append((m, piece))
        gathers.append(LocalGather(tuple(rest), float(tile.nbytes(itemsize)), tuple(contributions)))
    return CrossMeshPlan(method, shape, itemsize, tuple(transfers), tuple(gathers))

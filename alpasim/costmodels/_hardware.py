"""Hardware descriptions: a `Device`, a `Link` and a `Cluster` of identical nodes.

A cluster is data: frozen, validated, hashable, and round-trips through JSON
(schema ``alpasim.cluster/1``) so that a plan can record the machine it was made for.
Bandwidths of links are in Gbit/s per device and direction, the unit network
datasheets use; `Link.bytes_per_s` converts once for the cost functions.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CLUSTER_SCHEMA = "alpasim.cluster/1"
# Dtypes a device may quote a peak for (the float dtypes of `alpasim.graphs`).
PEAK_DTYPES = ("float16", "bfloat16", "float32")
GIB = 2**30


class ClusterError(ValueError):
    """A device, link or cluster with an impossible value, or a malformed cluster JSON."""


def host_memory_bytes() -> int | None:
    """This host's physical RAM, or None where the OS does not say (what virtual CPU
    devices share)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive(owner: str, field: str, value: Any) -> float:
    """`value` as a finite float > 0, else a ClusterError naming `field` and the value."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ClusterError(f"{owner}: {field} must be a finite number > 0, got {value!r}")
    return float(value)


def check_count(owner: str, field: str, value: Any) -> int:
    """`value` as an int >= 1, else a ClusterError naming `field` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClusterError(f"{owner}: {field} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator: peak FLOP/s per dtype, memory capacity and memory bandwidth.

    `peak_flops` accepts a mapping dtype -> FLOP/s and is stored as sorted (dtype,
    FLOP/s) pairs so the device stays hashable; read it with `peak_flops_per_s(dtype)`.
    For half precision it is the dense tensor-core peak; `float32` is the plain FP32
    (CUDA-core) peak, which the compute model also uses for non-matmul ops.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        peaks = self.peak_flops
        if isinstance(peaks, Mapping):
            peaks = peaks.items()
        try:
            pairs = sorted((str(k), v) for k, v in peaks)
        except (TypeError, ValueError):
            raise ClusterError(f"{owner}: peak_flops must map dtype -> FLOP/s, got {self.peak_flops!r}") from None
        for dtype, value in pairs:
            if dtype not in PEAK_DTYPES:
                raise ClusterError(f"{owner}: peak_flops has unknown dtype {dtype!r}; expected some of {PEAK_DTYPES}")
            check_positive(owner, f"peak_flops[{dtype!r}]", value)
        if "float32" not in dict(pairs):
            raise ClusterError(f"{owner}: peak_flops needs a 'float32' entry, got {dict(pairs)!r}")
        object.__setattr__(self, "peak_flops", tuple((k, float(v)) for k, v in pairs))
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes <= 0:
            raise ClusterError(f"{owner}: memory_bytes must be an integer > 0, got {self.memory_bytes!r}")
        object.__setattr__(self, "memory_bandwidth_bytes_per_s",
                           check_positive(owner, "memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s))

    def peak_flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; dtypes without an entry (integers) use the float32 peak."""
        table = dict(self.peak_flops)
        return table.get(dtype, table["float32"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "memory_bytes": self.memory_bytes,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s}


SWEEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True, slots=True)
class BusSweep:
    """A measured sweep of a link's collectives: nccl-tests' bus bandwidth per message
    size, as `all_reduce_perf` / `all_gather_perf` / `reduce_scatter_perf` print it.

    `points` is ((kind, ((bytes, busbw GB/s), ...)), ...), sizes increasing; "all_reduce"
    is required, the other kinds optional. Bus bandwidth is nccl-tests' size-normalised
    rate (PERFORMANCE.md: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and
    reduce-scatter, with S the full tensor), so a ring collective of S bytes takes
    k(n-1)/n x S / busbw(S); a sweep of 8 GPUs is taken for groups of 2 and 4 on the
    same switch too (each GPU keeps its own links to it). Between measured sizes busbw
    is interpolated log-log; below the smallest the time stays the smallest size's
    (latency-bound); above the largest the rate stays the largest's; time never falls as
    S grows. A kind with no sweep of its own takes the all-reduce's, capped at the link's rate (an all-reduce through NVLink
    SHARP reduces in the switch and can exceed it; a ring all-gather cannot)."""

    source: str
    points: tuple[tuple[str, tuple[tuple[float, float], ...]], ...]
    # Per kind: the sizes, their logs, the (never falling) times S / busbw and their logs,
    # derived once from `points` (`bus_time_s` runs for every priced collective).
    _curves: dict[str, tuple[tuple[float, ...], list[float], list[float], list[float]]] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        owner = f"bus sweep {self.source!r}"
        kinds = [k for k, _ in self.points]
        if "all_reduce" not in kinds or len(set(kinds)) != len(kinds) or not set(kinds) <= set(SWEEP_KINDS):
            raise ClusterError(f"{owner}: kinds must be distinct among {SWEEP_KINDS} and include all_reduce, "
                               f"got {kinds}")
        for kind, pts in self.points:
            sizes = [b for b, _ in pts]
            if not pts or any(not _is_number(v) or not math.isfinite(v) or v <= 0 for p in pts for v in p) \
                    or sizes != sorted(set(sizes)):
                raise ClusterError(f"{owner}: {kind} needs (bytes, GB/s) pairs, both > 0, sizes increasing")
        points = tuple((k, tuple((float(b), float(g)) for b, g in pts)) for k, pts in self.points)
        object.__setattr__(self, "points", points)
        curves = {}
        for kind, pts in points:
            sizes = tuple(b for b, _ in pts)
            times = list(itertools.accumulate((b / (g * 1e9) for b, g in pts), max))
            curves[kind] = (sizes, [math.log(b) for b in sizes], times, [math.log(t) for t in times])
        object.__setattr__(self, "_curves", curves)

    def bus_time_s(self, kind: str, nbytes: float, cap_bytes_per_s: float) -> float:
        """S / busbw(S) of `kind` on an `nbytes` tensor (class doc): the collective's time
        up to its ring factor k(n-1)/n, so the caller multiplies by a constant and the
        time stays monotone in S to the last bit (dividing S by a bandwidth got from S
        does not).

        Interpolated log-log between sizes (the same as interpolating busbw log-log,
        where the table's times increase) and clamped between the two sizes' times, so
        that rounding at a segment's ends never lets the time fall as S grows. A table's
        time can dip between two sizes by noise (H100's ring reduce-scatter: 43.5 us at
        2 MiB, 41.5 at 4 MiB); such a dip is read as flat."""
        own = kind in self._curves
        sizes, log_sizes, times, log_times = self._curves[kind if own else "all_reduce"]
        if nbytes <= sizes[0]:
            t = times[0]
        elif nbytes >= sizes[-1]:
            t = times[-1] * (nbytes / sizes[-1])
        else:
            i = bisect.bisect_right(sizes, nbytes)
            f = (math.log(nbytes) - log_sizes[i - 1]) / (log_sizes[i] - log_sizes[i - 1])
            t = min(max(math.exp(log_times[i - 1] + f * (log_times[i] - log_times[i - 1])), times[i - 1]), times[i])
        return t if own else max(t, nbytes / cap_bytes_per_s)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, **{k: [list(p) for p in pts] for k, pts in self.points}}

    @classmethod
    def from_json(cls, data: Any, path: str) -> BusSweep:
        r = _Reader(data, path)
        source = r.get("source", str)
        points = []
        for kind in SWEEP_KINDS:
            pts = r.get(kind, list, optional=kind != "all_reduce")
            if pts is not None:
                if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pts):
                    raise ClusterError(f"cluster JSON: field '{path}.{kind}' must be [[bytes, GB/s], ...]")
                points.append((kind, tuple(tuple(p) for p in pts)))
        r.done()
        return cls(source, tuple(points))


@dataclass(frozen=True, slots=True)
class Link:
    """A communication channel: Gbit/s per device and direction, plus a per-message
    latency; `sweep`, where one was measured, prices its collectives instead
    (`_collectives`)."""

    name: str
    bandwidth_gbps: float
    latency_s: float
    sweep: BusSweep | None = None

    def __post_init__(self) -> None:
        owner = f"link {self.name!r}"
        object.__setattr__(self, "bandwidth_gbps", check_positive(owner, "bandwidth_gbps", self.bandwidth_gbps))
        lat = self.latency_s
        if not _is_number(lat) or not math.isfinite(lat) or lat < 0:
            raise ClusterError(f"{owner}: latency_s must be a finite number >= 0, got {lat!r}")
        object.__setattr__(self, "latency_s", float(lat))
        if self.sweep is not None and not isinstance(self.sweep, BusSweep):
            raise ClusterError(f"{owner}: sweep must be a BusSweep, got {self.sweep!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth_gbps": self.bandwidth_gbps, "latency_s": self.latency_s,
                **({"sweep": self.sweep.to_json()} if self.sweep is not None else {})}

    @classmethod
    def from_json(cls, data: Any, path: str) -> Link:
        r = _Reader(data, path)
        sweep = BusSweep.from_json(r.sub("sweep").data, f"{path}.sweep") if "sweep" in data else None
        link = cls(r.get("name", str), r.get("bandwidth_gbps", float), r.get("latency_s", float), sweep)
        r.done()
        return link


@dataclass(frozen=True, slots=True)
class SpineTier:
    """The network tier above the rails: leaf switches of `nodes_per_leaf` nodes each,
    joined by a spine that carries `1 / oversubscription` of what the leaf's cards can
    send (1: a non-blocking fat tree; a DGX SuperPOD scalable unit is 32 nodes)."""

    nodes_per_leaf: int
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        check_count("spine", "nodes_per_leaf", self.nodes_per_leaf)
        if check_positive("spine", "oversubscription", self.oversubscription) < 1:
            raise ClusterError(f"spine: oversubscription must be at least 1, got {self.oversubscription!r}")

    def to_json(self) -> dict[str, Any]:
        return {"nodes_per_leaf": self.nodes_per_leaf, "oversubscription": self.oversubscription}


@dataclass(frozen=True, slots=True)
class Hop:
    """One port a device-to-device copy occupies: `port` keys it (every copy through the
    same port shares it), `link` is its capacity and latency, `node` where it sits."""

    port: tuple
    name: str
    node: int
    link: Link


# The largest cluster alpasim models: Llama-3 405B trained on 16,384 H100s, the largest
# published run. Planning scales with the device count (the stage DP's tables hold a
# state per device count), so a typo of a million nodes is refused here, not after an
# hour of planning.
MAX_DEVICES = 16384


@dataclass(frozen=True, slots=True)
class Cluster:
    """`nodes` identical nodes of `devices_per_node` devices each.

    `intra_node` is the link a device uses to reach devices of its own node (NVLink or
    NVSwitch). `inter_node` is ONE network card; a node has `nics_per_node` of them
    (default: one per device, as in a DGX). When every device of a node talks across
    nodes at once — what a collective along a mesh axis that spans nodes does, since
    all groups along the axis run together — the cards are shared evenly, and a device
    gets `inter_node_per_device`: min(nics, devices) * bandwidth / devices. A device
    never drives more than one card (NCCL binds each GPU to its nearest NIC).
    """

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    nics_per_node: int | None = None
    spine: SpineTier | None = None

    def __post_init__(self) -> None:
        owner = f"cluster {self.name!r}"
        check_count(owner, "nodes", self.nodes)
        check_count(owner, "devices_per_node", self.devices_per_node)
        if self.nics_per_node is None:
            object.__setattr__(self, "nics_per_node", self.devices_per_node)
        check_count(owner, "nics_per_node", self.nics_per_node)
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ClusterError(f"{owner}: nodes x devices_per_node = {self.nodes} x {self.devices_per_node} = "
                               f"{self.nodes * self.devices_per_node} devices, more than alpasim models (at most "
                               f"{MAX_DEVICES}, the largest published training run)")
        for field, kind in (("device", Device), ("intra_node", Link), ("inter_node", Link)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise ClusterError(f"{owner}: {field} must be a {kind.__name__}, got {value!r}")
        if self.spine is not None and not isinstance(self.spine, SpineTier):
            raise ClusterError(f"{owner}: spine must be a SpineTier, got {self.spine!r}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def inter_node_per_device(self) -> Link:
        """The network share of one device when all devices of its node cross nodes at once."""
        share = min(self.nics_per_node, self.devices_per_node) / self.devices_per_node
        link = self.inter_node
        return Link(f"{link.name} (per-device share)", link.bandwidth_gbps * share, link.latency_s)

    def node_of(self, device_id: int) -> int:
        if not 0 <= device_id < self.num_devices:
            raise ClusterError(f"cluster {self.name!r}: device id {device_id} outside [0, {self.num_devices})")
        return device_id // self.devices_per_node

    def nic_of(self, device_id: int) -> int:
        """The card of its node a device sends through (the nearest: rails, one per GPU
        in a DGX; with fewer cards, consecutive devices share one)."""
        return device_id % self.devices_per_node * self.nics_per_node // self.devices_per_node

    def leaf_of(self, node: int) -> int:
        """The leaf switch a node's cards hang off (0 for all without a spine tier)."""
        return 0 if self.spine is None else node // self.spine.nodes_per_leaf

    def spine_uplink(self) -> Link:
        """One leaf's share of the spine, each direction: its cards' bandwidth divided by
        the oversubscription."""
        if self.spine is None:
            raise ClusterError(f"cluster {self.name!r} has no spine tier")
        nodes = min(self.spine.nodes_per_leaf, self.nodes)
        gbps = nodes * self.nics_per_node * self.inter_node.bandwidth_gbps / self.spine.oversubscription
        return Link(f"{self.inter_node.name} spine uplink", gbps, self.inter_node.latency_s)

    def route(self, src: int, dst: int) -> tuple[Hop, ...]:
        """The ports a copy from device `src` to device `dst` passes, in order: the two
        devices' NVLink ports inside a node; across nodes the sending and receiving
        cards and, between leaves, both leaves' spine uplinks. The one routing rule
        the cross-mesh pricing, the stage-boundary pricing and the simulator share
        (collectives along a mesh axis take `group_link`, the same tiers)."""
        a, b = self.node_of(src), self.node_of(dst)
        if a == b:
            return (Hop(("out", src), f"dev{src} nvlink out", a, self.intra_node),
                    Hop(("in", dst), f"dev{dst} nvlink in", b, self.intra_node))
        ca, cb = self.nic_of(src), self.nic_of(dst)
        hops = [Hop(("nic-out", a, ca), f"node{a} nic{ca} out", a, self.inter_node)]
        la, lb = self.leaf_of(a), self.leaf_of(b)
        if la != lb:
            up = self.spine_uplink()
            first = lambda leaf: leaf * self.spine.nodes_per_leaf  # noqa: E731
            hops += [Hop(("spine-up", la), f"leaf{la} spine up", first(la), up),
                     Hop(("spine-down", lb), f"leaf{lb} spine down", first(lb), up)]
        return (*hops, Hop(("nic-in", b, cb), f"node{b} nic{cb} in", b, self.inter_node))

    def tiers(self) -> list[dict[str, Any]]:
        """The network tiers, innermost first, as the catalog lists them."""
        out = [{"tier": "nvlink", "devices": self.devices_per_node, "link": self.intra_node.to_json()},
               {"tier": "rails", "nics_per_node": self.nics_per_node, "link": self.inter_node.to_json()}]
        if self.spine is not None:
            out.append({"tier": "spine", **self.spine.to_json()})
        return out

    def with_overrides(self, *, nodes: int | None = None, devices_per_node: int | None = None,
                       inter_node_gbps: float | None = None, memory_gb: float | None = None) -> Cluster:
        """A new validated cluster with some fields replaced (None keeps the field).

        `inter_node_gbps` is the bandwidth of one network card; `memory_gb` is in GiB
        (2**30 bytes), the unit GPU memory is sold in (a "16 GB" V100 has 16 GiB).
        The number of cards per node is kept.
        """
        changes: dict[str, Any] = {}
        if nodes is not None:
            changes["nodes"] = nodes
        if devices_per_node is not None:
            changes["devices_per_node"] = devices_per_node
        if inter_node_gbps is not None:
            changes["inter_node"] = dataclasses.replace(self.inter_node, bandwidth_gbps=inter_node_gbps)
        if memory_gb is not None:
            gib = check_positive(f"cluster {self.name!r}", "memory_gb", memory_gb)
            changes["device"] = dataclasses.replace(self.device, memory_bytes=int(round(gib * GIB)))
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (schema `alpasim.cluster/1`); `from_json` inverts it exactly."""
        return {"schema": CLUSTER_SCHEMA, "name": self.name, "nodes": self.nodes,
                "devices_per_node": self.devices_per_node, "nics_per_node": self.nics_per_node,
                "device": self.device.to_json(), "intra_node": self.intra_node.to_json(),
                "inter_node": self.inter_node.to_json(),
                **({"spine": self.spine.to_json()} if self.spine is not None else {})}

    @classmethod
    def from_json(cls, data: Any) -> Cluster:
        """Parse a dict made by `to_json` (or by hand); errors name the offending field."""
        r = _Reader(data, "cluster")
        schema = r.get("schema", str)
        if schema != CLUSTER_SCHEMA:
            raise ClusterError(f"cluster JSON: field 'schema' must be {CLUSTER_SCHEMA!r}, got {schema!r}")
        dev = r.sub("device")
        device = Device(dev.get("name", str), dev.get("peak_flops", dict), dev.get("memory_bytes", int),
                        dev.get("memory_bandwidth_bytes_per_s", float))
        dev.done()
        links = [Link.from_json(r.sub(key).data, f"cluster.{key}") for key in ("intra_node", "inter_node")]
        spine = None
        if "spine" in data:
            sp = r.sub("spine")
            spine = SpineTier(sp.get("nodes_per_leaf", int), float(sp.get("oversubscription", float)))
            sp.done()
        cluster = cls(r.get("name", str), r.get("nodes", int), r.get("devices_per_node", int), device,
                      links[0], links[1], r.get("nics_per_node", int, optional=True), spine)
        r.done()
        return cluster


class _Reader:
    """Typed access to one JSON object; remembers which keys were read to reject unknown ones."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ClusterError(f"cluster JSON: field {path!r} must be an object, got {type(data).__name__}")
        self.data, self.path, self.seen = data, path, set()

    def get(self, key: str, kind: type, optional: bool = False) -> Any:
        self.seen.add(key)
        where = f"{self.path}.{key}"
        if key not in self.data:
            if optional:
                return None
            raise ClusterError(f"cluster JSON: missing field {where!r}")
        value = self.data[key]
        ok = {str: isinstance(value, str), dict: isinstance(value, Mapping),
              int: isinstance(value, int) and not isinstance(value, bool),
              float: _is_number(value), list: isinstance(value, list)}[kind]
        if not ok:
            raise ClusterError(f"cluster JSON: field {where!r} must be {kind.__name__}, got {value!r}")
        return value

    def sub(self, key: str) -> _Reader:
        self.seen.add(key)
        if key not in self.data:
            raise ClusterError(f"cluster JSON: missing field {self.path + '.' + key!r}")
        return _Reader(self.data[key], f"{self.path}.{key}")

    def done(self) -> None:
        extra = sorted(set(self.data) - self.seen)
        if extra:
            raise ClusterError(f"cluster JSON: unknown field {self.path + '.' + extra[0]!r} "
                              f"(known: {sorted(self.seen)})")

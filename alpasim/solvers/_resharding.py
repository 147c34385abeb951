"""Resharding one tensor between two specs on one mesh (seed 3.4.3, Table 2).

Per mesh axis, compare which tensor dimension (and position, for S01) the axis shards
in the source and in the destination:

* same, or unused in both: nothing;
* unused in the source, used in the destination: a local slice, free;
* used in the source, unused in the destination: an all-gather along that axis;
* used in both, on different dimensions (or positions): an all-to-all along that axis.

The steps run in the cheapest valid order: slices first (they shrink every later
message), then all-to-alls, then all-gathers, slowest link first. Sizes follow the
collective cost conventions of `alpasim.costmodels`: an all-gather's bytes are the
gathered tensor inside one group, an all-to-all's are one device's buffer. Partial sums never need
resharding here: a strategy that leaves partial outputs pays its all-reduce or
reduce-scatter itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.costmodels import collective_time_s

from ._mesh import LogicalMesh
from ._spec import ShardingSpec


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective on a mesh: kind, bytes (costmodels convention), mesh axes."""

    kind: str
    nbytes: float
    axes: tuple[int, ...]

    def time_s(self, mesh: LogicalMesh) -> float:
        return _collective_time_s(self.kind, self.nbytes, self.axes, mesh)

    def to_json(self) -> dict:
        return {"kind": self.kind, "bytes": self.nbytes, "mesh_axes": list(self.axes)}


@functools.lru_cache(maxsize=1 << 16)
def _collective_time_s(kind: str, nbytes: float, axes: tuple[int, ...], mesh: LogicalMesh) -> float:
    return collective_time_s(kind, nbytes, [mesh.axes[a] for a in axes])


def resharding_collectives(src: ShardingSpec, dst: ShardingSpec, nbytes: float,
                           mesh: LogicalMesh) -> list[Collective]:
    """The collectives that turn a tensor of `nbytes` from `src` into `dst` on `mesh`."""
    return list(_resharding(src, dst, float(nbytes), mesh))


@functools.lru_cache(maxsize=1 << 16)
def _resharding(src: ShardingSpec, dst: ShardingSpec, nbytes: float, mesh: LogicalMesh) -> tuple[Collective, ...]:
    if src.rank != dst.rank:
        raise ValueError(f"cannot reshard between {src} and {dst}: ranks differ")
    if src == dst:
        return ()
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    slices, swaps, gathers = [], [], []
    for a in live:
        s, d = _placement(src, a, mesh), _placement(dst, a, mesh)
        if s == d:
            continue
        if s is None:
            slices.append(a)
        elif d is None:
            gathers.append(a)
        else:
            swaps.append(a)
    # After the slices, a device holds nbytes / shards, with shards over every axis that
    # the source or the (sliced-in) destination uses.
    held = set(src.axes_used()) | set(slices)
    per_device = nbytes / mesh.axis_size(tuple(a for a in held if mesh.shape[a] > 1))
    out = [Collective("all_to_all", per_device, (a,)) for a in swaps]
    # Slowest link first, while the pieces are small (the hierarchical all-gather order).
    gathers.sort(key=lambda a: mesh.axes[a].link.bytes_per_s)
    for a in gathers:
        out.append(Collective("all_gather", per_device * mesh.shape[a], (a,)))
        per_device *= mesh.shape[a]
    return tuple(out)  # cached: immutable


def _placement(spec: ShardingSpec, axis: int, mesh: LogicalMesh) -> tuple[int, int] | None:
    """(tensor dim, position among that dim's axes of size > 1) sharded on `axis`, or None.

    Axes of size 1 do not count: on a 1xn mesh S01 and S1 are the same layout.
    """
    found = spec.dim_of_axis(axis)
    if found is None:
        return None
    dim = found[0]
    return dim, [a for a in spec.dims[dim] if mesh.shape[a] > 1].index(axis)


def resharding_time_s(src: ShardingSpec, dst: ShardingSpec, nbytes: float, mesh: LogicalMesh) -> float:
    return _resharding_time_s(src, dst, float(nbytes), mesh)


@functools.lru_cache(maxsize=1 << 18)
def _resharding_time_s(src: ShardingSpec, dst: ShardingSpec, nbytes: float, mesh: LogicalMesh) -> float:
    # Called about 10^4 times per layer problem, mostly for pairs already seen.
    return sum(c.time_s(mesh) for c in _resharding(src, dst, nbytes, mesh))


def collectives_time_s(collectives: Sequence[Collective], mesh: LogicalMesh) -> float:
    return sum(c.time_s(mesh) for c in collectives)

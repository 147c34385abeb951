"""Submeshes of a cluster (seed 3.4.7): allowed shapes, coverage, placement, logical views.

A cluster is an N x M grid (nodes, i.e. NVLink domains, x devices each). Stages get
submeshes of two families only: (1, 2^k) inside one node with 2^k dividing M (up to
`node_block(M)`, M itself when M is a power of two), and (n, M), n whole nodes (n = 1
included). Any list of such shapes whose sizes add up to N*M tiles the grid (the
paper's Appendix A): the (n, M) blocks take whole nodes, and the (1, 2^k) pieces,
placed largest first, pack the remaining nodes exactly, because powers of two that all
divide M and sum to a multiple of M fill bins of size M with no gap (each bin's free
space stays a multiple of the next piece). `place_submeshes` does exactly that and
returns device ids; given the stage DP's runs (consecutive pieces that must share a
node) it packs the runs instead (`place_runs`, `pack_runs`), each run's pieces side by
side on one node.

Logical views: a submesh of d devices can be viewed as any (d0, d1) with d0*d1 = d whose
second axis stays inside a node (so the fast links sit on axis 1 and a view that
spans nodes puts the slow links on axis 0). Each view's links come from the cluster.
"""

from __future__ import annotations

import functools
import itertools

from collections.abc import Sequence
from dataclasses import dataclass, field

from alpasim.costmodels import Cluster, MeshAxis, axis_of_groups

from ._mesh import LogicalMesh


@dataclass(frozen=True, slots=True, order=True)
class SubmeshShape:
    """(n, m): n nodes (or 1) by m devices of each."""

    n: int
    m: int
    # n x m, kept: placement and the stage DP read it in their innermost loops.
    size: int = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", self.n * self.m)
        object.__setattr__(self, "_hash", hash((self.n, self.m)))

    def __hash__(self) -> int:  # placement checks sets of hundreds of pieces: hash once
        return self._hash

    def __str__(self) -> str:
        return f"({self.n},{self.m})"


def node_block(devices_per_node: int) -> int:
    """The largest power of two that divides M: the biggest part-node piece (8 of a
    72-GPU NVL72 domain, M itself when M is a power of two)."""
    return devices_per_node & -devices_per_node


def submesh_shapes(nodes: int, devices_per_node: int) -> list[SubmeshShape]:
    """(1, 1), (1, 2), (1, 4), ... up to `node_block(M)`, then the whole node (1, M) and
    (2, M), ..., (N, M): a stage inside one NVLink domain takes a power-of-two part that
    tiles it, or all of it (on a 72-GPU NVL72: 1, 2, 4, 8 or 72 GPUs). A new list each
    call; the shapes themselves are shared (`_submesh_shapes`)."""
    return list(_submesh_shapes(nodes, devices_per_node))


@functools.lru_cache(maxsize=256)
def _submesh_shapes(nodes: int, devices_per_node: int) -> tuple[SubmeshShape, ...]:
    """The shapes of `submesh_shapes`, computed once per cluster shape."""
    out = []
    m, block = 1, node_block(devices_per_node)
    while m <= block:
        out.append(SubmeshShape(1, m))
        m *= 2
    if block != devices_per_node:
        out.append(SubmeshShape(1, devices_per_node))
    out += [SubmeshShape(n, devices_per_node) for n in range(2, nodes + 1)]
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _allowed_shapes(nodes: int, devices_per_node: int) -> frozenset[SubmeshShape]:
    return frozenset(_submesh_shapes(nodes, devices_per_node))


def place_submeshes(shapes: Sequence[SubmeshShape], nodes: int, devices_per_node: int,
                    runs: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Device ids for each shape (in the given order) tiling the cluster exactly.

    `runs` (the stage DP's, indices into `shapes`) groups the one-node pieces that must
    share a node; each run's pieces sit side by side on one node (`place_runs`).
    Without runs: in order when no piece then straddles a node, else largest first.
    Raises ValueError when the sizes do not add up, a shape is not allowed or the runs
    do not pack.
    """
    total = sum(s.size for s in shapes)
    if total != nodes * devices_per_node:
        raise ValueError(f"submeshes of {total} devices cannot cover a {nodes}x{devices_per_node} cluster exactly")
    bad = set(shapes) - _allowed_shapes(nodes, devices_per_node)
    if bad:
        raise ValueError(f"submesh shape {min(bad)} is not one of the allowed shapes "
                         f"{sorted(_allowed_shapes(nodes, devices_per_node))}")
    if runs is not None:
        return place_runs(shapes, runs, nodes, devices_per_node)
    in_order = _contiguous(shapes, devices_per_node)
    if in_order is not None:
        return in_order
    placement: list[list[int] | None] = [None] * len(shapes)
    node = 0
    for i, s in enumerate(shapes):
        if s.n > 1:
            placement[i] = list(range(node * devices_per_node, (node + s.n) * devices_per_node))
            node += s.n
    # Remaining nodes: one-node pieces, largest first, first fit.
    free = [(n, 0) for n in range(node, nodes)]  # (node, next free slot)
    order = sorted((i for i, p in enumerate(placement) if p is None), key=lambda i: -shapes[i].m)
    for i in order:
        m = shapes[i].m
        for k, (n, used) in enumerate(free):
            if used + m <= devices_per_node:
                placement[i] = list(range(n * devices_per_node + used, n * devices_per_node + used + m))
                free[k] = (n, used + m)
                break
        else:
            raise ValueError(f"cannot place submesh {shapes[i]}: the shapes do not tile the cluster")
    return [p for p in placement if p is not None]


def pack_runs(run_sizes: Sequence[int], bins: int, capacity: int) -> list[int] | None:
    """Bin of each run (a group of one-node pieces that must share a node) such that
    every bin is filled exactly, or None. Exact: largest first, depth-first over bins,
    trying one bin per distinct fill level, memoised on the sorted fill levels."""
    if sum(run_sizes) != bins * capacity or any(r > capacity for r in run_sizes):
        return None
    order = sorted(range(len(run_sizes)), key=lambda r: -run_sizes[r])
    fill = [0] * bins
    where = [0] * len(run_sizes)
    failed: set[tuple[int, tuple[int, ...]]] = set()

    def place(n: int) -> bool:
        if n == len(order):
            return True
        key = (n, tuple(sorted(fill)))
        if key in failed:
            return False
        size, tried = run_sizes[order[n]], set()
        for b in range(bins):
            if fill[b] + size <= capacity and fill[b] not in tried:
                tried.add(fill[b])
                fill[b] += size
                where[order[n]] = b
                if place(n + 1):
                    return True
                fill[b] -= size
        failed.add(key)
        return False

    return where if place(0) else None


def pack_node_groups(pieces: Sequence[int], runs: Sequence[Sequence[int]], nodes: int,
                     devices_per_node: int) -> list[int] | None:
    """`pack_runs` of the runs of one-node pieces (`pieces`: each stage's device count)
    into the nodes the whole-node pieces leave: each such run's node among those, in
    the order of `runs`, or None when they do not pack or a run mixes the two kinds."""
    small = [r for r in runs if pieces[r[0]] < devices_per_node]
    if any(pieces[j] >= devices_per_node for r in small for j in r):
        return None
    whole = sum(p for p in pieces if p >= devices_per_node) // devices_per_node
    return pack_runs([sum(pieces[j] for j in r) for r in small], nodes - whole, devices_per_node)


def place_runs(shapes: Sequence[SubmeshShape], runs: Sequence[Sequence[int]], nodes: int,
               devices_per_node: int) -> list[list[int]]:
    """Several-node pieces on whole nodes in pipeline order, then each run of one-node
    pieces on one node of those left (an exact packing, `pack_runs`), its
    pieces side by side in pipeline order."""
    if sorted(j for r in runs for j in r) != list(range(len(shapes))):
        raise ValueError(f"runs {list(map(list, runs))} do not name each of the {len(shapes)} stages once")
    placement: list[list[int]] = [[] for _ in shapes]
    node = 0
    for j, s in enumerate(shapes):
        if s.n > 1 or s.m == devices_per_node:
            placement[j] = list(range(node * devices_per_node, node * devices_per_node + s.size))
            node += s.n
    small = [list(r) for r in runs if shapes[r[0]].size < devices_per_node]
    bins = pack_node_groups([s.size for s in shapes], runs, nodes, devices_per_node)
    if bins is None:
        raise ValueError(f"the node groups {small} of {[s.size for s in shapes]} do not pack the {nodes - node} "
                         f"nodes left")
    used = [0] * (nodes - node)
    for r, b in zip(small, bins):
        for j in r:
            first = (node + b) * devices_per_node + used[b]
            placement[j] = list(range(first, first + shapes[j].size))
            used[b] += shapes[j].size
    return placement


def starts_cleanly(size: int, start: int, devices_per_node: int) -> bool:
    """Whether a piece of `size` devices may sit on devices start.. without straddling a
    node: a one-node piece ends by its node's end, a several-node piece starts a node."""
    offset = start % devices_per_node
    return offset + size <= devices_per_node if size <= devices_per_node else offset == 0


def _contiguous(shapes: Sequence[SubmeshShape], devices_per_node: int) -> list[list[int]] | None:
    """Stage i on the devices right after stage i-1's, if no piece then straddles a node
    boundary: neighbouring stages share a node whenever they can (plans priced without
    boundaries; the DP's runs say which neighbours share a node otherwise)."""
    out, start = [], 0
    for s in shapes:
        if not starts_cleanly(s.size, start, devices_per_node):
            return None
        out.append(list(range(start, start + s.size)))
        start += s.size
    return out


def covers_exactly(shapes: Sequence[SubmeshShape], nodes: int, devices_per_node: int) -> bool:
    """Whether `place_submeshes` tiles the cluster with these shapes (every device once)."""
    try:
        placed = place_submeshes(shapes, nodes, devices_per_node)
    except ValueError:
        return False
    ids = sorted(itertools.chain.from_iterable(placed))
    return ids == list(range(nodes * devices_per_node))


def logical_shapes(shape: SubmeshShape, devices_per_node: int) -> list[tuple[int, int]]:
    """Views (d0, d1) of a submesh whose axis 1 stays inside a node.

    Inside a node every split is a candidate. A submesh of several nodes is viewed as
    (nodes, M) — model parallelism within each node, data parallelism across — or as
    one flat data-parallel axis (n*M, 1): splitting a node between the two axes would
    put model-parallel traffic on the slow inter-node links, which Alpa's default
    search space excludes for the same reason, and it halves the ILPs to solve.
    """
    d = shape.size
    views = [(d // b, b) for b in range(1, d + 1)
             if d % b == 0 and b <= shape.m and shape.m % b == 0 and devices_per_node % b == 0]
    if shape.n > 1:
        views = [v for v in views if v[1] in (1, shape.m)]
    return views


def logical_mesh(cluster: Cluster, devices: Sequence[int], view: tuple[int, int]) -> LogicalMesh:
    """The `LogicalMesh` of `devices` (row-major) in `view`, with links from the cluster."""
    d0, d1 = view
    if d0 * d1 != len(devices):
        raise ValueError(f"view {view} does not have {len(devices)} devices")
    grid = [list(devices[r * d1:(r + 1) * d1]) for r in range(d0)]
    axis0 = [[grid[r][c] for r in range(d0)] for c in range(d1)]
    axis_0 = axis_of_groups(cluster, d0, axis0) if d0 > 1 else MeshAxis(d0, cluster.intra_node)
    axis_1 = axis_of_groups(cluster, d1, grid) if d1 > 1 else MeshAxis(d1, cluster.intra_node)
    return LogicalMesh((axis_0, axis_1))

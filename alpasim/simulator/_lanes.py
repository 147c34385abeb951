"""Lanes: fold a network whose traffic is K identical, independent copies into one.

A Megatron layout's pipeline sends are SPMD: every device of a mesh sends its shard to
its counterpart in the next mesh, each over its own network card, at the same instant
and of the same size. Llama 3's 405B layout at 16,384 GPUs sends 1,024 such copies per
tensor, and its 16 meshes of 128 nodes exchange some 8,000 tensors an iteration, so a
flow-level simulation handles millions of flows; where a copy crosses pods, every
copy of the tensor shares the pods' spine uplinks, and max-min fair sharing has to
recompute one component of thousands of flows each time one starts or ends.

The traffic has a symmetry that makes this unnecessary. When the links split into K
lanes, each route (`_routes.Route`) has exactly one copy in each lane, the lanes are
the same network up to renaming (same capacities, same sharing pattern, same bytes and
latencies), and the links no lane owns are each used by all K copies of every route
that touches them (a spine uplink), then permuting the lanes maps the network and its
traffic onto itself. The max-min fair allocation is unique, so it is invariant under
that permutation: the K copies of a route always get the same rate and finish
together. Simulating lane 0 alone, with each shared link at 1/K of its capacity
(K flows sharing C get C / K each; one flow on C / K gets the same), gives the same
finish time for every tensor, to rounding. `LaneFold.orbit` maps each lane-0 link to
its K counterparts, so the engine still records every link's traffic.

Anything less symmetric (routes of different copy counts, a lane-local link shared
by two copies, lanes that differ in any way) is not folded: the engine then runs
every copy, as before.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import networkx as nx

from ._routes import Copy, Route
from ._timeline import Event


@dataclass(frozen=True, slots=True)
class LaneFold:
    """The network of lane 0 that stands for K identical lanes (module doc)."""

    lanes: int                                  # K
    routes: tuple[Route, ...]                   # each route with lane 0's copy only
    capacities: tuple[float, ...]               # per link; a link every lane shares at 1/K
    orbit: dict[int, tuple[int, ...]]           # lane-0 link -> the link in each lane (a shared one K times)


def fold_lanes(routes: Sequence[Route], capacities: Sequence[float]) -> LaneFold | None:
    """The lane fold of `routes` over links of `capacities`, or None if the traffic
    does not split into K >= 2 identical lanes (module doc)."""
    moving = list({id(r): r for r in routes if r.copies}.values())     # a route may serve many transfers
    if not moving:
        return None
    k = len(moving[0].copies)
    if k < 2 or any(len(r.copies) != k for r in moving):
        return None
    shared = _shared_links(moving, k)
    if shared is None:
        return None
    lanes = _lanes(moving, shared, k)
    if lanes is None:
        return None
    signatures, links_by_lane = [], []
    for lane in range(k):
        signature, local = _signature(moving, lanes, lane, shared, capacities)
        signatures.append(signature)
        links_by_lane.append(local)
    if any(s != signatures[0] for s in signatures[1:]):
        return None
    orbit = {link: tuple(local[j] for local in links_by_lane) for j, link in enumerate(links_by_lane[0])}
    orbit.update({link: (link,) * k for link in shared})
    lane0 = {id(r): dataclasses.replace(r, copies=(lanes[id(r)][0],)) for r in moving}
    folded = [lane0[id(r)] if r.copies else r for r in routes]
    caps = tuple(c / k if i in shared else float(c) for i, c in enumerate(capacities))
    return LaneFold(k, tuple(folded), caps, orbit)


def _shared_links(moving: Sequence[Route], k: int) -> set[int] | None:
    """Links some route sends all its K copies over (a spine uplink); None if a link is
    used by more than one but fewer than K copies of a route, or by all K of one route
    and a single copy of another."""
    shared, single = set(), set()
    for r in moving:
        for link, n in Counter(link for c in r.copies for link in set(c.links)).items():
            if n == k:
                shared.add(link)
            elif n == 1:
                single.add(link)
            else:
                return None
    return None if shared & single else shared


def _lanes(moving: Sequence[Route], shared: set[int], k: int) -> dict[int, list[Copy]] | None:
    """Per route (by id), its copies in lane order, or None.

    The links no lane shares, joined by the copies that use them, fall into connected
    components. Each route must have its K copies in K different components. Components
    touched by the same routes form a group (a forward send's cards and a backward
    send's are different groups: a card's two directions are two links), and each group
    must have K components, numbered in the order of its first route's copies: lane i
    is every group's i-th component."""
    joined = nx.Graph()
    for r in moving:
        for c in r.copies:
            own = [link for link in c.links if link not in shared]
            if not own:
                return None
            joined.add_node(own[0])
            nx.add_path(joined, own)
    component = {link: i for i, links in enumerate(nx.connected_components(joined)) for link in links}
    find = component.__getitem__
    where: dict[int, list[int]] = {}                     # route id -> its copies' components
    touching: dict[int, list[int]] = {}                 # component -> the routes with a copy there
    for i, r in enumerate(moving):
        comps = [find(next(link for link in c.links if link not in shared)) for c in r.copies]
        if len(set(comps)) != k:
            return None
        where[id(r)] = comps
        for comp in comps:
            touching.setdefault(comp, []).append(i)
    groups: dict[tuple[int, ...], list[int]] = {}
    for comp, routes in touching.items():
        groups.setdefault(tuple(routes), []).append(comp)
    lane_of: dict[int, int] = {}
    for routes, comps in groups.items():
        if len(comps) != k:
            return None
        lane_of.update((comp, lane) for lane, comp in enumerate(where[id(moving[routes[0]])]))
    out: dict[int, list[Copy]] = {}
    for r in moving:
        ordered: list[Copy] = [r.copies[0]] * k
        for c, comp in zip(r.copies, where[id(r)]):
            ordered[lane_of[comp]] = c
        out[id(r)] = ordered
    return out


def _signature(moving: Sequence[Route], lanes: dict[int, list[Copy]], lane: int, shared: set[int],
               capacities: Sequence[float]) -> tuple[tuple, list[int]]:
    """Lane `lane`'s traffic with its own links renumbered by first use (shared links
    keep their ids), and its links in that order: two lanes with equal signatures are
    the same network up to renaming."""
    local: dict[int, int] = {}
    signature = []
    for r in moving:
        c = lanes[id(r)][lane]
        ids = tuple(("shared", link) if link in shared else local.setdefault(link, len(local)) for link in c.links)
        signature.append((c.nbytes, c.latency_s, ids))
    signature.append(tuple(capacities[link] for link in local))
    return tuple(signature), list(local)


class LaneEvents(Collection):
    """A timeline's events with each lane-0 link event standing for its K lanes' (the
    same message on each lane's own link, at the same times), expanded as they are
    read: Llama 3's 16,384-GPU layout would otherwise hold tens of millions of them."""

    def __init__(self) -> None:
        self._items: list[Event | tuple[Event, tuple[str, ...]]] = []
        self._count = 0

    def append(self, event: Event) -> None:
        self._items.append(event)
        self._count += 1

    def fan_out(self, event: Event, tracks: tuple[str, ...]) -> None:
        """`event` once on each of `tracks` (its link in every lane; its own track alone
        where nothing was folded)."""
        if len(tracks) == 1:
            self.append(event)
            return
        self._items.append((event, tracks))
        self._count += len(tracks)

    def __len__(self) -> int:
        return self._count

    def unfanned(self) -> Iterator[Event]:
        """The events recorded once (every mesh track's), without the lanes' link events."""
        return (item for item in self._items if isinstance(item, Event))

    def __iter__(self) -> Iterator[Event]:
        for item in self._items:
            if isinstance(item, Event):
                yield item
            else:
                event, tracks = item
                for track in tracks:
                    yield event._replace(track=track)

    def __contains__(self, event: object) -> bool:
        return any(e == event for e in self)

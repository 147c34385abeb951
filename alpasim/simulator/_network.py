"""A fluid (flow-level) network with max-min fair bandwidth sharing.

Each message in flight is a flow of bytes over a few links (a sending port and a
receiving port); each link is one direction of an NVLink port or of a network card,
with a capacity in bytes/s. Whenever a flow starts or ends, the rates of the flows it
shares links with (transitively: its connected component) are recomputed by
progressive filling: repeatedly find the link whose remaining capacity split evenly
among its unfixed flows is smallest, give those flows that share, remove them. This
is the max-min fair allocation (Bertsekas and Gallager, "Data Networks", sec. 6.5.2),
the standard flow-level model of TCP and of NCCL channels sharing a wire. A flow alone
on its links runs at the slowest link's capacity, so one message takes exactly
bytes/bandwidth; two flows through one card take twice as long each.

Ignored: congestion-control dynamics (flows reach their fair rate at once), switch
buffers, and packetisation. Latency (alpha) is charged by the caller before the flow
starts. The class is pure bookkeeping: the engine asks it for finish times and tells
it when time has advanced.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Flow:
    __slots__ = ("links", "rate", "remaining", "since", "version")

    def __init__(self, links: tuple[int, ...], nbytes: float, now: float) -> None:
        self.links, self.remaining, self.rate, self.since, self.version = links, nbytes, 0.0, now, 0


class FluidNetwork:
    """Active flows over links of fixed capacity; rates are max-min fair at all times."""

    def __init__(self, capacities: Sequence[float]) -> None:
        self.capacity = [float(c) for c in capacities]
        if any(c <= 0 for c in self.capacity):
            raise ValueError(f"fluid network: link capacities must be > 0, got {list(capacities)}")
        self.flows: dict[int, _Flow] = {}
        self.on_link: list[set[int]] = [set() for _ in self.capacity]

    def add(self, flow_id: int, links: tuple[int, ...], nbytes: float, now: float) -> list[tuple[int, float, int]]:
        """Start a flow; returns (flow, finish time, version) for every flow whose rate changed."""
        if flow_id in self.flows:
            raise ValueError(f"fluid network: flow {flow_id} is already active")
        if not links or nbytes <= 0:
            raise ValueError(f"fluid network: flow {flow_id} needs links and bytes > 0")
        self.flows[flow_id] = _Flow(tuple(links), float(nbytes), now)
        for link in links:
            self.on_link[link].add(flow_id)
        return self._reshare(links, now)

    def remove(self, flow_id: int, now: float) -> list[tuple[int, float, int]]:
        """End a flow (it finished); returns the changed (flow, finish, version) like `add`."""
        flow = self.flows.pop(flow_id)
        for link in flow.links:
            self.on_link[link].discard(flow_id)
        return self._reshare(flow.links, now)

    def is_current(self, flow_id: int, version: int) -> bool:
        """Whether a finish time handed out with `version` still holds for the flow."""
        flow = self.flows.get(flow_id)
        return flow is not None and flow.version == version

    def _component(self, links: tuple[int, ...]) -> tuple[set[int], set[int]]:
        """Flows and links reachable from `links` through shared links."""
        seen_links, flows = set(links), set()
        todo = list(links)
        while todo:
            for f in self.on_link[todo.pop()]:
                if f not in flows:
                    flows.add(f)
                    for link in self.flows[f].links:
                        if link not in seen_links:
                            seen_links.add(link)
                            todo.append(link)
        return flows, seen_links

    def _reshare(self, links: tuple[int, ...], now: float) -> list[tuple[int, float, int]]:
        flows, comp_links = self._component(links)
        if not flows:
            return []
        for f in flows:  # bank the bytes moved at the old rates
            flow = self.flows[f]
            flow.remaining -= flow.rate * (now - flow.since)
            flow.since = now
        if len(flows) == 1:      # alone on its links (most messages): the slowest link's capacity,
            # what progressive filling gives one flow, without building its tables
            (f,) = flows
            return self._set_rates({f: min(self.capacity[link] for link in self.flows[f].links)}, now)
        return self._set_rates(self._progressive_filling(comp_links), now)

    def _progressive_filling(self, comp_links: set[int]) -> dict[int, float]:
        """The max-min fair rates of the flows on `comp_links` (module doc).

        The bottleneck each round is the link of the smallest even share, ties to the
        lowest link id, found on a heap of (share, link) rather than by a scan of every
        link each round (a data-parallel collective over 64 nodes puts thousands of
        links in one component). Every link a round touches gets an entry at its new
        share, and an entry whose share is not its link's current one is stale and
        skipped, so the first entry that holds is the scan's minimum: the same rounds,
        in the same order, to the bit."""
        spare = {link: self.capacity[link] for link in comp_links}
        unfixed = {link: set(self.on_link[link]) for link in comp_links if self.on_link[link]}
        heap = [(spare[link] / len(fs), link) for link, fs in unfixed.items()]
        heapq.heapify(heap)
        rates: dict[int, float] = {}
        while unfixed:
            share, link = heapq.heappop(heap)
            fs = unfixed.get(link)
            if fs is None or spare[link] / len(fs) != share:
                continue                                  # fixed already, or its share has grown
            touched = set()
            for f in sorted(fs):
                rates[f] = share
                for other in self.flows[f].links:
                    spare[other] -= share
                    if other != link and other in unfixed:
                        unfixed[other].discard(f)
                        touched.add(other)
            del unfixed[link]
            for other in touched:
                if unfixed[other]:
                    heapq.heappush(heap, (spare[other] / len(unfixed[other]), other))
                else:
                    del unfixed[other]
        return rates

    def _set_rates(self, rates: dict[int, float], now: float) -> list[tuple[int, float, int]]:
        """Give each flow its new rate; (flow, finish, version) of those that changed."""
        changed = []
        for f in sorted(rates):
            flow = self.flows[f]
            if rates[f] != flow.rate or flow.version == 0:
                flow.rate = rates[f]
                flow.version += 1
                changed.append((f, now + max(flow.remaining, 0.0) / flow.rate, flow.version))
        return changed

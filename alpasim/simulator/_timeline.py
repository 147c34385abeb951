"""`Timeline`: what happened in one simulated iteration, and the metrics read off it.

Events are intervals on tracks. Mesh tracks ("mesh3") carry `compute` (a forward or
backward run), `recv` (the mesh blocked on a tensor already on the wire), `allgather`
(the receiver-side gather of seed 3.4.10) and `sync` (gradient sync and update); link
tracks ("node0 nic0 out") carry `send` (one message's flow on that port).

Metric definitions (S meshes, iteration time T):

    busy_s   compute + sync time of a mesh (work the planner's t_i counts)
    comm_s   time a mesh is blocked on communication: waiting for data in flight (or,
             where the system's sends block, for its own output to land)
             plus local all-gathers
    idle_s   T - busy_s - comm_s (pipeline bubbles and waiting for senders)
    bubble_fraction = 1 - sum_k busy_k / (S T)

With balanced stages (t = t_f + t_b each), no sync and free communication, every mesh
is busy B t and T = (S + B - 1) t by eq. 2, so bubble_fraction = (S - 1)/(S + B - 1),
the same number `alpasim.solvers.bubble_fraction` gives for the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

EVENT_KINDS = ("compute", "send", "recv", "allgather", "sync", "idle")


class Event(NamedTuple):
    """One interval on one track; `name` is the phase of a run or the tensor of a message."""

    track: str
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    nbytes: float = 0.0
    name: str = ""
    chunk: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class MeshInfo:
    stage: int
    devices: tuple[int, ...]
    nodes: tuple[int, ...]                  # the nodes its devices sit on (empty without a cluster)
    params_bytes: float
    device_nodes: tuple[int, ...] = ()      # node of each device, in `devices` order (empty without a cluster)


@dataclass(frozen=True)
class Timeline:
    """Events, per-mesh memory samples and totals of one simulated iteration (the
    engine's result; treat the lists as read-only)."""

    schedule: str
    microbatches: int
    chunks: int
    cross_mesh: str
    meshes: tuple[MeshInfo, ...]
    iteration_s: float
    events: list[Event]
    memory: list[list[tuple[float, float]]]  # per mesh: (time, bytes per device) after each change
    links: tuple[tuple[str, int], ...] = ()  # (name, node) of every link that carried traffic
    cross_mesh_bytes: float = 0.0            # bytes sent between meshes (device to device)
    inter_node_bytes: float = 0.0            # the part of it that crossed nodes
    predicted_iteration_s: float | None = None
    free_communication: bool = False
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0                      # how long the simulation itself took
    blocking_sends: bool = False             # each pipeline send held its mesh until it landed
    lanes: int = 1                           # identical network lanes simulated as one (`_lanes`)
    _stats: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)

    # ----------------------------------------------------------------- metrics
    @property
    def num_meshes(self) -> int:
        return len(self.meshes)

    def mesh_stats(self) -> list[dict[str, Any]]:
        """Per mesh: stage, devices, busy_s (compute_s + sync_s), comm_s, idle_s."""
        if self._stats is None:
            acc = [{"compute_s": 0.0, "sync_s": 0.0, "comm_s": 0.0} for _ in self.meshes]
            index = {f"mesh{k}": k for k in range(self.num_meshes)}
            # A mesh's own "send" events are the time a blocking send held it (`blocking_sends`).
            key = {"compute": "compute_s", "sync": "sync_s", "recv": "comm_s", "send": "comm_s",
                   "allgather": "comm_s"}
            for e in self._mesh_events():
                k = index.get(e.track)
                if k is not None and e.kind in key:
                    acc[k][key[e.kind]] += e.end_s - e.start_s
            stats = []
            for m, a in zip(self.meshes, acc):
                busy = a["compute_s"] + a["sync_s"]
                stats.append({"stage": m.stage, "devices": list(m.devices), "busy_s": busy, **a,
                              "idle_s": max(self.iteration_s - busy - a["comm_s"], 0.0)})
            object.__setattr__(self, "_stats", stats)  # a cache, not state
        return self._stats

    @property
    def bubble_fraction(self) -> float:
        """1 - sum of busy time / (meshes x iteration time); see the module docstring."""
        if self.iteration_s <= 0:
            return 0.0
        busy = sum(s["busy_s"] for s in self.mesh_stats())
        return 1.0 - busy / (self.num_meshes * self.iteration_s)

    def peak_mesh_memory_bytes(self) -> list[float]:
        """Per mesh, the largest per-device footprint it reached."""
        return [max((b for _, b in samples), default=0.0) for samples in self.memory]

    @property
    def peak_memory_bytes(self) -> list[float]:
        """Per device, indexed by global device id (devices of no mesh: 0)."""
        size = 1 + max(d for m in self.meshes for d in m.devices)
        out = [0.0] * size
        for m, peak in zip(self.meshes, self.peak_mesh_memory_bytes()):
            for d in m.devices:
                out[d] = peak
        return out

    def _mesh_events(self):
        """The events, less the lanes' fanned-out link events where the engine folded
        them (`_lanes.LaneEvents`): no mesh track is among those."""
        unfanned = getattr(self.events, "unfanned", None)
        return self.events if unfanned is None else unfanned()

    def count(self, kind: str) -> int:
        return sum(e.kind == kind for e in self.events)

    def idle_events(self) -> list[Event]:
        """The gaps between a mesh's own events, as `idle` events (for plots)."""
        per_mesh: dict[str, list[Event]] = {}
        for e in self._mesh_events():
            if e.track.startswith("mesh"):
                per_mesh.setdefault(e.track, []).append(e)
        out = []
        for k in range(self.num_meshes):
            t, track = 0.0, f"mesh{k}"
            for e in sorted(per_mesh.get(track, ()), key=lambda e: e.start_s):
                if e.start_s > t:
                    out.append(Event(track, "idle", k, -1, t, e.start_s))
                t = max(t, e.end_s)
            if self.iteration_s > t:
                out.append(Event(track, "idle", k, -1, t, self.iteration_s))
        return out

    def to_json(self, events: bool = False) -> dict[str, Any]:
        """The metrics as a JSON-ready dict; `events=True` adds every event."""
        d: dict[str, Any] = {
            "schedule": self.schedule, "microbatches": self.microbatches, "chunks": self.chunks,
            "cross_mesh": self.cross_mesh, "free_communication": self.free_communication,
            "blocking_sends": self.blocking_sends, "network_lanes": self.lanes,
            "iteration_s": self.iteration_s, "predicted_iteration_s": self.predicted_iteration_s,
            "bubble_fraction": self.bubble_fraction, "peak_memory_bytes": self.peak_memory_bytes,
            "meshes": self.mesh_stats(),
            "cross_mesh_bytes": self.cross_mesh_bytes, "inter_node_bytes": self.inter_node_bytes,
            "num_events": len(self.events), "wall_s": self.wall_s,
            "events_per_s": len(self.events) / self.wall_s if self.wall_s > 0 else None,
            "notes": list(self.notes),
        }
        if events:
            d["events"] = [e._asdict() for e in self.events]
        return d

    # ---------------------------------------------------------------- outputs
    def chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace event JSON (opens in Perfetto / chrome://tracing)."""
        from ._render import write_chrome_trace

        return write_chrome_trace(self, Path(path))

    def gantt_png(self, path: str | Path) -> Path:
        """Write a Gantt chart: one row per mesh, compute / communication / idle colours."""
        from ._render import write_gantt_png

        return write_gantt_png(self, Path(path))

    def memory_png(self, path: str | Path) -> Path:
        """Write per-device memory over time, one line per mesh (stage)."""
        from ._render import write_memory_png

        return write_memory_png(self, Path(path))

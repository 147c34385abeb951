"""The discrete-event engine: run a plan's `Program` on a simulated cluster (SimPy).

Each mesh is one SimPy process walking its instruction list (seed 3.4.11: meshes
follow static lists without a driver). Semantics:

- `Run` takes the stage's forward_s or backward_s; plans without the split use 1/3
  and 2/3 of compute_s (backward ~ 2x forward). A backward split into B and W takes
  `solvers.split_backward`'s shares of it. Under interleaving, chunk c of mesh k is
  plan stage c*S + k with its own times and bytes when the plan is cut into chunks
  (`plan.chunks`); a plan of one stage per mesh has each stage imagined as v chunks
  of 1/v of its times and bytes.
- `Send` does not block the mesh: it waits the link latency, then starts one flow per
  point-to-point copy of the tensor's route (`_routes`) in the fluid network
  (`_network`: max-min fair sharing of every NVLink port and network card, so
  concurrent messages through one card slow each other down). The tensor has arrived
  when its last flow ends. Under a system whose sends block (`blocking_sends`, the
  profile's `p2p`: DeepSpeed's and Megatron's pipelines) the mesh waits for that
  before its next instruction.
- `Recv` blocks until the tensor has arrived, then runs the receiver-side local
  all-gathers (their ring time). Time blocked while the data was on the wire is
  communication; time blocked before the sender even sent it is idle.
- A plan with sharded gradients (ZeRO-2, Llama 3's FSDP: `PipelineStage.grad_scatter_s`)
  puts each backward's weight-gradient reduce-scatters on the mesh's gradient stream
  as the backward ends (inline in it without overlap or with shared executors); the
  planner's estimate of the stream's tail (`solvers.scatter_tail_s`, inside sync_s) is
  replaced by waiting for the stream at `GradSync`.
- `GradSync` takes the stage's sync_s (the planner's costed gradient all-reduce plus
  optimizer update, once per iteration; `Update` is a marker, already inside it).
  A plan whose stages carry gradient buckets (`costmodels._overlap`) runs them on a
  stream of the mesh's own, started with its last backward (a chunked plan: each
  chunk's buckets with that chunk's last backward, after the chunks' before them):
  each bucket waits until that backward has produced it, then for the bucket before it; `GradSync` then waits
  for the stream and takes the rest of sync_s (the optimizer step). The stream's
  bandwidth is not shared with pipeline messages (below).
  Tensors that move once per iteration are sent after the sender's last run and
  received before its `GradSync`.
- Memory per device of a mesh: params_bytes (of all its chunks); a microbatch's
  activations of a chunk reach their peak (activation_bytes) while its forward or
  backward runs and keep only its stash (stash_bytes: what backward reads of the
  forward, the planner's eq. 5) in between, until the `Free` after its backward (a
  plan without stash_bytes keeps the whole peak, the conservative old rule). The
  planner checks interleaved meshes with the same rule (`order_peak_bytes` in the
  solvers, tested equal). A backward run before its forward is an error.
  A split backward (`solvers.split_backward`) holds after its B only what its W reads (weight_stash_bytes), until
  the `Free` after W; W adds no working set of its own beyond that. Plus receive buffers
  from arrival until the run (or sync) that consumes them, and during `GradSync` the
  optimizer step's working set (`stages[i].memory["update_bytes"]`, the copies Adam
  makes when it reads or writes other layouts than stored; the largest of a mesh's
  chunks, whose steps run one after another). Devices of one mesh run
  SPMD and share this footprint; a buffer counts at the largest per-device share.

Shared executors (`executors=N`, a model of the *runtime*, not of a GPU cluster): every
mesh's work — each `Run`, each `GradSync`, each `Send` until its tensor has arrived
and each `Recv`'s local all-gathers — first acquires one of N executors shared by all
meshes (a SimPy `Resource`, FIFO). `executors=1` is a runtime where one driver walks
every mesh and blocks on each instruction (`alpasim.backends.run_local`): the
iteration is then the sum of all instruction times, whatever the schedule. Each such
call also pays `dispatch_s` (a jitted call's launch and `block_until_ready`, which the
profiled op times deliberately leave out). Default: no executors, no dispatch — the
meshes run concurrently, as on a GPU cluster.

Ties are deterministic: SimPy orders events by (time, priority, insertion), and the
engine creates them in a fixed order. With `free_communication`, messages arrive the
instant they are sent and gathers cost nothing (the seed's eq. 2 setting).

Ignored: contention between pipeline messages and the gradient all-reduce or the
local all-gathers, compute slowed by communication kernels, PCIe hops to the NIC.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import simpy

from alpasim.costmodels import Cluster, UnknownPresetError, get_cluster
from alpasim.solvers import SYSTEMS, PipelinePlan, PipelineStage, scatter_tail_s, split_backward, stage_phase_s

from ._lanes import LaneEvents, LaneFold, fold_lanes
from ._network import FluidNetwork
from ._program import DIRECTION, LAST_USE, Free, GradSync, Program, Recv, Run, Send, Update
from ._routes import LinkTable, Route, route_transfers
from ._schedules import build_program
from ._timeline import Event, MeshInfo, Timeline


def _mesh_state_bytes(own) -> float:
    """Per device of a mesh, what its stages hold for the whole iteration: each one's
    states, and the largest of their buffers (`params_bytes` is states + buffers; a
    mesh's chunks run one at a time and reuse one gather buffer, as the planner counts)."""
    buffers = [float((st.memory or {}).get("buffer_bytes", 0.0)) for st in own]
    return sum(st.params_bytes - b for st, b in zip(own, buffers, strict=True)) + max(buffers)


def plan_cluster(plan: PipelinePlan) -> Cluster | None:
    """The cluster a plan was made for: its recorded `spec`, else the named preset resized."""
    info = plan.cluster
    if info.spec:
        return Cluster.from_json(info.spec)
    try:
        return get_cluster(info.name, nodes=info.nodes, devices_per_node=info.devices_per_node,
                           inter_node_gbps=info.inter_node_gbps)
    except UnknownPresetError:
        return None


class _Channel:
    """One tensor of one microbatch in flight: when it was sent, when it arrived."""

    __slots__ = ("arrived_at", "landed", "pending", "sent_at", "waiter")

    def __init__(self) -> None:
        self.sent_at: float | None = None
        self.arrived_at: float | None = None
        self.waiter: simpy.Event | None = None     # the receiver's
        self.landed: simpy.Event | None = None     # the sender's, when a shared executor waits for the copy
        self.pending = 0


class _Engine:
    def __init__(self, plan: PipelinePlan, program: Program, routes: list[Route], links: LinkTable | None,
                 free: bool, executors: int | None = None, dispatch_s: float = 0.0, overlap: bool = True,
                 blocking_sends: bool = False, fold: LaneFold | None = None) -> None:
        self.plan, self.program, self.free = plan, program, free
        # A network of K identical lanes runs lane 0 only (`_lanes`); `orbit` still
        # records each link's traffic in every lane.
        self.routes = list(fold.routes) if fold is not None else routes
        self.orbit = fold.orbit if fold is not None else None
        self.blocking_sends = blocking_sends
        self.env = simpy.Environment()
        self.executor = simpy.Resource(self.env, capacity=executors) if executors else None
        self.dispatch_s = dispatch_s
        v, B = program.chunks, program.microbatches
        # Per mesh, per chunk: pass times and bytes. A plan cut into chunks has each
        # chunk's own stage; a plan of one stage per mesh run interleaved has each
        # stage imagined as v equal chunks (`_schedules`).
        self.mesh_stages = [plan.mesh_chunks(k) for k in range(program.num_meshes)]
        self.phase_s: list[list[dict[str, float]]] = []
        self.act_bytes: list[list[float]] = []
        self.stash_bytes: list[list[float]] = []
        self.weight_stash_bytes: list[list[float]] = []
        for mesh in self.mesh_stages:
            own = mesh if plan.chunks > 1 else mesh * v
            scale = 1.0 if plan.chunks > 1 else 1.0 / v
            passes = [split_backward(st, B) for st in own]
            # "scatter": a backward's sharded-gradient scatters (`PipelineStage.grad_scatter_s`).
            self.phase_s.append([{"forward": p.forward_s * scale, "backward": p.backward_s * scale,
                                  "backward_input": p.input_s * scale, "backward_weight": p.weight_s * scale,
                                  "scatter": st.grad_scatter_s * scale} for st, p in zip(own, passes)])
            self.act_bytes.append([st.activation_bytes * scale for st in own])
            self.stash_bytes.append([p.stash_bytes * scale for p in passes])
            self.weight_stash_bytes.append([p.weight_stash_bytes * scale for p in passes])
        self.alpha = [max((c.latency_s for c in r.copies), default=0.0) for r in self.routes]
        capacities = fold.capacities if fold is not None else links.capacities if links is not None else ()
        self.net = FluidNetwork(capacities) if links is not None and not free and links.names else None
        self.link_names = links.names if links is not None else []
        self.channels: dict[tuple[int, int], _Channel] = {}
        self.events = LaneEvents()
        self.lane_tracks: dict[int, tuple[str, ...]] = {}
        # Per mesh: its chunks' states, gradient syncs and optimizer steps (one after another).
        self.params_bytes = [_mesh_state_bytes(own) for own in self.mesh_stages]
        self.sync_s = [sum(st.sync_s for st in own) for own in self.mesh_stages]
        self.update_bytes = [max(float((st.memory or {}).get("update_bytes", 0.0)) for st in own)
                             for own in self.mesh_stages]
        self.memory: list[list[tuple[float, float]]] = [[(0.0, b)] for b in self.params_bytes]
        self.mem = list(self.params_bytes)
        self.held: list[dict[tuple, float]] = [{} for _ in self.mesh_stages]
        self.flows: dict[int, tuple] = {}
        self.next_flow = 0
        self.pc = [0] * program.num_meshes
        self.end: list[float | None] = [None] * program.num_meshes
        self.used_links: set[int] = set()
        self.cross_bytes = self.inter_bytes = 0.0
        # Gradient buckets overlapping the last backward (module doc): on a stream of the
        # mesh's own, so not with shared executors (one driver blocks on each). Per mesh:
        # instruction index -> the stage whose buckets start with that run (a chunk's
        # last backward, when the plan is cut into chunks; else the mesh's last).
        self.stream_ok = overlap and executors is None
        self.bucket_runs: list[dict[int, PipelineStage]] = []
        for k, mesh in enumerate(program.meshes):
            last: dict[int, int] = {}
            for pc, ins in enumerate(mesh):
                if type(ins) is Run and ins.phase in LAST_USE:
                    last[ins.chunk if plan.chunks > 1 else 0] = pc
            own = self.mesh_stages[k]
            runs = {pc: own[c] for c, pc in last.items() if own[c].sync_buckets}
            self.bucket_runs.append(runs if self.stream_ok else {})
        self.stream_done: list[simpy.Event | None] = [None] * program.num_meshes
        # Sharded gradients (ZeRO-2, Llama 3's FSDP): each backward's weight-gradient
        # reduce-scatters go on the same stream when it overlaps, else inline; the
        # planner's estimate of the stream's tail is inside sync_s (`PipelineStage`).
        self.scatter_tail = [sum(scatter_tail_s(st.grad_scatter_s, st.compute_s, B) for st in own)
                             for own in self.mesh_stages]

    # ------------------------------------------------------------ messages
    def _channel(self, key: tuple[int, int]) -> _Channel:
        ch = self.channels.get(key)
        if ch is None:
            ch = self.channels[key] = _Channel()
        return ch

    def _arrive(self, ch: _Channel) -> None:
        ch.arrived_at = self.env.now
        for event in (ch.waiter, ch.landed):
            if event is not None:
                event.succeed()

    def _landing(self, ch: _Channel) -> Iterator[simpy.Event]:
        """Wait until the tensor of `ch` (just sent) has arrived."""
        if ch.arrived_at is None:
            ch.landed = self.env.event()
            yield ch.landed

    def _send(self, ins: Send) -> _Channel:
        ch = self._channel((ins.transfer, ins.microbatch))
        ch.sent_at = self.env.now
        route = self.routes[ins.transfer]
        self.cross_bytes += route.wire_bytes
        self.inter_bytes += route.inter_node_bytes
        if self.free or not route.copies:
            self._arrive(ch)
            return ch
        ch.pending = len(route.copies)
        start = functools.partial(self._start_flows, ch, route, ins)
        alpha = self.alpha[ins.transfer]
        if alpha > 0:
            self.env.timeout(alpha).callbacks.append(start)
        else:
            start(None)
        return ch

    def _start_flows(self, ch: _Channel, route: Route, ins: Send, _event: object) -> None:
        now = self.env.now
        for copy in route.copies:
            fid = self.next_flow
            self.next_flow += 1
            self.flows[fid] = (ch, copy, ins, now)
            self._schedule(self.net.add(fid, copy.links, copy.nbytes, now))

    def _schedule(self, changed: list[tuple[int, float, int]]) -> None:
        now = self.env.now
        for fid, finish, version in changed:
            self.env.timeout(max(finish - now, 0.0)).callbacks.append(
                functools.partial(self._finish_flow, fid, version))

    def _finish_flow(self, fid: int, version: int, _event: object) -> None:
        if not self.net.is_current(fid, version):
            return  # the flow's rate changed after this finish time was handed out
        now = self.env.now
        changed = self.net.remove(fid, now)
        ch, copy, ins, start = self.flows.pop(fid)
        name = self.program.transfers[ins.transfer].tensor
        for link in copy.links:
            event = Event(self.link_names[link], "send", ins.src_stage, ins.microbatch, start, now, copy.nbytes, name)
            self.events.fan_out(event, self._lane_tracks(link))
        ch.pending -= 1
        if ch.pending == 0:
            self._arrive(ch)
        self._schedule(changed)

    def _lane_tracks(self, link: int) -> tuple[str, ...]:
        """The names of `link` in every lane (`_lanes`; itself alone, unfolded), marked used."""
        tracks = self.lane_tracks.get(link)
        if tracks is None:
            lanes = (link,) if self.orbit is None else self.orbit[link]
            self.used_links.update(lanes)
            tracks = self.lane_tracks[link] = tuple(self.link_names[i] for i in lanes)
        return tracks

    # -------------------------------------------------------------- meshes
    def _acquire(self) -> Iterator[simpy.Event]:
        """Wait for a shared executor (module doc); None when the meshes run free."""
        if self.executor is None:
            return None
        req = self.executor.request()
        yield req
        return req

    def _release(self, req) -> None:
        if req is not None:
            self.executor.release(req)

    def _sample(self, k: int, delta: float) -> None:
        self.mem[k] += delta
        self.memory[k].append((self.env.now, self.mem[k]))

    def _grad_stream(self, stage: PipelineStage, scale: float, after: simpy.Event | None,
                     done: simpy.Event) -> Iterator[simpy.Event]:
        """A stage's gradient buckets, started with its last backward: each waits until
        the backward has made it (its offset, scaled to this run's length), then runs
        after the one before it (`costmodels.run_buckets`), on the mesh's one stream
        (after the buckets of the mesh's chunks before, `after`)."""
        env, start = self.env, self.env.now
        if after is not None and not after.processed:
            yield after
        for ready, seconds in stage.sync_buckets:
            at = start + ready * scale
            if at > env.now:
                yield env.timeout(at - env.now)
            yield env.timeout(seconds)
        done.succeed()

    def _scatter_stream(self, seconds: float, after: simpy.Event | None, done: simpy.Event) -> Iterator[simpy.Event]:
        """A backward's gradient scatters on the mesh's stream, after its work before."""
        if after is not None and not after.processed:
            yield after
        yield self.env.timeout(seconds)
        done.succeed()

    def _mesh(self, k: int) -> Iterator[simpy.Event]:
        env, track, held = self.env, f"mesh{k}", self.held[k]
        phase_chunks, act_chunks, stash_chunks = self.phase_s[k], self.act_bytes[k], self.stash_bytes[k]
        kept_chunks = self.weight_stash_bytes[k]    # what a split backward's W still reads after B
        live: dict[tuple[int, int], float] = {}   # (microbatch, chunk) -> its stash now
        transfers = self.program.transfers
        for pc, ins in enumerate(self.program.meshes[k]):
            self.pc[k] = pc
            kind = type(ins)
            if kind is Run:
                c = ins.chunk
                phase_s, act, stash, kept = phase_chunks[c], act_chunks[c], stash_chunks[c], kept_chunks[c]
                transient = act - stash          # on top of the stash while a run is at its peak
                req = yield from self._acquire()
                # A run's working set beyond the stash: the whole activations in F, the
                # transient in a backward or B; W works on what B kept, already counted.
                extra = act if ins.phase == "forward" else 0.0 if ins.phase == "backward_weight" else transient
                self._sample(k, extra)
                start, d = env.now, phase_s[ins.phase] + self.dispatch_s
                scatter = phase_s["scatter"] if ins.phase in ("backward", "backward_weight") else 0.0
                if scatter and not self.stream_ok:
                    d, scatter = d + scatter, 0.0           # inline in the backward
                bucketed = self.bucket_runs[k].get(pc)
                if bucketed is not None:
                    # The buckets' offsets are into the whole backward; a split one makes
                    # its weight gradients in W, so they are spread over W's run.
                    backward = stage_phase_s(bucketed, self.program.microbatches)[1]
                    after, self.stream_done[k] = self.stream_done[k], env.event()
                    env.process(self._grad_stream(bucketed, phase_s[ins.phase] / backward if backward > 0 else 0.0,
                                                  after, self.stream_done[k]))
                if d > 0:
                    yield env.timeout(d)
                if scatter:
                    after, self.stream_done[k] = self.stream_done[k], env.event()
                    env.process(self._scatter_stream(scatter, after, self.stream_done[k]))
                self._release(req)
                done = transient if ins.phase == "forward" else extra    # F leaves its stash behind
                if done:
                    self._sample(k, -done)
                key = (ins.microbatch, ins.chunk)
                if ins.phase != "forward" and key not in live:
                    raise RuntimeError(f"schedule {self.program.schedule!r}: mesh {k} runs {ins.phase} of microbatch "
                                       f"{ins.microbatch}, chunk {ins.chunk} before its forward")
                if ins.phase == "forward":
                    live[key] = stash
                elif ins.phase == "backward_input":       # only the weight gradients' inputs stay
                    self._sample(k, kept - live.get(key, stash))
                    live[key] = kept
                self.events.append(Event(track, "compute", k, ins.microbatch, start, env.now, 0.0, ins.phase,
                                         ins.chunk))
                buf = held.pop((ins.microbatch, DIRECTION[ins.phase], ins.chunk), 0.0)
                if buf:
                    self._sample(k, -buf)
            elif kind is Send:
                if self.executor is not None:   # the sender's driver blocks until the copy has landed
                    req = yield from self._acquire()
                    if self.dispatch_s > 0:
                        yield env.timeout(self.dispatch_s)
                    yield from self._landing(self._send(ins))
                    self._release(req)
                elif self.blocking_sends:       # the system's send holds its stream until the copy lands
                    t0 = env.now
                    yield from self._landing(self._send(ins))
                    if env.now > t0:
                        self.events.append(Event(track, "send", k, ins.microbatch, t0, env.now,
                                                 self.routes[ins.transfer].wire_bytes, transfers[ins.transfer].tensor))
                else:
                    self._send(ins)
            elif kind is Recv:
                ch = self._channel((ins.transfer, ins.microbatch))
                t0 = env.now
                if ch.arrived_at is None:
                    ch.waiter = env.event()
                    yield ch.waiter
                route, t = self.routes[ins.transfer], transfers[ins.transfer]
                wire_start = max(t0, ch.sent_at)
                if env.now > wire_start:
                    self.events.append(Event(track, "recv", k, ins.microbatch, wire_start, env.now,
                                             route.wire_bytes, t.tensor))
                if route.gather_s > 0 and not self.free:
                    req = yield from self._acquire()
                    start = env.now
                    yield env.timeout(route.gather_s)
                    self._release(req)
                    self.events.append(Event(track, "allgather", k, ins.microbatch, start, env.now,
                                             route.buffer_bytes, t.tensor))
                if route.buffer_bytes:
                    key = ("sync",) if t.per_iteration else (ins.microbatch, t.direction, t.dst_chunk)
                    held[key] = held.get(key, 0.0) + route.buffer_bytes
                    self._sample(k, route.buffer_bytes)
            elif kind is Free:
                self._sample(k, -live.pop((ins.microbatch, ins.chunk), stash_chunks[ins.chunk]))
            elif kind is GradSync:
                req = yield from self._acquire()
                start, d = env.now, self.sync_s[k] + self.dispatch_s - self.scatter_tail[k]
                if self.stream_done[k] is not None:
                    yield self.stream_done[k]           # the buckets still running after the backward
                    # The buckets carried the reduction; with the gathers overlapping the
                    # next forward, those moved there and that forward's wait is charged here.
                    d -= sum(st.grad_sync_s + st.param_gather_s - st.gather_exposed_s
                             for st in self.bucket_runs[k].values())
                working = self.update_bytes[k]          # the optimizer step's own copies
                if working:
                    self._sample(k, working)
                if d > 0:
                    yield env.timeout(d)
                if working:
                    self._sample(k, -working)
                self._release(req)
                self.events.append(Event(track, "sync", k, -1, start, env.now))
                buf = held.pop(("sync",), 0.0)
                if buf:
                    self._sample(k, -buf)
            elif kind is not Update:
                raise TypeError(f"mesh {k}: unknown instruction {ins!r}")
        self.end[k] = env.now

    def run(self) -> list[float]:
        for k in range(self.program.num_meshes):
            self.env.process(self._mesh(k))
        self.env.run()
        stuck = [k for k, t in enumerate(self.end) if t is None]
        if stuck:
            k = stuck[0]
            raise RuntimeError(f"schedule {self.program.schedule!r} deadlocked: mesh {k} waits forever at "
                               f"instruction {self.pc[k]}: {self.program.meshes[k][self.pc[k]]!r}")
        return self.end  # type: ignore[return-value]


def _sends_block(plan: PipelinePlan) -> bool:
    """Whether `plan`'s system held a pipeline stage until its sends landed (its
    profile's `p2p`; a plan file recording no such entry: as its named profile says,
    else overlapped)."""
    system = plan.system or {}
    p2p = system.get("settings", {}).get("p2p")
    if p2p is None and system.get("name") in SYSTEMS:
        p2p = SYSTEMS[system["name"]].p2p
    return p2p == "blocking"


def simulate(plan: PipelinePlan, schedule: str | Program | None = None, *, chunks: int = 2,
             cluster: Cluster | None = None, cross_mesh: str = "local_all_gather",
             free_communication: bool = False, executors: int | None = None, dispatch_s: float = 0.0,
             overlap: bool = True, blocking_sends: bool | None = None) -> Timeline:
    """Simulate one training iteration of `plan` under `schedule` and return its `Timeline`.

    `schedule` is a name in `SCHEDULES` ("1f1b", "gpipe", "interleaved" with `chunks`
    model chunks per mesh, "zb-h1", "zb-h2") or a ready `Program`; None: the plan's own
    (`plan.schedule`, 1F1B unless the planner chose another). `cluster` defaults to the one recorded
    in the plan. `cross_mesh` picks the resharding method ("local_all_gather",
    "send_recv", "signal"). `free_communication` makes every message instant.
    `executors` (e.g. 1 for a one-process runtime) and `dispatch_s` model how a runtime
    shares its compute among the meshes (module doc). `overlap=False` runs a plan's
    gradient buckets after the backward as one sync, as a plan made without them does.
    `blocking_sends`: a mesh's stream waits for each pipeline send to land before it
    runs on (the system's point-to-point calls block: DeepSpeed's and Megatron's); None:
    as the plan's system profile ran (its `p2p` entry; overlapped for plans without one).
    """
    if executors is not None and executors < 1:
        raise ValueError(f"executors must be >= 1 (or None for free-running meshes), got {executors!r}")
    if dispatch_s < 0:
        raise ValueError(f"dispatch_s must be >= 0, got {dispatch_s!r}")
    t0 = time.perf_counter()
    if schedule is None:
        schedule = plan.schedule
    program = schedule if isinstance(schedule, Program) else build_program(plan, schedule, chunks=chunks)
    if program.num_meshes != plan.num_meshes:
        raise ValueError(f"program has {program.num_meshes} meshes but the plan {plan.num_meshes}")
    if cluster is None:
        cluster = plan_cluster(plan)
        if cluster is None and not free_communication:
            raise ValueError(f"plan cluster {plan.cluster.name!r} is no preset and the plan records no "
                             "'spec'; pass a cluster or use free communication")
    routes, links = route_transfers(program, plan, cluster, cross_mesh)
    if blocking_sends is None:
        blocking_sends = _sends_block(plan)
    fold = fold_lanes(routes, links.capacities) if links is not None and not free_communication else None
    engine = _Engine(plan, program, routes, links, free_communication, executors, dispatch_s, overlap,
                     blocking_sends, fold)
    ends = engine.run()
    meshes = tuple(MeshInfo(k, tuple(st.devices),
                            tuple(sorted({cluster.node_of(d) for d in st.devices})) if cluster else (),
                            engine.params_bytes[k], tuple(cluster.node_of(d) for d in st.devices) if cluster else ())
                   for k, st in enumerate(plan.meshes))
    used = sorted(engine.used_links)
    notes = ()
    fallback = sum(1 for r, t in zip(routes, program.transfers) if not r.planned and t.nbytes > 0)
    if fallback:
        note = (f"{fallback} of {len(routes)} cross-mesh tensors had no usable sharding specs and were split "
                "evenly over the receivers")
        notes = (note,)
    return Timeline(program.schedule, program.microbatches, program.chunks, cross_mesh, meshes, max(ends),
                    engine.events, engine.memory, tuple((links.names[i], links.nodes[i]) for i in used),
                    engine.cross_bytes, engine.inter_bytes, plan.predicted.iteration_s,
                    free_communication, notes, time.perf_counter() - t0, blocking_sends,
                    fold.lanes if fold is not None else 1)

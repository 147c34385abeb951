"""The local runtime: one process walks the simulator's `Program` over every mesh.

`run_local(plan)` builds the same `Program` `alpasim simulate` runs
(`alpasim.simulator.build_program`), lowers each stage on its devices (`lower_stage`;
an interleaved plan's chunks each as a stage of its own, on its mesh's devices) and
executes the instruction lists: `Run` calls the stage's compiled forward or
backward (under a zero-bubble schedule, its B or W program), `Send` moves tensors
with `jax.device_put` to the receiver's `NamedSharding`, `Recv` hands them to the
receiver, `Free` drops the stash, `GradSync` is empty (JAX reduced each microbatch's
gradients inside its backward; see `_executable`) and `Update` runs the sharded Adam
step.

The meshes are walked round-robin, each as far as its `Recv`s are satisfied, so the
order within every mesh is the program's and a receive never runs before its send.
Every instruction is timed around `block_until_ready` into a `Timeline`, the type the
simulator produces, so traces and Gantt charts work on measured runs too. One process
runs one instruction at a time: the measured timeline is serial, and the step time is
the sum of all meshes' work plus transfers (on a CPU the virtual devices share the
cores anyway).

What the program's transfers carry: each names a training-graph tensor — a forward
activation, or a cotangent the receiver's backward ops read (`_stage_ops`) — and carries
it per microbatch. A tied parameter's gradient contribution (GPT's LM head to the word
embedding; the `per_iteration` transfer) carries the sender's accumulated copy
gradient instead, which the owner adds into its own accumulator. At its `GradSync` the
owner sends the summed accumulator back to each copy (the second half of Megatron-LM's
all-reduce of the two copies' gradients; the plan lists only the first), and the copy
waits for it at its own `GradSync`. Both then run the same Adam step, so the copies
stay equal without a refresh.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from alpasim.graphs import get_recipe
from alpasim.simulator import Event, GradSync, MeshInfo, Program, Recv, Run, Send, Timeline, Update, build_program
from alpasim.solvers import PipelinePlan, planning_graph

from ._executable import StageExecutable, lower_stage, stage_inputs
from ._stage_profile import StageTimes, profile_stages
from ._stages import StagePart, microbatch_inputs

Payload = list[tuple[str, str]]  # (kind "act" | "ct" | "tied", training-graph tensor name)


@dataclass(frozen=True)
class RunResult:
    """Losses per step, step 1's accumulated gradients, measured times, the last step's timeline."""

    losses: list[float]
    grads: dict[str, np.ndarray]            # graph parameter name -> full-batch (mean) gradient of step 1
    step_times_s: list[float]
    timeline: Timeline
    stages: list                            # StageExecutable (local) or RemoteStage (ray)
    program: Program
    restarts: list[dict] = field(default_factory=list)  # ray: {"step", "mesh", "restart_s"} per restarted actor
    stage_profile: list[StageTimes] = field(default_factory=list)  # each stage timed alone, before step 1
    actor_platform: str | None = None       # ray: "gpu" or "cpu", what the mesh actors ran on

    @property
    def measured_step_s(self) -> float:
        """Median step time; the first step is left out when there are more (warm-up)."""
        times = self.step_times_s[1:] or self.step_times_s
        return statistics.median(times)


def run_local(plan: PipelinePlan, *, steps: int = 1, seed: int = 0, schedule: str | None = None,
              devices: Sequence[jax.Device] | None = None, profile_iters: int = 0,
              fence: str | None = "op") -> RunResult:
    """Train `steps` iterations of `plan` on this process's devices (plan device ids
    index `devices`, default `jax.devices()`). With `profile_iters`, each compiled stage
    is first timed alone (`profile_stage`, Alpa's stage profiling) into `stage_profile`.
    `fence` holds each backward to the plan's op order (`lower_stage`)."""
    devices = list(devices if devices is not None else jax.devices())
    need = 1 + max(d for st in plan.stages for d in st.devices)
    if len(devices) < need:
        raise ValueError(f"plan uses device ids up to {need - 1}; only {len(devices)} devices are visible "
                         f"(set XLA_FLAGS=--xla_force_host_platform_device_count={need} on the CPU)")
    graph = planning_graph(plan.model)
    program = runnable_program(plan, schedule)
    shared = stage_inputs(plan, graph, seed)
    # The stages whose backward runs as B and W (zero bubble): their whole backward is
    # not compiled ahead (`StagePrograms`).
    split = {program.stage_of(k, i.chunk) for k, mesh in enumerate(program.meshes) for i in mesh
             if type(i) is Run and i.phase == "backward_input"}
    stages = [lower_stage(plan, graph, k, [devices[d] for d in st.devices], seed=seed, shared=shared,
                          split_backward=k in split, fence=fence) for k, st in enumerate(plan.stages)]
    payloads = _payloads(program, shared.train.meta.get("tied_grads", ()), [s.ops for s in stages])
    profile = profile_stages(stages, graph, iters=profile_iters, seed=seed) if profile_iters else []
    losses, times, grads = [], [], {}
    timeline = None
    for step in range(steps):
        walker = _Walker(program, stages, payloads, graph, seed, step)
        t0 = time.perf_counter()
        walker.run()
        times.append(time.perf_counter() - t0)
        losses.append(float(sum(np.asarray(v) for v in walker.losses) / plan.microbatches))
        if step == 0:
            grads = walker.grads
        timeline = walker.timeline(plan, times[-1])
    return RunResult(losses, grads, times, timeline, stages, program, stage_profile=profile)


def runnable_program(plan: PipelinePlan, schedule: str | None = None, program: Program | None = None) -> Program:
    """The program a runtime executes: `program`, else the plan's under `schedule`.

    An interleaved program runs when the plan is cut into those chunks (`plan.chunks`:
    each chunk is a stage of its own, lowered on its mesh's devices). The simulator can
    also imagine a one-stage-per-mesh plan's stages as v chunks of 1/v each, but then
    there is nothing to lower per chunk: such programs are refused. A backward split
    into input and weight gradients (zero bubble) runs as two programs per stage
    (`StageExecutable.backward_input` / `backward_weight`).
    """
    config = (plan.model.source or {}).get("config") or {}
    cp = max((plan.search.megatron or {}).get("cp", 1), config.get("context_parallel", 1))
    if cp > 1:   # the view's attention is each chunk's alone; the KV all-gather is priced, not lowered
        raise ValueError(f"a context-parallel plan (cp {cp}) does not run on the backend yet: its KV "
                         f"all-gather is priced, not lowered")
    recipe = get_recipe(plan.model.precision)
    if recipe.keeps_low_precision_grads:    # its kept gradients and pass are priced, not lowered
        raise ValueError(f"precision {recipe.name} (DeepSpeed's BF16_Optimizer: 16-bit gradients kept and added "
                         f"into the fp32 accumulator after each backward) does not run on the backend: plan with "
                         f"--precision mixed-fp32grad to run the plan")
    program = program or build_program(plan, schedule or plan.schedule)
    if program.chunks != plan.chunks:
        raise ValueError(f"the {program.schedule!r} program runs {program.chunks} model chunks per mesh; the plan "
                         f"is cut into {plan.chunks} per mesh (plan with `--schedule interleaved` to cut it so)")
    return program


def _payloads(program: Program, tied: Sequence[str], ops: Sequence | None = None) -> dict[int, Payload]:
    """What each program transfer carries (module doc). `ops` (each stage's `StageOps`,
    where at hand) checks that every tensor a stage's programs read arrives."""
    tied = set(tied)
    out: dict[int, Payload] = {}
    for i, t in enumerate(program.transfers):
        if t.tensor == "<control>":
            continue
        if t.tensor in tied:
            out[i] = [("tied", t.tensor)]
        elif t.per_iteration:
            raise ValueError(f"transfer {t.tensor!r} (mesh {t.src_stage} -> {t.dst_stage}) moves once per "
                             f"iteration, but it is not a tied gradient: the backward reads it per microbatch")
        else:
            out[i] = [("act" if t.direction == "forward" else "ct", t.tensor)]
    for j, o in enumerate(ops or ()):
        arriving = {t.tensor for i, t in enumerate(program.transfers)
                    if program.stage_of(t.dst_stage, t.dst_chunk) == j and i in out}
        missing = [t for t in (*o.acts_in, *o.cts_in) if t not in arriving]
        if missing:
            raise ValueError(f"the program brings stage {j} (mesh {j % program.num_meshes}) no transfer of "
                             f"{missing}, which it reads")
    return out


def tied_copies(owners: Mapping[str, int], readers: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Parameter -> the meshes other than its owner that keep a copy of it."""
    return {p: tuple(k for k in readers.get(p, ()) if k != owners[p]) for p in owners
            if any(k != owners[p] for k in readers.get(p, ()))}


def measured_timeline(plan: PipelinePlan, program: Program, events: list[Event], params_bytes: list[float],
                      sent_bytes: float, step_s: float, note: str) -> Timeline:
    """A measured step as the simulator's `Timeline` (per-device parameter bytes as the
    only memory sample: the runtimes do not track activations). `params_bytes` is per
    plan stage; a mesh holds its chunks' together."""
    S = plan.num_meshes
    params_bytes = [sum(params_bytes[k::S]) for k in range(S)]
    meshes = tuple(MeshInfo(k, tuple(st.devices), (0,), params_bytes[k], (0,) * len(st.devices))
                   for k, st in enumerate(plan.meshes))
    memory = [[(0.0, b)] for b in params_bytes]
    links = tuple(sorted({(e.track, 0) for e in events if e.kind == "send"}))
    return Timeline(program.schedule, program.microbatches, program.chunks, "device_put", meshes, step_s, events,
                    memory, links, sent_bytes, 0.0, plan.predicted.iteration_s, notes=(note,), wall_s=step_s)


def params_bytes_per_device(stage: StageExecutable) -> float:
    """Parameter bytes one device of the stage's mesh holds (its shard of each)."""
    return float(sum(v.addressable_shards[0].data.nbytes for v in stage.params.values()))


class _Walker:
    """One iteration of the program over all meshes, with per-instruction timing.

    The Ray worker subclasses it for one mesh: it replaces how payloads leave
    (`send`) and arrive (`take`) and the clock, and keeps the rest.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self, program: Program, stages: Mapping[int, StageExecutable], payloads: dict[int, Payload],
                 graph, seed: int, step: int, t0: float | None = None) -> None:
        """`stages` maps plan stage j (chunk j // S of mesh j mod S under interleaving;
        else mesh j) to its executable: every stage here, one mesh's in a Ray actor."""
        self.program, self.stages, self.payloads = program, stages, payloads
        self.graph, self.seed, self.step = graph, seed, step
        self.meshes = program.num_meshes
        self.mailbox: dict[tuple[int, int], list] = {}
        self.acts: dict[tuple[int, int], dict] = defaultdict(dict)     # (stage, microbatch) -> received activations
        self.cts: dict[tuple[int, int], dict] = defaultdict(dict)      # (stage, microbatch) -> received cotangents
        self.outs: dict[tuple[int, int], dict] = {}                    # (stage, microbatch) -> forward outputs
        self.back: dict[tuple[int, int], dict] = {}                    # (stage, microbatch) -> cotangents to send
        by_mesh = list(stages.items() if isinstance(stages, Mapping) else enumerate(stages))
        self.owners = {p: k for k, st in by_mesh for p in st.ops.owned}   # parameter -> the stage that updates it
        readers = defaultdict(list)
        for k, st in by_mesh:
            for p in st.ops.params:
                readers[p].append(k)
        self.copies = tied_copies(self.owners, readers)
        self.tied_box: dict[tuple[int, str], jax.Array] = {}            # (copy mesh, parameter) -> summed gradient
        self.losses: list = []
        self.grads: dict[str, np.ndarray] = {}
        self.events: list[Event] = []
        self.sent_bytes = 0.0
        self.t0 = self.clock() if t0 is None else t0

    def chunks_of(self, mesh: int) -> list[int]:
        """The plan stages mesh k runs."""
        return [self.program.stage_of(mesh, c) for c in range(self.program.chunks)]

    def run(self) -> None:
        pc = [0] * self.program.num_meshes
        while any(pc[k] < len(m) for k, m in enumerate(self.program.meshes)):
            moved = False
            for k, mesh in enumerate(self.program.meshes):
                while pc[k] < len(mesh):
                    ins = mesh[pc[k]]
                    if isinstance(ins, Recv) and (ins.transfer, ins.microbatch) not in self.mailbox:
                        break
                    if isinstance(ins, GradSync) and any((j, p) not in self.tied_box for j in self.chunks_of(k)
                                                         for p in self.copied(j)
                                                         if self.owners[p] % self.meshes != k):
                        break   # a copy waits for an owner on another mesh (one on this mesh sends in this sync)
                    self.execute(k, ins)
                    pc[k] += 1
                    moved = True
            if not moved:
                meshes = self.program.meshes
                stuck = {k: meshes[k][pc[k]] for k in range(len(pc)) if pc[k] < len(meshes[k])}
                raise RuntimeError(f"program deadlocked: every mesh waits on a receive: {stuck}")

    def execute(self, k: int, ins) -> None:
        start = self.clock()
        if isinstance(ins, Run):
            m, j = ins.microbatch, self.program.stage_of(k, ins.chunk)
            stage = self.stages[j]
            if ins.phase == "forward":
                data = microbatch_inputs(self.graph, self.seed, self.step, m)
                outs = stage.forward(m, self.acts.pop((j, m), {}), data)
                jax.block_until_ready(outs)
                self.outs[j, m] = outs
                if stage.part.loss is not None:
                    self.losses.append(outs[stage.part.loss])
            elif ins.phase == "backward_weight":
                stage.backward_weight(m)
                jax.block_until_ready(stage.acc)
            else:
                run = stage.backward_input if ins.phase == "backward_input" else stage.backward
                self.back[j, m] = run(m, self.cts.pop((j, m), {}))
                jax.block_until_ready((self.back[j, m], stage.acc))  # a first stage returns no cotangents
                self.outs.pop((j, m), None)  # its sends came right after the forward (the stash is consumed)
            self.record(f"mesh{k}", "compute", k, ins.microbatch, start, name=ins.phase, chunk=ins.chunk)
        elif isinstance(ins, Send):
            self.send(k, ins, start)
        elif isinstance(ins, Recv):
            self.receive(k, ins)
            self.record(f"mesh{k}", "recv", k, ins.microbatch, start, name=self.program.transfers[ins.transfer].tensor)
        elif isinstance(ins, GradSync):
            for j in self.chunks_of(k):     # every owner here sends first: a copy may sit on this mesh too
                self.send_tied_grads(j)
            for j in self.chunks_of(k):
                self.take_tied_grads(j)
            self.record(f"mesh{k}", "sync", k, -1, start, name="grad_sync")
        elif isinstance(ins, Update):
            for j in self.chunks_of(k):
                stage = self.stages[j]
                if self.step == 0:
                    self.grads.update({p: stage.host_grad(p) for p in stage.part.owned})
                stage.update()
                jax.block_until_ready((stage.params, stage.states))
            self.record(f"mesh{k}", "sync", k, -1, start, name="update")
        else:  # Free: the stash, and the cotangents already sent
            j = self.program.stage_of(k, ins.chunk)
            self.stages[j].free(ins.microbatch)
            self.back.pop((j, ins.microbatch), None)

    def copied(self, j: int) -> list[str]:
        """The tied parameters stage j keeps a copy of (owned by another stage)."""
        return [p for p, js in self.copies.items() if j in js]

    def send_tied_grads(self, j: int) -> None:
        """The second half of the tied copies' all-reduce (module doc): the owner (stage
        j) sends its summed accumulator to every copy (`take_tied_grads` takes it)."""
        stage, k = self.stages[j], j % self.meshes
        for p in stage.ops.owned:
            for dst in self.copies.get(p, ()):
                start = self.clock()
                value = stage.grad(p)
                self.send_tied(j, dst, p, value)
                self.sent_bytes += value.nbytes
                self.record(f"mesh{k}->mesh{dst % self.meshes}", "send", k, -1, start, float(value.nbytes),
                            f"{p}:grad (tied)")

    def take_tied_grads(self, j: int) -> None:
        """A copy (stage j) takes its owner's summed gradient as its own."""
        for p in self.copied(j):
            self.stages[j].set_grad(p, self.take_tied(j, p))

    def send_tied(self, j: int, dst: int, param: str, value: jax.Array) -> None:
        dst_stage = self.stages[dst]
        self.tied_box[dst, param] = jax.device_put(value, dst_stage.shardings[f"{param}:grad"])

    def take_tied(self, j: int, param: str) -> jax.Array:
        return self.tied_box.pop((j, param))

    def outgoing(self, k: int, ins: Send) -> list[tuple[str, str, jax.Array]]:
        """(kind, name, value) of everything transfer `ins` carries out of mesh k."""
        m = ins.microbatch
        j = self.program.stage_of(k, self.program.transfers[ins.transfer].src_chunk)
        out = []
        for kind, name in self.payloads.get(ins.transfer, ()):
            if kind == "act":
                out.append((kind, name, self.outs[j, m][name]))
            elif kind == "ct":
                out.append((kind, name, self.back[j, m][name]))
            else:  # a tied copy's accumulated gradient, by parameter
                ops = self.stages[j].ops
                (p,) = [p for p, g in ops.grads.items() if g == name]
                out.append(("grad", p, self.stages[j].grad(p)))
        return out

    def receiver(self, ins: Send | Recv) -> int:
        """The plan stage a transfer's payload is for."""
        t = self.program.transfers[ins.transfer]
        return self.program.stage_of(t.dst_stage, t.dst_chunk)

    def send(self, k: int, ins: Send, start: float) -> None:
        dst = self.stages[self.receiver(ins)]
        m = ins.microbatch
        moved, nbytes = [], 0.0
        for kind, name, value in self.outgoing(k, ins):
            target = dst.shardings[f"{name}:grad" if kind == "grad" else name]
            moved.append((kind, name, jax.device_put(value, target)))
            nbytes += value.nbytes
        jax.block_until_ready([v for _, _, v in moved])
        self.mailbox[ins.transfer, m] = moved
        self.sent_bytes += nbytes
        self.record(f"mesh{k}->mesh{ins.dst_stage}", "send", k, m, start, nbytes,
                    self.program.transfers[ins.transfer].tensor)

    def take(self, k: int, ins: Recv) -> list[tuple[str, str, jax.Array]]:
        """The payload of `ins`, already in its receiver's layouts (`run` only calls it once sent)."""
        return self.mailbox.pop((ins.transfer, ins.microbatch))

    def receive(self, k: int, ins: Recv) -> None:
        m, j = ins.microbatch, self.receiver(ins)
        for kind, name, value in self.take(k, ins):
            if kind == "act":
                self.acts[j, m][name] = value
            elif kind == "ct":
                have = self.cts[j, m].get(name)
                self.cts[j, m][name] = value if have is None else have + value
            else:
                self.stages[j].add_grad(name, value)

    def record(self, track: str, kind: str, stage: int, microbatch: int, start: float, nbytes: float = 0.0,
               name: str = "", chunk: int = 0) -> None:
        self.events.append(Event(track, kind, stage, microbatch, start - self.t0, self.clock() - self.t0,
                                 nbytes, name, chunk))

    def timeline(self, plan: PipelinePlan, step_s: float) -> Timeline:
        return measured_timeline(plan, self.program, self.events, [params_bytes_per_device(s) for s in self.stages],
                                 self.sent_bytes, step_s, "measured: local runtime, serial walk")

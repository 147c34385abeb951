"""The Ray runtime: one actor per mesh, each its own JAX process, running its instruction list.

`run_ray(plan)` builds the same `Program` as `run_local` and starts one `MeshWorker`
actor per mesh (`_ray_worker`); each lowers its own stage (under interleaving, each
of its mesh's chunks) on its own devices (on virtual CPU devices, the plan's device ids,
so the stage's programs are `run_local`'s: `_ray_worker.stage_devices`). The driver sends every actor its instruction list once, before the first step
(Alpa's MPMD design: after that the meshes follow their lists without coordination),
together with the peers' handles; per step it only calls `step` on all actors at once
and collects losses, step 1's gradients and per-instruction times. Boundary tensors go
from actor to actor through Ray, never through the driver.

Times: each actor stamps its instructions with `time.time()` minus the driver's step
start, so the merged `Timeline` has one time axis. That assumes one clock: true on one
host, approximate (NTP skew) on a cluster.

Timeouts: `timeout_s` bounds every wait of a step: each `Recv` in an actor, the
acceptance of its sends and, with `PING_TIMEOUT_S` of grace so that an actor's own
timeout reports first, the driver's wait for a whole step (which catches a mesh stuck
outside any wait). The driver's other calls, an actor's local work (loading its
program, profiling, taking its peers' handles, checkpoints, a roll-back), are bounded
by `timeout_s` or `CALL_TIMEOUT_S`, whichever is longer: a short `timeout_s`, set to
catch a missing tensor quickly, must not fail a run whose checkpoint of large states,
or a load on a busy machine, takes longer. Starting an actor has its own bound
(`STARTUP_TIMEOUT_S`), since it includes importing JAX and compiling the stage. A
timeout raises one `RayRuntimeError` naming the mesh, the instruction and the tensor;
nothing hangs.

CPU actors outlive a run: a run that completes hands them, their stages dropped, to an
idle pool of this driver's Ray session, and the next run takes the ones whose Ray
options fit its meshes (`assign` lowers the new stages in the warm process) and stops
the rest, so the idle pool never holds more actors than one run had (GPU actors are always
stopped: JAX holds most of a GPU's memory while its process lives). Alpa does the same: a
`PhysicalDeviceMesh`'s workers start once, at `alpa.init`, and run every executable
compiled for it. Starting an actor costs a process, importing JAX and alpasim (about
3 s of CPU each on the 2-core machine); a warm one only lowers its stage. A run that
started Ray itself stops it at the end, actors and all; a run that fails kills its
actors, whose state it no longer knows.

Fault tolerance (policy): after every completed step the driver fetches each stage's
`state_dict()` (parameters, gradient accumulators, Adam states) — a checkpoint per
step, cheap for the small models run here; a large model would checkpoint every few
steps, to storage. When a step fails and an actor turns out dead, that actor is
re-created, reloaded with its program and its checkpoint, every other actor rolls back
to the same checkpoint, and the step is redone (`RESTARTS_PER_STEP` times at most).
The data of a step is a pure function of (seed, step, microbatch), so the redone step
computes exactly what the failed one would have. A failure with every actor alive (a
timeout, an exception in a stage) is not retried: it is a bug, reported as is.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from alpasim.simulator import Program
from alpasim.solvers import PipelinePlan, planning_graph

from ._ray_pool import resolve_address
from ._ray_worker import MeshWorker, StepAborted
from ._runtime import RunResult, _payloads, measured_timeline, runnable_program
from ._executable import stage_inputs
from ._stages import partition

# Importing JAX and lowering a stage (a plan from before `layer_specs` re-solves its
# intra-op plan, at most `_stages.RESOLVE_TIME_LIMIT_S`) and compiling three programs.
STARTUP_TIMEOUT_S = 600.0
# The driver's calls that wait on one actor's own work, never on another mesh.
CALL_TIMEOUT_S = 120.0
RESTARTS_PER_STEP = 2
# Liveness pings, `where` queries and aborts: answered by an idle actor thread at once.
PING_TIMEOUT_S = 10.0
# Threads per actor: the step, deliveries arriving meanwhile, and the driver's abort or query.
MAX_CONCURRENCY = 4


class RayRuntimeError(RuntimeError):
    """A Ray run failed: a mesh timed out or raised, or died and could not be restarted."""


def run_ray(plan: PipelinePlan, *, steps: int = 1, seed: int = 0, address: str | None = None,
            timeout_s: float = 120.0, schedule: str | None = None,
            on_step: Callable[[int, list], None] | None = None, program: Program | None = None,
            profile_iters: int = 0, platform: str = "auto") -> RunResult:
    """Train `steps` iterations of `plan` with one Ray actor per mesh.

    `address=None` uses the Ray cluster this process is connected to, or starts a local
    one (and stops it at the end); an address connects there (alpasim must be
    installed on its nodes). `on_step(step, actors)` runs after each completed step
    (tests kill an actor there). `program` runs a given program instead of the plan's.
    With `profile_iters`, each actor first times its stage alone (`profile_stage`), one
    actor after another, into `stage_profile`.
    """
    import ray

    program = runnable_program(plan, schedule, program)
    address = resolve_address(address)
    started = not ray.is_initialized()
    if started:
        local = {} if address else {"include_dashboard": False}
        ray.init(address=address, log_to_driver=False, **local)
    graph = planning_graph(plan.model)
    meshes, finished = None, False
    try:
        platform = actor_platform(ray, plan, platform)
        meshes = _Meshes(ray, plan, program, partition(graph, plan),
                         stage_inputs(plan, graph, seed).train.meta.get("tied_grads", []), seed, timeout_s,
                         platform)
        profile = meshes.profile(profile_iters) if profile_iters else []
        losses, times, grads, timeline = [], [], {}, None
        for step in range(steps):
            outs, step_s = meshes.run_step(step)
            times.append(step_s)
            losses.append(float(sum(v for o in outs for v in o["losses"]) / plan.microbatches))
            if step == 0:
                grads = {p: g for o in outs for p, g in o["grads"].items()}
            events = sorted((e for o in outs for e in o["events"]), key=lambda e: (e.start_s, e.track))
            timeline = measured_timeline(plan, program, events, [s.params_bytes for s in meshes.stages],
                                         sum(o["sent_bytes"] for o in outs), step_s,
                                         "measured: ray runtime, one actor per mesh")
            if on_step is not None:
                on_step(step, list(meshes.actors))
        result = RunResult(losses, grads, times, timeline, list(meshes.stages), program, meshes.restarts, profile,
                           platform)
        finished = True
        return result
    finally:
        if meshes is not None:
            meshes.close(keep=finished and not started)
        if started:
            ray.shutdown()


PLATFORMS = ("auto", "gpu", "cpu")


def actor_platform(ray, plan: PipelinePlan, platform: str) -> str:
    """"gpu" or "cpu" for the mesh actors. The plan's devices are accelerators (every
    cluster preset is a GPU machine), so "auto" asks Ray for GPUs wherever the Ray
    cluster has any and runs on virtual CPU devices only where it has none (a laptop,
    CI); "gpu" insists and fails at once, naming the shortfall, where one mesh needs
    more GPUs than the Ray cluster holds; "cpu" is what the caller asked for."""
    if platform not in PLATFORMS:
        raise RayRuntimeError(f"platform {platform!r}: choose one of {', '.join(PLATFORMS)}")
    if platform == "cpu":
        return "cpu"
    gpus = int(ray.cluster_resources().get("GPU", 0))
    need = max(len(st.devices) for st in plan.stages)
    if platform == "auto":
        return "gpu" if gpus else "cpu"
    if gpus < need:
        raise RayRuntimeError(f"a mesh of the plan needs {need} GPUs; the Ray cluster has {gpus}")
    return "gpu"


def _actor_options(devices: int, platform: str = "cpu") -> dict[str, Any]:
    """Ray options of one mesh's actor: a process of its own that sees `devices` devices.

    On "gpu" the actor asks Ray for `devices` GPUs, its mesh's (Ray sets
    CUDA_VISIBLE_DEVICES to them, so JAX's devices in the actor are exactly its mesh),
    and one CPU. On "cpu" the devices are virtual CPU devices, ids 0 to the plan's
    largest (`_Meshes.fit`), of which the actor's stages take the plan's own device ids
    (`_ray_worker.stage_devices`); it reserves no CPU (the meshes share the host's
    cores, as in the local runtime) and sets XLA's device count in its environment. The
    driver's own XLA flags reach every actor (`_xla_flags`).
    """
    if platform == "gpu":
        env = {"JAX_PLATFORMS": "cuda", **_xla_flags(None)}
        return {"num_cpus": 1, "num_gpus": devices, "max_concurrency": MAX_CONCURRENCY,
                "runtime_env": {"env_vars": env}}
    env = {**_xla_flags(devices), "JAX_PLATFORMS": "cpu"}
    return {"num_cpus": 0, "max_concurrency": MAX_CONCURRENCY, "runtime_env": {"env_vars": env}}


def _xla_flags(cpu_devices: int | None) -> dict[str, str]:
    """`XLA_FLAGS` for an actor: the driver's flags, so a flag its user set (a dump
    directory, an optimisation level) holds on every mesh, with the virtual device count
    replaced by the actor's (`cpu_devices`, the plan's: `_Meshes.fit`; None on GPUs: no
    count). Empty when there is nothing to set."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    if cpu_devices is not None:
        kept.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    return {"XLA_FLAGS": " ".join(kept)} if kept else {}


class _IdleActors:
    """The actors of this driver's last finished run, for the next one (module doc),
    held for the Ray session they belong to: after `ray.shutdown()` they are gone, and a
    new session finds none."""

    def __init__(self) -> None:
        self.session: tuple[str, str] | None = None
        self.actors: list[tuple[dict, Any]] = []

    @staticmethod
    def _session(ray) -> tuple[str, str]:
        context = ray.get_runtime_context()
        return context.get_job_id(), context.get_node_id()

    def take(self, ray) -> list[tuple[dict, Any]]:
        """Every idle actor of the current session, as (what it fits: `_Meshes.fit`, handle)."""
        actors, self.actors = self.actors, []
        return actors if self.session == self._session(ray) else []

    def give(self, ray, actors: list[tuple[dict, Any]]) -> None:
        session = self._session(ray)
        if self.session != session:
            self.session, self.actors = session, []
        self.actors += actors

    def __len__(self) -> int:
        return len(self.actors)


_IDLE = _IdleActors()
# Attempt numbers, increasing across runs: a late delivery or abort from an attempt of an
# earlier run that an actor served can never match an attempt of this one.
_EPOCHS = itertools.count()


def idle_actors() -> int:
    """How many mesh actors wait for this driver's next `run_ray`."""
    return len(_IDLE)


def stop_idle_actors() -> None:
    """Stop the mesh actors kept for the next `run_ray` (their processes and devices)."""
    import ray

    if not ray.is_initialized():        # gone with their session
        _IDLE.actors = []
        return
    for _, actor in _IDLE.take(ray):
        ray.kill(actor)


def _cause(error: Exception) -> str:
    """The message of what went wrong inside an actor, without Ray's wrapping."""
    cause = getattr(error, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


class _Meshes:
    """The actors of one run, their last checkpoint, and how to replace one."""

    def __init__(self, ray, plan: PipelinePlan, program: Program, parts: list, tied: list[str], seed: int,
                 timeout_s: float, platform: str = "cpu") -> None:
        self.ray, self.plan, self.program, self.seed, self.timeout_s = ray, plan, program, seed, timeout_s
        self.call_timeout_s = max(timeout_s, CALL_TIMEOUT_S)
        self.platform = platform
        self.payloads = _payloads(program, tied)
        self.owners = {p: part.index for part in parts for p in part.owned}
        self.readers = {p: tuple(part.index for part in parts if p in part.params) for p in self.owners}
        self.worker_cls = ray.remote(MeshWorker)
        self.epoch = -1                             # this run's attempts draw theirs from _EPOCHS
        self.restarts: list[dict] = []
        self.starting: dict[int, Any] = {}          # mesh -> the call that answers once its actor is ready
        idle = _IDLE.take(ray)
        self.actors: list = []
        try:
            for k in range(program.num_meshes):
                self.actors.append(self.spawn(k, idle))
        finally:
            for _, actor in idle:       # the idle actors this run does not fit, before any waits for devices
                ray.kill(actor)
        try:
            self.stages = [None] * len(plan.stages)     # per plan stage (chunks of a mesh come from its actor)
            self.load(range(program.num_meshes))
            self.set_peers()
            self.checkpoint = self.fetch_state()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- actors
    def fit(self, k: int) -> dict[str, Any]:
        """What an actor must have to serve mesh `k`: its Ray options (platform, device
        count, the XLA flags in its environment). On GPUs the count is the mesh's; on
        virtual CPU devices it is the plan's, the same for every mesh, so any idle actor
        of a plan with as many devices serves any of this plan's meshes."""
        if self.platform == "gpu":
            return _actor_options(len(self.plan.stages[k].devices), "gpu")
        return _actor_options(1 + max(d for st in self.plan.stages for d in st.devices), "cpu")

    def spawn(self, k: int, idle: list | None = None):
        """Mesh `k`'s actor: an idle one that fits and still answers (taken out of `idle`;
        one that died while idle is stopped), else a new one."""
        fit = self.fit(k)
        for entry in [e for e in idle or [] if e[0] == fit]:
            idle.remove(entry)
            actor = entry[1]
            if self.answers(actor.ready.remote()):
                self.starting[k] = actor.assign.remote(self.plan, k, self.seed)
                return actor
            self.ray.kill(actor)
        actor = self.worker_cls.options(**fit).remote(self.plan, k, self.seed)
        self.starting[k] = actor.ready.remote()
        return actor

    def answers(self, ref) -> bool:
        """Whether an actor's call `ref` returns within `PING_TIMEOUT_S`."""
        try:
            self.ray.get(ref, timeout=PING_TIMEOUT_S)
        except self.ray.exceptions.RayError:
            return False
        return True

    def load(self, ks) -> None:
        """Wait for the actors `ks` to start, then send each its part of the program."""
        self.get({k: self.starting.pop(k) for k in ks}, STARTUP_TIMEOUT_S, "start (import JAX, lower its stage)")
        calls = {k: self.actors[k].load_program.remote(self.program, self.payloads, self.owners, self.readers,
                                                       self.timeout_s) for k in ks}
        for summaries in self.get(calls, self.call_timeout_s, "load its program").values():
            for summary in summaries:
                self.stages[summary.index] = summary

    def profile(self, iters: int) -> list:
        """Each plan stage timed alone, one actor at a time so they do not share the cores."""
        by_stage = {}
        for k, a in enumerate(self.actors):
            by_stage.update(self.get({k: a.profile.remote(iters)}, self.call_timeout_s, "profile its stage")[k])
        return [by_stage[j] for j in range(len(self.stages))]

    def set_peers(self) -> None:
        self.get({k: a.set_peers.remote(self.actors) for k, a in enumerate(self.actors)}, self.call_timeout_s,
                 "take its peers' handles")

    def fetch_state(self) -> list[dict]:
        states = self.get({k: a.state_dict.remote() for k, a in enumerate(self.actors)}, self.call_timeout_s,
                          "return its checkpoint")
        return [states[k] for k in range(len(self.actors))]

    def close(self, keep: bool = False) -> None:
        """Stop the actors, or with `keep` (the run finished) hand the CPU ones to the idle
        pool once they have dropped their stages; one that does not answer (a caller's
        `on_step` killed it) is stopped. GPU actors are always stopped: JAX holds most of
        a GPU's memory for as long as its process lives."""
        keep = keep and self.platform == "cpu"
        releases = [a.release.remote() for a in self.actors] if keep else []
        kept = []
        for k, a in enumerate(self.actors):
            if keep and self.answers(releases[k]):
                kept.append((self.fit(k), a))
            else:
                self.ray.kill(a)
        _IDLE.give(self.ray, kept)

    # --------------------------------------------------------------- steps
    def run_step(self, step: int) -> tuple[list[dict], float]:
        """Run one step on every actor, checkpoint, and return (per-mesh outputs, step
        seconds); a dead actor is restarted and the step redone (module doc)."""
        for attempt in range(RESTARTS_PER_STEP + 1):
            self.epoch = next(_EPOCHS)
            t0 = time.time()
            refs = [a.step.remote(step, self.epoch, t0) for a in self.actors]
            try:
                outs = self.gather(step, refs)
                step_s = time.time() - t0
                self.checkpoint = self.fetch_state()
                return outs, step_s
            except RayRuntimeError as failure:
                dead = self.dead()
                if not dead:
                    raise
                if attempt == RESTARTS_PER_STEP:
                    raise RayRuntimeError(f"step {step}: meshes {dead} died {attempt + 1} times; giving up "
                                          f"({failure})") from failure
                start = time.perf_counter()
                for k in dead:
                    self.restart(k, step)
                self.set_peers()
                self.get({k: a.load_state_dict.remote(self.checkpoint[k]) for k, a in enumerate(self.actors)},
                         self.call_timeout_s, "roll back to the last checkpoint")
                restart_s = time.perf_counter() - start
                self.restarts += [{"step": step, "mesh": k, "restart_s": restart_s} for k in dead]
        raise AssertionError("unreachable")

    def gather(self, step: int, refs: list) -> list[dict]:
        """Every actor's reply to `step`; on the first failure the others are aborted
        (so they stop waiting on it) and the root cause is raised."""
        ray = self.ray
        deadline = time.monotonic() + self.timeout_s + PING_TIMEOUT_S
        mesh_of = {ref: k for k, ref in enumerate(refs)}
        pending, outs, errors = list(refs), [None] * len(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready and not errors:
                where = self.where([mesh_of[r] for r in pending])
                self.abort()
                raise RayRuntimeError(f"step {step}: meshes {sorted(mesh_of[r] for r in pending)} did not finish "
                                      f"within {self.timeout_s + PING_TIMEOUT_S:g} s ({'; '.join(where)})")
            if not ready:
                break  # the root error is known; the stragglers are aborted
            for ref in ready:
                try:
                    outs[mesh_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if not errors:
                        self.abort()
                    errors[mesh_of[ref]] = e
        if errors:
            roots = [k for k, e in errors.items() if not isinstance(getattr(e, "cause", None), StepAborted)]
            k = roots[0] if roots else next(iter(errors))
            raise RayRuntimeError(f"step {step}, mesh {k}: {_cause(errors[k])}")
        return outs

    def abort(self) -> None:
        for a in self.actors:
            a.abort.remote(self.epoch)

    def where(self, ks: list[int]) -> list[str]:
        out = []
        for k in ks:
            try:
                out.append(self.ray.get(self.actors[k].where.remote(), timeout=PING_TIMEOUT_S))
            except self.ray.exceptions.RayError as e:
                out.append(f"mesh {k}: {_cause(e)}")
        return out

    def dead(self) -> list[int]:
        """The meshes whose actor no longer answers because it died (not merely busy)."""
        ray = self.ray
        pings = [a.ready.remote() for a in self.actors]
        out = []
        for k, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                out.append(k)
            except ray.exceptions.GetTimeoutError:
                pass
        return out

    def restart(self, k: int, step: int) -> None:
        self.ray.kill(self.actors[k])
        self.actors[k] = self.spawn(k)
        try:
            self.load([k])
        except RayRuntimeError as e:
            raise RayRuntimeError(f"mesh {k} died in step {step} and could not be restarted: {e}") from e

    def get(self, calls: dict[int, Any], timeout_s: float, what: str) -> dict[int, Any]:
        """ray.get of one call per mesh under one deadline; a failure names the mesh."""
        ray = self.ray
        deadline = time.monotonic() + timeout_s
        out = {}
        for k, ref in calls.items():
            try:
                out[k] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise RayRuntimeError(f"mesh {k} did not {what} within {timeout_s:g} s") from None
            except ray.exceptions.RayError as e:
                raise RayRuntimeError(f"mesh {k} failed to {what}: {_cause(e)}") from e
        return out


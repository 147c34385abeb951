"""One mesh of a Ray run: an actor that owns a stage and follows its instruction list.

The actor builds its stage from the plan alone (`lower_stage` on its devices:
`stage_devices`), receives its instruction list once (`load_program`), then runs one
iteration per `step` call. It executes instructions exactly as the local runtime
does (`_runtime._Walker`, subclassed) except at the edges:

- `Send` gathers the payload to host numpy and calls `deliver` on the receiving
  actor (a Ray call: the object store moves the bytes); the reply is only awaited at
  the end of the step, so a send does not block the sender, as in the program's model;
- `Recv` waits on the actor's mailbox, which `deliver` fills from another thread
  (the actor is threaded), and puts the payload into this mesh's layouts;
- at `GradSync`, the owner of a tied parameter sends its summed accumulator to the
  meshes that keep a copy, and those wait for it (the local runtime's `sync_tied`).

Every wait is bounded by the run's `timeout_s` and fails naming the mesh, the
instruction and the tensor. Deliveries carry the driver's attempt number (`epoch`),
so when a step is redone after a restart, a late payload of the failed attempt is
dropped instead of being taken for the new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from alpasim.simulator import Program, Recv, Send
from alpasim.solvers import PipelinePlan, planning_graph

from ._executable import lower_stage
from ._runtime import Payload, _Walker, params_bytes_per_device, tied_copies
from ._stage_profile import StageTimes, profile_stage
from ._memory import MeasuredMemory, measured_memory
from ._stages import StagePart


class StepAborted(Exception):
    """The driver called off this attempt of the step (another mesh failed)."""


@dataclass(frozen=True)
class HloText:
    """A compiled program's HLO fetched from an actor; `as_text` as on a jax `Compiled`."""

    text: str

    def as_text(self) -> str:
        return self.text


@dataclass(frozen=True)
class RemoteStage:
    """What the driver keeps of a stage that lives in an actor: the attributes of a
    `StageExecutable` that reports read (index, part, mesh, compiled HLO for
    `compare_collectives`), and its parameter bytes per device for the timeline."""

    index: int
    part: StagePart
    mesh: jax.sharding.AbstractMesh
    compiled: dict[str, HloText]
    params_bytes: float
    memory: MeasuredMemory | None = None       # `measured_memory` of the actor's compiled stage
    device_ids: tuple[int, ...] = ()        # the ids, in the actor's process, of its mesh's devices


def stage_devices(plan: PipelinePlan, j: int) -> list[jax.Device]:
    """Plan stage j's devices in this actor. On virtual CPU devices the actor sees ids 0
    to the plan's largest (`_ray_runtime._actor_options`) and takes the stage's own
    device ids, as `run_local` does: the stage compiles to the very program the local
    runtime compiles for it (same HLO, same device assignment), so the two runtimes run
    the same code and a persistent XLA compilation cache serves both. On GPUs the
    process sees exactly its mesh's devices (Ray's CUDA_VISIBLE_DEVICES), in order."""
    devices = jax.devices()
    if devices[0].platform != "cpu":
        return devices
    by_id = {d.id: d for d in devices}
    return [by_id[d] for d in plan.stages[j].devices]


class MeshWorker:
    """The actor class (wrapped with `ray.remote` by the driver; no Ray at import)."""

    def __init__(self, plan: PipelinePlan, k: int, seed: int) -> None:
        self.cond = threading.Condition()
        self.mailbox: dict[tuple[int, Any], list] = {}    # (epoch, key) -> [(kind, name, numpy)]
        self.epoch = -1                 # attempt numbers increase across runs (`_ray_runtime._EPOCHS`)
        self.aborted_epoch = -1
        self.assign(plan, k, seed)

    # ------------------------------------------------------------- set-up
    def assign(self, plan: PipelinePlan, k: int, seed: int) -> int:
        """Become mesh `k` of `plan`: lower its stages on this process's devices, with
        nothing left of a run this actor served before (`_ray_runtime` keeps idle
        actors for the next run of this driver, as Alpa keeps its mesh workers)."""
        self.release()
        self.k, self.seed = k, seed
        self.graph = planning_graph(plan.model)
        # The plan stages this mesh runs: one, or its chunks under interleaving.
        own = range(k, len(plan.stages), plan.num_meshes)
        self.stages = {j: lower_stage(plan, self.graph, j, stage_devices(plan, j), seed=seed) for j in own}
        self.inflight = {j: plan.stages[j].inflight_microbatches for j in own}
        self.at: Any = None                               # the instruction being run, for `where`
        return k

    def release(self) -> None:
        """Drop the stages (their arrays and programs), the peers and anything delivered:
        before an actor waits idle, and before it takes another mesh."""
        self.stages, self.peers, self.program = {}, [], None
        with self.cond:
            self.mailbox.clear()

    def ready(self) -> int:
        return self.k

    def load_program(self, program: Program, payloads: dict[int, Payload], owners: dict[str, int],
                     readers: dict[str, tuple[int, ...]], timeout_s: float) -> list[RemoteStage]:
        """This mesh's part of the program, sent once before the first step; answers with
        the summaries (one per stage it runs) the driver keeps."""
        self.program, self.payloads, self.timeout_s = program, payloads, timeout_s
        self.owners, self.readers = owners, readers
        return [RemoteStage(j, s.part, s.mesh.abstract_mesh,
                            {name: HloText(c.as_text()) for name, c in s.compiled.items()},
                            params_bytes_per_device(s), measured_memory(s, self.inflight[j]),
                            tuple(int(d.id) for d in s.mesh.devices.flat))
                for j, s in self.stages.items()]

    def profile(self, iters: int) -> dict[int, StageTimes]:
        """Each of its stages' compiled programs timed alone (`profile_stage`)."""
        return {j: profile_stage(s, self.graph, iters=iters, seed=self.seed) for j, s in self.stages.items()}

    def set_peers(self, peers: list) -> None:
        """Handles of every mesh's actor (index k is this one); renewed after a restart."""
        self.peers = list(peers)

    def state_dict(self) -> dict:
        return {j: s.state_dict() for j, s in self.stages.items()}

    def load_state_dict(self, state: dict) -> None:
        """Roll back to a checkpoint: the stage's state, and nothing left in the mailbox."""
        for j, s in self.stages.items():
            s.load_state_dict(state[j])
        with self.cond:
            self.mailbox.clear()

    # ------------------------------------------------------------ per step
    def deliver(self, epoch: int, key: Any, items: list) -> None:
        with self.cond:
            if epoch >= self.epoch:
                self.mailbox[epoch, key] = items
                self.cond.notify_all()

    def abort(self, epoch: int) -> None:
        with self.cond:
            self.aborted_epoch = max(self.aborted_epoch, epoch)
            self.cond.notify_all()

    def where(self) -> str:
        at = self.at
        if isinstance(at, Recv):
            at = f"{at}, tensor {self.program.transfers[at.transfer].tensor!r}"
        return f"mesh {self.k} at {at}"

    def step(self, step: int, epoch: int, t0: float) -> dict:
        """One iteration; times are `time.time() - t0` (`t0`: the driver's step start)."""
        import ray

        with self.cond:
            self.epoch = epoch
            for key in [key for key in self.mailbox if key[0] < epoch]:
                del self.mailbox[key]
        walker = _ActorWalker(self, step, t0)
        for ins in self.program.meshes[self.k]:
            if self.aborted_epoch >= epoch:  # stop before an update the driver will roll back anyway
                raise StepAborted(f"mesh {self.k}: step aborted by the driver before {ins}")
            self.at = ins
            walker.execute(self.k, ins)
        self.at = "waiting for its deliveries to be accepted"
        try:
            ray.get(walker.pending, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"mesh {self.k}: its sends were not accepted within {self.timeout_s:g} s") from None
        self.at = None
        return {"losses": [np.asarray(v) for v in walker.losses], "grads": walker.grads,
                "events": walker.events, "sent_bytes": walker.sent_bytes}

    def wait_for(self, epoch: int, key: Any, what: str) -> list:
        """Block until `deliver` brings `key` for this attempt; fail after `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while (epoch, key) not in self.mailbox:
                if self.aborted_epoch >= epoch:
                    raise StepAborted(f"mesh {self.k}: step aborted by the driver while waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"mesh {self.k}: {what}; nothing arrived within {self.timeout_s:g} s")
                self.cond.wait(left)
            return self.mailbox.pop((epoch, key))


class _ActorWalker(_Walker):
    """The local runtime's walker on one mesh, with Ray at the edges (module doc)."""

    clock = staticmethod(time.time)

    def __init__(self, worker: MeshWorker, step: int, t0: float) -> None:
        stages: Mapping[int, Any] = worker.stages
        super().__init__(worker.program, stages, worker.payloads, worker.graph, worker.seed, step, t0=t0)
        self.worker = worker
        self.epoch = worker.epoch
        self.pending: list = []      # replies of this step's deliveries
        self.owners = worker.owners
        self.copies = tied_copies(worker.owners, worker.readers)

    def send(self, k: int, ins: Send, start: float) -> None:
        items = [(kind, name, np.asarray(v)) for kind, name, v in self.outgoing(k, ins)]
        self.post(ins.dst_stage, (ins.transfer, ins.microbatch), items)
        nbytes = float(sum(v.nbytes for _, _, v in items))
        self.sent_bytes += nbytes
        self.record(f"mesh{k}->mesh{ins.dst_stage}", "send", k, ins.microbatch, start, nbytes,
                    self.program.transfers[ins.transfer].tensor)

    def take(self, k: int, ins: Recv) -> list[tuple[str, str, jax.Array]]:
        t = self.program.transfers[ins.transfer]
        what = f"{ins} waits for tensor {t.tensor!r} from mesh {ins.src_stage}"
        items = self.worker.wait_for(self.epoch, (ins.transfer, ins.microbatch), what)
        sh = self.stages[self.receiver(ins)].shardings
        return [(kind, name, jax.device_put(v, sh[f"{name}:grad" if kind == "grad" else name]))
                for kind, name, v in items]

    def post(self, dst: int, key: Any, items: list) -> None:
        self.pending.append(self.worker.peers[dst].deliver.remote(self.epoch, key, items))

    def send_tied(self, j: int, dst: int, param: str, value: jax.Array) -> None:
        # Keyed by the copy: two copies of one parameter may sit on one mesh (two of its chunks).
        self.post(dst % self.meshes, ("tied", param, dst), [("grad", param, np.asarray(value))])

    def take_tied(self, j: int, param: str) -> jax.Array:
        owner = self.worker.owners[param]
        what = (f"the summed gradient of tied parameter {param!r} (stage {j}) waits for its owner, stage {owner} on "
                f"mesh {owner % self.meshes}")
        ((_, _, value),) = self.worker.wait_for(self.epoch, ("tied", param, j), what)
        return value

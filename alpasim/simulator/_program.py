"""`Program`: the static per-mesh instruction lists of one training iteration (seed 3.4.11).

Alpa's driver writes one instruction list per mesh before training and each mesh's
workers then follow theirs without coordination. A `Program` is that: plain, frozen
data with a JSON form, so the simulator and the execution backends run the same thing.

Instructions (a mesh walks its tuple in order):

    Run(stage, microbatch, phase, chunk)   one pass of one model chunk: "forward",
                                           "backward" (input and weight gradients), or
                                           the backward split as zero-bubble schedules
                                           run it: "backward_input" (what the previous
                                           stage waits for) and "backward_weight"
                                           (weight gradients only, deferrable)
    Send(transfer, microbatch, ...)        start moving a tensor to another mesh; does
                                           not block the sender (a separate stream)
    Recv(transfer, microbatch, ...)        block until that tensor has arrived (and been
                                           all-gathered inside this mesh, seed 3.4.10)
    Free(stage, microbatch, chunk)         release the activations a backward consumed
    GradSync(stage)                        gradient all-reduce of the iteration
    Update(stage)                          optimizer step

`transfer` indexes `Program.transfers`: what moves, between which meshes and chunks,
under which sharding specs. `microbatch` is -1 for tensors that move once per
iteration (e.g. a tied embedding's accumulated gradient).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PHASES = ("forward", "backward")                # the directions tensors cross meshes in
RUN_PHASES = ("forward", "backward", "backward_input", "backward_weight")
# The direction of the tensors a run receives before it and sends after it (None: none).
DIRECTION = {"forward": "forward", "backward": "backward", "backward_input": "backward", "backward_weight": None}
# The run after which a microbatch's activations are no longer needed.
LAST_USE = frozenset({"backward", "backward_weight"})
WHOLE_ITERATION = -1  # the microbatch index of a per-iteration transfer


@dataclass(frozen=True, slots=True)
class Run:
    """One pass (`RUN_PHASES`) of `stage` (= mesh) on one microbatch; `chunk` is the
    model chunk of an interleaved schedule (virtual stage chunk * S + stage), else 0."""

    stage: int
    microbatch: int
    phase: str
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.phase not in RUN_PHASES:
            raise ValueError(f"run: phase must be one of {RUN_PHASES}, got {self.phase!r}")


@dataclass(frozen=True, slots=True)
class Send:
    transfer: int
    microbatch: int
    src_stage: int
    dst_stage: int


@dataclass(frozen=True, slots=True)
class Recv:
    transfer: int
    microbatch: int
    src_stage: int
    dst_stage: int


@dataclass(frozen=True, slots=True)
class Free:
    stage: int
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class GradSync:
    stage: int


@dataclass(frozen=True, slots=True)
class Update:
    stage: int


Instruction = Run | Send | Recv | Free | GradSync | Update
_OPS: dict[str, type] = {"run": Run, "send": Send, "recv": Recv, "free": Free, "grad_sync": GradSync,
                         "update": Update}
_NAMES = {cls: name for name, cls in _OPS.items()}


@dataclass(frozen=True, slots=True)
class StageTransfer:
    """One tensor that crosses meshes once per microbatch (or once per iteration).

    `src_chunk`/`dst_chunk` name the model chunks producing and consuming it: it is
    sent after `Run(src_stage, m, direction, src_chunk)` and received before
    `Run(dst_stage, m, direction, dst_chunk)` ("forward" activations, "backward"
    cotangents); a per-iteration tensor is sent after the sender's last run and
    received before the receiver's `GradSync`. `nbytes` is the whole (unsharded)
    tensor; specs are the layouts on each mesh ("S0RR"), None when unknown.
    """

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: float
    src_stage: int
    dst_stage: int
    direction: str
    per_iteration: bool = False
    src_spec: str | None = None
    dst_spec: str | None = None
    src_chunk: int = 0
    dst_chunk: int = 0

    def __post_init__(self) -> None:
        if self.direction not in PHASES:
            raise ValueError(f"transfer {self.tensor!r}: direction must be one of {PHASES}, got {self.direction!r}")
        if self.nbytes < 0:
            raise ValueError(f"transfer {self.tensor!r}: nbytes must be >= 0, got {self.nbytes!r}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class Program:
    """One instruction tuple per mesh (mesh k runs plan stage k, or under interleaving
    plan stages c * S + k), plus the transfers.

    `devices[k]` are mesh k's global device ids; `chunks` is the number of model chunks
    per mesh (1 unless the schedule is interleaved).
    """

    schedule: str
    microbatches: int
    chunks: int
    devices: tuple[tuple[int, ...], ...]
    meshes: tuple[tuple[Instruction, ...], ...]
    transfers: tuple[StageTransfer, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.meshes):
            raise ValueError(f"program: {len(self.meshes)} instruction lists for {len(self.devices)} meshes")
        if self.microbatches < 1 or self.chunks < 1:
            raise ValueError(f"program: microbatches and chunks must be >= 1, got {self.microbatches}, "
                             f"{self.chunks}")

    @property
    def num_meshes(self) -> int:
        return len(self.meshes)

    def stage_of(self, mesh: int, chunk: int) -> int:
        """The plan stage (virtual stage) that runs `chunk` on `mesh`: chunk * S + mesh."""
        return chunk * self.num_meshes + mesh

    def count(self, kind: type) -> int:
        """How many instructions of `kind` (e.g. `Run`) the whole program holds."""
        return sum(type(ins) is kind for mesh in self.meshes for ins in mesh)

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "chunks": self.chunks,
                "devices": [list(d) for d in self.devices],
                "meshes": [[{"op": _NAMES[type(i)], **asdict(i)} for i in mesh] for mesh in self.meshes],
                "transfers": [t.to_json() for t in self.transfers]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Program:
        """Inverse of `to_json`; a bad instruction names its mesh and position."""
        meshes = []
        for k, mesh in enumerate(data["meshes"]):
            ins = []
            for j, d in enumerate(mesh):
                fields = dict(d)
                op = fields.pop("op", None)
                if op not in _OPS:
                    raise ValueError(f"program: meshes[{k}][{j}]: unknown op {op!r}; expected one of {list(_OPS)}")
                try:
                    ins.append(_OPS[op](**fields))
                except TypeError as e:
                    raise ValueError(f"program: meshes[{k}][{j}]: {e}") from None
            meshes.append(tuple(ins))
        transfers = tuple(StageTransfer(**{**t, "shape": tuple(t["shape"])}) for t in data["transfers"])
        return cls(str(data["schedule"]), int(data["microbatches"]), int(data["chunks"]),
                   tuple(tuple(d) for d in data["devices"]), tuple(meshes), transfers)

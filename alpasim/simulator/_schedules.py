"""Pipeline schedules: a `PipelinePlan` -> a `Program` (one instruction list per mesh).

Each is a record of the one table, `solvers.SCHEDULES`, whose builder gives each
mesh's run order; here the orders are wrapped into programs. All are synchronous (a
flush at the end of every iteration), so they differ only in the order each mesh runs
its forwards and backwards:

- "gpipe" (Huang et al., 2019): every forward, then every backward (last microbatch
  first). A stage holds all B microbatches' activations at its peak.
- "1f1b" (PipeDream-flush, Narayanan et al., 2021; the seed's eq. 2): stage i
  (0-based) first runs w_i = min(S - 1 - i, B) warm-up forwards, then alternates one
  forward and one backward, then drains the w_i backwards left. It holds at most
  min(S - i, B) microbatches in flight; with free communication and balanced stages
  it takes (S + B - 1)(t_f + t_b), eq. 2.
- "interleaved" (Megatron-LM's virtual stages, Narayanan et al., SC'21, sec. 2.2):
  each mesh runs v model chunks; chunk c of mesh k is virtual stage c*S + k. A plan
  the planner cut into chunks (`plan.chunks` = v, `solvers._interleave`) lists them
  as its stages, each with its own times, bytes and transfers. Of a plan of one stage
  per mesh, each stage is imagined as v chunks of 1/v of its forward, backward and
  activations (a mesh keeps its devices and memory; the model imagined cut into S*v
  chunks dealt round-robin to the meshes, which is Megatron's layout), a what-if the
  runtimes cannot execute. Microbatches go in groups of S through all chunks (Megatron-core's
  schedule table; the last group also takes the remainder of B / S, one group if
  B < S), and mesh k warms up with 2(S - 1 - k) + (v - 1)g forwards, g the largest
  group's size. With balanced stages, free communication and B >= S an iteration
  takes B(t_f + t_b) + (S - 1)(t_f + t_b)/v, exactly (Megatron-LM's bubble, sec.
  2.2.2): the bubble shrinks v-fold, at the price of v times as many messages.
- "zb-h1" and "zb-h2" (zero bubble, Qi et al., ICLR 2024): each backward split into B
  (input gradients, which the previous stage waits for) and W (weight gradients,
  which nothing in the iteration waits for but the optimizer step), so a stage can
  run its W passes where 1F1B would idle. ZB-H1 is the paper's fixed order
  (`zb_h1_order`): 1F1B's warm-up, stage i deferring i W passes, so it holds 1F1B's
  S - i microbatches between F and B plus i waiting for W; with f = b = w and free
  communication an iteration takes 3Bt + (S - 1)t, a third of 1F1B's bubble. ZB-H2
  comes from the paper's greedy list scheduling, run on the plan's own pass times
  (`solvers.split_backward`) with free communication: a free stage runs a B whose
  cotangent has arrived, else an F whose input has arrived if it holds fewer than
  2(S - i) - 1 microbatches between F and B (and 2S - 1 before W), else a deferred
  W, else waits. With f = b = w and B >= 2S - 1 no stage idles between its first and
  last pass, so the iteration takes B(f + b + w) + (S - 1)f, the least a pipeline
  flushed at every iteration can: the last stage cannot start before the first
  microbatch has passed S - 1 forwards. (The paper's ZB-H2 reaches zero only without
  the flush, validating the optimizer step after the fact; not modelled.)

The orders and ZB-H2's greedy live in the solvers, where the planner reads them too.

Cross-mesh tensors come from `plan.transfers` (of a chunked plan, between its chunks:
each mapped to its mesh and chunk). Adjacent stages always get a dependency:
where the plan lists no tensor between them (a synthetic or old plan) a zero-byte
control message stands in. Under imagined interleaving, the activations between adjacent stages
and their cotangents move at every chunk; the extra boundary from mesh S-1 back to
mesh 0 (chunk c to c+1) carries the tensors of the boundary 0 -> 1 (transformer stages
pass the same hidden state everywhere) in the layouts those meshes already use for it;
other tensors (skip connections, a tied embedding's gradient) leave the outermost chunk
of their source and reach the outermost chunk of their destination.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from alpasim.solvers import SCHEDULES, Order, PipelinePlan, PlanFormatError, PlanTransfer, validate_plan

from ._program import (
    DIRECTION,
    LAST_USE,
    WHOLE_ITERATION,
    Free,
    GradSync,
    Instruction,
    Program,
    Recv,
    Run,
    Send,
    StageTransfer,
    Update,
)

# ------------------------------------------------------------------- transfers
def _plan_transfer(t: PlanTransfer) -> StageTransfer:
    """A plan's transfer (validated when the plan was made or read) in the program."""
    return StageTransfer(t.tensor, t.shape, t.dtype, t.nbytes, t.src_stage, t.dst_stage, t.direction,
                         t.per_iteration, t.src_spec, t.dst_spec)


def _boundary_tensors(base: Sequence[StageTransfer]) -> list[StageTransfer]:
    """The tensors that cross a stage boundary at every model chunk under interleaving:
    activations between adjacent stages and their cotangents (a backward tensor with the
    shape of one that crossed the same boundary forward). Anything else — an accumulated
    weight gradient such as a tied embedding's, a skip connection — moves once."""
    forward_shapes: dict[tuple[int, int], set] = defaultdict(set)
    for t in base:
        if t.direction == "forward" and not t.per_iteration:
            forward_shapes[t.src_stage, t.dst_stage].add(t.shape)
    return [t for t in base if abs(t.src_stage - t.dst_stage) == 1 and not t.per_iteration
            and (t.direction == "forward" or t.shape in forward_shapes[t.dst_stage, t.src_stage])]


def stage_transfers(plan: PipelinePlan, chunks: int = 1) -> tuple[StageTransfer, ...]:
    """Every cross-mesh tensor of one iteration, with chunks and control messages (module doc)."""
    if plan.chunks > 1:
        return _chunk_transfers(plan)
    S, v = len(plan.stages), chunks
    base = [_plan_transfer(t) for t in plan.transfers]
    boundary = _boundary_tensors(base)
    out: list[StageTransfer] = []
    for t in base:
        if v == 1:
            out.append(t)
        elif t in boundary:
            out += [_with(t, c, c) for c in range(v)]
        elif t.direction == "forward":
            out.append(_with(t, 0, v - 1))
        else:
            out.append(_with(t, v - 1, 0))
    if S > 1:
        for c in range(v - 1):  # mesh S-1 chunk c -> mesh 0 chunk c+1, and the cotangents back
            out += _wrap_around(boundary, S, "forward", c)
            out += _wrap_around(boundary, S, "backward", c)
    return tuple(_with_controls(out, S, v))


def _chunk_transfers(plan: PipelinePlan) -> tuple[StageTransfer, ...]:
    """The transfers of a plan cut into chunks: each between two of its chunks
    (virtual stages j = chunk * S + mesh), as the planner listed them."""
    S, v = plan.num_meshes, plan.chunks
    out = []
    for t in plan.transfers:
        (c0, k0), (c1, k1) = divmod(t.src_stage, S), divmod(t.dst_stage, S)
        out.append(StageTransfer(t.tensor, t.shape, t.dtype, t.nbytes, k0, k1, t.direction, t.per_iteration,
                                 t.src_spec, t.dst_spec, c0, c1))
    return tuple(_with_controls(out, S, v))


def _with_controls(out: list[StageTransfer], S: int, v: int) -> list[StageTransfer]:
    """`out` and a zero-byte control message wherever two consecutive virtual stages on
    different meshes have no tensor between them in a direction (each needs a dependency
    both ways)."""
    have = {(t.src_stage, t.src_chunk, t.dst_stage, t.dst_chunk, t.direction) for t in out if not t.per_iteration}
    for j in range(S * v - 1):
        (c0, k0), (c1, k1) = divmod(j, S), divmod(j + 1, S)
        if k0 == k1:
            continue  # the same mesh: its own program order is the dependency
        if (k0, c0, k1, c1, "forward") not in have:
            out.append(StageTransfer("<control>", (), "", 0.0, k0, k1, "forward", src_chunk=c0, dst_chunk=c1))
        if (k1, c1, k0, c0, "backward") not in have:
            out.append(StageTransfer("<control>", (), "", 0.0, k1, k0, "backward", src_chunk=c1, dst_chunk=c0))
    return out


def _wrap_around(boundary: Sequence[StageTransfer], S: int, direction: str, chunk: int) -> list[StageTransfer]:
    """The tensors of the extra boundary between mesh S-1 (chunk `chunk`) and mesh 0
    (chunk + 1): those of boundary 0 -> 1 (cotangents 1 -> 0). Their layouts are taken
    from where each mesh already holds that tensor: mesh 0 as it sends it to (receives
    it from) mesh 1, mesh S-1 as it receives it from (sends it to) mesh S-2; unknown
    when the two boundaries do not carry the same shapes."""
    def between(src: int, dst: int) -> list[StageTransfer]:
        return [t for t in boundary if (t.src_stage, t.dst_stage) == (src, dst)]

    if direction == "forward":
        first, last = between(0, 1), between(S - 2, S - 1)
        src, dst, src_chunk, dst_chunk = S - 1, 0, chunk, chunk + 1
    else:
        first, last = between(1, 0), between(S - 1, S - 2)
        src, dst, src_chunk, dst_chunk = 0, S - 1, chunk + 1, chunk
    same = len(first) == len(last) and all(a.shape == b.shape for a, b in zip(first, last))
    out = []
    for i, t in enumerate(first):
        specs = (None, None)
        if same:
            specs = (last[i].dst_spec, t.src_spec) if direction == "forward" else (t.dst_spec, last[i].src_spec)
        out.append(StageTransfer(t.tensor, t.shape, t.dtype, t.nbytes, src, dst, direction, False, *specs,
                                 src_chunk, dst_chunk))
    return out


def _with(t: StageTransfer, src_chunk: int, dst_chunk: int) -> StageTransfer:
    return StageTransfer(t.tensor, t.shape, t.dtype, t.nbytes, t.src_stage, t.dst_stage, t.direction,
                         t.per_iteration, t.src_spec, t.dst_spec, src_chunk, dst_chunk)


# ------------------------------------------------------------------- programs
def program_from_orders(plan: PipelinePlan, schedule: str, orders: Sequence[Order], chunks: int = 1) -> Program:
    """Wrap each mesh's run order with its receives, sends, frees and the final sync."""
    transfers = stage_transfers(plan, chunks)
    sends: dict[tuple, list[int]] = defaultdict(list)   # (mesh, phase, chunk) -> transfers to send after
    recvs: dict[tuple, list[int]] = defaultdict(list)   # (mesh, phase, chunk) -> transfers to receive before
    last_sends: dict[int, list[int]] = defaultdict(list)
    last_recvs: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(transfers):
        if t.per_iteration:
            last_sends[t.src_stage].append(i)
            last_recvs[t.dst_stage].append(i)
        else:
            sends[t.src_stage, t.direction, t.src_chunk].append(i)
            recvs[t.dst_stage, t.direction, t.dst_chunk].append(i)
    meshes = []
    for k, order in enumerate(orders):
        ins: list[Instruction] = []
        for phase, m, c in order:
            direction = DIRECTION[phase]
            ins += [Recv(i, m, transfers[i].src_stage, k) for i in recvs.get((k, direction, c), ())]
            ins.append(Run(k, m, phase, c))
            ins += [Send(i, m, k, transfers[i].dst_stage) for i in sends.get((k, direction, c), ())]
            if phase in LAST_USE:
                ins.append(Free(k, m, c))
        ins += _per_iteration(k, transfers, last_sends[k], last_recvs[k], len(orders))
        ins += [GradSync(k), Update(k)]
        meshes.append(tuple(ins))
    return Program(schedule, plan.microbatches, chunks, tuple(tuple(s.devices) for s in plan.meshes),
                   tuple(meshes), transfers)


# The most passes (runs of one chunk on one microbatch) a program may hold: the engine
# keeps every event, about 1 KiB and 10 us each (a million is ~10 s and ~1 GiB here).
MAX_PROGRAM_RUNS = 10 ** 6


def _per_iteration(k: int, transfers: Sequence[StageTransfer], sends: Sequence[int], recvs: Sequence[int],
                   meshes: int) -> list[Instruction]:
    """Mesh k's once-per-iteration transfers (tied weights' gradient contributions, summed
    towards the owner from the last stage that reads the weight to the first): by
    virtual stage, last first, each receiving before it sends, so a stage in the middle
    of such a chain forwards its own part and the parts it received (sending first lost
    them), and chains through chunks of several meshes cannot deadlock."""
    events = [((transfers[i].dst_chunk * meshes + k), 0, Recv(i, WHOLE_ITERATION, transfers[i].src_stage, k))
              for i in recvs]
    events += [((transfers[i].src_chunk * meshes + k), 1, Send(i, WHOLE_ITERATION, k, transfers[i].dst_stage))
               for i in sends]
    return [ins for _, _, ins in sorted(events, key=lambda e: (-e[0], e[1]))]


def check_plan(plan: PipelinePlan, schedule: str | None = None, chunks: int = 1) -> tuple[int, int]:
    """(S meshes, B) of a plan the simulator can run (`solvers.validate_plan`, and a
    program of at most MAX_PROGRAM_RUNS passes); else a `PlanFormatError` naming the
    field. A plan cut into chunks per mesh (`plan.chunks` > 1) runs a chunked schedule
    (interleaved) only: the others run one stage per mesh."""
    if not plan.stages:
        raise PlanFormatError("plan field 'stages' is empty (an infeasible plan cannot be simulated)")
    if plan.microbatches < 1:
        raise PlanFormatError(f"plan field 'microbatches' must be >= 1, got {plan.microbatches}")
    rec = SCHEDULES.get(schedule) if schedule is not None else None
    passes = 3 if rec is not None and rec.splits_backward else 2
    runs = len(plan.stages) * plan.microbatches * passes * (chunks if plan.chunks == 1 else 1)
    if runs > MAX_PROGRAM_RUNS:
        raise PlanFormatError(f"plan field 'microbatches': {plan.microbatches} microbatches through {len(plan.stages)} "
                              f"stages{f' of {chunks} chunks' if plan.chunks == 1 and chunks > 1 else ''} is "
                              f"{runs:.3g} passes; the simulator runs at most {MAX_PROGRAM_RUNS:,} "
                              "(about 10 s and 1 GiB)")
    if plan.chunks > 1 and schedule is not None and not (rec is not None and rec.chunked):
        raise PlanFormatError(f"the plan runs {plan.chunks} model chunks on each of its {plan.num_meshes} meshes: "
                              f"it runs the interleaved schedule, not {schedule!r}")
    validate_plan(plan)     # what a plan file must hold: the loader's rule, for plans made in code too
    return plan.num_meshes, plan.microbatches


def build_program(plan: PipelinePlan, schedule: str | None = None, *, chunks: int = 2) -> Program:
    """The `Program` of `schedule` (a name in `SCHEDULES`; None: the plan's own) for
    `plan`. `chunks` is read by a chunked schedule ("interleaved") on a plan of one
    stage per mesh only: a plan cut into chunks runs its own (module doc)."""
    schedule = plan.schedule if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    rec = SCHEDULES[schedule]
    if not rec.chunked:
        chunks = 1
    elif plan.chunks > 1:
        chunks = plan.chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{rec.name} schedule: chunks must be an integer >= 1, got {chunks!r}")
    check_plan(plan, rec.name, chunks)
    return program_from_orders(plan, rec.name, rec.orders(plan, chunks), chunks)

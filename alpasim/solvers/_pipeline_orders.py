"""Run orders of the pipeline schedules, the pass times they are built from, and the
memory an order holds.

A run order is what one mesh computes, in order: (phase, microbatch, chunk) triples.
The simulator wraps each order into a `Program` (`simulator._schedules`, where the
schedules are described); the planner reads the same orders to price what a schedule
holds in memory (`order_peak_bytes`), so the two use one liveness rule. Every builder
lives here, below the simulator, so one table (`_schedule.SCHEDULES`) can hold them:
the fixed orders, and ZB-H2's greedy list scheduler run on the plan's pass times.

A backward pass computes input gradients (dX = dY W^T: what the previous stage waits
for) and weight gradients (dW = X^T dY: needed only by the optimizer step). Zero-bubble
schedules (Qi et al., ICLR 2024) run them as two passes, B and W, and defer W into
the bubbles. The planner prices the split per stage (`PipelineStage.backward_weight_s`,
`weight_stash_bytes`); a plan without it gets half of each: a matmul's two gradients
take the same FLOPs, and of what the backward reads, the weight gradients keep the
layer inputs and the cotangents, about half of a transformer layer's stash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._pipeline_plan import PipelineStage


Order = list[tuple[str, int, int]]  # (phase, microbatch, chunk) in the order one mesh runs them

# ------------------------------------------------------------------ pass times
# The share of backward time and of the stash a stage without a priced split gets.
DEFAULT_WEIGHT_SHARE = 0.5


def stage_phase_s(stage: PipelineStage, microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on a stage.

    Old plans carry no split (both 0): backward is taken as twice the forward, the
    usual ratio for matmul-dominated layers (two matmuls per forward one).
    """
    if stage.forward_s > 0 or stage.backward_s > 0:
        return stage.forward_s, stage.backward_s
    compute = stage.compute_s if stage.compute_s > 0 else max(stage.time_s - stage.sync_s / microbatches, 0.0)
    return compute / 3, 2 * compute / 3


@dataclass(frozen=True, slots=True)
class PassTimes:
    """One microbatch on one stage: seconds of F, of B (input gradients) and of W
    (weight gradients; B + W = the whole backward), and the bytes its stash holds after
    F and, once B has run, until W."""

    forward_s: float
    input_s: float
    weight_s: float
    stash_bytes: float
    weight_stash_bytes: float

    @property
    def backward_s(self) -> float:
        return self.input_s + self.weight_s


def split_backward(stage: PipelineStage, microbatches: int) -> PassTimes:
    """The stage's passes for a schedule that splits the backward (module doc)."""
    f, b = stage_phase_s(stage, microbatches)
    w = min(stage.backward_weight_s, b) if stage.backward_weight_s > 0 else DEFAULT_WEIGHT_SHARE * b
    stash = min(stage.stash_bytes, stage.activation_bytes) if stage.stash_bytes > 0 else stage.activation_bytes
    # What W reads can exceed the stash: under recomputation it is recomputed in B.
    kept = stage.weight_stash_bytes if stage.weight_stash_bytes > 0 else DEFAULT_WEIGHT_SHARE * stash
    return PassTimes(f, b - w, w, stash, kept)


# ------------------------------------------------------------------ run orders
def gpipe_order(num_stages: int, microbatches: int, stage: int) -> Order:
    """All forwards in microbatch order, then all backwards in reverse order."""
    del num_stages, stage
    return ([("forward", m, 0) for m in range(microbatches)]
            + [("backward", m, 0) for m in reversed(range(microbatches))])


def one_f_one_b_order(num_stages: int, microbatches: int, stage: int) -> Order:
    """PipeDream-flush: min(S-1-i, B) warm-up forwards, then 1F1B pairs, then drain."""
    warmup = min(num_stages - 1 - stage, microbatches)
    order: Order = [("forward", m, 0) for m in range(warmup)]
    for k in range(microbatches - warmup):
        order += [("forward", warmup + k, 0), ("backward", k, 0)]
    order += [("backward", m, 0) for m in range(microbatches - warmup, microbatches)]
    return order


def interleaved_order(num_stages: int, microbatches: int, stage: int, chunks: int) -> Order:
    """Megatron-core's interleaved 1F1B for mesh `stage` with `chunks` model chunks."""
    if chunks == 1:
        return one_f_one_b_order(num_stages, microbatches, stage)
    # The k-th forward a mesh runs is table[k]: microbatches in groups, each group
    # through chunk 0, then chunk 1, ...; the k-th backward walks the chunks in reverse.
    # Groups hold S microbatches, the last one also the remainder of B / S: a last group
    # smaller than S (Megatron-core's choice) deadlocks, e.g. S=4, B=5, v=3. The warm-up
    # covers the largest group g: the last mesh's k-th backward is of a microbatch whose
    # last-chunk forward is (v - 1)g forwards later in the table (a warm-up of the first
    # group's size ran backwards before their forwards whenever S did not divide B).
    sizes = [num_stages] * (microbatches // num_stages) or [microbatches]
    sizes[-1] += microbatches - sum(sizes)
    table, first = [], 0
    for size in sizes:
        table += [(m, c) for c in range(chunks) for m in range(first, first + size)]
        first += size
    total = len(table)
    warmup = min(2 * (num_stages - 1 - stage) + (chunks - 1) * max(sizes), total)

    def fwd(k: int) -> tuple[str, int, int]:
        return "forward", table[k][0], table[k][1]

    def bwd(k: int) -> tuple[str, int, int]:
        return "backward", table[k][0], chunks - 1 - table[k][1]

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def zb_h1_order(num_stages: int, microbatches: int, stage: int) -> Order:
    """ZB-H1 (Qi et al., ICLR 2024, sec. 3.1) for stage i: 1F1B's S - 1 - i warm-up
    forwards, then i forward / input-gradient pairs whose weight gradients wait, then
    forward, input gradient and the oldest waiting weight gradient in turn, and the
    rest drained in that order. Stage i holds at most S - i microbatches between F and
    B, as under 1F1B, and i more waiting for W."""
    S, B = num_stages, microbatches
    order: Order = []
    f = b = w = 0

    def run(phase: str, m: int) -> int:
        order.append((phase, m, 0))
        return m + 1

    for _ in range(min(S - 1 - stage, B)):
        f = run("forward", f)
    for _ in range(stage):
        if f < B:
            f, b = run("forward", f), run("backward_input", b)
    while f < B:
        f, b, w = run("forward", f), run("backward_input", b), run("backward_weight", w)
    while b < B:
        b, w = run("backward_input", b), run("backward_weight", w)
    while w < B:
        w = run("backward_weight", w)
    return order


def zero_bubble_greedy(passes: Sequence[PassTimes], microbatches: int, limits: Sequence[int],
                       alive: int) -> tuple[list[Order], float]:
    """(every stage's order, when the last pass ends) under ZB-H2's greedy list
    scheduling (described in `simulator._schedules`), simulated with free communication:
    `passes[i]` are stage i's pass times, `limits[i]` how many microbatches it may hold
    between F and B, `alive` how many between F and W (so deferred W passes cannot
    pile up: each holds its weight gradients' inputs). Stages decide in time order, ties
    to the lower index. A stage with nothing to run waits for the first moment anything
    can change for it (an input it knows the arrival of, or another stage's next
    decision); it does not decide past a stage still to decide at the same moment,
    whose pass may bring it an input sooner."""
    S, B = len(passes), microbatches
    inf = math.inf
    f_ready = [[0.0] * B] + [[inf] * B for _ in range(S - 1)]   # when F(m)'s input exists on stage i
    b_ready = [[inf] * B for _ in range(S)]                      # when B(m)'s cotangent does
    free = [0.0] * S
    nf, nb, nw = [0] * S, [0] * S, [0] * S
    orders: list[Order] = [[] for _ in range(S)]
    blocked: dict[int, float] = {}              # stage -> the time it found nothing to run at

    def next_look(i: int) -> float:
        """When stage i, idle at free[i], could next run something (inf: not known)."""
        t = free[i]
        waits = [b_ready[i][nb[i]]] if nb[i] < nf[i] else []
        if nf[i] < B and nf[i] - nb[i] < limits[i] and nf[i] - nw[i] < alive:
            waits.append(f_ready[i][nf[i]])
        later = [x for x in waits if t < x < inf] + [free[k] for k in range(S) if nw[k] < B and free[k] > t]
        return min(later, default=inf)

    while True:
        busy = [i for i in range(S) if nw[i] < B]
        if not busy:
            return orders, max(free)
        now = min(free[k] for k in busy)
        at = [k for k in busy if free[k] == now]
        deciding = [k for k in at if blocked.get(k) != now]
        if not deciding:   # every stage at this moment found nothing: each looks again at its next one
            moved = False
            for k in at:
                later = next_look(k)
                if later < inf:
                    free[k], moved = later, True
            blocked.clear()
            if not moved:
                raise RuntimeError(f"zero-bubble order: every stage waits (limits {list(limits)})")
            continue
        i = deciding[0]
        t, p = free[i], passes[i]
        if nb[i] < nf[i] and b_ready[i][nb[i]] <= t:
            phase, m, d = "backward_input", nb[i], p.input_s
        elif nf[i] < B and nf[i] - nb[i] < limits[i] and nf[i] - nw[i] < alive and f_ready[i][nf[i]] <= t:
            phase, m, d = "forward", nf[i], p.forward_s
        elif nw[i] < nb[i]:
            phase, m, d = "backward_weight", nw[i], p.weight_s
        else:
            blocked[i] = t                       # until no stage can decide at this moment
            continue
        blocked.clear()
        orders[i].append((phase, m, 0))
        free[i] = end = t + d
        if phase == "forward":
            nf[i] += 1
            if i + 1 < S:
                f_ready[i + 1][m] = end
            else:
                b_ready[i][m] = end
        elif phase == "backward_input":
            nb[i] += 1
            if i > 0:
                b_ready[i - 1][m] = end
        else:
            nw[i] += 1


def zb_h2_limits(num_stages: int) -> tuple[list[int], int]:
    """ZB-H2's (microbatches stage i may hold between F and B, any stage between F and
    W) for the greedy: 2(S - i) - 1 and 2S - 1."""
    S = num_stages
    return [2 * (S - i) - 1 for i in range(S)], 2 * S - 1


def order_peak_bytes(order: Order, stash: Sequence[float], act: Sequence[float],
                     kept: Sequence[float] | None = None) -> float:
    """The most bytes of activations one mesh holds while running `order` by itself:
    each microbatch of chunk c keeps `stash[c]` from the end of its forward until its
    backward (or, split, until its W, keeping only `kept[c]` after B); a running
    forward holds `act[c]` of its own on top of what is live, a running backward or B
    its transient act[c] - stash[c]; W adds nothing of its own. This is the simulator's
    engine rule without receive buffers (tested equal on random orders)."""
    kept = kept if kept is not None else stash
    live: dict[tuple[int, int], float] = {}
    total = peak = 0.0
    for phase, m, c in order:
        if phase == "forward":
            peak = max(peak, total + act[c])
            live[m, c] = stash[c]
            total += stash[c]
        elif phase == "backward_weight":
            total -= live.pop((m, c))
        else:
            peak = max(peak, total + act[c] - stash[c])
            if phase == "backward":
                total -= live.pop((m, c))
            else:   # backward_input: only what W reads stays
                total += kept[c] - live[m, c]
                live[m, c] = kept[c]
    return peak


def most_live(order: Order, chunks: int) -> list[int]:
    """Per chunk: the most of its microbatches `order` holds between forward and last use."""
    live = [0] * chunks
    most = [0] * chunks
    for phase, _, c in order:
        if phase == "forward":
            live[c] += 1
            most[c] = max(most[c], live[c])
        elif phase in ("backward", "backward_weight"):
            live[c] -= 1
    return most

"""Run orders of the fixed pipeline schedules, and the memory an order holds.

A run order is what one mesh computes, in order: (phase, microbatch, chunk) triples.
The simulator wraps each order into a `Program` (`simulator._schedules`, where the
schedules are described); the planner reads the same orders to price what a schedule
holds in memory (`order_peak_bytes`), so the two use one liveness rule. Only the fixed
orders live here: ZB-H2's comes from a greedy list scheduler run on the plan's pass
times, which is the simulator's.
"""

from __future__ import annotations

from collections.abc import Sequence


Order = list[tuple[str, int, int]]  # (phase, microbatch, chunk) in the order one mesh runs them

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

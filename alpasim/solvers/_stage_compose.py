"""A stage from its layers' options: memory (eq. 5), gradient sync and overlap, scalar and
over the whole stage table.

A stage k..i on a view sums its layers' options (prefix sums; one option index for the
whole stage); its memory is `costmodels.stage_memory` with min(s, B) microbatches in
flight (seed eq. 5, s = stages from this one to the end): persistent + in-flight stashes
+ the one running layer's working set + buffers, never a sum of per-layer peaks. It
takes the fastest option that fits the device; a submesh takes its fastest logical
view; infeasible is inf (`assemble`). The scalar forms (`compose_stage`, `stage_sync`)
price one chosen stage for the plan; the vectorised ones (`assemble`, `exposed_ranges`,
`gather_ranges`) every range of the table at once, by the same rules.

What the composition ignores, and why it is acceptable: resharding between two layers
of a stage whose plans disagree on the boundary layout (layers of one kind share a
plan, and the boundary is the residual stream, batch-sharded in practice) and mixing
options inside a stage (a finer knapsack could fit a little more in memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from alpasim.costmodels import (LayerMemory, LayerSync, StageMemory, bucket_count, bucket_schedule, carry_peak,
                                exposed_s, gather_exposed_s, range_max, range_peak, stage_memory)
from alpasim.graphs import OpGraph

from ._layer_options import INF, LayerOption
from ._mesh import LogicalMesh
from ._resharding import Collective
from ._spec import ShardingSpec


def scatter_tail_s(scatter_s: float, busy_s: float, microbatches: int) -> float:
    """What a gradient-scatter stream leaves after the last backward: each of the
    `microbatches` backwards adds `scatter_s` to the stream as it ends, and the work
    between two backwards (`busy_s`, a microbatch's forward and backward) runs beside
    it. The last microbatch's scatters always run after, and where the stream is
    slower than the compute it falls behind by the difference every microbatch."""
    if scatter_s <= 0:
        return 0.0
    return scatter_s + max(0.0, (microbatches - 1) * (scatter_s - busy_s))


@dataclass(frozen=True, slots=True)
class TiedCopy:
    """A layer that reads a parameter another layer (`owner`) updates; `outputs` index
    the layer graph's outputs its backward hands to the owner (gradient contributions)."""

    owner: int
    outputs: tuple[int, ...]


def tied_owners(graph: OpGraph, layers: Sequence[OpGraph]) -> list[TiedCopy | None]:
    """For each layer, its `TiedCopy` (the LM head reading the word embedding), or None."""
    owner = {op.inputs[0]: op.layer for op in graph.ops if op.prim == "adam"}
    readers: dict[str, set[int]] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers.setdefault(t, set()).add(op.layer)
    out: list[TiedCopy | None] = []
    for l, lg in enumerate(layers):
        updated = {op.inputs[0] for op in lg.ops if op.prim == "adam"}
        others = [owner[p.name] for p in lg.params if p.name not in updated and owner.get(p.name, l) != l]
        if not others:
            out.append(None)
            continue
        backward = {t for op in lg.ops if op.phase == "backward" for t in op.outputs}
        outs = tuple(k for k, t in enumerate(lg.outputs) if t in backward and others[0] in readers.get(t, ()))
        out.append(TiedCopy(others[0], outs))
    return out


def carry_bytes(layer: OpGraph, o: LayerOption, copy: TiedCopy, mesh: LogicalMesh) -> float:
    """Per-device bytes of what the copy's backward hands its owner, in the option's layouts."""
    total = 0.0
    for k in copy.outputs:
        t = layer.tensors[layer.outputs[k]]
        shards = ShardingSpec.parse(o.output_specs[k]).num_shards(mesh) if o.output_specs else 1
        total += t.nbytes / shards
    return total


def compose_stage(opts: Sequence[LayerOption], inflight: int, drop_tied: bool = False,
                  carries: Sequence[tuple[int, int, float]] = ()) -> StageMemory:
    """`costmodels.stage_memory` of a stage running `opts` (one option per layer, in
    order). `drop_tied`: the stage also holds the owner of the tied copies among them,
    which are then counted once, and `carries` (from, to, bytes), indices into `opts`,
    are their gradient contributions held from the copy's backward to the owner's."""
    layers = [LayerMemory(o.inflight_bytes, o.activation_bytes) for o in opts]
    tied = [sum(o.tied[i] for o in opts) if drop_tied else 0.0 for i in range(3)]
    return stage_memory(layers, params_bytes=sum(o.params_bytes for o in opts) - tied[0],
                        grads_bytes=sum(o.grads_bytes for o in opts) - tied[1],
                        optimizer_bytes=sum(o.optimizer_bytes for o in opts) - tied[2],
                        inflight=inflight, buffer_bytes=max((o.gather_bytes for o in opts), default=0.0),
                        carries=carries, update_bytes=max((o.update_bytes for o in opts), default=0.0))


def _in_buckets(kind: str, nbytes: float, axes: tuple[int, ...], n: int, mesh: LogicalMesh) -> float:
    """Seconds of `nbytes` moved by `kind` in `n` equal buckets, each its own collective."""
    return n * Collective(kind, nbytes / n, axes).time_s(mesh) if n else 0.0


def layer_sync(o: LayerOption, mesh: LogicalMesh, bucket_bytes: float, tp_overlap: bool = False) -> LayerSync:
    """The option's backward and its gradient collectives re-priced in buckets of
    `bucket_bytes` (each bucket one collective of its own size)."""
    seconds, count = 0.0, 0
    for kind, axes, nbytes in o.grad_groups:
        n = bucket_count(nbytes, bucket_bytes)
        seconds += _in_buckets(kind, nbytes, axes, n, mesh)
        count += n
    return LayerSync(max(o.busy_s(True, tp_overlap) - o.forward_busy_s(tp_overlap), 0.0), seconds, count)


def layer_gathers(o: LayerOption, mesh: LogicalMesh, bucket_bytes: float) -> float:
    """The option's parameter all-gathers' seconds in the next forward, with
    Megatron-core's `--overlap-param-gather` (`costmodels._overlap`): the step's
    gathers (those of the sliced states and a flat buffer's weights, `_sync_terms`) in
    the buckets of the gradients they come from (param_and_grad_buffer.py: a bucket's
    `param_data` is gathered as one, as its `grad_data` is reduce-scattered)."""
    seconds = 0.0
    for axes, nbytes in o.gather_groups:
        grads = sum(b for _, a, b in o.grad_groups if a == axes)
        seconds += _in_buckets("all_gather", nbytes, axes, bucket_count(grads or nbytes, bucket_bytes), mesh)
    return seconds


def stage_sync(opts: Sequence[LayerOption], mesh: LogicalMesh, bucket_bytes: float | None,
               tp_overlap: bool = False, gather_overlap: bool = False
               ) -> tuple[tuple[tuple[float, float], ...], float, float, float]:
    """(buckets, exposed seconds, of those the next forward's wait for its gathers, the
    after-step gathers moved into that forward) of a stage running `opts`: the bucketed
    reduction overlapping its backward where that leaves less after it than one
    collective per gradient does after the backward (many small buckets each pay a
    launch, and a short backward hides little), else no buckets and all of it.
    `gather_overlap`: the parameters' all-gathers run in the next forward
    (`layer_gathers`, `costmodels._overlap`)."""
    unbucketed = sum(o.grad_sync_s for o in opts)
    if bucket_bytes is None:
        return (), unbucketed, 0.0, 0.0
    syncs = [layer_sync(o, mesh, bucket_bytes, tp_overlap) for o in opts]
    wait = moved = 0.0
    if gather_overlap:
        wait = gather_exposed_s([o.forward_busy_s(tp_overlap) for o in opts],
                                [layer_gathers(o, mesh, bucket_bytes) for o in opts])
        moved = sum(o.param_gather_s for o in opts)
    exposed = exposed_s(syncs) + wait
    if exposed >= unbucketed + moved:
        return (), unbucketed, 0.0, 0.0
    return bucket_schedule(syncs), exposed, wait, moved


def gather_ranges(forward: np.ndarray, gather: np.ndarray) -> np.ndarray:
    """`costmodels.gather_exposed_s` of every layer range k..i at once: (L, ...) per-layer
    forward and all-gather seconds -> (L, L, ...). With prefix sums G and F, range k..i
    waits max(0, max_{k<=l<=i} (G_l - F_{l-1}) - (G_{k-1} - F_{k-1}))."""
    zero = np.zeros((1,) + forward.shape[1:])
    g = np.concatenate([zero, np.cumsum(gather, axis=0)])          # G_0 .. G_L
    f = np.concatenate([zero, np.cumsum(forward, axis=0)])
    lead = g[1:] - f[:-1]                                           # G_l - F_{l-1}, l = 1..L
    base = g[:-1] - f[:-1]                                          # G_{k-1} - F_{k-1}
    return np.maximum(range_max(lead) - base[:, None], 0.0)


def exposed_ranges(backward: np.ndarray, sync: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """`costmodels.exposed_s` of every layer range k..i at once: (L, ...) per-layer
    backward seconds, bucketed sync seconds and bucket counts -> (L, L, ...) exposed
    seconds. For a range ending at i the stream's state after layer l does not depend
    on where the range starts, so one pass per distance i - l serves every range."""
    num_layers = backward.shape[0]
    prefix = np.concatenate([np.zeros((1,) + backward.shape[1:]), np.cumsum(backward, axis=0)])
    out = np.full((num_layers,) + backward.shape, INF)
    free = np.zeros(backward.shape)                          # by i: the stream after layers i..l
    n = np.maximum(buckets, 1)
    for d in range(num_layers):
        i = np.arange(d, num_layers)
        l = i - d
        start = prefix[i + 1] - prefix[l + 1]                 # layer l's backward starts
        b, c = backward[l], sync[l]
        end = np.maximum.reduce([free[i] + c, start + b + c / n[l], start + b / n[l] + c])
        free[i] = np.where(buckets[l] > 0, end, free[i])
        out[l, i] = np.maximum(free[i] - (prefix[i + 1] - prefix[l]), 0.0)
    return out


def _table_options(kinds: Sequence[str], options, n_mesh: int, n_opt: int):
    """(layer, mesh, column, option) of every cell of the stage table's per-layer
    arrays: column j holds a layer's j-th option, or its last where it has fewer."""
    for l, kind in enumerate(kinds):
        for m in range(n_mesh):
            opts = options.get((kind, m), [])
            for j in range(n_opt if opts else 0):
                yield l, m, j, opts[min(j, len(opts) - 1)]


def _overlapped_sync(kinds: Sequence[str], options, meshes, shape: tuple[int, int, int], ranges,
                     bucket_bytes: float, tp_overlap: bool, gather_overlap: bool) -> np.ndarray:
    """`stage_sync`'s exposed seconds for every layer range at once, (L, L, M, J): what
    a range's buckets leave after its backward (with `gather_overlap`, plus its next
    forward's wait for the parameters' gathers), or, where that is more, all its
    collectives after the backward. `ranges` sums a per-layer array over each range.
    `gather_overlap` implies buckets (`build_stage_costs`)."""
    backward, bucketed, buckets, unbucketed, forward, gathers, moved = (np.zeros(shape) for _ in range(7))
    # By layer kind: layers of one kind share their option, so its sync and gathers.
    syncs: dict[tuple[str, int, int], tuple[LayerSync, float]] = {}
    for l, m, j, o in _table_options(kinds, options, shape[1], shape[2]):
        known = syncs.get((kinds[l], m, j))
        if known is None:
            mesh = meshes[m][2]
            known = syncs[(kinds[l], m, j)] = (layer_sync(o, mesh, bucket_bytes, tp_overlap),
                                               layer_gathers(o, mesh, bucket_bytes) if gather_overlap else 0.0)
        ls, gathers[l, m, j] = known
        backward[l, m, j], bucketed[l, m, j], buckets[l, m, j] = ls.backward_s, ls.sync_s, ls.buckets
        unbucketed[l, m, j] = o.grad_sync_s
        if gather_overlap:
            forward[l, m, j], moved[l, m, j] = o.forward_busy_s(tp_overlap), o.param_gather_s
    exposed = exposed_ranges(backward, bucketed, buckets)
    if gather_overlap:
        exposed = exposed + gather_ranges(forward, gathers)
    return np.minimum(exposed, ranges(unbucketed) + ranges(moved))


def _with_tied_copies(p_range: np.ndarray, peak_range: np.ndarray, kinds: Sequence[str], options, meshes,
                      owners: Sequence[TiedCopy | None], layers: Sequence[OpGraph], tied: np.ndarray,
                      stash: np.ndarray, peak: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranges' persistent bytes less each tied copy held beside its owner (one set
    of states serves both), and their peak with what a copy after its owner carries
    (`carry_peak`): (L, L, M, J) each, as `_assemble` composes them."""
    num_layers, n_mesh, n_opt = tied.shape
    k_idx, i_idx = np.indices((num_layers, num_layers))
    for l, copy in enumerate(owners):
        if copy is None:
            continue
        lo, hi = min(l, copy.owner), max(l, copy.owner)
        both = (k_idx <= lo) & (i_idx >= hi)                             # ranges holding copy and owner
        p_range = p_range - np.where(both[..., None, None], np.nan_to_num(tied[l], posinf=0.0)[None, None], 0.0)
        if copy.owner < l and copy.outputs:
            carry = np.zeros((n_mesh, n_opt))
            for m in range(n_mesh):
                opts = options.get((kinds[l], m), [])
                for j in range(n_opt):
                    if opts:
                        carry[m, j] = carry_bytes(layers[l], opts[min(j, len(opts) - 1)], copy, meshes[m][2])
            carried = carry_peak(np.nan_to_num(stash, posinf=0.0), np.where(np.isinf(peak), 0.0, peak),
                                 l, copy.owner, carry)
            peak_range = np.maximum(peak_range, carried)
    return p_range, peak_range


def assemble(kinds: Sequence[str], options, meshes, shapes, memory: float, microbatches: int, num_layers: int,
              s_max: int, owners: Sequence[TiedCopy | None] = (), layers: Sequence[OpGraph] = (),
              bucket_bytes: float | None = None, tp_overlap: bool = False, gather_overlap: bool = False):
    """Compose the layer options into t(k..i, shape, s) and its memory, vectorised.

    Memory is `compose_stage` for every range at once: persistent sums, the one-
    microbatch peak by `range_peak`, the gathered-parameter buffer by `range_max`, a
    tied copy dropped from ranges that also hold its owner. With `bucket_bytes` the
    gradient sync of a range is what its buckets leave exposed after its backward
    (`exposed_ranges`), not the sum of its layers' collectives."""
    n_mesh = len(meshes)
    n_opt = max((len(v) for v in options.values()), default=1)
    shape = (num_layers, n_mesh, n_opt)
    time, pers, peak, stash, tied, gather, update = (np.full(shape, INF) for _ in range(7))
    overlap = bucket_bytes is not None
    for l, m, j, o in _table_options(kinds, options, n_mesh, n_opt):
        # With overlap the gradient sync (and with gather overlap the parameter gathers)
        # is the range's exposed part (`_overlapped_sync`), not each layer's.
        # A sharded-gradient scatter stream ends after the backward (`scatter_tail_s`).
        busy = o.busy_s(overlap, tp_overlap)
        after = o.sync_s - (o.grad_sync_s if overlap else 0.0) - (o.param_gather_s if gather_overlap else 0.0) \
            + (scatter_tail_s(o.grad_scatter_stream_s, busy, microbatches) if overlap else 0.0)
        time[l, m, j] = busy + after / microbatches
        pers[l, m, j] = o.persistent_bytes
        peak[l, m, j] = o.activation_bytes
        stash[l, m, j] = o.inflight_bytes
        tied[l, m, j] = o.tied_bytes
        gather[l, m, j] = o.gather_bytes
        update[l, m, j] = o.update_bytes

    k_idx, i_idx = np.indices((num_layers, num_layers))
    empty = (k_idx > i_idx)[..., None, None]

    def ranges(x: np.ndarray) -> np.ndarray:  # (L, ...) -> (L, L, ...) sums over k..i
        prefix = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, axis=0)])
        out = prefix[None, 1:] - prefix[:-1, None]
        out[k_idx > i_idx] = INF
        return out

    t_range, p_range, s_range = ranges(time), ranges(pers), ranges(np.nan_to_num(stash, posinf=0.0))
    if overlap:
        t_range = t_range + _overlapped_sync(kinds, options, meshes, shape, ranges, bucket_bytes, tp_overlap,
                                             gather_overlap) / microbatches
    peak_range = range_peak(np.nan_to_num(stash, posinf=0.0), np.where(np.isinf(peak), 0.0, peak))
    buffers = np.maximum(range_max(np.where(np.isinf(gather), 0.0, gather)), 0.0)
    updates = np.maximum(range_max(np.where(np.isinf(update), 0.0, update)), 0.0)
    p_range, peak_range = _with_tied_copies(p_range, peak_range, kinds, options, meshes, owners, layers,
                                            tied, stash, peak)
    with np.errstate(invalid="ignore"):                                  # inf - inf on empty ranges
        transient = np.where(np.isfinite(s_range), np.maximum(peak_range - s_range, 0.0), INF)
    base = p_range + buffers                                             # (L, L, M, J): persistent + buffers
    shape_of_mesh = np.array([shapes.index(s) for s, _, _ in meshes])
    cost = np.full((num_layers, num_layers, len(shapes), s_max), INF)
    view = np.zeros(cost.shape, dtype=int)
    opt = np.zeros(cost.shape, dtype=int)
    mem = np.full(cost.shape, INF)
    least = np.full(cost.shape, INF)
    for s in range(1, s_max + 1):
        need = base + np.maximum(min(s, microbatches) * s_range + transient, updates)   # w stashed, or the update
        need = np.where(empty, INF, need)
        smallest = need.min(axis=3)                                      # (L, L, M)
        t = np.where(need <= memory, t_range, INF)
        j_best = np.argmin(t, axis=3)                               # (L, L, M)
        t_best = np.take_along_axis(t, j_best[..., None], axis=3)[..., 0]
        m_need = np.take_along_axis(need, j_best[..., None], axis=3)[..., 0]
        for h in range(len(shapes)):
            cols = np.flatnonzero(shape_of_mesh == h)
            if not len(cols):
                continue
            sub = t_best[:, :, cols]
            pick = np.argmin(sub, axis=2)
            cost[:, :, h, s - 1] = np.take_along_axis(sub, pick[..., None], axis=2)[..., 0]
            view[:, :, h, s - 1] = cols[pick]
            opt[:, :, h, s - 1] = np.take_along_axis(j_best[:, :, cols], pick[..., None], axis=2)[..., 0]
            mem[:, :, h, s - 1] = np.take_along_axis(m_need[:, :, cols], pick[..., None], axis=2)[..., 0]
            least[:, :, h, s - 1] = smallest[:, :, cols].min(axis=2)
    return cost, view, opt, mem, least

"""Gradient synchronisation bucketed and overlapped with the backward (DDP, Megatron-LM).

With gradient accumulation, a stage reduces its weight gradients once an iteration,
during the last microbatch's backward: PyTorch DDP and Megatron-LM's
`--overlap-grad-reduce` cut the gradients into buckets and launch each bucket's
collective on a communication stream as soon as the backward has produced it, so
only what is still running when the backward ends is exposed.

The model here, used alike by the stage DP, the plan and the simulator:

* the backward runs a stage's layers last to first; layer l takes b_l seconds;
* a layer's gradient collectives (`LayerSync`: C_l seconds over n_l buckets, each
  priced by the collective model at its own size, so latency is paid per bucket) fill
  their buckets evenly over the layer's backward: bucket j of the layer is ready at
  S_l + b_l * j / n_l, S_l the time the layer's backward starts;
* one stream runs buckets in the order they are ready, one at a time.

Then the stream is free again after layer l at

    E_l = max(E_prev + C_l,  S_l + b_l + c_l,  S_l + b_l / n_l + C_l),   c_l = C_l / n_l

(the queue of n equal jobs arriving evenly: either the stream was the bottleneck
from the start, or it keeps up and the last bucket waits only for itself, or it falls
behind from the first bucket on), and the exposed sync is E (first layer) minus the
backward's end, at least 0. `bucket_schedule` lists the buckets one by one, for the
simulator's stream; `exposed_s` is the closed form, and both are the same queue.

Buckets do not span layers (DDP's do, in parameter-registration order): a small layer
pays a bucket's latency of its own. The optimizer step and any collective after it
(ZeRO's and the distributed optimizer's parameter all-gather) stay after the backward,
except with Megatron-core's `--overlap-param-gather`:

* with the distributed optimizer a bucket's reduction is a reduce-scatter, and the
  updated parameters come back by an all-gather of the bucket's parameters
  (megatron/core/distributed/param_and_grad_buffer.py: `grad_data` in the gradients'
  dtype, fp32 for a bf16 model; `param_data` in the weights', bf16). Where the plan's
  layouts slice the states, it prices exactly that: reduce-scatters in the backward and
  the step's all-gathers after it; where they cannot (Megatron-core shards a flat
  buffer), the gradient's all-reduce is priced as the same reduce-scatter and an
  all-gather of the weights' bytes after the step (`solvers._layer_options._sync_terms`).
  After the step the gathers are priced one per parameter; overlapped, in the buckets of
  the gradients they come from (`solvers._stage_compose.layer_gathers`).
  With `overlap_param_gather` the all-gathers run in the next iteration's first
  forward, bucket by bucket ahead of the layers that read them (its forward pre-hook
  waits for a layer's bucket), so the backward's stream carries the reduce-scatters
  and the forward waits only where the gathers run ahead of it: with layer l's gather
  g_l and forward f_l, first to last, the forward's delay is

      D = max(0, max_l (g_1 + ... + g_l) - (f_1 + ... + f_{l-1}))

  (`gather_exposed_s`: the stream gathers back to back from the step's end, layer l
  starts when its gather is done and the layers before it have run). Every stage is
  charged its own wait, though a later stage's first forward also waits for the
  pipeline to fill: a conservative charge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# PyTorch DDP's default bucket (`bucket_cap_mb=25`).
DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


@dataclass(frozen=True, slots=True)
class LayerSync:
    """One layer's backward and its bucketed gradient collectives."""

    backward_s: float     # b: the layer's backward, per microbatch
    sync_s: float         # C: its gradient collectives, all buckets
    buckets: int          # n (0: nothing to synchronise)


def bucket_count(nbytes: float, bucket_bytes: float) -> int:
    """Buckets a gradient of `nbytes` fills (0 for none)."""
    if bucket_bytes <= 0 or not math.isfinite(bucket_bytes):
        raise ValueError(f"the bucket size must be a finite number of bytes > 0, got {bucket_bytes!r}")
    return 0 if nbytes <= 0 else math.ceil(nbytes / bucket_bytes)


def stream_end_s(free_s: float, start_s: float, layer: LayerSync) -> float:
    """When the stream is free after `layer`'s buckets (module doc's E_l), given when it
    was free before (`free_s`) and when the layer's backward starts (`start_s`)."""
    if layer.buckets == 0:
        return free_s
    b, c_all, n = layer.backward_s, layer.sync_s, layer.buckets
    return max(free_s + c_all, start_s + b + c_all / n, start_s + b / n + c_all)


def exposed_s(layers: Sequence[LayerSync]) -> float:
    """Seconds the gradient sync of a stage running `layers` (first to last) adds after
    its last backward ends, with the stream idle when that backward starts."""
    free = start = 0.0
    for layer in reversed(layers):
        free = stream_end_s(free, start, layer)
        start += layer.backward_s
    return max(free - start, 0.0)


def bucket_schedule(layers: Sequence[LayerSync]) -> tuple[tuple[float, float], ...]:
    """Every bucket as (ready, seconds), ready counted from the start of the backward of
    a stage running `layers` (first to last), in the order they become ready."""
    out: list[tuple[float, float]] = []
    start = 0.0
    for layer in reversed(layers):
        n = layer.buckets
        out += [(start + layer.backward_s * j / n, layer.sync_s / n) for j in range(1, n + 1)]
        start += layer.backward_s
    return tuple(out)


def run_buckets(buckets: Sequence[tuple[float, float]], backward_s: float) -> float:
    """The exposed seconds of `buckets` run one at a time in order on one stream, for a
    backward of `backward_s` (the explicit queue `exposed_s` is the closed form of)."""
    free = 0.0
    for ready, seconds in buckets:
        free = max(free, ready) + seconds
    return max(free - backward_s, 0.0)


def gather_exposed_s(forward_s: Sequence[float], gather_s: Sequence[float]) -> float:
    """Seconds the first forward of a stage running layers with these forwards waits for
    their parameters' all-gathers, run back to back ahead of it (module doc's D)."""
    delay = waited = gathered = 0.0
    for f, g in zip(forward_s, gather_s, strict=True):
        gathered += g
        delay = max(delay, gathered - waited)
        waited += f
    return delay


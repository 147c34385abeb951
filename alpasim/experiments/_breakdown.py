"""Where a predicted iteration goes: a plan's simulated timeline, split by what the
meshes spend it on, so that a row's error can be read against its parts.

Each mesh runs the whole iteration; averaged over the meshes, the parts sum to it:

* `passes_s`: the stages' forward and backward passes, with the collectives inside
  them left exposed (tensor, sequence and context parallelism's; ZeRO-3's per-layer
  gathers);
* `pipeline_s`: the mesh held by the pipeline's own traffic (`Timeline.mesh_stats`'
  comm_s): waiting for a tensor on the wire, a receive's gather, a send that blocks
  until it lands;
* `sync_s`: after the last backward, the gradient synchronisation still running (a
  sharded-gradient stream's tail among it), the optimizer step, and the parameters'
  gathers after it (with Megatron-core's `--overlap-param-gather`, the next forward's
  wait for them);
* `idle_s`: waiting for other meshes, the pipeline's bubble.

Every event of a mesh is its own process's, one after another, so the parts do not
overlap; the gradient streams beside the passes record no events of their own.
"""

from __future__ import annotations

from typing import Any

PARTS = ("passes_s", "pipeline_s", "sync_s", "idle_s")
_STATS = {"passes_s": "compute_s", "pipeline_s": "comm_s", "sync_s": "sync_s", "idle_s": "idle_s"}


def iteration_breakdown(timeline: Any) -> dict[str, float]:
    """The mean over `timeline`'s meshes of each part of its iteration (module doc)."""
    stats = timeline.mesh_stats()
    if not stats:
        return dict.fromkeys(PARTS, 0.0)
    return {part: sum(s[_STATS[part]] for s in stats) / len(stats) for part in PARTS}

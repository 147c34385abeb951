"""The three records `plan_pipeline` takes: what a method searches, what a user set, and
how the work runs.

A planner entry that grew a keyword per feature (24 of them) mixed three kinds of
input that change for different reasons: a method's part of the search space
(Megatron's fixed stage count and mesh views, a baseline's intra-op restriction), the
user's pricing choices (precision, recomputation, overlap, schedule), and where the
work runs (worker pool, cache, progress). Each is a frozen record here, checked once
in `__post_init__`, so a bad value is refused where the record is made, before any
pricing, and a method's space is one value the grid can loop over.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from alpasim.costmodels import DEFAULT_BUCKET_BYTES, CostModel
from alpasim.graphs import DTYPE_BYTES, KERNEL_STASHES, LOSS_KERNELS, RECOMPUTE_POLICIES, get_recipe

from ._cache import DiskCache
from ._interleave import DEFAULT_CHUNK_OPTIONS
from ._systems import GradBuckets

# Relative width of the stage DP's bottleneck windows (the paper's epsilon, unit-free):
# the DP's answer is at most (1 + epsilon) times the optimum (`_stage_dp`).
DEFAULT_EPSILON = 1e-3
# Deeper pipelines than this are never worth it on the paper's clusters (each stage would
# hold a handful of layers on a few devices), and the DP's cost grows with the depth.
DEFAULT_MAX_STAGES = 16
# What `PlanOptions.schedule` searches: the paper's 1F1B DP, interleaved chunks, or both.
PLANNER_SCHEDULES = ("1f1b", "interleaved", "auto")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What a method searches (`_methods`): the part of Alpa's space it keeps.

    `restriction` solves every layer under an intra-op baseline (`_intra_baselines.
    BASELINES`; None: the full ILP). `microbatches` is a fixed count or "auto" (the
    count searched; `microbatch_multiple` keeps only microbatches whose size it divides,
    so each data-parallel device gets whole samples). `layers` re-clusters the forward
    ops into that many layers with the eq. 6 DP instead of the zoo's blocks; `relabel`
    replaces the layer assignment instead. `max_stages` caps the pipeline's depth and
    `num_stages` fixes it (with `equal_layers`, stages of equal layer counts).
    `shape_ok`/`views_of` narrow the submeshes and their logical views. `pareto=False`
    solves each layer for its fastest plan only. `method` names the method (recorded in
    the plan) and `system` the system profile it is priced as (`_systems.SYSTEMS`)."""

    method: str = "alpa"
    system: str | None = None
    restriction: str | None = None
    microbatches: int | str = "auto"
    microbatch_multiple: int = 1
    layers: int | None = None
    relabel: Callable | None = None
    max_stages: int = DEFAULT_MAX_STAGES
    num_stages: int | None = None
    equal_layers: bool = False
    shape_ok: Callable | None = None
    views_of: Callable | None = None
    pareto: bool = True

    def __post_init__(self) -> None:
        if self.microbatches != "auto" and not _positive_int(self.microbatches):
            raise ValueError(f"microbatches must be a positive integer or 'auto', got {self.microbatches!r}")
        for name in ("microbatch_multiple", "max_stages"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("layers", "num_stages"):
            if getattr(self, name) is not None and not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What a user sets, resolved (`_methods.system_options` fills in a system
    profile's entries): every field is the value the plan is priced with.

    `remat` (full recomputation) and `recompute` (`graphs.RECOMPUTE_POLICIES`) are the
    training graph's policy for what the backward recomputes; `precision` names the
    mixed-precision recipe (`graphs.RECIPES`; None: mixed-fp32grad). `bucket_bytes`:
    gradients reduced in buckets of this size during the last backward
    (`costmodels._overlap`; None: after it, the paper's accounting). `tp_overlap`:
    GEMMs' collectives beside them (`_tp_overlap`); `gather_overlap`: the distributed
    optimizer's all-gathers in the next forward. `loss_kernel`: the cross-entropy's
    kernel (`graphs.with_loss_kernel`); `kernels`: elementwise and normalisation chains
    op by op or as hand-fused kernels. `schedule`: "1f1b" (the paper's DP),
    "interleaved" (the fastest interleaved plan, a chunk count from `chunk_options`) or
    "auto" (whichever predicts less). `epsilon`: the stage DP's window width.
    `price_boundaries=False` drops the stage-boundary transfer term from the DP's
    objective (the paper's eq. 2 as written). `cost_model` (None: analytic) prices
    every stage, on its own cluster."""

    remat: bool = True
    recompute: str = "none"
    precision: str | None = None
    bucket_bytes: float | GradBuckets | None = DEFAULT_BUCKET_BYTES
    tp_overlap: bool = False
    gather_overlap: bool = False
    loss_kernel: str = "fused"
    kernels: str = "per-op"
    schedule: str = "1f1b"
    chunk_options: tuple[int, ...] = DEFAULT_CHUNK_OPTIONS
    epsilon: float = DEFAULT_EPSILON
    price_boundaries: bool = True
    cost_model: CostModel | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_options, tuple):
            object.__setattr__(self, "chunk_options", tuple(self.chunk_options))
        if self.schedule not in PLANNER_SCHEDULES:
            raise ValueError(f"unknown planner schedule {self.schedule!r}; choose one of "
                             f"{', '.join(PLANNER_SCHEDULES)}")
        chunks = self.chunk_options
        if not chunks or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in chunks):
            raise ValueError(f"chunks per mesh must be integers >= 2, got {list(chunks)}")
        bucket = self.bucket_bytes
        if bucket is not None and not isinstance(bucket, GradBuckets) and (
                isinstance(bucket, (str, bool)) or not isinstance(bucket, (int, float))
                or not (math.isfinite(bucket) and bucket > 0)):
            raise ValueError(f"the gradient bucket must be a finite number of bytes > 0, got {bucket!r}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"unknown recompute policy {self.recompute!r}; choose one of "
                             f"{', '.join(RECOMPUTE_POLICIES)}")
        if self.loss_kernel not in LOSS_KERNELS:
            raise ValueError(f"unknown cross-entropy kernel {self.loss_kernel!r}; choose one of "
                             f"{', '.join(LOSS_KERNELS)}")
        if self.kernels not in KERNEL_STASHES:
            raise ValueError(f"unknown kernels {self.kernels!r}; choose one of {', '.join(KERNEL_STASHES)}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) \
                or not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}")

    def at_data_parallel(self, dp: int, model_dtype: str) -> PlanOptions:
        """These options with a system's `GradBuckets` sized for data-parallel degree
        `dp`, in the dtype the weight gradients are reduced in (the precision recipe's
        accumulator: fp32 under mixed-fp32grad, `_layer_options._sync_terms`)."""
        if not isinstance(self.bucket_bytes, GradBuckets):
            return self
        recipe = get_recipe(self.precision)
        itemsize = DTYPE_BYTES[recipe.grad_dtype(recipe.weight_dtype(model_dtype))]
        return dataclasses.replace(self, bucket_bytes=self.bucket_bytes.nbytes(dp, itemsize))


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How the planning work runs: `map_fn` fills the stage table's ILP jobs (the
    builtin map, a process pool's, Ray's: `_workers`), `cache` keeps solved stage
    costs on disk (None: none), `progress(label, done, total)` hears of each job."""

    map_fn: Callable[[Callable, Iterable], Iterable] = map
    cache: DiskCache | None = None
    progress: Callable[[str, int, int], None] | None = None


# `_methods`' common options that are not pricing choices: where the work runs, and the
# narrowing of a method's search space a user may ask for.
RUN_FIELDS = ("map_fn", "cache", "progress")
SPACE_OPTIONS = ("microbatches", "pareto")


def split_options(options: dict) -> tuple[dict, PlanOptions, RunOptions]:
    """A resolved keyword dict (`_methods`' common options) as the narrowing of a
    search space (`SPACE_OPTIONS`), `PlanOptions` and `RunOptions`."""
    space = {k: options[k] for k in SPACE_OPTIONS if k in options}
    run = RunOptions(**{k: options[k] for k in RUN_FIELDS if k in options})
    plan = PlanOptions(**{k: v for k, v in options.items() if k not in RUN_FIELDS and k not in SPACE_OPTIONS})
    return space, plan, run

"""The pipeline schedules, one record each, in one table (`SCHEDULES`): the names a plan
may hold (`validate_plan`), the programs the simulator builds (`simulator.build_program`)
and the schedules `simulator.choose_schedule` tries all read it, so no list of names
has to be kept equal to another, and what a schedule does is asked of its record, not
read off its name.

It lives with the solvers, below the simulator, because the planner checks plans
against it and the simulator imports the solvers, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._pipeline_orders import (Order, PassTimes, gpipe_order, interleaved_order, most_live, one_f_one_b_order,
                               split_backward, zb_h1_order, zb_h2_limits, zero_bubble_greedy)

if TYPE_CHECKING:
    from ._pipeline_plan import PipelinePlan


@dataclass(frozen=True, slots=True)
class Schedule:
    """One pipeline schedule. `orders(plan, chunks)` gives each mesh's run order for
    `plan` (`chunks`: model chunks per mesh, read by a chunked schedule only; the
    simulator passes a plan cut into chunks its own count). `inflight(S, B, mesh, chunks)` is the most forwards
    (of a microbatch through a chunk) the mesh holds at once, each from its forward to
    its last use (the backward, or W), counted on the mesh's order: the microbatches
    its memory must hold."""

    name: str
    orders: Callable[[PipelinePlan, int], list[Order]]
    splits_backward: bool       # the backward runs as B and W passes (the zero-bubble schedules)
    chunked: bool               # a mesh runs several model chunks (interleaved)
    automatic: bool             # one `simulator.choose_schedule` tries on a 1F1B plan by default
    inflight: Callable[[int, int, int, int], int]     # (S, B, mesh, chunks) -> forwards held


def _held(order: Order) -> int:
    """The most forwards `order` holds at once until their last use, all chunks together."""
    return most_live([(phase, m, 0) for phase, m, _ in order], 1)[0]


def _fixed(name: str, order: Callable[[int, int, int, int], Order], *, splits_backward: bool = False,
           chunked: bool = False, automatic: bool = False,
           held: Callable[[int, int, int, int], int] | None = None) -> Schedule:
    """A schedule whose order depends on S, B and the chunks only, not on pass times;
    `held` is its in-flight rule in closed form where it has one (the planner asks it of
    every plan it assembles), else the rule is counted on the order."""
    def orders(plan: PipelinePlan, chunks: int) -> list[Order]:
        return [order(plan.num_meshes, plan.microbatches, k, chunks) for k in range(plan.num_meshes)]

    def inflight(num_stages: int, microbatches: int, stage: int, chunks: int) -> int:
        return _held(order(num_stages, microbatches, stage, chunks))

    return Schedule(name, orders, splits_backward, chunked, automatic, held or inflight)


def _zb_h2_orders(plan: PipelinePlan, chunks: int) -> list[Order]:
    """ZB-H2: the greedy run on the plan's own pass times."""
    B = plan.microbatches
    return zero_bubble_greedy([split_backward(st, B) for st in plan.stages], B, *zb_h2_limits(plan.num_meshes))[0]


def _zb_h2_inflight(num_stages: int, microbatches: int, stage: int, chunks: int) -> int:
    """ZB-H2's order depends on the pass times: this counts it with F = B = W (the
    paper's setting), where every mesh reaches the greedy's bound, min(B, 2S - 1).
    Other times give other orders, none holding more."""
    unit = [PassTimes(1.0, 1.0, 1.0, 0.0, 0.0)] * num_stages
    return _held(zero_bubble_greedy(unit, microbatches, *zb_h2_limits(num_stages))[0][stage])


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    _fixed("1f1b", lambda S, B, k, v: one_f_one_b_order(S, B, k), automatic=True,
           held=lambda S, B, k, v: min(S - k, B)),                 # the seed's eq. 5
    _fixed("gpipe", lambda S, B, k, v: gpipe_order(S, B, k)),
    _fixed("interleaved", interleaved_order, chunked=True),
    _fixed("zb-h1", lambda S, B, k, v: zb_h1_order(S, B, k), splits_backward=True, automatic=True),
    Schedule("zb-h2", _zb_h2_orders, splits_backward=True, chunked=False, automatic=True,
             inflight=_zb_h2_inflight),
)}

"""`alpasim validate`: every published run of `_published_runs`, priced as its system ran.

Each row is planned as the Megatron-LM configuration it ran (`solvers.plan_model` with
`--method megatron` and the row's degrees, microbatch size, recomputation, sequence
parallelism and optimizer sharding), under the row's system profile, and the plan is
simulated on its schedule (`simulator.simulate`). The error is signed: predicted over
measured, minus one (negative: optimistic). Every row has a status: "priced";
"out of memory", a prediction that failed, since every row ran (the count is reported
beside the MAPE, never hidden in it); or "not expressible", a layout the planner
cannot state yet, with the reason it gave. The MAPE is over the priced rows, with
their count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from alpasim import simulator as sim
from alpasim import solvers as sv

from ._published_runs import PUBLISHED_RUNS, PublishedRun

# (remat, recompute) of the planner for a row's recomputation.
_RECOMPUTE = {"full": (True, "none"), "selective": (False, "selective"), "none": (False, "none")}


@dataclass(frozen=True, slots=True)
class ValidationRow:
    """One published run against its prediction (`error` = predicted / measured - 1)."""

    run: PublishedRun
    measured_s: float
    predicted_s: float | None
    plan_s: float
    reason: str = ""                     # why it is not priced (not expressible, or does not fit)
    system: dict[str, Any] | None = None
    out_of_memory: bool = False          # priced as not fitting, though it ran

    @property
    def status(self) -> str:
        return "priced" if self.expressible else "out of memory" if self.out_of_memory else "not expressible"

    @property
    def expressible(self) -> bool:
        return self.predicted_s is not None

    @property
    def error(self) -> float | None:
        return None if self.predicted_s is None else self.predicted_s / self.measured_s - 1.0

    def to_json(self) -> dict[str, Any]:
        r = self.run
        return {"id": r.id, "source": r.source, "system": r.system, "generation": r.generation, "gpus": r.gpus,
                "model": r.model, "tp": r.tp, "pp": r.pp, "dp": r.dp, "cp": r.cp, "chunks": r.chunks,
                "microbatch_size": r.microbatch_size, "recompute": r.recompute,
                "sequence_parallel": r.sequence_parallel, "distributed_optimizer": r.distributed_optimizer,
                "measured_s": self.measured_s, "predicted_s": self.predicted_s, "error": self.error,
                "expressible": self.expressible, "status": self.status, "reason": self.reason, "assumed": list(r.assumed),
                "differs": list(r.differs), "plan_s": self.plan_s, "priced_as": self.system}


def _not_expressible(run: PublishedRun) -> str:
    """What the planner cannot express of `run` yet ("" if it can)."""
    if run.cp > 1:
        return f"context parallelism (cp {run.cp}) is not modelled yet"
    return ""


def price_run(run: PublishedRun, cache: sv.DiskCache | None = None) -> ValidationRow:
    """`run` planned and simulated as its system ran (module doc)."""
    t0 = time.perf_counter()
    measured = run.measured_iteration_s
    reason = _not_expressible(run)
    if reason:
        return ValidationRow(run, measured, None, 0.0, reason)
    config = sv.MegatronConfig(run.tp, run.pp, run.dp, run.microbatch_size,
                               distributed_optimizer=run.distributed_optimizer,
                               sequence_parallel=run.sequence_parallel)
    remat, recompute = _RECOMPUTE[run.recompute]
    chunked = {"schedule": "interleaved", "chunk_options": (run.chunks,)} if run.chunks > 1 else {}
    try:
        plan = sv.plan_model(run.model, run.cluster, "megatron", megatron=config, system=run.system,
                             precision=run.precision, remat=remat, recompute=recompute, cache=cache, **chunked)
    except (ValueError, sv.PlanInfeasible) as e:     # refused: the layout cannot be expressed
        return ValidationRow(run, measured, None, time.perf_counter() - t0, str(e))
    if not plan.feasible:
        return ValidationRow(run, measured, None, time.perf_counter() - t0, "; ".join(plan.notes), plan.system,
                             out_of_memory=True)
    timeline = sim.simulate(plan, plan.schedule, chunks=plan.chunks)
    return ValidationRow(run, measured, timeline.iteration_s, time.perf_counter() - t0, "", plan.system)


def mape(rows: Iterable[ValidationRow]) -> tuple[float | None, int]:
    """Mean absolute percentage error over the priced rows, and how many there were."""
    errors = [abs(r.error) for r in rows if r.expressible]
    return (100.0 * sum(errors) / len(errors) if errors else None), len(errors)


def validate(runs: Sequence[PublishedRun] = PUBLISHED_RUNS, cache: sv.DiskCache | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Every run priced (`price_run`), with MAPE overall and per hardware generation,
    as one JSON-ready dict."""
    rows = []
    for i, run in enumerate(runs):
        if progress is not None:
            progress(run.id, i, len(runs))
        rows.append(price_run(run, cache))
    overall, n = mape(rows)
    by_generation = {}
    for gen in dict.fromkeys(r.generation for r in runs):
        value, count = mape(r for r in rows if r.run.generation == gen)
        by_generation[gen] = {"mape_percent": value, "rows": count,
                              "of": sum(r.generation == gen for r in runs),
                              "out_of_memory": sum(r.out_of_memory for r in rows if r.run.generation == gen)}
    return {"rows": [r.to_json() for r in rows], "mape_percent": overall, "priced_rows": n, "rows_total": len(rows),
            "out_of_memory_rows": sum(r.out_of_memory for r in rows),
            "by_generation": by_generation,
            "seconds": sum(r.plan_s for r in rows)}

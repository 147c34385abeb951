"""`alpasim validate`: every published run of `_published_runs`, priced as its system ran.

Each row is planned as the Megatron-LM configuration it ran (`solvers.plan_model` with
`--method megatron` and the row's degrees, microbatch size, recomputation, sequence
parallelism and optimizer sharding), under the row's system profile, or, a row of a
searched method (`PublishedRun.method`: an Alpa paper's), as what that method finds on
the row's cluster; and the plan is simulated on its schedule (`simulator.simulate`).
The error is signed: predicted over measured, minus one (negative: optimistic). Every row has a status: "priced";
"out of memory", a prediction that failed, since every row ran (the count is reported
beside the MAPE, never hidden in it); or "not expressible", a layout the planner
cannot state yet, with the reason it gave. The MAPE is over the priced rows, with
their count.

A row predicted out of memory is also priced with the device's memory raised to what
its layout needs (`lifted_s`, never in the MAPE): that separates a memory model that
is wrong about the row from a time model that is, since the two fail differently.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from alpasim import graphs as gr
from alpasim import simulator as sim
from alpasim import solvers as sv
from alpasim.units import format_bytes

from ._breakdown import PARTS, iteration_breakdown
from ._published_runs import PUBLISHED_RUNS, PublishedRun

STATUSES = ("priced", "out of memory", "not expressible")


@dataclass(frozen=True, slots=True)
class ValidationRow:
    """One published run against its prediction (`error` = predicted / measured - 1)."""

    run: PublishedRun
    measured_s: float
    predicted_s: float | None
    plan_s: float
    status: str = "priced"               # one of STATUSES (module doc)
    reason: str = ""                     # why it is not priced (not expressible, or does not fit)
    system: dict[str, Any] | None = None
    peak_bytes: float | None = None      # the plan's predicted peak memory per device (priced rows)
    needed_bytes: float | None = None    # out of memory: the least its layouts need per device, where known
    lifted_s: float | None = None        # out of memory: predicted with the device holding `lifted_bytes`
    lifted_bytes: float | None = None    # the memory it was priced with (whole GiB, at least `needed_bytes`)
    breakdown: dict[str, float] | None = None    # priced rows: where the iteration goes (`_breakdown`)

    @property
    def priced(self) -> bool:
        return self.status == "priced"

    @property
    def error(self) -> float | None:
        return None if self.predicted_s is None else self.predicted_s / self.measured_s - 1.0

    def to_json(self) -> dict[str, Any]:
        r = self.run
        return {"id": r.id, "source": r.source, "system": r.system, "method": r.method, "generation": r.generation,
                "gpus": r.gpus,
                "model": r.model, "tp": r.tp, "pp": r.pp, "dp": r.dp, "cp": r.cp, "chunks": r.chunks,
                "ends_as_layers": r.ends_as_layers,
                "microbatch_size": r.microbatch_size, "recompute": r.recompute,
                "sequence_parallel": r.sequence_parallel, "distributed_optimizer": r.distributed_optimizer,
                "sharded_gradients": r.sharded_gradients,
                "measured_s": self.measured_s, "predicted_s": self.predicted_s, "error": self.error,
                "expressible": self.status != "not expressible", "status": self.status, "reason": self.reason, "assumed": list(r.assumed),
                "differs": list(r.differs), "plan_s": self.plan_s, "priced_as": self.system,
                # No source publishes a row's peak memory: the prediction stands beside the device's.
                "predicted_peak_bytes": self.peak_bytes, "measured_peak_bytes": None,
                "needed_memory_bytes": self.needed_bytes, "lifted_predicted_s": self.lifted_s,
                "lifted_memory_bytes": self.lifted_bytes,
                "lifted_error": None if self.lifted_s is None else self.lifted_s / self.measured_s - 1.0,
                "device_memory_bytes": r.cluster.device.memory_bytes, "breakdown": self.breakdown}


def price_run(run: PublishedRun, cache: sv.DiskCache | None = None, lift: bool = True) -> ValidationRow:
    """`run` planned and simulated as its system ran (module doc); `lift=False` leaves
    an out-of-memory row without its time at the memory it needs."""
    t0 = time.perf_counter()
    measured = run.measured_iteration_s
    try:
        plan = _plan(run, run.cluster, cache)
    except (ValueError, sv.PlanInfeasible) as e:     # refused: the layout cannot be expressed
        return ValidationRow(run, measured, None, time.perf_counter() - t0, "not expressible", str(e))
    if not plan.feasible:
        needed = plan.predicted.needed_memory_bytes
        lifted_s, lifted_bytes = _lifted(run, needed, cache) if lift else (None, None)
        return ValidationRow(run, measured, None, time.perf_counter() - t0, "out of memory", "; ".join(plan.notes),
                             plan.system, needed_bytes=needed, lifted_s=lifted_s, lifted_bytes=lifted_bytes)
    timeline = sim.simulate(plan, plan.schedule, chunks=plan.chunks)
    return ValidationRow(run, measured, timeline.iteration_s, time.perf_counter() - t0, system=plan.system,
                         peak_bytes=plan.predicted.peak_memory_bytes, breakdown=iteration_breakdown(timeline))


def _plan(run: PublishedRun, cluster, cache: sv.DiskCache | None) -> sv.PipelinePlan:
    """`run`'s layout planned on `cluster` as its system ran; a searched method's row
    (`PublishedRun.method`), what that method finds there."""
    recompute = {} if run.recompute is None else dict(zip(("remat", "recompute"), sv.RECOMPUTE_OPTIONS[run.recompute]))
    if run.method != "megatron":
        return sv.plan_model(run.model, cluster, run.method, system=run.system, precision=run.precision, cache=cache,
                             **recompute)
    config = sv.MegatronConfig(run.tp, run.pp, run.dp, run.microbatch_size, sequence_parallel=run.sequence_parallel,
                               ends_as_layers=run.ends_as_layers, distributed_optimizer=run.distributed_optimizer,
                               sharded_gradients=run.sharded_gradients, cp=run.cp)
    chunked = {"schedule": "interleaved", "chunk_options": (run.chunks,)} if run.chunks > 1 else {}
    return sv.plan_model(run.model, cluster, "megatron", megatron=config, system=run.system,
                         distributed_optimizer=run.distributed_optimizer, precision=run.precision, cache=cache,
                         **recompute, **chunked)


def _lifted(run: PublishedRun, needed: float | None, cache: sv.DiskCache | None,
            tries: int = 4) -> tuple[float | None, float | None]:
    """(seconds, memory): `run` simulated with each device holding `needed` bytes, rounded up to a whole
    GiB (module doc). A refusal's need can be a lower bound (the 1F1B search's counts
    the states, not the activations): a plan that still does not fit tries again with
    10 % more, or what that refusal needs if more, `tries` times in all. (None, None)
    when no need was said or none of them fits."""
    if needed is None:
        return None, None
    for _ in range(tries):
        gib = math.ceil(needed / 2 ** 30 - 1e-9)
        plan = _plan(run, run.cluster.with_overrides(memory_gb=gib), cache)
        if plan.feasible:
            return sim.simulate(plan, plan.schedule, chunks=plan.chunks).iteration_s, float(gib * 2 ** 30)
        needed = max(plan.predicted.needed_memory_bytes or 0.0, 1.1 * gib * 2 ** 30)
    return None, None


SPAN_MICROBATCH_SIZES = (1, 2, 4)
SPAN_RECOMPUTE = ("none", "selective", "full")


def span_alternatives(run: PublishedRun) -> list[PublishedRun]:
    """`run` at every value its unpublished fields could have had (`UNPUBLISHABLE`):
    microbatch sizes of `SPAN_MICROBATCH_SIZES` that divide a data-parallel rank's
    share of the batch, and each of `SPAN_RECOMPUTE`; `run` itself first."""
    if run.method != "megatron" or not run.unpublished:
        return [run]
    try:
        share = gr.model_source(run.model).global_batch // run.dp
    except (ValueError, KeyError):    # price_run says why, for the row itself
        return [run]
    sizes = [m for m in SPAN_MICROBATCH_SIZES if share % m == 0] if "microbatch_size" in run.unpublished \
        else [run.microbatch_size]
    policies = SPAN_RECOMPUTE if "recompute" in run.unpublished else (run.recompute,)
    others = [dataclasses.replace(run, microbatch_size=m, recompute=r) for m, r in itertools.product(sizes, policies)
              if (m, r) != (run.microbatch_size, run.recompute)]
    return [run, *others]


def span(run: PublishedRun, cache: sv.DiskCache | None = None, first: ValidationRow | None = None) -> dict[str, Any]:
    """The row's predictions over its unpublished settings (`span_alternatives`): each
    alternative's, and the least and most of those priced, and whether the measured
    time lies between them. A sensitivity, never in the MAPE: which of a source's
    unsaid settings ran is not known, so a prediction is as certain as this span."""
    tried, seconds = [], 0.0
    for i, alt in enumerate(span_alternatives(run)):
        row = first if i == 0 and first is not None else price_run(alt, cache, lift=False)
        seconds += row.plan_s if row is not first else 0.0
        tried.append({"microbatch_size": alt.microbatch_size, "recompute": alt.recompute, "status": row.status,
                      "predicted_s": row.predicted_s})
    priced = [t["predicted_s"] for t in tried if t["status"] == "priced"]
    low, high = (min(priced), max(priced)) if priced else (None, None)
    measured = run.measured_iteration_s
    return {"alternatives": tried, "min_s": low, "max_s": high,
            "contains_measured": None if low is None else low <= measured <= high, "seconds": seconds}


def is_span(span_entry: dict[str, Any]) -> bool:
    """Whether a row's `span` varies anything: at least two of its settings priced."""
    return sum(a["status"] == "priced" for a in span_entry["alternatives"]) >= 2


def mape(rows: Iterable[ValidationRow]) -> tuple[float | None, int]:
    """Mean absolute percentage error over the priced rows, and how many there were."""
    errors = [abs(r.error) for r in rows if r.priced]
    return (100.0 * sum(errors) / len(errors) if errors else None), len(errors)


def validate(runs: Sequence[PublishedRun] = PUBLISHED_RUNS, cache: sv.DiskCache | None = None,
             progress: Callable[[str, int, int], None] | None = None, spans: bool = False) -> dict[str, Any]:
    """Every run priced (`price_run`), with MAPE overall and per hardware generation,
    as one JSON-ready dict; `spans`: each row's `span` too (its "span" entry), and how
    many rows' measured times lie in theirs."""
    rows, spanned = [], []
    for i, run in enumerate(runs):
        if progress is not None:
            progress(run.id, i, len(runs))
        rows.append(price_run(run, cache))
        if spans:
            spanned.append(span(run, cache, rows[-1]))
    overall, n = mape(rows)
    by_generation = {}
    for gen in dict.fromkeys(r.generation for r in runs):
        own = [r for r in rows if r.run.generation == gen]
        value, count = mape(own)
        by_generation[gen] = {"mape_percent": value, "rows": count, "of": len(own),
                              "out_of_memory": sum(r.status == "out of memory" for r in own)}
    report_rows = [r.to_json() for r in rows]
    for row, sp in zip(report_rows, spanned):
        row["span"] = sp
    real = [sp for sp in spanned if is_span(sp)]
    extra = {"rows_in_span": sum(bool(sp["contains_measured"]) for sp in real), "rows_with_span": len(real)} \
        if spans else {}
    return {"rows": report_rows, **extra, "mape_percent": overall, "priced_rows": n, "rows_total": len(rows),
            "out_of_memory_rows": sum(r.status == "out of memory" for r in rows),
            "by_generation": by_generation,
            "seconds": sum(r.plan_s for r in rows) + sum(sp["seconds"] for sp in spanned)}


def verdict(row: dict[str, Any]) -> str:
    """What a report row says in a table: its signed error, or why it has none."""
    if row["status"] == "priced":
        return f"{100 * row['error']:+.1f} %"
    if row["status"] != "out of memory":
        return row["reason"]
    need, lifted = row.get("needed_memory_bytes"), row.get("lifted_predicted_s")
    return "predicted out of memory (it ran)" + (
        f": needs {format_bytes(need)} of {format_bytes(row['device_memory_bytes'])}" if need else "") + (
        f"; with {format_bytes(row['lifted_memory_bytes'])} {lifted:.2f} s ({100 * row['lifted_error']:+.1f} %)"
        if lifted is not None else "")


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The MAPE lines under the table: per hardware generation, then all rows."""
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} %"

    lines = [f"{gen}: MAPE {pct(g['mape_percent'])} over {g['rows']} of {g['of']} rows; {g['out_of_memory']} "
             f"predicted out of memory" for gen, g in report["by_generation"].items()]
    lines.append(f"all: MAPE {pct(report['mape_percent'])} over {report['priced_rows']} of {report['rows_total']} "
                 f"rows; {report['out_of_memory_rows']} predicted out of memory, though every row ran")
    if "rows_with_span" in report:
        lines.append(f"measured inside the span of its unpublished settings: {report['rows_in_span']} of "
                     f"{report['rows_with_span']} rows with a span")
    return lines


def breakdown_cells(row: dict[str, Any]) -> list[str]:
    """A report row's iteration parts (`_breakdown.PARTS`) as shares of its prediction,
    or dashes for a row not priced."""
    parts = row.get("breakdown")
    if not parts or not row.get("predicted_s"):
        return ["-"] * len(PARTS)
    return [f"{100 * parts[p] / row['predicted_s']:.0f} %" for p in PARTS]


def span_cell(row: dict[str, Any]) -> str:
    """What a report row with a `span` says of it in a table: its least and most
    predictions and where the measured time lies, or "-" where nothing varies."""
    sp = row.get("span")
    if sp is None or not is_span(sp):
        return "-"
    return f"{sp['min_s']:.2f}-{sp['max_s']:.2f} {'inside' if sp['contains_measured'] else 'outside'}"

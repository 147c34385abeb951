"""The collectives XLA inserted into a compiled stage, read from its HLO, against the plan.

`hlo_collectives(text)` lists every all-reduce, all-gather, reduce-scatter, all-to-all
and collective-permute of an optimized (SPMD-partitioned) HLO module with its bytes
and replica groups. Bytes follow the planner's convention (`alpasim.solvers.Collective`,
`alpasim.costmodels` collective costs), per device:

    all-reduce      the buffer each device reduces (= its result)
    all-gather      the gathered result
    reduce-scatter  the buffer before scattering (= result x group size)
    all-to-all      one device's whole buffer (= its result)

Forms handled: tuple (combined) collectives, whose bytes are the sum of their
elements; async `-start`/`-done` pairs, counted once at the start (an all-gather-start
returns (operands, results); its results are counted); replica groups written as
explicit lists, iota tiles (`[2,4]<=[8]`) or mesh axes (`mesh['axis_0'=2] {'axis_0'}`).

`compare_collectives` sets, per stage, the bytes by kind the plan priced (its layers'
plans' collectives, each once: a microbatch's forward and backward plus the iteration's
gradient sync and update; `PipelineStage.collective_bytes`) against the HLO of its
compiled forward, backward and update (each program once): what was priced, never a
stage solved again. The weight gradients' reduction is in the update program, once per
iteration, as the plan has it (`_partial_grads`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from alpasim.solvers import PipelinePlan

from ._executable import StageExecutable

KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
         "all-to-all": "all_to_all", "collective-permute": "collective_permute"}
PLANNED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
              "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
                   r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\][^,]*|mesh\[[^\]]*\]\s*\{[^}]*\})")


@dataclass(frozen=True, slots=True)
class HloCollective:
    kind: str               # all_reduce | all_gather | reduce_scatter | all_to_all | collective_permute
    nbytes: float           # per device, the planner's convention (module doc)
    group_size: int
    replica_groups: str


def _shape_bytes(text: str) -> list[int]:
    return [_HLO_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text)]


def _group_size(groups: str) -> int:
    if groups.startswith("{{"):
        return len(groups[2:].split("}")[0].split(","))
    if groups.startswith("["):
        return int(groups[1:].split("]")[0].split(",")[-1])
    if groups.startswith("mesh"):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups.split("]")[0]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", groups.split("{", 1)[1]))
    return 1


def hlo_collectives(text: str) -> list[HloCollective]:
    """Every collective of an HLO module's text (module doc)."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        sizes = _shape_bytes(m["shape"])
        if m["start"] and m["op"] == "all-gather":
            sizes = sizes[len(sizes) // 2:]
        g = _GROUPS.search(line)
        groups = g.group(1) if g else ""
        n = _group_size(groups)
        nbytes = float(sum(sizes)) * (n if m["op"] == "reduce-scatter" else 1)
        out.append(HloCollective(KINDS[m["op"]], nbytes, n, groups))
    return out


def stage_collectives(stage: StageExecutable) -> dict[str, list[HloCollective]]:
    """Per compiled program ("forward", "backward", "update") of a stage, its collectives."""
    return {name: hlo_collectives(c.as_text()) for name, c in stage.compiled.items()}


def compare_collectives(plan: PipelinePlan, stages: Sequence[StageExecutable]) -> list[dict]:
    """Per stage: predicted (the plan's record; None for a plan from before it recorded
    them) and measured bytes by kind, their totals and ratio (measured over predicted,
    None when nothing was predicted), and the measured bytes per program."""
    report = []
    for s in stages:
        recorded = plan.stages[s.index].collective_bytes
        predicted: dict[str, float] = defaultdict(float, recorded or {})
        measured: dict[str, float] = defaultdict(float)
        programs = {}
        for name, found in stage_collectives(s).items():
            programs[name] = sum(c.nbytes for c in found if c.kind in PLANNED_KINDS)
            for c in found:
                measured[c.kind] += c.nbytes
        p_total = sum(predicted[k] for k in PLANNED_KINDS)
        m_total = sum(measured[k] for k in PLANNED_KINDS)
        report.append({"stage": s.index, "mesh": list(s.mesh.axis_sizes),
                       "predicted": {k: predicted[k] for k in PLANNED_KINDS} if recorded is not None else None,
                       "measured": {k: measured[k] for k in (*PLANNED_KINDS, "collective_permute")},
                       "predicted_bytes": p_total if recorded is not None else None, "measured_bytes": m_total,
                       "ratio": m_total / p_total if p_total and recorded is not None else None,
                       "measured_by_program": programs})
    return report

"""A runs file: published runs of one's own, checked as the built-in ones are.

`alpasim validate` prices the rows the project keeps (`_published_runs`). A model
checked only against the rows its authors saw may have learnt them; a set of other
published runs, kept from the project, is what judges whether it generalises. This
module is how such a set gets in: `alpasim validate --runs FILE` prices the file's rows
instead of the built-in ones, with the same table, MAPE and JSON.
`alpasim validate --save-runs FILE` writes the built-in rows in this format, a
template with every field.

The file is JSON, schema ``alpasim.runs/1``::

    {"schema": "alpasim.runs/1",
     "runs": [{"id": "gpt-22b-a100", "source": "a paper, its table",
               "system": "megatron-lm-2022", "cluster": "dgx-a100",
               "model": "gpt3:hidden=6144,layers=48,heads=64,seq=2048,batch=4",
               "tp": 8, "pp": 1, "dp": 1, "microbatch_size": 4, "recompute": "full",
               "measured_s": 1.42}]}

Required per row: `id` (unique), `system` (a profile of `solvers.SYSTEMS`), `cluster`
(a preset name, sized to the row's GPUs, or a cluster JSON object, `alpasim.cluster/1`,
with exactly the row's GPUs), `model` (a zoo spec), and the measurement: `measured_s`
(seconds per iteration) or `measured_tflops` (per GPU), the latter with
`flops_per_iteration` (the source's own count) or, for GPT and Llama models,
Megatron-LM's model-FLOP count of the spec. And what ran: `method` "megatron" (the
default) prices the published layout, `tp`, `pp`, `dp` and `microbatch_size` (required)
with `cp`, `chunks`, `sequence_parallel`, `distributed_optimizer`, `sharded_gradients`
and `ends_as_layers`; any other `solvers.METHODS` name (alpa, zero3, megatron-core, ...)
prices what that method's own search finds on `gpus` GPUs (required), as an Alpa paper
row reports Alpa's plan, and takes no layout fields. Optional: `source`, `generation`
(what MAPE groups by; default the device's name up to its first dash, A100 of
A100-SXM-80GB), `recompute` (full, selective, none; default none for a layout, the
system profile's for a searched method),
`precision`, `assumed` and `differs` (lists of text), `unpublished` (which of
microbatch_size and recompute the source leaves unsaid: `validate --spans` prices the
row at each value they could have had). Every field is checked when the
file is read, before anything is priced: an unknown field, a wrong type, a name that
does not exist, a layout whose GPUs are not its cluster's or whose batch does not split
into its microbatches is one line naming the row and the field. A layout the planner
then refuses (more stages than blocks, tensor parallelism beyond a node) is a row
"not expressible", with the planner's reason, as a built-in row would be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from alpasim import costmodels as cm
from alpasim import graphs as gr
from alpasim import solvers as sv

from ._published_runs import UNPUBLISHABLE, PublishedRun, gpt_model_flops, llama_model_flops

RUNS_SCHEMA = "alpasim.runs/1"

# Field: (JSON type, default; `_REQUIRED` for none). The layout and flags as PublishedRun has them.
_REQUIRED = object()
_FIELDS: dict[str, tuple[type, Any]] = {
    "id": (str, _REQUIRED), "source": (str, ""), "system": (str, _REQUIRED), "generation": (str, None),
    "cluster": (object, _REQUIRED), "model": (str, _REQUIRED),
    "method": (str, "megatron"), "gpus": (int, None),
    "tp": (int, None), "pp": (int, None), "dp": (int, None), "cp": (int, 1),
    "microbatch_size": (int, None), "chunks": (int, 1), "recompute": (str, None),
    "sequence_parallel": (bool, False), "distributed_optimizer": (bool, False), "sharded_gradients": (bool, False),
    "ends_as_layers": (bool, False), "precision": (str, "mixed-fp32grad"),
    "measured_s": (float, None), "measured_tflops": (float, None), "flops_per_iteration": (float, None),
    "assumed": (list, ()), "differs": (list, ()), "unpublished": (list, ()),
}
_RECOMPUTE = ("full", "selective", "none")
# The published layout: required with method "megatron", refused with a searched method.
_LAYOUT = ("tp", "pp", "dp", "microbatch_size")
_LAYOUT_FLAGS = ("cp", "chunks", "sequence_parallel", "distributed_optimizer", "sharded_gradients", "ends_as_layers",
                 "unpublished")


class RunsFileError(ValueError):
    """A runs file that cannot be read or holds a row that is not a run (one line)."""


def run_to_json(run: PublishedRun) -> dict[str, Any]:
    """`run` as a runs-file row (module doc); `runs_from_json` reads it back equal."""
    row = {name: getattr(run, name) for name in _FIELDS if name != "cluster"}
    row.update(cluster=run.cluster.to_json(), assumed=list(run.assumed), differs=list(run.differs),
               unpublished=list(run.unpublished))
    if run.method != "megatron":          # a searched method's row states no layout
        row = {k: v for k, v in row.items() if k not in _LAYOUT_FLAGS}
    return {k: v for k, v in row.items() if v is not None}


def runs_to_json(runs: tuple[PublishedRun, ...] | list[PublishedRun]) -> dict[str, Any]:
    return {"schema": RUNS_SCHEMA, "runs": [run_to_json(r) for r in runs]}


def read_runs_file(path: str | Path) -> tuple[PublishedRun, ...]:
    """The runs of the file at `path`, every row checked (module doc)."""
    return runs_from_json(gr.read_json_file(path, RunsFileError), str(path))


def runs_from_json(data: Any, where: str = "runs file") -> tuple[PublishedRun, ...]:
    if not isinstance(data, Mapping) or data.get("schema") != RUNS_SCHEMA:
        raise RunsFileError(f"{where}: expected a JSON object with \"schema\": \"{RUNS_SCHEMA}\" and \"runs\"")
    extra = sorted(set(data) - {"schema", "runs"})
    if extra:
        raise RunsFileError(f"{where}: unknown field {extra[0]!r} (known: runs, schema)")
    rows = data.get("runs")
    if not isinstance(rows, list) or not rows:
        raise RunsFileError(f"{where}: \"runs\" must be a non-empty list of rows")
    runs, seen = [], set()
    for i, row in enumerate(rows):
        run = _run_from_json(row, f"{where}: runs[{i}]", where)
        if run.id in seen:
            raise RunsFileError(f"{where}: runs[{i}]: id {run.id!r} appears twice")
        seen.add(run.id)
        runs.append(run)
    return tuple(runs)


def _run_from_json(row: Any, where: str, file: str) -> PublishedRun:
    if not isinstance(row, Mapping):
        raise RunsFileError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if isinstance(row.get("id"), str) and row["id"]:
        where = f"{where} ({row['id']})"
    unknown = sorted(set(row) - set(_FIELDS))
    if unknown:
        raise RunsFileError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(_FIELDS)})")
    values = {name: _field(row, name, where) for name in _FIELDS}
    values["assumed"], values["differs"] = tuple(values["assumed"]), tuple(values["differs"])
    values["unpublished"] = tuple(values["unpublished"])
    stray = sorted(set(values["unpublished"]) - set(UNPUBLISHABLE))
    if stray:
        raise RunsFileError(f"{where}: field 'unpublished' names {stray[0]!r}; a row may leave unpublished only "
                            f"{', '.join(UNPUBLISHABLE)}")
    values["method"] = _method(values["method"], where)
    gpus = _gpus(values, row, where)
    values["cluster"] = _cluster(values["cluster"], gpus, where)
    _check_names(values, where)
    source = _model(values["model"], where)
    if values["method"] == "megatron" and source.global_batch % (values["dp"] * values["microbatch_size"]):
        raise RunsFileError(f"{where}: the model's global batch {source.global_batch} does not split into "
                            f"microbatches of {values['microbatch_size']} over dp {values['dp']}")
    _check_measurement(values, source, where)
    del values["gpus"]
    if values["method"] == "megatron" and values["recompute"] is None:
        values["recompute"] = "none"      # a stated layout states its recomputation; unsaid, none
    if values["generation"] is None:
        values["generation"] = values["cluster"].device.name.split("-")[0]
    values["source"] = values["source"] or file
    try:
        return PublishedRun(**values)
    except ValueError as e:               # a rule the checks above do not repeat
        raise RunsFileError(f"{where}: {e}") from None


def _field(row: Mapping, name: str, where: str) -> Any:
    kind, default = _FIELDS[name]
    if name not in row:
        if default is _REQUIRED:
            raise RunsFileError(f"{where}: missing field {name!r}")
        return default
    value = row[name]
    ok = {str: isinstance(value, str) and (bool(value) or name == "source"), bool: isinstance(value, bool), object: True,
          int: isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          float: isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf,
          list: isinstance(value, list) and all(isinstance(v, str) for v in value)}[kind]
    if not ok:
        what = {str: "a non-empty string", bool: "true or false", int: "an integer >= 1",
                float: "a finite number > 0", list: "a list of strings"}[kind]
        raise RunsFileError(f"{where}: field {name!r} must be {what}, got {value!r}")
    if name == "source" and not value:
        return default
    return float(value) if kind is float else value


def _method(name: str, where: str) -> str:
    """A `solvers.METHODS` name (its CLI spelling too), as the planner knows it."""
    try:
        return sv.get_method(name).name
    except sv.UnknownMethodError:
        raise RunsFileError(f"{where}: unknown method {name!r} (known: "
                            f"{', '.join(m.cli_name for m in sv.METHODS.values())})") from None


def _gpus(values: dict[str, Any], row: Mapping, where: str) -> int:
    """The row's GPUs: its layout's product (method megatron, where `gpus` may repeat
    it), else `gpus` (a searched method, which takes no layout)."""
    if values["method"] != "megatron":
        given = [k for k in (*_LAYOUT, *_LAYOUT_FLAGS) if k in row]
        if given:
            raise RunsFileError(f"{where}: field {given[0]!r} is a published layout (method megatron); method "
                                f"{values['method']} searches its own")
        if values["gpus"] is None:
            raise RunsFileError(f"{where}: missing field 'gpus' (a searched method's row says how many GPUs ran)")
        return values["gpus"]
    missing = [k for k in _LAYOUT if values[k] is None]
    if missing:
        raise RunsFileError(f"{where}: missing field {missing[0]!r} (method megatron prices the published layout: "
                            f"{', '.join(_LAYOUT)})")
    gpus = values["tp"] * values["pp"] * values["dp"] * values["cp"]
    if values["gpus"] is not None and values["gpus"] != gpus:
        raise RunsFileError(f"{where}: gpus {values['gpus']} is not tp x pp x dp x cp = {gpus}")
    return gpus


def _cluster(spec: Any, gpus: int, where: str) -> cm.Cluster:
    """A preset sized to `gpus` (whole nodes, or part of one), or a cluster JSON object with exactly `gpus`."""
    try:
        if isinstance(spec, str):
            per_node = cm.get_cluster(spec).devices_per_node
            if gpus > per_node and gpus % per_node:
                raise RunsFileError(f"{where}: {gpus} GPUs are not whole nodes of {spec!r} ({per_node} per node)")
            if gpus < per_node:
                return cm.get_cluster(spec, nodes=1, devices_per_node=gpus)
            return cm.get_cluster(spec, nodes=gpus // per_node)
        if isinstance(spec, Mapping):
            cluster = cm.Cluster.from_json(spec)
        else:
            raise RunsFileError(f"{where}: field 'cluster' must be a preset name or a cluster JSON object")
    except (cm.ClusterError, cm.UnknownPresetError) as e:
        raise RunsFileError(f"{where}: {e.args[0] if e.args else e}") from None
    if cluster.num_devices != gpus:
        raise RunsFileError(f"{where}: the row ran on {gpus} GPUs, but the cluster has {cluster.num_devices}")
    return cluster


def _check_names(values: dict[str, Any], where: str) -> None:
    if values["system"] not in sv.SYSTEMS:
        raise RunsFileError(f"{where}: unknown system {values['system']!r} (known: {', '.join(sv.SYSTEMS)})")
    if values["recompute"] is not None and values["recompute"] not in _RECOMPUTE:
        raise RunsFileError(f"{where}: recompute must be one of {', '.join(_RECOMPUTE)}, got {values['recompute']!r}")
    if values["precision"] not in gr.RECIPES:
        raise RunsFileError(f"{where}: unknown precision {values['precision']!r} (known: {', '.join(gr.RECIPES)})")
    if values["method"] != "megatron":
        return
    try:
        sv.MegatronConfig(values["tp"], values["pp"], values["dp"], values["microbatch_size"],
                          sequence_parallel=values["sequence_parallel"], ends_as_layers=values["ends_as_layers"],
                          distributed_optimizer=values["distributed_optimizer"],
                          sharded_gradients=values["sharded_gradients"], cp=values["cp"])
    except ValueError as e:
        raise RunsFileError(f"{where}: {e}") from None


def _model(spec: str, where: str) -> gr.ModelSource:
    try:
        source = gr.model_source(spec)
    except (ValueError, gr.UnknownModelError) as e:     # a KeyError: its text is its first argument
        raise RunsFileError(f"{where}: model {spec!r}: {e.args[0] if e.args else e}") from None
    if source.config is None:
        raise RunsFileError(f"{where}: model {spec!r} is a saved graph; a runs file names zoo models")
    return source


def _check_measurement(values: dict[str, Any], source: gr.ModelSource, where: str) -> None:
    """Exactly one of seconds and throughput; a throughput gets its FLOP count (module doc)."""
    if (values["measured_s"] is None) == (values["measured_tflops"] is None):
        raise RunsFileError(f"{where}: give exactly one of 'measured_s' and 'measured_tflops'")
    if values["measured_tflops"] is None:
        if values["flops_per_iteration"] is not None:
            raise RunsFileError(f"{where}: 'flops_per_iteration' goes with 'measured_tflops', not 'measured_s'")
        return
    if values["flops_per_iteration"] is None:
        values["flops_per_iteration"] = model_flops(source.config, where)


def model_flops(cfg: Any, where: str = "model") -> float:
    """Megatron-LM's model-FLOP count of one iteration of a zoo GPT or Llama model."""
    if cfg.family == "gpt3" and cfg.ffn_mult == 4:
        return gpt_model_flops(cfg.batch, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab)
    if cfg.family == "llama":
        return llama_model_flops(cfg.batch, cfg.seq, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn,
                                 cfg.vocab)
    raise RunsFileError(f"{where}: no model-FLOP count for a {cfg.family} model here; give 'flops_per_iteration'")

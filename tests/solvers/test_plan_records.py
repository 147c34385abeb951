"""The plan's typed records: exact round trips, every field checked against its type,
and a bad field named by its path."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import get_cluster
from alpasim.simulator import synthetic_plan
from alpasim.solvers import (
    PipelinePlan,
    PlanFormatError,
    PlanModel,
    Prediction,
    SearchStats,
    PlanTransfer,
    plan_from_json,
)

CLUSTER = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)


def _plan() -> PipelinePlan:
    return synthetic_plan([1.0, 2.0], [2.0, 4.0], 4, devices_per_stage=2, cluster=CLUSTER, hidden_shape=(4, 8),
                          specs=("S0R", "RR"))


def _leaves(data, path=()):
    """(path, value) of every scalar in a JSON tree (not inside free-form dicts)."""
    if isinstance(data, dict):
        for k, v in data.items():
            if k in ("spec", "memory", "source", "param_specs", "extra"):
                continue
            yield from _leaves(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _leaves(v, (*path, i))
    else:
        yield path, data


def _set(data, path, value):
    for k in path[:-1]:
        data = data[k]
    data[path[-1]] = value


def _shown(path) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def test_a_plan_round_trips_exactly_and_its_parts_are_typed():
    plan = _plan()
    data = json.loads(json.dumps(plan.to_json()))
    again = plan_from_json(data)
    assert again == plan and again.to_json() == data
    assert isinstance(again.transfers[0], PlanTransfer) and again.transfers[0].shape == (4, 8)
    assert isinstance(again.predicted, Prediction) and isinstance(again.search, SearchStats)
    assert again.cluster.spec == CLUSTER.to_json()
    # JSON integers where a float is declared are read as floats; booleans never as numbers.
    data["stages"][0]["time_s"] = 3
    assert plan_from_json(data).stages[0].time_s == 3.0 and isinstance(plan_from_json(data).stages[0].time_s, float)


def test_fields_a_newer_writer_adds_survive_a_read_and_a_write():
    data = _plan().to_json()
    data["model"]["sequence_parallel"] = True
    data["predicted"]["energy_j"] = 12.5
    data["search"]["rewrites"] = ["fusion"]
    plan = plan_from_json(json.loads(json.dumps(data)))
    assert plan.model.extra == {"sequence_parallel": True} and plan.predicted.extra == {"energy_j": 12.5}
    assert plan.to_json() == json.loads(json.dumps(data))
    # Where a record has no room for them (a stage, a transfer), unknown fields are refused.
    data["transfers"][0]["tensr"] = "typo"
    with pytest.raises(PlanFormatError, match=r"transfers\[0\]: unknown field 'tensr'"):
        plan_from_json(data, "p.json")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_field_of_the_wrong_type_is_named_by_its_path(data):
    good = json.loads(json.dumps(_plan().to_json()))
    leaves = [(p, v) for p, v in _leaves(good) if p != ("schema",)]
    path, value = data.draw(st.sampled_from(leaves))
    # A value no field of this plan accepts where it has a number, string or flag.
    wrong = {bool: "yes", int: "7", float: "fast", str: 7, type(None): True}[type(value)]
    bad = copy.deepcopy(good)
    _set(bad, path, wrong)
    try:
        plan_from_json(bad, "p.json")
    except PlanFormatError as e:
        assert str(e).startswith(f"p.json: {_shown(path)}"), (path, str(e))
    else:
        raise AssertionError(f"{_shown(path)} = {wrong!r} was accepted")


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["transfers"][0].update(src_stage=5), "transfers[0]: stages 5 -> 1 are not two of the plan's 2"),
    (lambda d: d["transfers"][0].update(dst_stage=0), "transfers[0]: stages 0 -> 0 are not two stages"),
    (lambda d: d["transfers"][0].update(direction="sideways"), "transfers[0]: direction 'sideways'"),
    (lambda d: d["stages"][1].update(layers=[3, 2]), "stages[1]: layers [3, 2] are not a range"),
    (lambda d: d["stages"][1].update(submesh=[1, 2, 3]), "stages[1].submesh: expected 2 entries, got 3"),
    (lambda d: d["search"].update(cost_model={"name": "x"}), "search.cost_model: missing field 'digest'"),
    (lambda d: d.pop("predicted"), "missing field 'predicted'"),
    (lambda d: d["stages"][0].update(collective_bytes={"all_reduce": -1.0}),
     "stages[0].collective_bytes.all_reduce: must be a finite number >= 0"),
    (lambda d: d["stages"][0].update(collective_bytes={"all_reduce": "many"}), "stages[0].collective_bytes"),
])
def test_bad_values_are_refused_with_where_they_are(change, fragment):
    data = json.loads(json.dumps(_plan().to_json()))
    change(data)
    with pytest.raises(PlanFormatError) as e:
        plan_from_json(data, "p.json")
    assert str(e.value).startswith("p.json") and fragment in str(e.value), str(e.value)


def test_an_infeasible_plan_records_its_model_and_no_prediction():
    from alpasim.graphs import model_source
    from alpasim.solvers import infeasible_plan

    source = model_source("gpt3-1.3b")
    plan = infeasible_plan(source, CLUSTER, "zero2", "does not fit")
    assert plan.model == PlanModel("gpt3-1.3b", "gpt3", source.global_batch) and plan.predicted == Prediction()
    assert plan.notes == ("does not fit",) and not plan.feasible
    assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == plan

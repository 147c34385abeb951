"""The method registry and the one planner entry: what each method's record allows,
and every model source planned through the same call."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from alpasim.costmodels import get_cluster
from alpasim.graphs import JaxModel, from_jax, graph_digest, graph_to_json, save_graph
from alpasim.solvers import (
    COMMON_OPTIONS,
    METHODS,
    MegatronConfig,
    SearchSpace,
    UnknownMethodError,
    get_method,
    plan_model,
)
from alpasim.solvers._methods import METHOD_OPTIONS

sys.path.insert(0, str(Path(__file__).parents[1] / "graphs"))
from test_jax_import import TF, gpt_loss, gpt_shapes  # noqa: E402

TINY = "gpt3:hidden=32,layers=2,heads=2,seq=8,vocab=64,batch=8"
CLUSTER = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
VALUES = {"layers": 2, "max_stages": 2, "megatron": MegatronConfig(2, 2, 1, 1), "distributed_optimizer": True,
          "sequence_parallel": True}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_an_option_a_method_does_not_take_is_refused_before_any_planning(name):
    method = METHODS[name]
    assert method.accepts <= set(METHOD_OPTIONS)
    for key in METHOD_OPTIONS:
        if key not in method.accepts:
            with pytest.raises(ValueError, match=f"{key} does not apply to method {method.cli_name}"):
                # An unknown model too: the option is refused first, so nothing is built.
                plan_model("no-such-model", CLUSTER, name, **{key: VALUES[key]})


def test_method_names_and_unknown_options():
    assert get_method(" Equal-Layer ").name == "equal_layer" and get_method("zero3") is METHODS["zero3"]
    with pytest.raises(UnknownMethodError, match="choose one of alpa, intra-only, inter-only"):
        get_method("gpipe")
    with pytest.raises(TypeError, match="unknown option 'shape_ok'"):
        plan_model(TINY, CLUSTER, "alpa", shape_ok=lambda sh: True)
    assert "remat" in COMMON_OPTIONS and "restriction" not in COMMON_OPTIONS


def test_each_record_is_the_search_it_names():
    n = CLUSTER.num_devices
    assert METHODS["alpa"].space(CLUSTER) == SearchSpace(method="alpa", system="alpa-osdi22")
    dp = METHODS["data_parallel"].space(CLUSTER)
    assert dp == SearchSpace(method="data_parallel", system="alpa-osdi22", max_stages=1, restriction="data_parallel",
                             microbatch_multiple=n)
    assert METHODS["heuristic"].space(CLUSTER) == SearchSpace(method="heuristic", system="alpa-osdi22",
                                                              max_stages=1, restriction="heuristic")
    inter = METHODS["inter_only"].space(CLUSTER)
    assert inter.max_stages == n and inter.shape_ok(type("S", (), {"size": 1})())
    assert not inter.shape_ok(type("S", (), {"size": 2})())
    # A method's own choice wins over the user's narrowing; what it leaves free is the user's.
    assert METHODS["equal_operator"].space(CLUSTER, pareto=True).pareto is False
    assert METHODS["alpa"].space(CLUSTER, pareto=False, microbatches=4) == \
        SearchSpace(method="alpa", system="alpa-osdi22", pareto=False, microbatches=4)
    # Every method but Megatron-LM's plans a saved graph.
    assert [m.name for m in METHODS.values() if m.zoo_only] == ["megatron", "megatron_core"]


@pytest.mark.slow
def test_a_jax_function_a_saved_graph_and_the_graph_plan_alike(tmp_path):
    params, batch = gpt_shapes(**{**TF, "B": 8})
    model = JaxModel(gpt_loss, params, batch, name="my_gpt")
    graph = from_jax(gpt_loss, params, batch, name="my_gpt")
    save_graph(graph, tmp_path / "my_gpt.json")
    kw = {"microbatches": 2, "layers": 2, "max_stages": 2}
    plans = [plan_model(src, CLUSTER, "pp_dp", **kw) for src in (model, str(tmp_path / "my_gpt.json"), graph)]
    digest = graph_digest(graph_to_json(graph))
    for plan in plans:
        assert plan.feasible and plan.method == "pp_dp" and plan.model.name == "my_gpt"
        assert plan.model.source["digest"] == digest and plan.model.microbatch_size == 4
        assert plan.predicted.iteration_s == pytest.approx(plans[0].predicted.iteration_s, rel=1e-9)
        assert [s.layers for s in plan.stages] == [s.layers for s in plans[0].stages]

"""A user's own JAX model, imported and saved, is planned, simulated and run.

The model is a GPT written directly in JAX (`tests/graphs/test_jax_import.py`: tied
head, causal attention, GeLU MLP). Independent figures: the single-device step of the
same graph (`reference_step`, through the `reference` fixture); the graph the plan
embeds against the file it came from (by digest). The plan file is moved away from the
graph file before it runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

from alpasim.backends import check_numerics, run_local
from alpasim.costmodels import get_cluster
from alpasim.graphs import GraphFormatError, ModelSpecError, from_jax, graph_digest, graph_to_json, load_graph, save_graph
from alpasim.simulator import simulate
from alpasim.solvers import PlanModel, SearchSpace, load_plan, plan_pipeline, plan_with_method, planning_graph

sys.path.insert(0, str(Path(__file__).parents[1] / "graphs"))
from test_jax_import import TF, gpt_loss, gpt_shapes  # noqa: E402

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# Compiles whole pipelined plans: `make test-fast` leaves these to `make test`.
pytestmark = pytest.mark.slow


@needs_8
def test_an_imported_model_is_planned_simulated_and_run_from_its_plan_alone(tmp_path, reference):
    graph_file = tmp_path / "gpt.json"
    save_graph(from_jax(gpt_loss, *gpt_shapes(**{**TF, "B": 8}), name="my_gpt"), graph_file)
    plan = plan_pipeline(str(graph_file), get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=2, layers=2, pareto=False, shape_ok=lambda sh: sh.size == 4,
                                     views_of=lambda sh: [(2, 2)]))
    src = plan.model.source
    assert src["kind"] == "graph" and src["digest"] == graph_digest(graph_to_json(load_graph(graph_file)))
    assert plan.model.global_batch == 8 and plan.model.microbatch_size == 4 and len(plan.stages) == 2
    # The microbatch graph the plan was priced on: the saved graph at half its batch.
    mb = planning_graph(plan.model)
    assert mb.tensors["batch/ids"].shape == (4, TF["T"]) and mb.num_layers == 2

    edited = json.loads(json.dumps(plan.to_json()))   # a copy: to_json shares the plan's own dicts
    edited["model"]["source"]["graph"]["tensors"][0]["shape"][0] += 1
    with pytest.raises(GraphFormatError, match="does not match its digest"):
        planning_graph(PlanModel.from_json(edited["model"]))   # `alpasim run` prints it as its one-line error (exit 2)

    moved = tmp_path / "elsewhere" / "plan.json"
    moved.parent.mkdir()
    plan.save(moved)
    graph_file.unlink()                      # the plan carries its graph
    again = load_plan(moved)
    assert simulate(again).iteration_s > 0
    result = run_local(again, steps=1)
    assert check_numerics(result.losses[0], result.grads, reference(again))["numerics_ok"]


def test_megatron_refuses_a_saved_graph_and_names_the_methods_that_take_it(tmp_path):
    graph_file = tmp_path / "g.json"
    save_graph(from_jax(gpt_loss, *gpt_shapes(**TF), name="g"), graph_file)
    with pytest.raises(ModelSpecError, match="other methods"):
        plan_with_method("megatron", str(graph_file), get_cluster("aws-p3.16xlarge", nodes=1))


def test_compare_takes_a_saved_graph_and_says_why_megatron_does_not(tmp_path):
    from alpasim.experiments import compare
    from alpasim.experiments._points import Point

    graph_file = tmp_path / "g.json"
    save_graph(from_jax(gpt_loss, *gpt_shapes(**TF), name="g"), graph_file)
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    cmp = compare(str(graph_file), cluster, ["data_parallel", "megatron"], cache=False, workers=1)
    dp, megatron = cmp.results
    assert dp.feasible and dp.throughput_pflops > 0
    assert not megatron.feasible and "saved graph" in megatron.notes[0]
    # The result cache keys a graph by what the file holds, not by its path.
    before = Point(str(graph_file), cluster, "data_parallel").key()
    save_graph(from_jax(gpt_loss, *gpt_shapes(**{**TF, "H": 2 * TF["H"]}), name="g"), graph_file)
    assert Point(str(graph_file), cluster, "data_parallel").key() != before


def test_sweep_takes_a_saved_graph_and_marks_what_a_method_does_not_take(tmp_path):
    from alpasim.experiments import sweep, sweep_cell

    graph_file = tmp_path / "g.json"
    save_graph(from_jax(gpt_loss, *gpt_shapes(**TF), name="g"), graph_file)
    report = sweep(str(graph_file), 2, "devices_per_node", [1, 2], ["data_parallel", "megatron"], workers=1,
                   cache=False)
    for v in (1, 2):
        assert report.result(v, "data_parallel").feasible
        refused = report.result(v, "megatron")
        assert refused.refused and sweep_cell(refused) == "n/a"
    assert report.stem() == "sweep-g-devices_per_node"
    files = report.write(tmp_path / "out")
    assert "| n/a |" in Path(files["md"]).read_text()

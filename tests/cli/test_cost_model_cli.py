"""`--cost-model` on plan and simulate: recorded in the plan, and one-line errors for bad files."""

from __future__ import annotations

import json

import pytest

from alpasim.costmodels import CollectiveFit, Link, OpFit, ProfiledCostModel, get_cluster

MODEL = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=4"
CLUSTER = ["--cluster", "aws-p3.16xlarge", "--nodes", "1", "--devices-per-node", "2"]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    ops = {c: OpFit(10e-6, 1 / 20e9, 1 / 10e9) for c in ("matmul", "elementwise", "softmax", "normalization")}
    collectives = {(k, 2): CollectiveFit(50e-6, 1e-9) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                                "all_to_all")}
    model = ProfiledCostModel("cli-test", ops, collectives, Link("memcpy", 80.0, 20e-6), get_cluster("dgx-a100"))
    path = tmp_path_factory.mktemp("cm") / "profile.json"
    model.save(path)
    return path, model.digest


def test_plan_and_simulate_with_a_profile(profile_path, tmp_path, cli):
    path, digest = profile_path
    plan_file = tmp_path / "plan.json"
    proc = cli("plan", "--model", MODEL, *CLUSTER, "--microbatches", "2", "--no-cache", "--workers", "1",
               "--cost-model", str(path), "--out", str(plan_file), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["search"]["cost_model"] == {"name": "cli-test", "digest": digest}
    assert plan["cluster"]["spec"]["intra_node"]["name"] == "memcpy"
    proc = cli("simulate", str(plan_file), "--cost-model", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["iteration_s"] > 0 and not any("priced by" in n for n in report["notes"])
    # An analytic plan simulated with a profile says what was (not) re-priced.
    analytic = tmp_path / "analytic.json"
    assert cli("plan", "--model", MODEL, *CLUSTER, "--microbatches", "2", "--no-cache", "--workers", "1",
               "--out", str(analytic), "--json").returncode == 0
    report = json.loads(cli("simulate", str(analytic), "--cost-model", str(path), "--json").stdout)
    assert any("priced by the analytic model" in n for n in report["notes"])


@pytest.fixture(scope="module")
def analytic_plan(tmp_path_factory, cli):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli("plan", "--model", MODEL, *CLUSTER, "--microbatches", "2", "--no-cache", "--workers", "1",
               "--out", str(path), "--json").returncode == 0
    return path


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{oops", "not valid JSON"),
    ('{"schema": "alpasim.costmodel/1", "name": "x"}', "missing field 'ops'"),
])
def test_bad_cost_model_files_are_one_line_errors(tmp_path, analytic_plan, content, message, cli):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    for args in (["plan", "--model", MODEL, *CLUSTER], ["simulate", str(analytic_plan)]):
        proc = cli(*args, "--cost-model", str(path))
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and lines[0].startswith("alpasim: error:"), proc.stderr

"""`alpasim simulate` and `alpasim plan --simulate` end to end."""

from __future__ import annotations

import json

import pytest

from alpasim.costmodels import get_cluster
from alpasim.simulator import synthetic_plan


@pytest.fixture
def plan_file(tmp_path):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    plan = synthetic_plan([0.01] * 4, [0.02] * 4, 8, cluster=cluster, params_bytes=1e9, activation_bytes=1e8,
                          layers_per_stage=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_simulate_json_contract(plan_file, tmp_path, cli):
    proc = cli("simulate", str(plan_file), "--json", "--trace", str(tmp_path / "t.json"), "--gantt",
               str(tmp_path / "g.png"), "--memory-png", str(tmp_path / "m.png"))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    # Control messages only: eq. 2 exactly, (S + B - 1)(t_f + t_b).
    assert r["iteration_s"] == pytest.approx((4 + 8 - 1) * 0.03, rel=1e-12)
    assert r["predicted_iteration_s"] == pytest.approx(r["iteration_s"])
    assert r["bubble_fraction"] == pytest.approx(3 / 11)
    assert r["schedule"] == "1f1b" and r["cross_mesh_bytes"] == 0
    assert r["peak_memory_bytes"] == [pytest.approx(1e9 + min(4 - i, 8) * 1e8) for i in range(4)]
    assert [m["devices"] for m in r["meshes"]] == [[0], [1], [2], [3]]
    assert {"busy_s", "comm_s", "idle_s"} <= set(r["meshes"][0])
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "g.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0


def test_simulate_table_and_other_schedules(plan_file, tmp_path, cli):
    proc = cli("simulate", str(plan_file), "--schedule", "interleaved", "--chunks", "2", "--gantt",
               str(tmp_path / "g.png"))
    assert proc.returncode == 0, proc.stderr
    assert "simulated iteration" in proc.stdout and f"wrote gantt: {tmp_path / 'g.png'}" in proc.stdout
    r = json.loads(cli("simulate", str(plan_file), "--schedule", "gpipe", "--json").stdout)
    assert r["schedule"] == "gpipe" and max(r["peak_memory_bytes"]) == pytest.approx(1e9 + 8 * 1e8)


def _edit(path, tmp_path, edit):
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / "bad.json"
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.pop("stages"), "missing field 'stages'"),
    (lambda d: d.pop("microbatches"), "missing field 'microbatches'"),
    (lambda d: d["stages"][1].pop("devices"), "stages[1]: missing field 'devices'"),
    (lambda d: d["stages"][2].update(devices=[]), "stages[2]: field 'devices' is empty"),
    (lambda d: d.update(schema="alpasim.plan/0"), "'schema'"),
    (lambda d: d.update(stages=[]), "field 'stages' is empty"),
])
def test_bad_plans_are_one_line_naming_the_field(plan_file, tmp_path, edit, fragment, cli):
    proc = cli("simulate", str(_edit(plan_file, tmp_path, edit)), "--json")
    assert proc.returncode == 2, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and fragment in lines[0]


def test_plans_without_the_forward_backward_split_still_simulate(plan_file, tmp_path, cli):
    def strip(d):
        for s in d["stages"]:
            s.pop("forward_s")
            s.pop("backward_s")

    proc = cli("simulate", str(_edit(plan_file, tmp_path, strip)), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["iteration_s"] == pytest.approx(11 * 0.03)


def test_sends_block_as_the_plan_says_unless_told(tmp_path, cli):
    """A synthetic plan records no system: its sends are overlapped, `--p2p blocking`
    holds each stage until its output lands (longer, and counted as communication)."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=2, devices_per_node=1)
    plan = synthetic_plan([0.01] * 2, [0.02] * 2, 4, cluster=cluster, hidden_shape=(256, 1024))
    path = tmp_path / "plan.json"
    plan.save(path)
    runs = {p2p: json.loads(cli("simulate", str(path), "--json", *(("--p2p", p2p) if p2p else ())).stdout)
            for p2p in (None, "overlapped", "blocking")}
    assert runs[None]["iteration_s"] == runs["overlapped"]["iteration_s"] < runs["blocking"]["iteration_s"]
    assert (runs[None]["blocking_sends"], runs["blocking"]["blocking_sends"]) == (False, True)
    assert runs["blocking"]["meshes"][0]["comm_s"] > runs["overlapped"]["meshes"][0]["comm_s"]


@pytest.mark.parametrize("args, fragment", [
    (["--schedule", "zigzag"], "1f1b, gpipe, interleaved"),
    (["--cross-mesh", "pigeon"], "local_all_gather"),
    (["--chunks", "0"], "--chunks"),
    (["--p2p", "eventually"], "overlapped or blocking"),
])
def test_bad_options_are_one_line(plan_file, args, fragment, cli):
    proc = cli("simulate", str(plan_file), *args)
    assert proc.returncode == 2 and fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_plan_file_is_one_line(tmp_path, cli):
    proc = cli("simulate", str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "nope.json" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_simulate_json_adds_the_simulation(tmp_path, cli):
    env = {"ALPASIM_CACHE_DIR": str(tmp_path / "cache")}
    proc = cli("plan", "--model", "gpt3-350m", "--cluster", "aws-p3.16xlarge", "--nodes", "1",
               "--devices-per-node", "1", "--simulate", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["schema"] == "alpasim.plan/1" and len(r["stages"]) == 1
    sim = r["simulation"]
    # One stage, no communication: B microbatches back to back, then the sync.
    stage = r["stages"][0]
    want = r["microbatches"] * (stage["forward_s"] + stage["backward_s"]) + stage["sync_s"]
    assert sim["iteration_s"] == pytest.approx(want, rel=1e-9)
    assert sim["iteration_s"] == pytest.approx(r["predicted"]["iteration_s"], rel=1e-6)
    assert sim["peak_memory_bytes"] == [pytest.approx(stage["memory_bytes"])]


@pytest.mark.slow
def test_plan_interleaved_writes_a_chunked_plan_the_simulator_runs(tmp_path, cli):
    """`plan --schedule interleaved --chunks 2`: a plan of S x 2 stages whose `simulate`
    runs its own chunks (not 1/v of a stage); other schedules or chunk counts on it,
    and bad chunk counts to plan, are one line and exit 2."""
    env = {"ALPASIM_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "plan.json"
    model = "gpt3:hidden=64,layers=4,heads=2,seq=32,vocab=128,batch=8"
    proc = cli("plan", "--model", model, "--nodes", "1", "--devices-per-node", "4", "--microbatches", "4",
               "--no-remat", "--schedule", "interleaved", "--chunks", "2", "--out", str(out), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["schedule"] == "interleaved" and p["chunks"] == 2 and len(p["stages"]) % 2 == 0
    meshes = len(p["stages"]) // 2
    assert all(p["stages"][j]["devices"] == p["stages"][j % meshes]["devices"] for j in range(len(p["stages"])))
    r = json.loads(cli("simulate", str(out), "--json").stdout)
    assert r["schedule"] == "interleaved" and r["chunks"] == 2 and len(r["meshes"]) == meshes
    assert r["predicted_iteration_s"] == pytest.approx(p["predicted"]["iteration_s"])
    # The planner's makespan of the chunks' orders predicts the simulated iteration (0.7 % off here).
    assert r["iteration_s"] == pytest.approx(p["predicted"]["iteration_s"], rel=0.1)
    bad = cli("simulate", str(out), "--schedule", "1f1b")
    assert bad.returncode == 2 and "interleaved schedule, not '1f1b'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = cli("simulate", str(out), "--chunks", "3")     # the plan's own chunks, not an imagined count
    assert bad.returncode == 2 and "cut into 2 chunks per mesh" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    for chunks in ("1", "two", ""):
        bad = cli("plan", "--model", model, "--nodes", "1", "--schedule", "interleaved", "--chunks", chunks, env=env)
        assert bad.returncode == 2 and "--chunks" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1

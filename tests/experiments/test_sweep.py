"""What-if sweeps, `compare` and `plan --method`: rows, files, cache resume, CLI contracts."""

from __future__ import annotations

import csv
import json
import os

import pytest

from alpasim.costmodels import get_cluster
from alpasim.experiments import Result, SweepReport, sweep, sweep_cluster

# Two nodes of one GPU each: every method's communication crosses the swept link, and
# a cold plan takes seconds.
TINY = "gpt3:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=8"
GBPS = [1, 10, 100]
METHODS = ["alpa", "intra-only", "inter_only", "megatron"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("alpasim-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALPASIM_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def report(cache_dir) -> SweepReport:
    return sweep(TINY, 2, "inter_node_gbps", GBPS, METHODS, devices_per_node=1)


def test_rows_cover_every_value_and_method(report):
    rows = report.rows()
    assert [(r["value"], r["method"]) for r in rows] == [
        (float(v), m) for v in GBPS for m in ("alpa", "intra_only", "inter_only", "megatron")]
    for r in rows:
        assert r["feasible"] and r["throughput_pflops"] > 0 and r["iteration_s"] > 0, r
    # Both nodes are one GPU: intra-op only is one 2x1 mesh, Alpa a 2-stage pipeline.
    assert report.result(10.0, "intra_only").plan["stages"][0]["submesh"] == [2, 1]
    assert report.gap(10.0) == pytest.approx(report.result(10.0, "alpa").throughput_pflops
                                             / report.result(10.0, "intra_only").throughput_pflops)


def test_throughput_never_drops_as_bandwidth_grows(report):
    for m in report.methods:
        ys = [report.result(float(v), m).throughput_pflops for v in GBPS]
        assert all(b >= a * (1 - 1e-9) for a, b in zip(ys, ys[1:])), (m, ys)
    # ...and the axis really reaches the plans: intra-op only all-reduces across nodes.
    slow, fast = (report.result(float(v), "intra_only").throughput_pflops for v in (1, 100))
    assert fast > 2 * slow


def test_alpa_predicts_at_least_intra_only(report):
    # Intra-op only is Alpa's search cut to one stage, priced by the same eq. 2.
    for v in report.values:
        assert report.result(v, "alpa").predicted_pflops >= report.result(v, "intra_only").predicted_pflops * (
            1 - 1e-9)


def test_files_csv_markdown_png(report, tmp_path):
    files = report.write(tmp_path)
    assert set(files) == {"csv", "md", "png"}
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(GBPS) * len(METHODS)
    assert rows[0]["inter_node_gbps"] == "1.0" and rows[0]["method"] == "alpa"
    assert float(rows[-1]["throughput_pflops"]) == pytest.approx(report.result(100.0, "megatron").throughput_pflops)
    md = open(files["md"]).read()
    assert "| inter_node_gbps | alpa | intra_only | inter_only | megatron | alpa / intra_only |" in md
    assert md.count("\n- ") == len(GBPS)  # Alpa's plan per value
    with open(files["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_out_of_memory_points_are_rows_not_errors(cache_dir, tmp_path):
    r = sweep(TINY, 2, "memory_gb", ["0.0001", 16], ["intra-only", "inter-only"], devices_per_node=1)
    assert [row["feasible"] for row in r.rows()] == [False, False, True, True]
    assert r.rows()[0]["throughput_pflops"] is None and r.rows()[0]["plan"].startswith("infeasible")
    files = r.write(tmp_path)
    assert "| 0.0001 | OOM | OOM |" in open(files["md"]).read()
    rows = list(csv.DictReader(open(files["csv"])))
    assert rows[0]["feasible"] == "False" and rows[0]["throughput_pflops"] == ""
    assert open(files["png"], "rb").read(4) == b"\x89PNG"


def test_alpa_plan_changes_are_named():
    def fake(label: str, stages: list, b: int) -> Result:
        plan = {"feasible": True, "microbatches": b,
                "stages": [{"layers": l, "submesh": s, "logical_mesh": s} for l, s in stages]}
        return Result("m", 4, "alpa", label, True, 1.0, 1.0, 1.0, 1.0, 0.0, plan=plan)

    two = [([0, 1], [1, 2]), ([2, 3], [1, 2])]
    results = (fake("1", two, 8), fake("2", two, 8), fake("3", [([0, 3], [1, 4])], 4),
               Result("m", 4, "alpa", "4", False, None, None, None, None, 0.0,
                      plan={"feasible": False, "notes": ["out of memory"]}))
    r = SweepReport("m", 4, "memory_gb", (1.0, 2.0, 3.0, 4.0), ("alpa",), "aws-p3.16xlarge", results)
    assert [p["change"] for p in r.alpa_plans()] == ["", "", "2 -> 1 stages, B 8 -> 4", "becomes infeasible"]
    assert r.alpa_plans()[0]["summary"] == "2 stages, B=8: 0..1 on 1x2 as 1x2 | 2..3 on 1x2 as 1x2"
    assert r.gap(1.0) is None  # no intra-only in this sweep


def test_an_interrupted_sweep_resumes_from_the_cache(cache_dir):
    class Interrupt(Exception):
        pass

    def stop_after_two(done: int, total: int, r: Result) -> None:
        if done == 2:
            raise Interrupt

    args = (TINY, 2, "inter_node_gbps", [3, 30], ["intra-only", "inter-only"])
    with pytest.raises(Interrupt):
        sweep(*args, devices_per_node=1, progress=stop_after_two)
    resumed = sweep(*args, devices_per_node=1)
    assert [r.cached for r in resumed.results] == [True, True, False, False]
    again = sweep(*args, devices_per_node=1)
    assert all(r.cached for r in again.results)
    assert [r.throughput_pflops for r in again.results] == [r.throughput_pflops for r in resumed.results]
    assert [r.label for r in again.results] == ["3", "3", "30", "30"]


def test_a_damaged_result_entry_is_planned_again(cache_dir):
    """A cached point whose JSON is well formed but wrong (a negative throughput, an
    unknown field) is a miss: the point is planned again and its row is the true one."""
    args = (TINY, 2, "inter_node_gbps", [7], ["intra-only"])
    first = sweep(*args, devices_per_node=1)
    files = sorted((cache_dir / "points").rglob("*.json"))
    entry = next(f for f in files if json.loads(f.read_text()).get("label") == "7")
    for change in ({"throughput_pflops": -1.0}, {"surprise": 1}):
        entry.write_text(json.dumps({**json.loads(entry.read_text()), **change}))
        again = sweep(*args, devices_per_node=1)
        assert not again.results[0].cached
        assert again.results[0].throughput_pflops == first.results[0].throughput_pflops > 0


def test_sweep_clusters_per_axis():
    assert sweep_cluster("devices_per_node", 2, 8).nodes == 4
    one = sweep_cluster("devices_per_node", 8, 4)
    assert (one.nodes, one.devices_per_node) == (1, 4)
    assert sweep_cluster("device", "dgx-a100", 16).device.name == "A100-SXM-80GB"
    assert sweep_cluster("memory_gb", "32", 8).device.memory_bytes == 32 * 2 ** 30
    c = sweep_cluster("inter_node_gbps", 50, 16)
    assert (c.nodes, c.inter_node.bandwidth_gbps) == (2, 50.0)
    assert c == get_cluster("aws-p3.16xlarge", nodes=2, inter_node_gbps=50.0)
    with pytest.raises(ValueError, match="whole number"):
        sweep_cluster("devices_per_node", 4, 6)
    with pytest.raises(ValueError, match="unknown method"):
        sweep(TINY, 2, "inter_node_gbps", [1], ["alpa", "nope"])
    with pytest.raises(ValueError, match="not a positive number"):
        sweep(TINY, 2, "inter_node_gbps", ["-5"], ["alpa"])


def test_cli_sweep_json(tmp_path, cli):
    # A cache of its own: progress lines are printed for the points a sweep plans, and
    # the module's cache may hold these already: the Ray test's in-process sweep plans
    # the same points, and where the scheduler's ray scope ends with that test and this
    # module follows it on the same worker, the module's `cache_dir` is the same one.
    proc = cli("sweep", "--model", TINY, "--gpus", "2", "--devices-per-node", "1,2",
               "--methods", "alpa,intra-only", "--out-dir", str(tmp_path), "--workers", "1", "--json",
               "--out", str(tmp_path / "report.json"), env={"ALPASIM_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert json.loads((tmp_path / "report.json").read_text()) == r and r["files"]["json"].endswith("report.json")
    assert (r["axis"], r["values"], r["methods"]) == ("devices_per_node", [1, 2], ["alpa", "intra_only"])
    assert len(r["rows"]) == 4 and len(r["alpa_plans"]) == 2
    # One node of two GPUs: every plan stays inside NVLink, faster than two nodes.
    by = {(row["value"], row["method"]): row["throughput_pflops"] for row in r["rows"]}
    assert by[(2, "intra_only")] > by[(1, "intra_only")]
    assert all(os.path.exists(p) for p in r["files"].values())
    assert "[4/4" in proc.stderr  # progress goes to stderr


@pytest.mark.parametrize("args, message", [
    (["--methods", "alpa"], "exactly one axis"),
    (["--inter-node-gbps", "10,fast"], "comma-separated numbers"),
    (["--inter-node-gbps", "10", "--memory-gb", "16"], "exactly one axis"),
    (["--inter-node-gbps", "10", "--methods", "alpa,bogus"], "unknown method 'bogus'"),
    (["--device-preset", "dgx-a100,tpu"], "unknown cluster preset 'tpu'"),
])
def test_cli_sweep_errors_are_one_line(cache_dir, args, message, cli):
    proc = cli("sweep", "--model", TINY, "--gpus", "2", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


def test_cli_plan_method_baseline_and_megatron_degrees(cache_dir, cli):
    base = ("plan", "--model", TINY, "--nodes", "2", "--devices-per-node", "1")
    proc = cli(*base, "--method", "intra-only", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["method"] == "intra_only" and p["feasible"] and len(p["stages"]) == 1
    proc = cli(*base, "--method", "megatron", "--tp", "1", "--pp", "2", "--dp", "1",
               "--microbatch-size", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["search"]["megatron"] == {"tp": 1, "pp": 2, "dp": 1, "microbatch_size": 2, "distributed_optimizer": False,
                                       "sequence_parallel": False, "ends_as_layers": False,
                                       "sharded_gradients": False, "cp": 1}
    assert len(p["stages"]) == 2 and p["microbatches"] == 8 // 2
    sp = ("--method", "megatron", "--tp", "2", "--pp", "1", "--dp", "1", "--microbatch-size", "2", "--json")
    two = ("plan", "--model", TINY, "--nodes", "1", "--devices-per-node", "2")
    plain, proc = cli.json(*two, *sp[:-1]), cli(*two, *sp, "--sequence-parallel")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["search"]["megatron"]["sequence_parallel"] is True and p["method"] == "megatron"
    assert p["stages"][0]["memory"]["stash_bytes"] < plain["stages"][0]["memory"]["stash_bytes"]


def test_cli_plan_method_errors_and_infeasible(cache_dir, cli):
    base = ("plan", "--model", TINY, "--nodes", "2", "--devices-per-node", "1")
    for args, message in ((["--method", "intra-only", "--tp", "2"], "only apply to --method megatron"),
                          (["--method", "megatron", "--tp", "1"], "missing --pp, --dp, --microbatch-size"),
                          (["--method", "megatron", "--tp", "2", "--pp", "1", "--dp", "1", "--microbatch-size",
                            "1"], "tensor parallelism beyond one node"),
                          (["--method", "best"], "choose one of alpa, intra-only")):
        proc = cli(*base, *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    tiny_memory = (*base, "--memory-gb", "0.0001", "--method", "inter-only")
    proc = cli(*tiny_memory)
    assert proc.returncode == 2 and "no feasible plan" in proc.stderr
    proc = cli(*tiny_memory, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["feasible"] is False


def test_cli_compare_matches_the_sweep(cache_dir, report, cli):
    proc = cli("compare", "--model", TINY, "--nodes", "2", "--devices-per-node", "1",
               "--inter-node-gbps", "100", "--methods", "alpa,megatron,intra-only", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["method"]: r for r in json.loads(proc.stdout)["rows"]}
    assert list(rows) == ["alpa", "megatron", "intra_only"]
    assert rows["alpa"]["ratio_to_alpa"] == 1.0
    for m in rows:  # the same points as the sweep's at 100 Gb/s, so cached
        assert rows[m]["cached"]
        assert rows[m]["throughput_pflops"] == pytest.approx(report.result(100.0, m).throughput_pflops)
    assert rows["intra_only"]["ratio_to_alpa"] == pytest.approx(1 / report.gap(100.0))
    text = cli("compare", "--model", TINY, "--nodes", "2", "--devices-per-node", "1",
               "--inter-node-gbps", "100", "--methods", "alpa,intra-only")
    assert text.returncode == 0
    lines = [ln for ln in text.stdout.splitlines() if ln.startswith("  ")]
    assert len(lines) == 2 and "intra_only" in lines[1] and "x alpa" in lines[1]


def test_cli_compare_sets_schedules_side_by_side(cache_dir, report, cli):
    """`--schedules`: each plan simulated under each schedule, the 1F1B row equal to the
    method's own simulated iteration; zero bubble never slower than 1F1B; a bad name is
    one line before any planning."""
    proc = cli("compare", "--model", TINY, "--nodes", "2", "--devices-per-node", "1",
               "--inter-node-gbps", "100", "--methods", "alpa,megatron", "--schedules", "gpipe,1f1b,zb-h1,zb-h2",
               "--json")
    assert proc.returncode == 0, proc.stderr
    for row in json.loads(proc.stdout)["rows"]:
        by = row["schedules"]
        assert list(by) == ["gpipe", "1f1b", "zb-h1", "zb-h2"]
        assert by["1f1b"]["iteration_s"] == pytest.approx(row["iteration_s"], rel=1e-12)
        assert by["zb-h1"]["iteration_s"] <= by["1f1b"]["iteration_s"] * (1 + 1e-12)
        assert all(0 <= r["bubble_fraction"] < 1 and r["peak_memory_bytes"] > 0 for r in by.values())
    bad = cli("compare", "--model", TINY, "--nodes", "2", "--methods", "alpa", "--schedules", "zb-h3")
    assert bad.returncode == 2 and "unknown schedule 'zb-h3'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.ray
def test_cli_sweep_on_ray_matches_the_local_pool(tmp_path, cache_dir, cli):
    """`--ray` plans the points as Ray tasks on a local one-machine cluster (started and
    stopped by the command); with a fresh cache every point is really planned there,
    and the numbers equal an in-process sweep's."""
    proc = cli("sweep", "--model", TINY, "--gpus", "2", "--devices-per-node", "1,2",
               "--methods", "alpa,intra-only", "--ray", "--workers", "2", "--out-dir", str(tmp_path / "out"),
               "--json", timeout=600, env={"ALPASIM_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(row["value"], row["method"]): row for row in json.loads(proc.stdout)["rows"]}
    local = sweep(TINY, 2, "devices_per_node", [1, 2], ["alpa", "intra-only"])
    assert len(rows) == 4
    for (value, method), row in rows.items():
        assert not row["cached"]
        assert row["throughput_pflops"] == pytest.approx(local.result(value, method).throughput_pflops,
                                                         rel=1e-9), (value, method)


@pytest.mark.ray
def test_cli_compare_on_an_existing_ray_cluster_with_a_worker_cap(tmp_path, cli, ray_cluster):
    """`--ray-address` with `--workers` (which used to fail: Ray refuses num_cpus when
    connecting): `compare` joins a running cluster (the session's), caps its tasks in
    flight at one, and its rows equal an in-process comparison's."""
    from alpasim.experiments import compare

    proc = cli("compare", "--model", TINY, "--nodes", "1", "--devices-per-node", "2",
               "--methods", "intra-only,inter-only", "--ray-address", ray_cluster, "--workers", "1", "--json",
               timeout=600, env={"ALPASIM_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["method"]: row for row in json.loads(proc.stdout)["rows"]}
    local = compare(TINY, get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2), ["intra-only", "inter-only"],
                    cache=False)
    for row in local.rows():
        assert rows[row["method"]]["throughput_pflops"] == pytest.approx(row["throughput_pflops"], rel=1e-9)

"""The `alpasim` command end to end: JSON contracts and one-line user errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_console_script_and_python_m_are_the_forked_command(cli):
    """The tests' forked command (`cli`) is what a user runs: the console script
    (`fresh=True`) and `python -m alpasim.cli` print the same JSON and the same one-line
    refusals, a usage error's name of the command included."""
    runs = {"forked": lambda *a: cli(*a), "script": lambda *a: cli(*a, fresh=True),
            "python -m": lambda *a: _python_m(cli, *a)}
    for args in (("models", "--json"), ("plan", "--model", "gpt9"), ("plan", "--nodes", "2")):
        seen = {how: run(*args) for how, run in runs.items()}
        assert len({(r.returncode, r.stdout) for r in seen.values()}) == 1, (args, seen)
        errors = {how: r.stderr.replace("python -m alpasim.cli", "alpasim") for how, r in seen.items()}
        assert len(set(errors.values())) == 1, (args, errors)
    assert seen["forked"].returncode == 2 and seen["forked"].lines[0].startswith("alpasim: error: Missing option")


def _python_m(cli, *args):
    proc = subprocess.run([sys.executable, "-m", "alpasim.cli", *args], capture_output=True, text=True, timeout=120,
                          env=cli.environment(), cwd=cli.scratch)
    return proc


def test_graph_json_matches_the_acceptance_closed_forms(cli):
    b, s, l, h, v = 1024, 1024, 24, 2048, 51200
    r = cli.json("graph", "gpt3-1.3b")
    assert r["params"] == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h)) + (v + s) * h, rel=0.01)
    assert r["flops"]["einsum"] == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                 rel=0.02)
    assert r["flops"]["total"] >= r["flops"]["einsum"]
    assert set(r["ops"]) == {"forward", "backward", "update"} and all(n > 0 for n in r["ops"].values())
    assert r["layers"] == 24 and r["build_s"] > 0
    rr = cli.json("graph", "gpt3-1.3b", "--remat")
    assert rr["flops"]["einsum"] == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)),
                                                  rel=0.02)
    assert rr["flops_without_remat"] == r["flops"]
    assert rr["memory"]["activations_peak_bytes"] < r["memory"]["activations_peak_bytes"]


def test_every_command_takes_the_model_as_model(cli):
    small = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=2"
    by_option, positional = cli.json("graph", "--model", small), cli.json("graph", small)
    by_option.pop("build_s"), positional.pop("build_s")
    assert by_option == positional and by_option["params"] > 0
    assert cli.json("intra", "--model", small, "--mesh", "1x2", "--batch", "2")["layers"] == [1, 1]


def test_graph_with_cluster_layers_and_batch(cli):
    r = cli.json("graph", "wresnet-1b", "--cluster", "aws-p3.16xlarge", "--nodes", "2", "--layers", "8",
                 "--batch", "64")
    assert r["layers"] == 8 and r["config"]["batch"] == 64
    assert r["cluster"]["nodes"] == 2 and r["cluster"]["num_devices"] == 16
    assert r["on_cluster"]["single_device_iteration_s"] > 0


def test_models_and_clusters_json(cli):
    models = cli.json("models")["models"]
    assert len(models) == 27          # the paper's 22, Llama 3 8B/70B/405B, Mixtral, DeepSeek-V2-Lite-like
    by_name = {m["name"]: m for m in models}
    assert by_name["gpt3-39b"]["family"] == "gpt3"
    assert by_name["moe-70b"]["params"] == pytest.approx(70e9, rel=0.02)
    assert by_name["llama3-405b"]["params"] == pytest.approx(405.85e9, rel=0.005)
    assert by_name["mixtral-8x7b"]["family"] == "topk-moe"
    assert {"name", "family", "params"} <= set(models[0])
    names = [c["name"] for c in cli.json("clusters")["clusters"]]
    assert names == ["aws-p3.16xlarge", "dgx-a100", "dgx-h100", "gb200-nvl72"]


@pytest.mark.slow
def test_graph_save_round_trips(tmp_path, cli):
    """What `graph --save` writes, `plan`, `compare` and `sweep` take, and planning it is
    planning the zoo name: the same plan, field for field (but the search's timings),
    and Megatron-LM's row too, which takes zoo models only."""
    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=8"
    path = tmp_path / "g.json"
    proc = cli("graph", model, "--save", str(path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(path.read_text())["schema"] == "alpasim.graph/1"
    where = ("--nodes", "1", "--devices-per-node", "2")
    saved, named = (cli.json("plan", "--model", m, *where) for m in (path, model))
    assert saved.pop("search").keys() == named.pop("search").keys()
    assert saved == named and saved["feasible"]
    rows, named_rows = (cli.json("compare", "--model", m, *where, "--methods", "alpa,megatron")["rows"]
                        for m in (path, model))
    assert [r["method"] for r in rows] == ["alpa", "megatron"] and all(r["feasible"] for r in rows)
    assert [r["iteration_s"] for r in rows] == [r["iteration_s"] for r in named_rows]
    sweep = cli.json("sweep", "--model", path, "--gpus", "2", "--devices-per-node", "1,2", "--methods", "alpa",
                     "--out-dir", tmp_path / "sweep")
    assert len(sweep["rows"]) == 2 and all(r["feasible"] for r in sweep["rows"])


@pytest.mark.parametrize("args, fragment", [
    (["graph", "gpt9-1t"], "valid names: gpt3-350m"),
    (["graph", "gpt3:hidden=64,layrs=2"], "'layrs'"),
    (["graph", "gpt3-1.3b", "--cluster", "tpu-pod"], "valid names: aws-p3.16xlarge"),
    (["graph", "gpt3-1.3b", "--cluster", "aws-p3.16xlarge", "--nodes", "0"], "nodes"),
    (["graph", "gpt3-1.3b", "--batch", "0"], "batch"),
    (["graph", "missing.json"], "missing.json"),
    (["graph"], "no model given: pass --model"),
    (["graph", "gpt3-1.3b", "--model", "gpt3-2.6b"], "two models given"),
    (["intra", "--model", "gpt3-1.3b", "--layers", "99"], "the model has layers 0..23"),
    (["plan", "--model", "gpt3-1.3b", "--method", "zero2", "--max-stages", "2"],
     "--max-stages does not apply to --method zero2"),
    (["plan", "--model", "gpt3-1.3b", "--method", "inter-only", "--layers", "4"],
     "--layers does not apply to --method inter-only"),
    (["plan", "--model", "gpt3-1.3b", "--distributed-optimizer"], "--distributed-optimizer only applies to"),
    (["plan", "--model", "gpt3-1.3b", "--method", "zero2", "--sequence-parallel"],
     "--sequence-parallel only applies to --method megatron or megatron-core"),
    (["plan", "--model", "gpt3-1.3b", "--recompute", "some"], "choose one of none, fusible, selective, auto"),
    (["graph", "gpt3-1.3b", "--recompute", "auto"], "choose one of none, fusible, selective"),
    (["graph", "llama:hidden=64,heads=4,kv_heads=3,ffn=8,layers=1"], "kv_heads"),
    # Output paths are checked before the work: these would otherwise plan for a minute.
    (["plan", "--model", "gpt3-39b", "--out", "/tmp"], "--out /tmp: is a directory"),
    (["plan", "--model", "gpt3-39b", "--out", "/proc/version/plan.json"], "/proc/version is not a directory"),
    (["graph", "gpt3-1.3b", "--save", "/proc/graph.json"], "--save /proc/graph.json: cannot write in /proc"),
    (["simulate", "missing-plan.json", "--gantt", "/tmp"], "--gantt /tmp: is a directory"),
    (["sweep", "--model", "gpt3-1.3b", "--gpus", "8", "--memory-gb", "16", "--out-dir", "/proc/version"],
     "--out-dir /proc/version: is a file"),
])
def test_user_errors_are_one_line_and_exit_2(args, fragment, cli):
    proc = cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert fragment in lines[0]


def test_bad_graph_and_cluster_files_name_file_and_field(tmp_path, cli):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "alpasim.graph/1", "name": "x", "tensors": [{"name": "a"}], "ops": []}))
    proc = cli("graph", str(bad))
    assert proc.returncode == 2 and str(bad) in proc.stderr and "'shape'" in proc.stderr
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"schema": "alpasim.cluster/1", "name": "x"}))
    proc = cli("graph", "gpt3-350m", "--cluster", str(cluster))
    assert proc.returncode == 2 and str(cluster) in proc.stderr


def test_intra_json_contract(cli):
    r = cli.json("intra", "gpt3-1.3b", "--mesh", "2x4", "--layers", "5", "--batch", "8")
    for key in ("status", "objective_s", "communication_s", "compute_s", "memory_bytes", "specs", "collectives",
                "compare"):
        assert key in r
    assert r["status"] == "optimal" and r["layers"] == [5, 5] and r["mesh"] == [2, 4]
    assert r["objective_s"] == pytest.approx(r["communication_s"], rel=1e-6)
    assert r["specs"]["layer5/w_fc1"] in {"RS1", "RS01", "S0S1", "RR", "S0R", "S1R", "RS0", "S01R", "S1S0"}
    c = r["collectives"][0]
    assert {"kind", "bytes", "mesh_axes"} <= set(c)
    for name in ("data_parallel", "megatron"):
        cmp = r["compare"][name]
        assert {"communication_s", "memory_bytes", "fits"} <= set(cmp)
        assert r["communication_s"] <= cmp["communication_s"] * (1 + 1e-9)
    assert r["memory_bytes"] <= r["compare"]["data_parallel"]["memory_bytes"]


def test_intra_method_and_memory_override(cli):
    dp = cli.json("intra", "gpt3-350m", "--mesh", "1x4", "--method", "data_parallel")
    assert all(s.strip("R") == "" for p, s in dp["specs"].items() if p.endswith("/w_fc1"))
    proc = cli("intra", "gpt3-1.3b", "--mesh", "1x8", "--memory-gb", "0.01")
    assert proc.returncode == 2 and "does not fit" in proc.stderr
    # One size formatter: the budget of 0.01 GiB reads 10.24 MiB, not "0.01 GiB".
    assert "needs at least 372.17 MiB per device, the budget is 10.24 MiB" in proc.stderr


def test_intra_batch_is_the_global_batch(cli):
    """`--batch` is the global batch everywhere: with --microbatches 4 the stage runs on
    a quarter of it (same compute and activations as the whole of a quarter-size batch),
    and without --microbatches on microbatches of at most 8 samples."""
    args = ("intra", "gpt3-350m", "--mesh", "1x4", "--layers", "5", "--method", "data_parallel")
    split, whole = cli.json(*args, "--batch", "32", "--microbatches", "4"), cli.json(*args, "--batch", "8")
    assert (split["batch"], split["microbatches"], split["microbatch_size"]) == (32, 4, 8)
    assert (whole["batch"], whole["microbatches"], whole["microbatch_size"]) == (8, 1, 8)
    assert split["compute_s"] == pytest.approx(whole["compute_s"], rel=1e-9)
    assert split["memory"]["activations_peak_bytes"] == whole["memory"]["activations_peak_bytes"]
    assert split["sync_s"] == pytest.approx(whole["sync_s"], rel=1e-9)     # once per iteration either way
    own = cli.json(*args)
    assert (own["batch"], own["microbatches"], own["microbatch_size"]) == (1024, 128, 8)
    proc = cli(*args, "--batch", "12", "--microbatches", "5")
    assert proc.returncode == 2 and "does not divide the global batch 12" in proc.stderr


def test_intra_mesh_defaults_to_one_node_of_the_cluster(cli):
    assert cli.json("intra", "gpt3-350m", "--layers", "5", "--devices-per-node", "4")["mesh"] == [1, 4]


@pytest.mark.parametrize("args, fragment", [
    (["intra", "gpt3-350m", "--mesh", "2by4"], "mesh shape"),
    (["intra", "gpt3-350m", "--mesh", "16x16"], "needs 256 devices"),
    (["intra", "gpt3-350m", "--method", "zero9"], "--method"),
    (["intra", "gpt3-350m", "--layers", "99"], "layers 0..23"),
])
def test_intra_user_errors(args, fragment, cli):
    proc = cli(*args)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_plan_gpt3_2_6b_on_one_node(tmp_path, cli):
    out = tmp_path / "plan.json"
    r = cli.json("plan", "--model", "gpt3-2.6b", "--cluster", "aws-p3.16xlarge", "--nodes", "1", "--microbatches",
                 "128", "--out", out, timeout=600)
    assert r["schema"] == "alpasim.plan/1" and r["feasible"] and r["method"] == "alpa"
    assert {"name", "params", "flops_per_iteration"} <= set(r["model"])
    assert {"name", "nodes", "devices_per_node"} <= set(r["cluster"])
    assert {"iteration_s", "tflops_per_device", "throughput_pflops", "peak_memory_bytes"} <= set(r["predicted"])
    assert {"seconds", "ilp_solves", "cache_hits"} <= set(r["search"])
    devices = sorted(d for s in r["stages"] for d in s["devices"])
    assert devices == list(range(8))
    for s in r["stages"]:
        assert {"layers", "devices", "submesh", "logical_mesh", "time_s", "memory_bytes"} <= set(s)
        assert s["memory_bytes"] <= 16 * 2 ** 30
    assert json.loads(out.read_text()) == r


def test_plan_that_fits_nowhere_is_one_line(cli):
    proc = cli("plan", "--model", "gpt3-39b", "--nodes", "1", "--devices-per-node", "1", "--microbatches", "1024",
               "--no-cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    # Progress lines of the search come first; the failure is the one error line, last.
    assert all(ln.startswith("alpasim: ") for ln in lines)
    errors = [ln for ln in lines if ln.startswith("alpasim: error: ")]
    assert errors == lines[-1:] and "does not fit" in errors[0] and "GiB per device" in errors[0]


def test_long_commands_show_progress_on_stderr_with_json_too(cli):
    """Without a terminal (here, a file) progress is plain lines on stderr, with --json
    as without it; stdout holds the JSON alone."""
    small = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=8"
    proc = cli("plan", "--model", small, "--nodes", "1", "--devices-per-node", "2", "--microbatches", "2",
               "--no-cache", "--workers", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["feasible"]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("alpasim: alpa: B=2: ")]
    assert lines and re.fullmatch(r"alpasim: alpa: B=2: (\d+)/\1 \(\d+ s\)", lines[-1]), lines   # done: n/n
    proc = cli("intra", "--model", small, "--mesh", "1x2", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["status"] == "optimal"
    assert "alpasim: intra: layers" in proc.stderr and "alpasim: intra: megatron for comparison" in proc.stderr


def test_a_table_written_to_a_file_keeps_each_row_on_one_line(cli):
    """Piped, a table takes the width its rows need (rich's default folds them at 80
    columns); COLUMNS, where given, still sets the width. (Both run the real entry
    point: the width is chosen at import, and pytest-xdist's workers set COLUMNS=80.)"""
    wide = cli("models", env={"COLUMNS": ""}, fresh=True)
    (row,) = [ln for ln in wide.stdout.splitlines() if "gpt3-350m" in ln]
    assert "dropout=" in row and len(row) > 80, wide.stdout
    narrow = cli("models", env={"COLUMNS": "80"}, fresh=True)
    (row,) = [ln for ln in narrow.stdout.splitlines() if "gpt3-350m" in ln]
    assert "dropout=" not in row and len(row) <= 80, narrow.stdout

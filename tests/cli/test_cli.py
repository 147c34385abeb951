"""The `alpasim` command end to end: JSON contracts and one-line user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "alpasim.cli", *args], capture_output=True, text=True,
                          timeout=300)


def run_json(*args: str) -> dict:
    proc = run(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_graph_json_matches_the_acceptance_closed_forms():
    b, s, l, h, v = 1024, 1024, 24, 2048, 51200
    r = run_json("graph", "gpt3-1.3b")
    assert r["params"] == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h)) + (v + s) * h, rel=0.01)
    assert r["flops"]["einsum"] == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                 rel=0.02)
    assert r["flops"]["total"] >= r["flops"]["einsum"]
    assert set(r["ops"]) == {"forward", "backward", "update"} and all(n > 0 for n in r["ops"].values())
    assert r["layers"] == 24 and r["build_s"] > 0
    rr = run_json("graph", "gpt3-1.3b", "--remat")
    assert rr["flops"]["einsum"] == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)),
                                                  rel=0.02)
    assert rr["flops_without_remat"] == r["flops"]
    assert rr["memory"]["activations_peak_bytes"] < r["memory"]["activations_peak_bytes"]


def test_graph_with_cluster_layers_and_batch():
    r = run_json("graph", "wresnet-1b", "--cluster", "aws-p3.16xlarge", "--nodes", "2", "--layers", "8",
                 "--batch", "64")
    assert r["layers"] == 8 and r["config"]["batch"] == 64
    assert r["cluster"]["nodes"] == 2 and r["cluster"]["num_devices"] == 16
    assert r["on_cluster"]["single_device_iteration_s"] > 0


def test_models_and_clusters_json():
    models = run_json("models")["models"]
    assert len(models) == 22
    by_name = {m["name"]: m for m in models}
    assert by_name["gpt3-39b"]["family"] == "gpt3"
    assert by_name["moe-70b"]["params"] == pytest.approx(70e9, rel=0.02)
    assert {"name", "family", "params"} <= set(models[0])
    names = [c["name"] for c in run_json("clusters")["clusters"]]
    assert names == ["aws-p3.16xlarge", "dgx-a100", "dgx-h100"]


def test_graph_save_round_trips(tmp_path):
    path = tmp_path / "g.json"
    proc = run("graph", "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=2", "--save", str(path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(path.read_text())["schema"] == "alpasim.graph/1"


@pytest.mark.parametrize("args, fragment", [
    (["graph", "gpt9-1t"], "valid names: gpt3-350m"),
    (["graph", "gpt3:hidden=64,layrs=2"], "'layrs'"),
    (["graph", "gpt3-1.3b", "--cluster", "tpu-pod"], "valid names: aws-p3.16xlarge"),
    (["graph", "gpt3-1.3b", "--cluster", "aws-p3.16xlarge", "--nodes", "0"], "nodes"),
    (["graph", "gpt3-1.3b", "--batch", "0"], "batch"),
    (["graph", "missing.json"], "missing.json"),
])
def test_user_errors_are_one_line_and_exit_2(args, fragment):
    proc = run(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert fragment in lines[0]


def test_bad_graph_and_cluster_files_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "alpasim.graph/1", "name": "x", "tensors": [{"name": "a"}], "ops": []}))
    proc = run("graph", str(bad))
    assert proc.returncode == 2 and str(bad) in proc.stderr and "'shape'" in proc.stderr
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"schema": "alpasim.cluster/1", "name": "x"}))
    proc = run("graph", "gpt3-350m", "--cluster", str(cluster))
    assert proc.returncode == 2 and str(cluster) in proc.stderr

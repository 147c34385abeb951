"""`reproduce`: the figure registry, the summary ratios, the files and the CLI contract.

Real planning only on a tiny GPT (a few seconds); the ratios are checked on hand-built
results against hand-computed values.
"""

from __future__ import annotations

import csv
import json
import os

import pytest

from alpasim import experiments as ex
from alpasim.experiments import FIGURES, Point, Result, paper_cluster, reproduce

TINY = "gpt3:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=16"


def tiny_points() -> list[Point]:
    """fig7a-shaped points of a tiny GPT: 1 and 2 GPUs, one out of memory."""
    return [Point(TINY, paper_cluster(1), "alpa"),
            Point(TINY, paper_cluster(1), "megatron"),
            Point(TINY, paper_cluster(1, memory_gb=0.0001), "intra_only"),   # 100 KB: cannot fit
            Point(TINY, paper_cluster(2), "alpa", microbatches=1),
            Point(TINY, paper_cluster(2), "intra_only", microbatches=1)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("ALPASIM_CACHE_DIR")
    os.environ["ALPASIM_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        del os.environ["ALPASIM_CACHE_DIR"]
    else:
        os.environ["ALPASIM_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def tiny_report(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    return reproduce("fig7a", out, workers=1, points=tiny_points())


def fake(model: str, gpus: int, method: str, pflops: float | None, label: str = "") -> Result:
    return Result(model, gpus, method, label, pflops is not None, pflops, pflops, None, None, 1.0)


# ------------------------------------------------------------------ registry
def test_registry_has_every_figure_of_the_issue():
    assert list(FIGURES) == ["fig7a", "fig7b", "fig7c", "fig8", "fig9", "fig11", "table5"]


def test_figure_points_follow_the_paper():
    a = ex.figure_points("fig7a")
    assert {p.method for p in a} == {"alpa", "megatron", "intra_only", "inter_only"}
    assert sorted({p.gpus for p in a}) == [1, 2, 4, 8, 16, 32, 64]
    assert all(p.cluster.name == "aws-p3.16xlarge" for p in a)
    big = next(p for p in a if p.gpus == 64)
    assert (big.model, big.cluster.nodes, big.cluster.devices_per_node) == ("gpt3-39b", 8, 8)
    assert {p.gpus for p in ex.figure_points("fig7b", max_gpus=8)} == {1, 2, 4, 8}
    assert {p.gpus for p in ex.figure_points("fig8")} == {1, 2, 4, 8}
    assert {(p.model.split("-")[0], p.gpus) for p in ex.figure_points("fig9")} == {
        ("gpt3", 16), ("gpt3", 32), ("wresnet", 16), ("wresnet", 32)}
    f11 = ex.figure_points("fig11")
    assert {(p.method, p.cross_mesh, p.label) for p in f11} == {
        ("alpa", v, v) for v in ("send_recv", "local_all_gather", "signal")}
    assert len({p.key() for p in f11}) == len(f11)   # each variant is its own cached result


# ------------------------------------------------------------ summary ratios
def test_ratio_and_scaling_efficiency():
    assert ex.ratio(3.0, 1.5) == 2.0
    assert ex.ratio(None, 1.0) is None and ex.ratio(1.0, None) is None and ex.ratio(1.0, 0.0) is None
    rs = [fake("m1", 1, "alpa", 0.1), fake("m32", 32, "alpa", 2.4)]
    # (2.4 / 32) / (0.1 / 1) = 0.75
    assert ex.scaling_efficiency(rs, gpus=32, series="alpa") == pytest.approx(0.75)


def test_fig7b_summary_by_hand():
    rs = [fake("moe-a", 1, "alpa", 0.05), fake("moe-b", 8, "alpa", 0.4), fake("moe-b", 8, "deepspeed_moe", 0.32),
          fake("moe-c", 16, "alpa", 0.7), fake("moe-c", 16, "deepspeed_moe", 0.2),
          fake("moe-d", 32, "alpa", 1.2), fake("moe-d", 32, "deepspeed_moe", 0.1),
          fake("moe-d", 32, "inter_only", None), fake("moe-c", 16, "inter_only", 0.5)]
    s = FIGURES["fig7b"].summary(rs)
    assert s["alpa_over_deepspeed_16"] == pytest.approx(3.5)
    assert s["alpa_over_deepspeed_32"] == pytest.approx(12.0)
    assert s["alpa_over_deepspeed_8"] == pytest.approx(1.25)
    assert s["deepspeed_per_gpu_16_over_8"] == pytest.approx((0.2 / 16) / (0.32 / 8))
    assert s["deepspeed_per_gpu_64_over_8"] is None
    assert s["alpa_scaling_efficiency_32"] == pytest.approx((1.2 / 32) / 0.05)
    assert s["inter_only_first_oom_gpus"] == 32


def test_fig7a_fig7c_fig9_fig11_summaries_by_hand():
    a = FIGURES["fig7a"].summary([fake("g", 8, "alpa", 0.5), fake("g", 8, "megatron", 0.45),
                                  fake("g", 8, "intra_only", None)])
    assert a["alpa_over_best_megatron_8"] == pytest.approx(0.5 / 0.45)
    assert a["intra_only_over_alpa_8"] is None
    c = FIGURES["fig7c"].summary([fake("w1", 1, "alpa", 0.1), fake("w32", 32, "alpa", 2.56),
                                  fake("w1", 1, "pp_dp", 0.1), fake("w16", 16, "pp_dp", None),
                                  fake("w32", 32, "pp_dp", None)])
    assert c["wresnet_scaling_efficiency_32"] == pytest.approx(0.8)
    assert c["pp_dp_first_oom_gpus"] == 16 and c["alpa_over_pp_dp_32"] is None
    assert c["inter_only_first_oom_gpus"] is None
    n = FIGURES["fig9"].summary([fake("wresnet-x", 32, "alpa", 1.6), fake("wresnet-x", 32, "equal_layer", 1.0),
                                 fake("wresnet-x", 32, "equal_operator", 0.4), fake("gpt3-x", 32, "alpa", 1.0),
                                 fake("gpt3-x", 32, "equal_layer", 1.0)])
    assert n["wresnet_dp_over_equal_layer_32"] == pytest.approx(1.6)
    assert n["wresnet_dp_over_equal_operator_32"] == pytest.approx(4.0)
    assert n["gpt3_dp_over_equal_layer_32"] == pytest.approx(1.0) and n["gpt3_dp_over_equal_operator_32"] is None
    e = FIGURES["fig11"].summary([fake("w", 32, "alpa", 0.5, "send_recv"), fake("w", 32, "alpa", 1.0,
                                  "local_all_gather"), fake("w", 32, "alpa", 1.25, "signal")])
    assert e["all_gather_over_send_recv_32"] == pytest.approx(2.0)
    assert e["signal_over_all_gather_32"] == pytest.approx(1.25)


def test_every_paper_value_names_a_summary_key():
    """A paper constant under a key the summary never produces would never be shown."""
    for name, fig in FIGURES.items():
        pts = fig.points()
        rs = [fake(p.model, p.gpus, p.method, 1.0, p.label) for p in pts]
        assert set(fig.paper) <= set(fig.summary(rs)), name


# ---------------------------------------------------------- a real (tiny) run
def test_report_structure_and_json(tiny_report):
    d = json.loads(json.dumps(tiny_report.to_json()))
    assert d["name"] == "fig7a" and set(d["summary"]) >= {"alpa_over_best_megatron_1", "intra_only_over_alpa_2"}
    assert len(d["points"]) == 5
    for p in d["points"]:
        assert {"model", "gpus", "method", "throughput_pflops", "feasible"} <= set(p)
    oom = [p for p in d["points"] if not p["feasible"]]
    assert [(p["gpus"], p["method"], p["throughput_pflops"]) for p in oom] == [(1, "intra_only", None)]
    assert all(p["throughput_pflops"] > 0 for p in d["points"] if p["feasible"])


def test_summary_is_computed_from_the_points(tiny_report):
    pf = {(p["gpus"], p["method"]): p["throughput_pflops"] for p in tiny_report.points_json()}
    s = tiny_report.summary
    assert s["alpa_over_best_megatron_1"] == pytest.approx(pf[1, "alpa"] / pf[1, "megatron"])
    assert s["intra_only_over_alpa_2"] == pytest.approx(pf[2, "intra_only"] / pf[2, "alpa"])
    assert s["intra_only_over_alpa_1"] is None                 # out of memory
    assert s["alpa_over_best_megatron_2"] is None              # no Megatron point at 2 GPUs
    assert s["alpa_scaling_efficiency_2"] == pytest.approx((pf[2, "alpa"] / 2) / pf[1, "alpa"])


def test_files_csv_markdown_png(tiny_report):
    files = tiny_report.files
    assert set(files) == {"csv", "markdown", "png"}
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 and rows[2]["feasible"] == "False" and rows[2]["throughput_pflops"] == ""
    assert float(rows[0]["throughput_pflops"]) == pytest.approx(tiny_report.results[0].throughput_pflops)
    md = open(files["markdown"]).read()
    assert "| model | GPUs | alpa | megatron | intra_only |" in md and "×" in md
    assert "| alpa_over_best_megatron_1 |" in md and "![fig7a](fig7a.png)" in md
    with open(files["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------- CLI
def test_cli_json_prints_one_object(tiny_report, cache_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from alpasim.cli import app

    monkeypatch.setattr(ex, "figure_points", lambda name, max_gpus=None: [
        p for p in tiny_points() if max_gpus is None or p.gpus <= max_gpus])
    res = CliRunner().invoke(app, ["reproduce", "fig7a", "--out-dir", str(tmp_path), "--json", "--workers", "1",
                                   "--max-gpus", "1", "--out", str(tmp_path / "report.json")])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)                                  # progress went to stderr
    assert json.loads((tmp_path / "report.json").read_text()) == d
    assert d["name"] == "fig7a" and len(d["points"]) == 3 and "alpa_over_best_megatron_1" in d["summary"]
    assert d["paper"]["alpa_over_best_megatron_1"] == 1.0
    assert (tmp_path / "fig7a.md").is_file()


@pytest.mark.parametrize("args, needle", [
    (["reproduce", "fig99"], "choose one of fig7a, fig7b, fig7c, fig8, fig9, fig11, table5"),
    (["reproduce", "fig7a", "--max-gpus", "0"], "--max-gpus"),
    (["reproduce", "fig7a", "--workers", "0"], "--workers"),
    (["reproduce", "fig7a", "--out", "/tmp"], "--out /tmp: is a directory"),
    (["reproduce", "fig7a", "--out-dir", "/proc/version"], "--out-dir /proc/version: is a file"),
])
def test_cli_user_errors_are_one_line(args, needle, cli):
    proc = cli(*args, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr

"""`alpasim validate`: the published runs, their FLOP counts, and the table."""

from __future__ import annotations

import math
import re

import pytest

from alpasim import experiments as ex
from alpasim import graphs as gr
from alpasim import solvers as sv
from alpasim.experiments._published_runs import gpt_model_flops, llama_model_flops


@pytest.mark.parametrize("run", ex.PUBLISHED_RUNS, ids=lambda r: r.id)
def test_every_row_is_a_layout_of_its_cluster(run):
    """The published degrees multiply to the cluster's GPUs, the batch splits into whole
    microbatches per data-parallel rank, the model and system exist, and the measured
    time is positive."""
    source = gr.model_source(run.model)
    assert run.gpus == run.cluster.num_devices
    assert source.global_batch % (run.dp * run.microbatch_size) == 0
    assert run.system in sv.SYSTEMS and run.generation in run.cluster.device.name
    assert run.measured_iteration_s > 0
    assert run.recompute in ("full", "selective", "none")


@pytest.mark.parametrize("spec, formula", [
    ("gpt3:hidden=1024,layers=3,heads=16,seq=512,vocab=51200,batch=2",
     lambda: gpt_model_flops(2, 512, 3, 1024, 51200)),
    ("llama:hidden=1024,layers=2,heads=16,kv_heads=4,ffn=2816,seq=512,vocab=32000,batch=2",
     lambda: llama_model_flops(2, 512, 2, 1024, 16, 4, 2816, 32000)),
])
def test_the_published_flop_counts_are_the_graphs_matmuls(spec, formula):
    """The sources' model-FLOP formulas against an independent count: three times the
    forward graph's einsum FLOPs (backward = twice the forward)."""
    forward = gr.flops_by_kind(gr.forward_graph(spec))["matmul"]
    assert formula() == pytest.approx(3 * forward, rel=1e-3)


def test_validate_prices_rows_and_keeps_the_ones_it_cannot(tmp_path):
    import dataclasses

    runs = [r for r in ex.PUBLISHED_RUNS if r.id.startswith("korthikanti-22b")]
    # A layout the planner refuses (more pipeline stages than the model has blocks).
    deep = dataclasses.replace(runs[0], id="deep", pp=64, cluster=runs[0].cluster.with_overrides(nodes=64))
    report = ex.validate([*runs, deep], sv.DiskCache(enabled=False))
    rows = {r["id"]: r for r in report["rows"]}
    assert len(rows) == 3
    refused = rows["deep"]
    assert refused["status"] == "not expressible" and "64 pipeline stages, but" in refused["reason"]
    priced = [r for r in rows.values() if r["expressible"]]
    assert len(priced) == 2 and report["priced_rows"] == 2
    for r in priced:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["priced_as"]["name"] == "megatron-lm-2022"
        # 22B's bf16 weights, fp32 grads and Adam states over tp 8 (18 bytes a parameter)
        # are a floor of the peak; the device's 80 GB its ceiling.
        params = 48 * 12 * 6144 ** 2 + 51200 * 6144
        assert 18 * params / 8 < r["predicted_peak_bytes"] <= r["device_memory_bytes"] == 80 * 2 ** 30
        assert r["measured_peak_bytes"] is None
    full, selective = rows["korthikanti-22b-full"], rows["korthikanti-22b-sp-selective"]
    assert selective["predicted_s"] < full["predicted_s"]          # no forward recomputed whole
    assert report["mape_percent"] == pytest.approx(50 * (abs(full["error"]) + abs(selective["error"])))
    assert report["by_generation"]["A100"] == {"mape_percent": report["mape_percent"], "rows": 2, "of": 3,
                                               "out_of_memory": 0}
    assert list(report["by_generation"]) == ["A100"]          # only the generations of the rows given


def test_a_row_that_does_not_fit_is_a_failed_prediction_not_a_gap():
    import dataclasses

    row = next(r for r in ex.PUBLISHED_RUNS if r.id == "korthikanti-22b-full")
    small = dataclasses.replace(row, cluster=row.cluster.with_overrides(memory_gb=24))
    report = ex.validate([small], sv.DiskCache(enabled=False))
    (priced,) = report["rows"]
    assert priced["status"] == "out of memory" and priced["predicted_s"] is None
    assert priced["predicted_peak_bytes"] is None
    assert (report["out_of_memory_rows"], report["priced_rows"], report["mape_percent"]) == (1, 0, None)
    # What breaks the budget: the least any layout needs, more than the 24 GiB there is.
    need = priced["needed_memory_bytes"]
    assert need > 24 * 2 ** 30 and "GiB of 24.00 GiB; with " in ex.validation_verdict(priced)
    # Beside it, the row's time with the memory it needs (whole GiB: the states' 47.13
    # are a lower bound, so 10 % more each try), as a row of that device would be
    # priced, and outside the MAPE.
    lifted = priced["lifted_memory_bytes"] / 2 ** 30
    assert lifted == int(lifted) and lifted >= math.ceil(need / 2 ** 30)
    roomy = dataclasses.replace(row, cluster=row.cluster.with_overrides(memory_gb=lifted))
    (fits,) = ex.validate([roomy], sv.DiskCache(enabled=False))["rows"]
    assert fits["status"] == "priced" and priced["lifted_predicted_s"] == pytest.approx(fits["predicted_s"])
    assert priced["lifted_error"] == pytest.approx(fits["error"])


def test_cli_validate_prints_the_table_and_refuses_an_unknown_row(cli):
    shown = cli("validate", "--rows", "korthikanti-22b-full")
    assert shown.returncode == 0, shown.stderr
    assert "korthikanti-22b-full" in shown.stdout and "A100: MAPE" in shown.stdout
    # The last column, however the table folds it: the peak of the device's 80 GiB.
    peak = " ".join(line.split("│")[-2].strip() for line in shown.stdout.splitlines() if line.startswith("│"))
    assert re.fullmatch(r"\d+\.\d\d GiB of 80\.00 GiB", peak), shown.stdout
    bad = cli("validate", "--rows", "gpt5")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "korthikanti-22b-full" in bad.stderr


def test_the_breakdown_of_an_iteration_sums_to_it_and_finds_the_bubble(cli):
    """Averaged over the meshes, the passes, the pipeline's sends, the sync and the idle
    time are the predicted iteration; one stage never idles, and two stages of 4
    microbatches idle about the 1F1B bubble, (p - 1) / (m + p - 1) of it."""
    import dataclasses

    row = next(r for r in ex.PUBLISHED_RUNS if r.id == "korthikanti-22b-full")
    piped = dataclasses.replace(row, id="piped", pp=2, microbatch_size=1, cluster=row.cluster.with_overrides(nodes=2))
    one, two = ex.validate([row, piped], sv.DiskCache(enabled=False))["rows"]
    for r in (one, two):
        parts = r["breakdown"]
        assert list(parts) == list(ex.BREAKDOWN_PARTS)
        assert sum(parts.values()) == pytest.approx(r["predicted_s"], rel=1e-9)
        assert all(v >= 0 for v in parts.values())
    assert one["breakdown"]["idle_s"] == pytest.approx(0, abs=1e-9) and one["breakdown"]["pipeline_s"] == 0
    assert 0 < one["breakdown"]["sync_s"] < one["breakdown"]["passes_s"]   # the optimizer step, after the passes
    bubble = two["breakdown"]["idle_s"] / two["predicted_s"]
    assert 0.5 * (1 / 5) < bubble < 1.5 * (1 / 5)
    # The table gets the four parts as shares of the iteration, however narrow a
    # terminal folds it (each column's pieces joined over the row's lines).
    plain, shown = (cli("validate", "--rows", "korthikanti-22b-full", *flag) for flag in ((), ("--breakdown",)))
    assert shown.returncode == 0, shown.stderr

    def columns(out: str) -> list[str]:
        rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
        return [" ".join(r[k].strip() for r in rows if r[k].strip()) for k in range(len(rows[0]))]

    extra = columns(shown.stdout)[len(columns(plain.stdout)):]
    assert len(extra) == 4 and all(re.fullmatch(r"\d+ %", c) for c in extra), shown.stdout
    shares = [int(c.split()[0]) for c in extra]
    assert abs(sum(shares) - 100) <= 2
    assert shares[0] == round(100 * one["breakdown"]["passes_s"] / one["predicted_s"])

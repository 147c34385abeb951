"""Runs files (`alpasim validate --runs`): the format, its checks, and the command."""

from __future__ import annotations

import copy
import json
import re

import pytest

from alpasim import costmodels as cm
from alpasim import experiments as ex
from alpasim import simulator as sim
from alpasim import solvers as sv
from alpasim.experiments._published_runs import gpt_model_flops
from alpasim.experiments._runs_file import runs_from_json

TINY = {"id": "tiny", "system": "megatron-lm-2022", "cluster": "dgx-a100",
        "model": "gpt3:hidden=1024,layers=4,heads=16,seq=1024,vocab=51200,batch=8",
        "tp": 2, "pp": 2, "dp": 1, "microbatch_size": 1, "measured_tflops": 100.0}


def _file(*rows) -> dict:
    return {"schema": ex.RUNS_SCHEMA, "runs": list(rows)}


def test_the_built_in_rows_survive_a_runs_file_exactly():
    """Every published row, written as a runs file and read back through JSON text, is
    the row it was: cluster (links, sweeps, spine), layout, flags, FLOP count."""
    text = json.dumps(ex.runs_to_json(ex.PUBLISHED_RUNS))
    assert runs_from_json(json.loads(text)) == ex.PUBLISHED_RUNS


def test_a_row_gets_its_cluster_generation_and_flop_count():
    (run,) = runs_from_json(_file(TINY))
    # 4 GPUs of an 8-GPU preset: one node of 4, the rest of the preset kept.
    assert (run.cluster.nodes, run.cluster.devices_per_node, run.gpus) == (1, 4, 4)
    assert run.cluster.inter_node == cm.get_cluster("dgx-a100").inter_node
    assert run.generation == "A100" and run.recompute == "none" and run.cp == 1 and run.method == "megatron"
    # Throughput becomes seconds by Megatron-LM's model-FLOP count of the spec.
    flops = gpt_model_flops(8, 1024, 4, 1024, 51200)
    assert run.flops_per_iteration == flops
    assert run.measured_iteration_s == pytest.approx(flops / (100e12 * 4))
    # A source's own count wins, and whole nodes of a preset are whole nodes.
    (own,) = runs_from_json(_file({**TINY, "flops_per_iteration": 1e15, "tp": 8, "dp": 2}))
    assert own.measured_iteration_s == pytest.approx(1e15 / (100e12 * 32))
    assert (own.cluster.nodes, own.cluster.devices_per_node) == (4, 8)


@pytest.mark.parametrize("change, says", [
    ({"system": "megatron-9"}, "unknown system 'megatron-9'"),
    ({"tp": 0}, "field 'tp' must be an integer >= 1"),
    ({"tp": True}, "field 'tp' must be an integer >= 1"),
    ({"sequence_parallel": "yes"}, "field 'sequence_parallel' must be true or false"),
    ({"recompute": "some"}, "recompute must be one of full, selective, none"),
    ({"precision": "fp4"}, "unknown precision 'fp4'"),
    ({"measured_s": 1.0}, "exactly one of 'measured_s' and 'measured_tflops'"),
    ({"measured_tflops": -3}, "field 'measured_tflops' must be a finite number > 0"),
    ({"measured_tflops": float("inf")}, "field 'measured_tflops' must be a finite number > 0"),
    ({"cluster": "dgx-b900"}, "unknown cluster preset 'dgx-b900'"),
    ({"model": "gpt5:hidden=2"}, "unknown model 'gpt5:hidden=2'"),
    ({"tp": 4, "pp": 3}, "12 GPUs are not whole nodes of 'dgx-a100'"),
    ({"microbatch_size": 3}, "global batch 8 does not split into microbatches of 3"),
    ({"sharded_gradients": True}, "sharded_gradients needs the distributed optimizer"),
    ({"seconds": 1.0}, "unknown field 'seconds'"),
    ({"assumed": "mbs 1"}, "field 'assumed' must be a list of strings"),
    ({"method": "magic"}, "unknown method 'magic'"),
    ({"method": "alpa"}, "field 'tp' is a published layout (method megatron); method alpa searches its own"),
    ({"gpus": 8}, "gpus 8 is not tp x pp x dp x cp = 4"),
])
def test_a_bad_row_is_refused_naming_the_row_and_its_field(change, says):
    with pytest.raises(ex.RunsFileError) as e:
        runs_from_json(_file({**TINY, **change}), "held.json")
    message = str(e.value)
    assert message.startswith("held.json: runs[0] (tiny): ") and says in message and "\n" not in message


SEARCHED = {"id": "alpa-tiny", "system": "alpa-osdi22", "method": "alpa", "gpus": 2, "cluster": "aws-p3.16xlarge",
            "model": "gpt3:hidden=256,layers=2,heads=4,seq=128,vocab=512,batch=8", "measured_s": 1.0}


def test_a_searched_methods_row_prices_what_the_method_finds(tmp_path):
    """An Alpa paper's row states no layout: it is priced as Alpa's own search on its
    GPUs finds it, exactly what planning the model there gives, and written back
    without a layout."""
    (run,) = runs_from_json(_file(SEARCHED))
    assert (run.method, run.tp, run.gpus, run.recompute) == ("alpa", None, 2, None)
    cache = sv.DiskCache(root=tmp_path)          # the second search reads the first's stage costs
    (row,) = ex.validate([run], cache)["rows"]
    direct = sv.plan_model(SEARCHED["model"], run.cluster, "alpa", system="alpa-osdi22", cache=cache)
    assert row["status"] == "priced" and row["method"] == "alpa" and row["tp"] is None
    assert row["predicted_s"] == pytest.approx(sim.simulate(direct, direct.schedule, chunks=direct.chunks).iteration_s)
    written = ex.runs_to_json([run])["runs"][0]
    assert "tp" not in written and "chunks" not in written and written["gpus"] == 2
    assert runs_from_json(json.loads(json.dumps(ex.runs_to_json([run])))) == (run,)
    for change, says in [({"gpus": None}, "missing field 'gpus'"), ({"chunks": 2}, "field 'chunks' is a published"),
                         ({"method": "megatron", "gpus": None}, "missing field 'tp' (method megatron prices")]:
        bad = {k: v for k, v in {**SEARCHED, **change}.items() if v is not None}
        with pytest.raises(ex.RunsFileError, match=re.escape(says)):
            runs_from_json(_file(bad))


def test_a_file_is_refused_whole_for_a_bad_shape_or_a_repeated_id():
    cluster = cm.get_cluster("dgx-a100", nodes=1).to_json()
    cases = [([], "expected a JSON object"), ({"runs": [TINY]}, "expected a JSON object"),
             ({**_file(TINY), "more": 1}, "unknown field 'more'"), (_file(), "non-empty list"),
             (_file(TINY, TINY), "runs\\[1\\]: id 'tiny' appears twice"),
             (_file(TINY, 3), "runs\\[1\\]: a row must be"),
             # A cluster JSON object must hold the row's GPUs exactly.
             (_file({**TINY, "cluster": cluster}), "ran on 4 GPUs, but the cluster has 8")]
    for data, says in cases:
        with pytest.raises(ex.RunsFileError, match=says):
            runs_from_json(copy.deepcopy(data))


def test_cli_prices_a_runs_file_and_refuses_a_bad_one_before_pricing(cli, tmp_path):
    good = tmp_path / "held.json"
    good.write_text(json.dumps(_file(TINY, {**TINY, "id": "tiny-sp", "sequence_parallel": True})))
    shown = cli("validate", "--runs", str(good), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert [r["id"] for r in report["rows"]] == ["tiny", "tiny-sp"] and report["priced_rows"] == 2
    assert all(r["generation"] == "A100" and r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
               for r in report["rows"])
    # --save-runs writes the chosen rows back, and they read as they were.
    saved = tmp_path / "saved.json"
    assert cli("validate", "--runs", str(good), "--rows", "SP", "--save-runs", str(saved)).returncode == 0
    assert [r.id for r in ex.read_runs_file(saved)] == ["tiny-sp"]
    # A bad second row stops the command before the first is priced: one line, no table.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_file(TINY, {**TINY, "id": "t2", "system": "nope"})))
    refused = cli("validate", "--runs", str(bad))
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "--runs " in refused.stderr and "runs[1] (t2): unknown system 'nope'" in refused.stderr
    missing = cli("validate", "--runs", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_a_run_built_in_code_is_checked_as_a_file_row_is():
    import dataclasses

    row = ex.PUBLISHED_RUNS[0]                         # korthikanti-22b-full: tp 8 on one node of 8
    with pytest.raises(ValueError, match="tp, pp, dp and microbatch_size must be positive integers"):
        dataclasses.replace(row, tp=None)
    with pytest.raises(ValueError, match="not the cluster's 8 devices"):
        dataclasses.replace(row, tp=4)
    with pytest.raises(ValueError, match="method alpa searches its own layout"):
        dataclasses.replace(row, method="alpa")
    searched = dataclasses.replace(row, method="alpa", tp=None, pp=None, dp=None, microbatch_size=None)
    assert searched.gpus == 8


def test_spans_price_a_row_at_every_unpublished_setting():
    """`validate(spans=True)`: a row that leaves its microbatch size and recomputation
    unsaid is priced at each (1, 2, 4 sequences where they divide a rank's share; none,
    selective, full), every alternative exactly what pricing that row would give, and
    the span is their least and most; a row that publishes everything has no span."""
    import dataclasses

    (run,) = runs_from_json(_file({**TINY, "unpublished": ["microbatch_size", "recompute"]}))
    cache = sv.DiskCache(enabled=False)
    report = ex.validate([run], cache, spans=True)
    (row,) = report["rows"]
    alternatives = row["span"]["alternatives"]
    # A rank's share of the batch is 8 sequences: 1, 2 and 4 divide it.
    assert [(a["microbatch_size"], a["recompute"]) for a in alternatives] == [
        (1, "none"), (1, "selective"), (1, "full"), (2, "none"), (2, "selective"), (2, "full"),
        (4, "none"), (4, "selective"), (4, "full")]
    # The row itself comes first, priced as validate prices it alone.
    assert alternatives[0]["predicted_s"] == pytest.approx(ex.validate([run], cache)["rows"][0]["predicted_s"])
    for a in alternatives[1:]:
        alone = ex.price_run(dataclasses.replace(run, microbatch_size=a["microbatch_size"], recompute=a["recompute"]),
                             cache)
        assert a["status"] == alone.status and a["predicted_s"] == pytest.approx(alone.predicted_s)
    priced = [a["predicted_s"] for a in alternatives if a["status"] == "priced"]
    assert (row["span"]["min_s"], row["span"]["max_s"]) == (min(priced), max(priced))
    assert row["span"]["contains_measured"] == (min(priced) <= row["measured_s"] <= max(priced))
    assert report["rows_with_span"] == 1 and report["rows_in_span"] == int(row["span"]["contains_measured"])
    # A measured time far above every setting's prediction lies outside the span.
    slow = dataclasses.replace(run, measured_tflops=None, flops_per_iteration=None, measured_s=100 * max(priced))
    far = ex.validate([slow], cache, spans=True)
    assert far["rows"][0]["span"]["contains_measured"] is False and far["rows_in_span"] == 0
    # Full recomputation redoes the forward: never faster than none at the same microbatch size.
    by = {(a["microbatch_size"], a["recompute"]): a["predicted_s"] for a in alternatives}
    assert all(by[(m, "full")] > by[(m, "none")] for m in (1, 2, 4))
    plain = ex.validate([dataclasses.replace(run, unpublished=())], cache, spans=True)
    assert len(plain["rows"][0]["span"]["alternatives"]) == 1 and plain["rows_with_span"] == 0
    # Interleaved over pp 4: microbatches of 4 leave 2 microbatches, which Megatron's
    # schedule refuses; 1 and 2 (8 and 4 microbatches) price, and make the span.
    deep = dataclasses.replace(run, model=run.model.replace("layers=4", "layers=8"), tp=1, pp=4, dp=1, chunks=2,
                               unpublished=("microbatch_size",))
    spanned = ex.validate([deep], cache, spans=True)
    statuses = [a["status"] for a in spanned["rows"][0]["span"]["alternatives"]]
    assert statuses == ["priced", "priced", "not expressible"] and spanned["rows_with_span"] == 1
    with pytest.raises(ex.RunsFileError, match="field 'unpublished' names 'chunks'"):
        runs_from_json(_file({**TINY, "unpublished": ["chunks"]}))


def test_cli_spans_add_a_column_and_a_count(cli, tmp_path):
    held = tmp_path / "held.json"
    held.write_text(json.dumps(_file({**TINY, "unpublished": ["microbatch_size"]})))
    shown = cli("validate", "--runs", str(held), "--spans")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(cli("validate", "--runs", str(held), "--spans", "--json").stdout)
    inside = int(report["rows"][0]["span"]["contains_measured"])
    text = " ".join(shown.stdout.split())
    assert f"measured inside the span of its unpublished settings: {inside} of 1 rows with a span" in text
    assert ("inside" if inside else "outside") in text          # the row's cell

"""The inter-op pass end to end: feasible plans that cover the cluster and fit memory."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import get_cluster
from alpasim.graphs import build_training_graph, forward_graph, resolve_model
from alpasim.solvers import (
    DiskCache,
    PlanFormatError,
    PlanInfeasible,
    ShardingSpec,
    bubble_fraction,
    load_plan,
    microbatch_candidates,
    plan_from_json,
    plan_pipeline,
    plan_with_method,
    planning_units,
)
from alpasim.units import format_bytes
from alpasim.solvers import PlanOptions, RunOptions, SearchSpace

GB16 = 16 * 2 ** 30


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return DiskCache(root=tmp_path_factory.mktemp("cache"))


@given(st.lists(st.floats(0.01, 10), min_size=1, max_size=8), st.integers(1, 63), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_more_microbatches_never_grow_the_bubble(costs, b, extra):
    assert bubble_fraction(costs, b + extra) <= bubble_fraction(costs, b) + 1e-12
    # Balanced stages: the textbook (S - 1) / (S - 1 + B).
    s = len(costs)
    assert bubble_fraction([1.0] * s, b) == pytest.approx((s - 1) / (s - 1 + b))


def _check_plan(plan, cluster):
    devices = sorted(d for s in plan.stages for d in s.devices)
    assert devices == list(range(cluster.num_devices))            # exact cover
    assert plan.stages[0].layers[0] == 0
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert b.layers[0] == a.layers[1] + 1                       # contiguous layers
    assert plan.stages[-1].layers[1] == plan.model.layers - 1
    for s in plan.stages:
        assert s.memory_bytes <= cluster.device.memory_bytes         # fits a 16 GB V100
        assert s.logical_mesh[0] * s.logical_mesh[1] == len(s.devices)
    assert plan.feasible and plan.predicted.iteration_s > 0
    assert plan.predicted.peak_memory_bytes <= GB16


@pytest.mark.slow
def test_gpt3_1_3b_on_two_nodes(cache):
    # Two nodes of four V100s (a real GPT-3 size across the slow link, in 15 s of planning).
    cluster = get_cluster("aws-p3.16xlarge", nodes=2, devices_per_node=4)
    plan = plan_pipeline("gpt3-1.3b", cluster, SearchSpace(microbatches=64), run=RunOptions(cache=cache))
    _check_plan(plan, cluster)
    _check_transfers(plan)
    # Slow links between nodes: no stage's model-parallel axis spans nodes.
    for s in plan.stages:
        nodes = {d // 4 for d in s.devices}
        if len(nodes) > 1:
            assert s.logical_mesh[1] in (1, 4)
    # A plan round-trips through JSON exactly.
    assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == plan
    tflops = plan.predicted.tflops_per_device
    assert 5 < tflops < 125  # below the V100's fp16 peak, above nonsense


def _check_transfers(plan):
    """Stage times split into forward and backward; what crosses stages is the residual
    stream forward and its cotangent backward, between neighbours, with layouts of the
    right rank on each side."""
    for s in plan.stages:
        assert s.forward_s > 0 and s.backward_s > s.forward_s          # backward recomputes (remat)
        assert s.forward_s + s.backward_s == pytest.approx(s.compute_s)
    per_microbatch = [t for t in plan.transfers if not t.per_iteration]
    pairs = {(t.src_stage, t.dst_stage) for t in per_microbatch}
    n = len(plan.stages)
    assert pairs == {(i, i + 1) for i in range(n - 1)} | {(i + 1, i) for i in range(n - 1)}
    mb = plan.model.microbatch_size
    for t in plan.transfers:
        assert (t.direction == "forward") == (t.dst_stage > t.src_stage)
        assert ShardingSpec.parse(t.src_spec).rank == len(t.shape)
        assert ShardingSpec.parse(t.dst_spec).rank == len(t.shape)
        if not t.per_iteration:
            assert t.shape[0] == mb                                   # activations of one microbatch
            assert t.nbytes == 2 * mb * 1024 * 2048                   # (b, s, h) fp16 of GPT-3 1.3B


def test_second_run_is_served_from_the_cache(cache):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    model = "gpt3:hidden=192,layers=3,heads=4,seq=64,vocab=512,batch=16"   # planned nowhere else in the module
    first = plan_pipeline(model, cluster, SearchSpace(microbatches=4), run=RunOptions(cache=cache))
    again = plan_pipeline(model, cluster, SearchSpace(microbatches=4), run=RunOptions(cache=cache))
    assert first.search.ilp_solves > 0 and again.search.ilp_solves == 0
    assert again.search.cache_hits >= first.search.ilp_solves
    assert again.predicted.iteration_s == pytest.approx(first.predicted.iteration_s)


@pytest.mark.parametrize("damage", ["negative size", "wrong field", "not a list", "not json"])
def test_a_damaged_cache_entry_is_a_miss_not_a_different_plan(tmp_path, damage):
    """Every stage-cost entry damaged in one way: well-formed JSON with a negative size
    or a field renamed, another type, or no JSON at all. The second plan reads none of
    them (they count as invalid), solves every layer again and equals the first."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    model = "gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=128,batch=8"
    first = plan_pipeline(model, cluster, SearchSpace(microbatches=2), run=RunOptions(cache=DiskCache(root=tmp_path)))
    files = sorted((tmp_path / "stages").rglob("*.json"))
    assert len(files) == first.search.ilp_solves > 0
    for f in files:
        entry = json.loads(f.read_text())
        if damage == "negative size":
            entry[0]["activation_bytes"] = -1e9
        elif damage == "wrong field":
            entry[0]["time"] = entry[0].pop("time_s")
        elif damage == "not a list":
            entry = {"options": entry}
        f.write_text("{truncated" if damage == "not json" else json.dumps(entry))
    cache = DiskCache(root=tmp_path)
    again = plan_pipeline(model, cluster, SearchSpace(microbatches=2), run=RunOptions(cache=cache))
    assert cache.invalid == len(files) and again.search.ilp_solves == first.search.ilp_solves
    assert again.predicted.iteration_s == pytest.approx(first.predicted.iteration_s, rel=1e-12)
    assert again.predicted.peak_memory_bytes == pytest.approx(first.predicted.peak_memory_bytes, rel=1e-12)


def test_model_that_fits_nowhere_says_how_much_memory():
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1)
    with pytest.raises(PlanInfeasible, match=r"needs at least \d+\.\d+ GiB per device") as e:
        plan_pipeline("gpt3-39b", cluster, SearchSpace(microbatches=1024))
    assert e.value.min_memory_bytes > GB16


def test_microbatch_candidates_divide_the_batch():
    assert microbatch_candidates(1024, "auto") == [32, 64, 128, 256, 512, 1024]
    assert microbatch_candidates(1024, 64) == [64]
    with pytest.raises(ValueError, match="divide"):
        microbatch_candidates(1024, 3)
    # A data-parallel system's microbatches give every device whole samples, up to the
    # same 32 samples, or one sample per device where it has more devices than that.
    assert microbatch_candidates(1024, "auto", 8) == [32, 64, 128]
    assert microbatch_candidates(96, "auto", 3) == [4, 8, 16, 32]
    assert microbatch_candidates(1024, "auto", 64) == [16]
    assert microbatch_candidates(1024, "auto", 3) == []
    assert microbatch_candidates(1024, 16, 64) == [16] and microbatch_candidates(1024, 32, 64) == []


@pytest.mark.slow
def test_data_parallel_baseline_on_64_devices_finds_its_microbatches():
    """DeepSpeed on 64 devices: every device takes whole samples, so a 64-sample batch
    is one microbatch of one sample per device (moe-70b's Figure 7b point was refused
    as having no such microbatch when only microbatches of 1-32 samples were tried)."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=8)
    plan = plan_with_method("zero2", "gpt3:hidden=32,layers=1,heads=2,seq=8,vocab=64,batch=64", cluster,
                            pareto=False)
    assert plan.feasible and plan.stages[0].devices == tuple(range(64)) and plan.microbatches == 1
    with pytest.raises(PlanInfeasible, match="whole samples"):
        plan_pipeline("gpt3:hidden=32,layers=1,heads=2,seq=8,vocab=64,batch=64", cluster,
                      SearchSpace(microbatches=2, microbatch_multiple=64, max_stages=1))


def test_bad_plan_files(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"schema": "alpasim.plan/0"}')
    with pytest.raises(PlanFormatError, match="'schema'"):
        load_plan(p)
    good = {"schema": "alpasim.plan/1", "model": {"name": "m", "family": "gpt3", "global_batch": 8},
            "cluster": {"name": "c", "nodes": 1, "devices_per_node": 1}, "method": "alpa", "feasible": True,
            "microbatches": 2, "stages": [{"layers": [0, 1]}], "predicted": {}, "search": {}}
    p.write_text(json.dumps(good))
    with pytest.raises(PlanFormatError, match=r"p.json: stages\[0\]: missing field 'devices'"):
        load_plan(p)
    p.write_text(json.dumps({**good, "model": {}}))
    with pytest.raises(PlanFormatError, match=r"p.json: model: missing field 'name'"):
        load_plan(p)


@pytest.mark.slow
def test_partition_spec_export(cache):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    plan = plan_pipeline("gpt3:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=32", cluster,
                         SearchSpace(microbatches=4), run=RunOptions(cache=cache))
    specs = plan.partition_specs()
    assert len(specs) == len(plan.stages)
    for stage, per_param in zip(plan.stages, specs):
        assert set(per_param) == set(stage.param_specs)
        for p, spec in per_param.items():
            text = stage.param_specs[p]
            assert len(spec) == text.count("R") + text.count("S")      # one entry per dimension
            for entry in spec:
                assert entry is None or entry in ("x", "y") or entry == ["x", "y"]


@pytest.mark.ray
def test_stage_table_on_ray(ray_cluster):
    """The stage table's ILPs as Ray tasks (on the session's cluster, which the map
    function joins) give the plan the in-process pool gives."""
    from alpasim.backends import ray_map_fn

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    model = "gpt3:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=8"
    local = plan_pipeline(model, cluster, SearchSpace(microbatches=2))
    remote = plan_pipeline(model, cluster, SearchSpace(microbatches=2), run=RunOptions(map_fn=ray_map_fn(ray_cluster)))
    assert remote.predicted.iteration_s == pytest.approx(local.predicted.iteration_s)
    assert [s.layers for s in remote.stages] == [s.layers for s in local.stages]


SMALL = "gpt3:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=32"


@pytest.mark.slow
def test_out_of_memory_bound_is_true_and_names_its_largest_term(cache):
    """Below the bound nothing fits; the best plan found with room to spare needs at
    least the bound; the message names the term it is made of."""
    roomy = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    best = plan_pipeline(SMALL, roomy, SearchSpace(microbatches=4), run=RunOptions(cache=cache))
    peak = max(st.memory_bytes for st in best.stages)
    tight = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4, memory_gb=peak / 2 ** 30 / 4)
    with pytest.raises(PlanInfeasible) as e:
        plan_pipeline(SMALL, tight, SearchSpace(microbatches=4), run=RunOptions(cache=cache))
    bound = e.value.min_memory_bytes
    assert 0 < bound <= peak
    message = str(e.value)
    assert f"needs at least {format_bytes(bound)} per device" in message
    assert "largest term is" in message or "spread over all 4 devices" in message


def test_plan_records_its_precision_recipe_and_breakdown(cache):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    for recipe, per_param in (("mixed-fp32grad", 18), ("mixed", 16)):
        plan = plan_pipeline(SMALL, cluster, SearchSpace(microbatches=4), PlanOptions(precision=recipe),
                             RunOptions(cache=cache))
        assert plan.model.precision == recipe and plan.model.bytes_per_param == per_param
        again = plan_from_json(json.loads(json.dumps(plan.to_json())))
        for st, back in zip(plan.stages, again.stages):
            m = back.memory
            assert set(m) >= {"params_bytes", "grads_bytes", "optimizer_bytes", "stash_bytes", "inflight",
                              "transient_bytes", "buffer_bytes", "total_bytes"}
            assert m["total_bytes"] == pytest.approx(st.memory_bytes)
            assert m["inflight"] == st.inflight_microbatches
            terms = (m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["buffer_bytes"]
                     + max(m["inflight"] * m["stash_bytes"] + m["transient_bytes"], m.get("update_bytes", 0.0)))
            assert terms == pytest.approx(m["total_bytes"])


def test_zero3_holds_the_largest_layers_gathered_parameters_twice(cache):
    """DeepSpeed's ZeRO-3 gathers each layer's parameters before use and prefetches the
    next: the buffer is twice the largest layer's full parameters, per device."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    plan = plan_with_method("zero3", SMALL, cluster, microbatches=4, cache=cache)
    (stage,) = plan.stages
    name, cfg = resolve_model(SMALL)
    fwd = planning_units(forward_graph(dataclasses.replace(cfg, batch=cfg.batch // 4), name=name))
    g = build_training_graph(fwd, remat=True).graph
    updated = {op.inputs[0]: op.layer for op in g.ops if op.prim == "adam"}
    per_layer = [sum(p.nbytes for p in g.params if updated.get(p.name) == l) for l in range(g.num_layers)]
    assert stage.memory["buffer_bytes"] == pytest.approx(2 * max(per_layer))
    # ZeRO-3 stores everything 1/N: the states per device are a quarter of the model's
    # 18 B/param (fp16 weights, fp32 gradients, master and Adam moments).
    states = stage.memory["params_bytes"] + stage.memory["grads_bytes"] + stage.memory["optimizer_bytes"]
    assert states == pytest.approx(sum(p.size for p in g.params) * 18 / 4, rel=0.02)

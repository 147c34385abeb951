"""Planning methods (Alpa, its ablations and the hand-designed baselines) on one search."""

from __future__ import annotations

import json

import pytest

from alpasim.costmodels import get_cluster
from alpasim.graphs import forward_graph, resolve_model
from alpasim.solvers import (
    METHODS,
    RECOMPUTE_SEARCH,
    DiskCache,
    MegatronConfig,
    equal_operator_layers,
    megatron_configs,
    plan_from_json,
    plan_with_method,
    throughput_pflops,
)

TINY = "gpt3:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=32"
MICROBATCHES = 4


@pytest.fixture(scope="module")
def cluster():
    return get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)


@pytest.fixture(scope="module")
def plans(cluster, tmp_path_factory):
    cache = DiskCache(root=tmp_path_factory.mktemp("cache"))
    methods = [m for m in METHODS if m not in ("megatron", "equal_operator")]
    return {m: plan_with_method(m, TINY, cluster, microbatches=MICROBATCHES, cache=cache) for m in methods}


def _covers(plan, n):
    return sorted(d for s in plan.stages for d in s.devices) == list(range(n))


@pytest.mark.slow
def test_every_method_gives_a_feasible_plan_that_covers_the_devices(plans, cluster):
    for method, plan in plans.items():
        assert plan.feasible and plan.method == method, method
        assert _covers(plan, cluster.num_devices), method
        assert throughput_pflops(plan) > 0
        assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == plan


@pytest.mark.slow
def test_search_spaces_shape_the_plans(plans, cluster):
    for method in ("intra_only", "data_parallel", "zero2", "zero3", "heuristic", "deepspeed_moe"):
        assert len(plans[method].stages) == 1, method
    inter = plans["inter_only"]
    assert len(inter.stages) == cluster.num_devices and all(len(s.devices) == 1 for s in inter.stages)
    lengths = {s.layers[1] - s.layers[0] + 1 for s in plans["equal_layer"].stages}
    assert max(lengths) - min(lengths) <= 1
    # PP-DP never shards a parameter: data parallelism replicates them.
    for s in plans["pp_dp"].stages:
        assert all(set(spec) <= {"R"} for spec in s.param_specs.values() if spec != "scalar")
    # ZeRO-3 stores parameters sharded, data parallel replicated.
    dp_bytes = plans["data_parallel"].stages[0].params_bytes
    assert plans["zero3"].stages[0].params_bytes < plans["zero2"].stages[0].params_bytes < dp_bytes


@pytest.mark.slow
def test_alpa_is_never_worse_than_a_restriction_of_its_space(plans):
    """Same B, and every method below searches a subset of Alpa's plans (up to the
    planning ILPs' 0.1% gap)."""
    alpa = plans["alpa"].predicted.iteration_s
    for method in ("intra_only", "inter_only", "pp_dp", "equal_layer", "data_parallel", "zero2", "zero3"):
        assert alpa <= plans[method].predicted.iteration_s * (1 + 2e-3), method


def test_megatron_explicit_configuration(cluster, tmp_path):
    config = MegatronConfig(tp=2, pp=2, dp=1, microbatch_size=8)
    plan = plan_with_method("megatron", TINY, cluster, megatron=config, cache=DiskCache(root=tmp_path))
    assert plan.feasible and len(plan.stages) == 2 and _covers(plan, 4)
    assert plan.microbatches == 32 // (8 * 1)
    assert plan.search.megatron == {"tp": 2, "pp": 2, "dp": 1, "microbatch_size": 8, "distributed_optimizer": False,
                                   "sequence_parallel": False, "ends_as_layers": False, "sharded_gradients": False,
                                   "cp": 1}
    # Equal blocks per stage (embedding with the first block, head with the last) ...
    assert [s.layers for s in plan.stages] == [(0, 1), (2, 3)]
    for s in plan.stages:
        assert s.logical_mesh == (1, 2)
        # ... and Megatron's layouts: column-parallel fc1, row-parallel fc2.
        fc1 = [spec for p, spec in s.param_specs.items() if p.endswith("/w_fc1")]
        fc2 = [spec for p, spec in s.param_specs.items() if p.endswith("/w_fc2")]
        assert fc1 and set(fc1) == {"RS1"} and set(fc2) == {"S1R"}


def test_megatron_grid_enumeration():
    configs = megatron_configs(8, 8, num_blocks=4, global_batch=32, microbatch_sizes=(1, 2))
    triples = {(c.tp, c.pp, c.dp) for c in configs}
    # tp in {1,2,4,8}, pp | blocks (4) and pp | 8/tp, dp = 8/(tp*pp).
    assert triples == {(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1),
                       (8, 1, 1)}
    assert len(configs) == 2 * len(triples)                 # every (mbs x dp) divides 32
    with pytest.raises(ValueError, match="positive"):
        MegatronConfig(0, 1, 1, 1)


def test_megatron_rejects_impossible_configurations(cluster):
    with pytest.raises(ValueError, match="tp x pp x dp"):
        plan_with_method("megatron", TINY, cluster, megatron=MegatronConfig(2, 1, 1, 1))


def test_out_of_memory_is_a_result(tmp_path):
    one = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1)
    plan = plan_with_method("data_parallel", "gpt3-39b", one, microbatches=1024, cache=DiskCache(root=tmp_path))
    assert not plan.feasible and plan.stages == ()
    assert throughput_pflops(plan) is None and "does not fit" in plan.notes[0]
    assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'gpipe'"):
        plan_with_method("gpipe", TINY, get_cluster("aws-p3.16xlarge", nodes=1))


def test_equal_operator_layers_have_equal_operator_counts():
    _, cfg = resolve_model(TINY)
    fwd = forward_graph(cfg, name="tiny")
    cut = equal_operator_layers(fwd)
    counts = [sum(1 for op in cut.ops if op.layer == layer) for layer in range(cut.num_layers)]
    assert cut.num_layers == 6                              # embedding + 4 blocks + head
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(fwd.ops)


def test_out_of_memory_note_bounds_a_pipelined_method_by_the_spread_model(tmp_path):
    """Inter-op only keeps every stage on one device, but pipelining spreads the model
    over all 8: the note's lower bound is the 18 B/param state (mixed precision with
    fp32 gradients) divided by 8, not the whole model on one device; known before any
    stage is priced, so nothing is cached."""
    import re

    node = get_cluster("aws-p3.16xlarge", nodes=1)
    plan = plan_with_method("inter_only", "gpt3-39b", node, microbatches=1024, cache=DiskCache(root=tmp_path))
    assert not plan.feasible
    need = float(re.search(r"at least ([\d.]+) GiB per device on 8 devices", plan.notes[0]).group(1))
    params = forward_graph("gpt3-39b").num_params()
    assert 39.0e9 < params < 39.3e9
    assert need == pytest.approx(params * 18 / 8 / 2 ** 30, abs=0.005)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("memory_gb, chosen", [(1000, "none"), (1.0, "selective"), (0.8, "full")])
def test_recompute_auto_recomputes_only_when_it_pays(tmp_path, memory_gb, chosen):
    """A long-sequence model (the attention probabilities are most of a layer's stash)
    on one device: with memory to spare no recomputation is fastest; when the stash of
    "none" does not fit, selective recomputation (QK^T and softmax again, no (s, s)
    stash) is the fastest that fits; with less still, only full recomputation fits. The
    order of the three times is the recomputed compute's: none < selective < full."""
    model = "gpt3:hidden=512,layers=4,heads=16,seq=2048,vocab=8192,batch=8"
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1, memory_gb=memory_gb)
    plan = plan_with_method("alpa", model, cluster, microbatches=8, recompute="auto", cache=DiskCache(root=tmp_path))
    assert plan.feasible
    assert (plan.model.remat, plan.model.recompute) == {"none": (False, "none"), "selective": (False, "selective"),
                                                        "full": (True, "none")}[chosen]
    (chose,) = [n for n in plan.notes if n.startswith("recompute auto chose")]
    assert chose.startswith(f"recompute auto chose {chosen} ")
    times = {label: plan_with_method("alpa", model, get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1,
                                                                memory_gb=1000),
                                     microbatches=8, remat=remat, recompute=policy,
                                     cache=DiskCache(root=tmp_path)).predicted.iteration_s
             for label, remat, policy in RECOMPUTE_SEARCH}
    assert times["none"] < times["selective"] < times["full"]
    assert plan.predicted.iteration_s == pytest.approx(times[chosen])

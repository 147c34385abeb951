"""What the planner refuses before it prices anything (`solvers._preflight`).

Independent answers: the planner's own per-stage memory accounting (the states bound
must never exceed what any plan it makes holds, and ZeRO-3, which shards every state,
meets it exactly); brute force over (S, v) for interleaved plans; and a planner whose
stage-cost table cannot be built, so a refusal that priced anything fails loudly.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import alpasim.solvers._inter_op as inter_op
from alpasim.costmodels import get_cluster
from alpasim.graphs import RECIPES, model_source
from alpasim.solvers import MegatronConfig, check_before_planning, model_states, plan_model
from alpasim.solvers._interleave import interleaved_cannot_exist
from alpasim.solvers._submesh import submesh_shapes
from alpasim.solvers import PlanOptions, SearchSpace

TINY = "gpt3:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=32"


def _states_held(plan) -> float:
    """Bytes of parameters, gradients and optimizer states the plan keeps on all its devices."""
    return sum((s.memory["params_bytes"] + s.memory["grads_bytes"] + s.memory["optimizer_bytes"]) * len(s.devices)
               for s in plan.stages)


def test_model_states_are_the_recipes_bytes_per_parameter():
    source = model_source(TINY)
    params = source.forward(1).num_params()
    h, l, v, s = 256, 4, 1024, 128
    assert params == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h     # GPT: blocks, embeddings, final norm
    for name, per_param in (("mixed-fp32grad", 18), ("mixed", 16), ("fp32", 16)):
        states = model_states(source, name)
        assert (states.params, states.bytes_per_param) == (params, per_param)
        assert RECIPES[name].bytes_per_param("float16") == per_param


@pytest.mark.slow
@pytest.mark.parametrize("method", ["alpa", "zero3", "inter_only", "megatron"])
def test_every_plan_holds_at_least_the_states_bound(tmp_path, method):
    """The bound is sound by the planner's own accounting: a plan's devices hold every
    state at least once; ZeRO-3 (every state sharded over every device) holds each
    exactly once, so the bound is also tight."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    plan = plan_model(TINY, cluster, method, **({"microbatches": 4} if method != "megatron" else {}))
    assert plan.feasible
    total = model_states(model_source(TINY)).total_bytes
    assert _states_held(plan) >= total * (1 - 1e-9)
    if method == "zero3":
        assert _states_held(plan) == pytest.approx(total, rel=1e-9)


def _refuse(*args, **kwargs):
    raise AssertionError("priced a stage before refusing")


@pytest.fixture
def no_pricing(monkeypatch):
    """A planner that fails if it builds a stage-cost table."""
    monkeypatch.setattr(inter_op, "build_stage_costs", _refuse)


@settings(max_examples=25, deadline=None)
@given(devices=st.sampled_from([1, 2, 4, 8]), ratio=st.floats(0.05, 0.999))
def test_a_device_smaller_than_the_states_share_is_refused_before_pricing(devices, ratio):
    source = model_source(TINY)
    share = model_states(source).total_bytes / devices
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=devices, memory_gb=share * ratio / 2 ** 30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inter_op, "build_stage_costs", _refuse)
        for method in ("alpa", "zero3", "intra_only"):
            plan = plan_model(source, cluster, method)
            assert not plan.feasible and plan.notes[0].startswith("does not fit:"), plan.notes
            assert "states" in plan.notes[0] and f"{devices} device" in plan.notes[0]


def test_a_device_that_holds_the_states_share_is_not_refused():
    source = model_source(TINY)
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4,
                          memory_gb=1.001 * model_states(source).total_bytes / 4 / 2 ** 30)
    assert check_before_planning(TINY, cluster, "zero3") is not None


@pytest.mark.parametrize("per_node, max_stages, chunks", [
    (1, 4, (2,)), (2, 4, (2,)), (2, 4, (3,)), (4, 4, (2,)), (4, 2, (2,)), (4, 1, (2,)), (4, 4, (3, 4)), (2, 2, (5,)),
])
@pytest.mark.slow
def test_interleaved_cannot_exist_exactly_where_the_search_finds_nothing(per_node, max_stages, chunks):
    """The check against the search itself, with memory to spare: on a GPT of 4 planning
    units (embedding, 2 blocks, head), the interleaved search finds a plan exactly where
    the check says one can exist (S meshes of one shape, 2 <= S <= max_stages, S x v <= 4)."""
    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=64,batch=8"
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=per_node, memory_gb=1000)
    why = interleaved_cannot_exist(4, submesh_shapes(1, per_node), cluster, max_stages, chunks)
    try:
        plan = inter_op.plan_pipeline(model, cluster, SearchSpace(max_stages=max_stages, microbatches=4, pareto=False),
                                      PlanOptions(schedule="interleaved", chunk_options=chunks))
        found = plan.chunks > 1
    except inter_op.PlanInfeasible as e:
        assert "can exist" in str(e) and why is not None, (str(e), why)
        found = False
    assert found == (why is None), why


def test_an_interleaved_plan_that_cannot_exist_is_refused_before_pricing(no_pricing):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=1)
    plan = plan_model(TINY, cluster, "alpa", schedule="interleaved", chunk_options=(2,))
    assert not plan.feasible and "can exist: it needs S >= 2 meshes" in plan.notes[0]
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=8)    # 6 layers: 8 x 2 and 4 x 2 > 6
    plan = plan_model(TINY, cluster, "alpa", schedule="interleaved", chunk_options=(4,), max_stages=4)
    assert not plan.feasible and "S x chunks <= its 6 layers" in plan.notes[0]


@pytest.mark.parametrize("config, fragment", [
    (MegatronConfig(2, 2, 2, 1), "tp x pp x dp = 8, the cluster has 4 devices"),
    (MegatronConfig(1, 5, 1, 1), "tp x pp x dp = 5"),
    (MegatronConfig(4, 1, 1, 1), None),
])
def test_megatron_configurations_that_cannot_be_are_named(no_pricing, config, fragment):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    if fragment is None:
        assert check_before_planning(TINY, cluster, "megatron", megatron=config) is not None
        return
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        plan_model(TINY, cluster, "megatron", megatron=config)


def test_a_pipeline_deeper_than_the_blocks_is_named(no_pricing):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=8)
    with pytest.raises(ValueError, match="8 pipeline stages, but .* has 4 blocks"):
        plan_model(TINY, cluster, "megatron", megatron=MegatronConfig(1, 8, 1, 1))


def test_a_graph_charges_only_the_states_its_training_graph_keeps(tmp_path):
    """An imported model with a leaf its loss never reads (1M floats, 16 MiB of would-be
    states) and a bfloat16 weight beside float32 ones: the bound is what ZeRO-3 holds,
    exactly, so a device with room for that but not for every leaf's states plans."""
    import jax
    import jax.numpy as jnp

    from alpasim.graphs import JaxModel

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w"])
        h = jnp.tanh(h @ params["half"].astype(jnp.float32))
        return jnp.mean(h * h)

    spec = jax.ShapeDtypeStruct
    params = {"w": spec((64, 64), jnp.float32), "half": spec((64, 64), jnp.bfloat16),
              "unused": spec((1024, 1024), jnp.float32)}
    source = model_source(JaxModel(loss, params, {"x": spec((8, 64), jnp.float32)}, name="partly"))
    states = model_states(source)
    assert states.params == 2 * 64 * 64
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    zero3 = plan_model(source, cluster, "zero3")
    assert _states_held(zero3) == pytest.approx(states.total_bytes, rel=1e-9)
    roomy = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2, memory_gb=4 * states.total_bytes / 2 ** 30)
    assert 16 * 1024 * 1024 / 2 > roomy.device.memory_bytes        # every leaf's states would not fit
    assert plan_model(source, roomy, "zero3").feasible


def test_an_alpa_search_too_shallow_to_fit_says_which_option_to_raise():
    """States fit the devices (the preflight passes), but one stage holding the whole
    model's activations does not: the refusal names --max-stages."""
    source = model_source(TINY)
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2,
                          memory_gb=1.2 * model_states(source).total_bytes / 2 / 2 ** 30)
    plan = plan_model(TINY, cluster, "alpa", max_stages=1, microbatches=1, pareto=False)
    assert not plan.feasible
    assert "pipelines deeper than --max-stages 1 were not searched: raise it (up to 2)" in plan.notes[0]
    for method in ("intra_only", "zero3"):     # one stage by design: no option to raise
        plan = plan_model(TINY, cluster, method, microbatches=1)
        assert not plan.feasible and "--max-stages" not in plan.notes[0], plan.notes


@pytest.mark.slow
def test_megatron_530b_at_pipeline_depth_35_prices():
    """Narayanan et al. 2021's 530B GPT (Table 1: 2,240 A100s, tp 8, pp 35, dp 8,
    batch 2,560, microbatch 1) is priced, deeper than the Alpa search's default 16
    stages: 35 stages of three blocks, each on a dp x tp = 8 x 8 mesh."""
    model = "gpt3:hidden=20480,layers=105,heads=128,seq=2048,vocab=51200,batch=2560"
    cluster = get_cluster("dgx-a100", nodes=280)
    plan = plan_model(model, cluster, "megatron", megatron=MegatronConfig(8, 35, 8, 1))
    assert plan.feasible, plan.notes
    assert len(plan.stages) == 35 and plan.microbatches == 2560 // 8
    assert [s.layers[1] - s.layers[0] + 1 for s in plan.stages] == [3] * 35
    assert all(s.logical_mesh == (8, 8) for s in plan.stages)
    assert plan.predicted.peak_memory_bytes <= cluster.device.memory_bytes


def test_megatron_interleaving_needs_microbatches_a_multiple_of_pp(no_pricing):
    """Megatron-LM's interleaved schedule refuses microbatches that pp does not divide
    (schedules.py); so does the planner, before pricing. 8 sequences over dp 1 in
    microbatches of 4 are 2, of 1 are 8: pp 4 divides 8, not 2."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    model = "gpt3:hidden=64,layers=8,heads=4,seq=32,vocab=96,batch=8"
    with pytest.raises(ValueError, match=r"interleaving needs the microbatches \(2\) to be a multiple of pp \(4\)"):
        plan_model(model, cluster, "megatron", megatron=MegatronConfig(1, 4, 1, 4), schedule="interleaved",
                   chunk_options=(2,))
    with pytest.raises(AssertionError, match="priced a stage"):    # 8 microbatches: allowed, so pricing starts
        plan_model(model, cluster, "megatron", megatron=MegatronConfig(1, 4, 1, 1), schedule="interleaved",
                   chunk_options=(2,))


def test_megatrons_grid_leaves_out_what_its_interleaving_refuses():
    """Asked to interleave, the grid prices only configurations Megatron's interleaved
    schedule runs: pp >= 2 and microbatches that pp divides (8 sequences; dp x mbs
    sets how many)."""
    from alpasim.solvers import DiskCache

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    model = "gpt3:hidden=64,layers=8,heads=4,seq=32,vocab=96,batch=8"
    plan = plan_model(model, cluster, "megatron", schedule="interleaved", chunk_options=(2,),
                      cache=DiskCache(enabled=False))
    tried = plan.search.megatron_grid
    assert tried and all(c["pp"] >= 2 and (8 // (c["dp"] * c["microbatch_size"])) % c["pp"] == 0 for c in tried)
    assert any(c["pp"] == 4 for c in tried)

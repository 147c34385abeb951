"""The intra-op pass on the paper's models: what it must find, named by spec."""

from __future__ import annotations

import pytest

from alpasim.graphs import build_training_graph, stage_graph
from alpasim.solvers import (
    IntraOpInfeasible,
    LogicalMesh,
    data_parallel_restriction,
    megatron_restriction,
    min_memory_choice,
    solve_intra_op,
)

GIB = 2 ** 30


@pytest.fixture(scope="module")
def gpt_layer():
    # A middle layer of GPT-3 1.3B (forward, backward and Adam) at microbatch 8.
    return stage_graph(build_training_graph("gpt3-1.3b:batch=8,layers=3").graph, 1, 1)


def _solve(stage, mesh, model, method=None, **kw):
    if method is not None:
        kw["restrict"], kw["leaf_specs"] = method(stage, mesh, model)
        kw["rewrite"] = False
    return solve_intra_op(stage, mesh, model, **kw)


def test_gpt_layer_ilp_communicates_no_more_than_data_parallel(p3, gpt_layer):
    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (1, 8))
    budget = cluster.device.memory_bytes
    alpa = _solve(gpt_layer, mesh, model, memory_budget_bytes=budget)
    dp = _solve(gpt_layer, mesh, model, data_parallel_restriction)
    meg = _solve(gpt_layer, mesh, model, megatron_restriction)
    assert alpa.status == "optimal"
    comm = lambda r: r.plan.amortized_communication_s()  # noqa: E731  (one microbatch)
    assert comm(alpa) <= comm(dp) * (1 + 1e-9)
    assert comm(alpa) <= comm(meg) * (1 + 1e-9)
    # With gradient accumulation over 32 microbatches data parallelism's sync amortises.
    dp32 = _solve(gpt_layer, mesh, model, data_parallel_restriction, microbatches=32)
    alpa32 = _solve(gpt_layer, mesh, model, memory_budget_bytes=budget, microbatches=32)
    assert alpa32.plan.amortized_communication_s(32) <= dp32.plan.amortized_communication_s(32) * (1 + 1e-9)
    assert dp32.plan.communication_s == 0 and dp32.plan.sync_s > 0
    # Data parallelism: every weight replicated, gradients all-reduced over all 8 devices.
    for p in ("layer1/w_fc1", "layer1/w_qkv"):
        assert str(dp.plan.specs[p]).strip("R") == ""
    assert dp.plan.memory.total_bytes <= budget  # memory to spare on a 16 GB V100


def test_gpt_layer_fits_when_data_parallel_does_not(p3, gpt_layer):
    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (1, 8))
    dp = _solve(gpt_layer, mesh, model, data_parallel_restriction)
    budget = 0.5 * GIB
    assert dp.plan.memory.total_bytes > budget  # data parallelism does not fit
    alpa = _solve(gpt_layer, mesh, model, memory_budget_bytes=budget)
    plan = alpa.plan
    assert plan.memory.total_bytes <= budget * (1 + 1e-9)
    w1, w2 = str(plan.specs["layer1/w_fc1"]), str(plan.specs["layer1/w_fc2"])
    m1 = str(plan.specs["layer1/w_fc1:adam_m"])
    megatron_style = w1 == "RS1" and w2 == "S1R"          # column- then row-parallel MLP
    update_sharded = m1 != "RR"                             # optimizer state split (ZeRO-like)
    assert megatron_style or update_sharded, (w1, w2, m1)
    # Either way the MLP's big contraction is not replicated and its state is not whole.
    assert plan.memory.optimizer_bytes < dp.plan.memory.optimizer_bytes


def test_weight_update_sharding_rewrite_keeps_cost_and_cuts_memory(p3, gpt_layer):
    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (2, 4))
    plain = _solve(gpt_layer, mesh, model, rewrite=False)
    rewritten = _solve(gpt_layer, mesh, model, rewrite=True)
    assert rewritten.plan.amortized_communication_s() <= plain.plan.amortized_communication_s() * (1 + 1e-9)
    assert rewritten.plan.memory.total_bytes <= plain.plan.memory.total_bytes
    kinds = {c.collective.kind for c in rewritten.plan.collectives}
    assert "reduce_scatter" in kinds and "all_gather" in kinds


def test_moe_layer_finds_expert_parallelism(p3):
    cluster, model = p3
    stage = stage_graph(build_training_graph("moe-2.4b:batch=8,layers=2").graph, 0, 0)
    mesh = LogicalMesh.on_cluster(cluster, (1, 8))
    plan = solve_intra_op(stage, mesh, model, memory_budget_bytes=cluster.device.memory_bytes).plan
    for op in ("layer0/expert_in", "layer0/expert_out"):
        loops = dict(plan.strategies[op].loops)
        assert loops.get("E") == (1,), (op, plan.strategies[op].name)
    assert str(plan.specs["layer0/w_expert_in"]) == "S1RR"   # experts split across devices
    assert str(plan.specs["layer0/w_expert_out"]) == "S1RR"
    # Cheaper than replicating the experts and splitting only the tokens.
    dp = _solve(stage, mesh, model, data_parallel_restriction)
    assert plan.amortized_communication_s() <= dp.plan.amortized_communication_s()


def test_impossible_budget_says_how_much_is_needed(p3, gpt_layer):
    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (1, 8))
    message = r"does not fit: .* needs at least \d+\.\d+ MiB per device, the budget is 10.24 MiB"
    with pytest.raises(IntraOpInfeasible, match=message) as e:
        solve_intra_op(gpt_layer, mesh, model, memory_budget_bytes=0.01 * GIB)
    assert 0.01 * GIB < e.value.min_memory_bytes < 0.5 * GIB


def test_mesh_that_divides_nothing_replicates_and_says_so(p3, gpt_layer):
    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (1, 7))      # (3 would split the fused QKV's q, k, v)
    result = solve_intra_op(gpt_layer, mesh, model)
    assert result.problem.notes and "no even split" in result.problem.notes[0]
    assert result.plan.communication_s == 0.0


def test_megatron_layer_communicates_the_row_parallel_outputs(p3):
    """Megatron-LM's closed form: per microbatch the forward finishes exactly two partial
    sums on the tensor-parallel axis, the outputs of the row-parallel attention
    projection and second MLP matmul, each a full (b, s, h) fp16 activation; no weight
    is ever gathered."""
    cluster, model = p3
    layer = stage_graph(build_training_graph("gpt3-1.3b:batch=8,layers=3", remat=False).graph, 1, 1)
    mesh = LogicalMesh.on_cluster(cluster, (1, 4))
    meg = _solve(layer, mesh, model, megatron_restriction)
    activation_bytes = 2 * 8 * 1024 * 2048                       # (b, s, h) fp16
    forward = {op.name for op in layer.ops if op.phase == "forward"}
    finishing = [c for c in meg.plan.collectives
                 if c.op in forward and c.tensor is None and not c.per_iteration]
    assert sorted(c.op for c in finishing) == ["layer1/fc2", "layer1/out_proj"]
    for c in finishing:
        assert c.collective.kind in ("all_reduce", "reduce_scatter") and c.collective.axes == (1,)
        assert c.collective.nbytes == activation_bytes
    params = {t.name for t in layer.params}
    assert not any(c.tensor in params for c in meg.plan.collectives)
    assert str(meg.plan.specs["layer1/w_fc1"]) == "RS1" and str(meg.plan.specs["layer1/w_fc2"]) == "S1R"


@pytest.mark.slow
def test_min_memory_choice_falls_back_to_the_least_memory_plan(p3, gpt_layer, monkeypatch):
    """When the time-optimising second solve finds nothing in its limit, the first
    (memory-minimising) solve's plan is used, so the layer does not look out of memory."""
    import alpasim.solvers._intra_op as intra_op

    cluster, model = p3
    mesh = LogicalMesh.on_cluster(cluster, (2, 4))
    fast = solve_intra_op(gpt_layer, mesh, model)
    least, normal = min_memory_choice(fast.problem, activation_multiplier=4)
    assert normal is not None and normal.status == "optimal"

    def timed_out(*args, **kwargs):
        raise RuntimeError("no plan within the time limit")

    monkeypatch.setattr(intra_op, "solve_problem", timed_out)
    least_again, fallback = min_memory_choice(fast.problem, activation_multiplier=4)
    assert least_again == pytest.approx(least)
    assert fallback is not None and fallback.status == "time_limit"
    assert fallback.plan.memory.with_inflight(4) == pytest.approx(least, rel=1e-6)
    assert fallback.plan.memory.with_inflight(4) < fast.plan.memory.with_inflight(4)


@pytest.mark.parametrize("remat", [True, False])
def test_stash_is_what_backward_reads_of_the_forward(p3, remat):
    """With remat a layer keeps only its input, (b, s, h) fp16, from forward to backward;
    without it also the intermediates its backward reads, still less than the peak."""
    cluster, model = p3
    layer = stage_graph(build_training_graph("gpt3-1.3b:batch=8,layers=3", remat=remat).graph, 1, 1)
    mem = solve_intra_op(layer, LogicalMesh.on_cluster(cluster, (1, 1)), model).plan.memory
    checkpoint = 2 * 8 * 1024 * 2048
    if remat:
        assert mem.stash_bytes == checkpoint
    else:
        assert checkpoint < mem.stash_bytes < mem.activations_peak_bytes
    assert mem.pipelined_bytes(4) == mem.persistent_bytes + mem.activations_peak_bytes + 3 * mem.stash_bytes


@pytest.mark.parametrize("model_name", [
    "llama3-8b:batch=2,seq=256,layers=3",
    "deepseek-v2-lite:batch=2,seq=256,layers=3,group_size=512",
])
def test_megatron_splits_todays_weights_over_the_tensor_parallel_axis(p3, model_name):
    """Megatron-LM's layout of a Llama / fine-grained MoE layer on a 1x8 mesh: every
    weight matrix (attention, SwiGLU, routed and shared experts) is split 8 ways on the
    tensor-parallel axis, so the layer's states are 1/8 per device (the router and the
    norm scales stay replicated, as in Megatron-core), and the states the plan holds are
    that many bytes: 18 B a parameter under the default recipe."""
    cluster, model = p3
    layer = stage_graph(build_training_graph(model_name).graph, 1, 1)
    mesh = LogicalMesh.on_cluster(cluster, (1, 8))
    _, leaf_specs = megatron_restriction(layer, mesh, model)
    replicated = 0
    for t in layer.params:
        (spec,) = leaf_specs[t.name]
        leaf = t.name.rsplit("/", 1)[-1]
        if t.rank >= 2 and leaf != "w_router":
            assert sum(1 in axes for axes in spec.dims) == 1, (t.name, spec)
        else:
            assert all(not axes for axes in spec.dims), (t.name, spec)
            replicated += t.size
    meg = _solve(layer, mesh, model, megatron_restriction)
    split = layer.num_params() - replicated
    assert meg.plan.memory.persistent_bytes == pytest.approx(18 * (split / 8 + replicated), rel=1e-6)


def test_megatron_keeps_gshard_routers_replicated(p3):
    """Megatron-LM's layout table keys on parameter names: GShard MoE's router is
    `w_gate` (h, E), replicated over the tensor-parallel axis, and Llama's SwiGLU gate
    (`w_gate_proj`) must not share its name (it did, and split the router's experts)."""
    cluster, model = p3
    layer = stage_graph(build_training_graph("moe-380m:batch=8,layers=2").graph, 0, 0)
    _, leaf_specs = megatron_restriction(layer, LogicalMesh.on_cluster(cluster, (1, 8)), model)
    (router,) = [t for t in leaf_specs if t.endswith("/w_gate")]
    assert all(not axes for axes in leaf_specs[router][0].dims)
    assert any(1 in axes for axes in leaf_specs[next(t for t in leaf_specs if t.endswith("/w_expert_in"))][0].dims)

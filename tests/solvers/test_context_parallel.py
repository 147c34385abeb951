"""Context parallelism (Megatron's cp, Llama 3's KV all-gather form): the rank's view,
its attention priced as whole sequences, and the KV exchange on the cp group's link."""

from __future__ import annotations

import dataclasses

import pytest

from alpasim import graphs as gr
from alpasim import solvers as sv
from alpasim.costmodels import AnalyticCostModel, get_cluster
from alpasim.solvers import _layer_options
from alpasim.solvers._mesh import LogicalMesh
from alpasim.solvers._stage_costs import layer_graphs
from alpasim.solvers._layer_options import layer_options

LLAMA = "llama:hidden=256,layers=2,heads=4,kv_heads=2,ffn=512,seq=512,vocab=512,batch=4,attention=fused"


@pytest.mark.parametrize("cp", [2, 4])
def test_a_ranks_view_does_the_whole_models_work(cp):
    """The view (s / cp positions, cp times the sequences, keys over cp chunks) does
    exactly the whole model's matmul and attention FLOPs, counted independently by
    `flops_by_kind` on both graphs."""
    whole = gr.model_source(LLAMA).config
    view = gr.context_parallel_view(whole, cp)
    assert (view.seq, view.batch, view.context_parallel) == (512 // cp, 4 * cp, cp)
    a, b = gr.flops_by_kind(gr.forward_graph(whole)), gr.flops_by_kind(gr.forward_graph(view))
    assert b["attention"] == a["attention"] > 0 and b["matmul"] == a["matmul"]


@pytest.mark.parametrize("device", ["dgx-h100", "aws-p3.16xlarge"])
def test_a_views_attention_is_priced_as_its_share_of_whole_sequences(device):
    """One shard of the view's attention (and its gradient) over n x cp devices costs
    what the whole model's costs over the same devices: from the measured kernel table
    (H100) and from the executed-FLOPs roofline (V100, no table)."""
    cp, n = 4, 2
    cost = AnalyticCostModel(get_cluster(device))
    long = gr.model_source(LLAMA.replace("hidden=256", "hidden=1024").replace("heads=4", "heads=8")
                           .replace("seq=512", "seq=16384")).config          # head dim 128, 16K positions
    whole = gr.training_graph(gr.forward_graph(long))
    view = gr.training_graph(gr.forward_graph(gr.context_parallel_view(long, cp)))
    for prim in ("attention", "attention_grad"):
        w = next(op for op in whole.ops if op.prim == prim)
        v = next(op for op in view.ops if op.prim == prim)
        assert cost.op_time_s(v, view.tensors, n * cp) == pytest.approx(cost.op_time_s(w, whole.tensors, n * cp))
        # ... and not what the chunk alone would cost (keys of its own chunk only).
        alone = v.replace(params=tuple((k, x) for k, x in v.params if k != "context_parallel"))
        assert cost.op_time_s(alone, view.tensors, n * cp) < 0.5 * cost.op_time_s(v, view.tensors, n * cp)


@pytest.mark.parametrize("remat, exchanges", [(False, 3), (True, 4)])
def test_the_kv_exchange_is_priced_on_the_cp_groups_link(monkeypatch, remat, exchanges):
    """A block of the view on a (cp, 1) mesh across two nodes (one GPU each): the KV
    exchange adds a forward all-gather of K and V, and a backward all-gather and a
    reduce-scatter of their gradients, each a two-rank ring over the network card:
    latency + half the gathered bytes / bandwidth (hand-computed), to the block's time
    per microbatch, and the first to its forward. Under full recomputation the
    recomputed forward gathers them once more (in the backward)."""
    cp = 2
    cluster = get_cluster("dgx-h100", nodes=2, devices_per_node=1)
    view = gr.context_parallel_view(gr.model_source(LLAMA).config, cp)
    block = layer_graphs(gr.training_graph(gr.forward_graph(dataclasses.replace(view, batch=cp)), remat=remat))[1]
    mesh = LogicalMesh.on_cluster(cluster, (cp, 1))
    (priced,) = layer_options(block, mesh, cluster, 1, restriction="megatron_distopt")
    monkeypatch.setattr(_layer_options, "kv_exchange_s", lambda *a: (0.0, 0.0))
    (bare,) = layer_options(block, mesh, cluster, 1, restriction="megatron_distopt")
    # Each rank holds one chunk: K and V of 256 positions, 2 KV heads of 64, bf16.
    gathered = cp * 2 * (256 * 2 * 64 * 2)
    link = cluster.inter_node
    one = link.latency_s + (cp - 1) / cp * gathered / (link.bandwidth_gbps * 1e9 / 8)
    assert priced.forward_s - bare.forward_s == pytest.approx(one, rel=1e-6)
    assert priced.time_s - bare.time_s == pytest.approx(exchanges * one, rel=1e-6)


def test_megatron_with_cp_plans_the_view_and_refuses_what_it_cannot():
    cluster = get_cluster("dgx-h100", nodes=1, devices_per_node=4)
    plan = sv.plan_model(LLAMA, cluster, "megatron-core", megatron=sv.MegatronConfig(1, 1, 2, 1, cp=2),
                         cache=sv.DiskCache(enabled=False))
    assert plan.feasible and plan.search.megatron["cp"] == 2
    assert plan.microbatches == 2                     # 4 sequences over dp 2, one at a time
    # The plan is of the view: 8 chunks of 256 positions, the stage mesh (cp x dp, tp).
    assert plan.stages[0].logical_mesh == (4, 1) and plan.model.global_batch == 8
    with pytest.raises(ValueError, match="tp x cp x pp x dp = 2, the cluster has 4"):
        sv.plan_model(LLAMA, cluster, "megatron-core", megatron=sv.MegatronConfig(1, 1, 1, 1, cp=2))
    with pytest.raises(ValueError, match="sequence 512 does not cut into 2 x cp = 6"):
        sv.plan_model(LLAMA, get_cluster("dgx-h100", nodes=1, devices_per_node=3), "megatron-core",
                      megatron=sv.MegatronConfig(1, 1, 1, 1, cp=3))
    with pytest.raises(ValueError, match="runs the fused attention kernel"):
        sv.plan_model(LLAMA, cluster, "megatron-core", megatron=sv.MegatronConfig(1, 1, 2, 1, cp=2),
                      attention="explicit")
    with pytest.raises(ValueError, match="context_parallel=2 is set by a Megatron configuration's cp"):
        sv.plan_model(LLAMA + ",context_parallel=2", cluster, "alpa")
    with pytest.raises(ValueError, match="built for Llama models"):
        sv.plan_model("gpt3:hidden=256,layers=2,heads=4,seq=512,vocab=512,batch=4", cluster, "megatron-core",
                      megatron=sv.MegatronConfig(1, 1, 2, 1, cp=2))


def test_cli_cp_belongs_to_an_explicit_configuration(cli):
    shown = cli("plan", "--model", LLAMA, "--cluster", "dgx-h100", "--nodes", "1", "--devices-per-node", "4",
                "--method", "megatron-core", "--tp", "1", "--cp", "2", "--pp", "1", "--dp", "2",
                "--microbatch-size", "1", "--json")
    assert shown.returncode == 0, shown.stderr
    import json

    assert json.loads(shown.stdout)["search"]["megatron"]["cp"] == 2
    table = cli("plan", "--model", LLAMA, "--cluster", "dgx-h100", "--nodes", "1", "--devices-per-node", "4",
                "--method", "megatron-core", "--tp", "1", "--cp", "2", "--pp", "1", "--dp", "2",
                "--microbatch-size", "1")
    # A microbatch of dp x mbs = 2 sequences, which the view counts as 4 chunks.
    assert "2 microbatches of 2 (4 chunks of 1/2 sequence)" in " ".join(table.stdout.split()), table.stdout
    alone = cli("plan", "--model", LLAMA, "--cluster", "dgx-h100", "--method", "megatron-core", "--cp", "2")
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1 and "--cp applies to an explicit" in alone.stderr
    explicit = cli("plan", "--model", LLAMA, "--cluster", "dgx-h100", "--nodes", "1", "--devices-per-node", "4",
                   "--method", "megatron-core", "--tp", "1", "--cp", "2", "--pp", "1", "--dp", "2",
                   "--microbatch-size", "1", "--attention", "explicit")
    assert explicit.returncode == 2 and explicit.stderr.count("\n") == 1, explicit.stderr
    assert "runs the fused attention kernel" in explicit.stderr and "attention is 'explicit'" in explicit.stderr

"""Sequence parallelism (Korthikanti et al. 2022) in the Megatron-LM baseline, and the
shared resharding it relies on.

Under tensor parallelism t, a layer's norms and residual adds run on a sequence shard
instead of repeating their work t times; each region's partial sums are
reduce-scattered onto the sequence and each region's input all-gathered, once for all
the region's readers (Q, K and V share one gather).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import alpasim.costmodels as cm
import alpasim.graphs as gr
from alpasim.solvers import (BASELINES, RECOMPUTE_SEARCH, LogicalMesh, MegatronConfig, objective_s,
                             plan_with_method, solve_intra_op)

MODEL = "gpt3:hidden=512,layers=4,heads=8,seq=512,vocab=4096,batch=16"


def _two_layers(model: str = MODEL, batch: int = 4) -> gr.OpGraph:
    name, cfg = gr.resolve_model(model)
    fwd = gr.forward_graph(dataclasses.replace(cfg, batch=batch), name=name)
    return gr.stage_graph(gr.build_training_graph(fwd).graph, 1, 2)


def _solve(stage, mesh, model, restriction):
    restrict, leaves = BASELINES[restriction](stage, mesh, model)
    return solve_intra_op(stage, mesh, model, restrict=restrict, leaf_specs=leaves, with_compute=True,
                          rewrite=False).plan


def test_forward_reduce_scatters_and_gathers_instead_of_all_reducing():
    """Per layer and microbatch the forward all-reduces nothing: two reduce-scatters
    (after the attention and MLP output projections) and two all-gathers (the two norms'
    outputs, each once for all its readers), every one of sbh fp16 bytes - as many bytes
    on the wire as Megatron-LM's two all-reduces - and the norms run on 1/t of the
    sequence, so the forward computes less."""
    stage = _two_layers()
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    mesh, model = LogicalMesh.on_cluster(cluster, (1, 4)), cm.AnalyticCostModel(cluster)
    sp, plain = _solve(stage, mesh, model, "megatron_sp"), _solve(stage, mesh, model, "megatron")
    phase = {op.name: op.phase for op in stage.ops}
    forward = lambda plan: Counter((c.collective.kind, c.collective.nbytes) for c in plan.collectives  # noqa: E731
                                   if phase.get(c.op) == "forward")
    sbh = 512 * 4 * 512 * 2
    assert forward(sp) == {("reduce_scatter", sbh): 4, ("all_gather", sbh): 4}
    assert forward(plain) == {("all_reduce", sbh): 4}
    norms = [op.name for op in stage.ops if op.prim == "layer_norm"]
    assert norms and all(sp.strategies[n].compute_s < plain.strategies[n].compute_s for n in norms)
    gathered = Counter(c.tensor for c in sp.collectives
                       if c.collective.kind == "all_gather" and phase[c.op] == "forward")
    assert set(gathered.values()) == {1}       # Q, K and V share the first norm's gather


@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_each_layers_collectives_are_megatrons(attention):
    """Korthikanti et al. sec. 4.2.2 per layer and microbatch, whichever attention kernel
    runs between the projections: forward, two all-gathers and two reduce-scatters;
    backward, the data gradients of the fused QKV and of FC1 reduce-scattered once each
    (one GEMM each, so one partial sum each), the output gradients of the projection and
    FC2 gathered, the norms' outputs gathered again for the weight gradients; no
    all-reduce anywhere. Every one sbh fp16 bytes."""
    stage = _two_layers(MODEL + f",attention={attention}")
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    mesh, model = LogicalMesh.on_cluster(cluster, (1, 4)), cm.AnalyticCostModel(cluster)
    sp = _solve(stage, mesh, model, "megatron_sp")
    phase = {op.name: op.phase for op in stage.ops}
    sbh = 512 * 4 * 512 * 2
    count = lambda which: Counter((c.collective.kind, c.collective.nbytes) for c in sp.collectives  # noqa: E731
                                  if not c.per_iteration and phase.get(c.op) == which)
    assert count("forward") == {("reduce_scatter", sbh): 4, ("all_gather", sbh): 4}
    backward = count("backward")
    assert backward[("reduce_scatter", sbh)] == 4 and not any(kind == "all_reduce" for kind, _ in backward)
    assert set(backward) == {("reduce_scatter", sbh), ("all_gather", sbh)}


def test_shared_gather_is_what_the_ilp_pays():
    """The ILP's objective prices a resharding shared by several readers once, as the
    plan it decodes (`realize`, which walks the graph) does."""
    stage = _two_layers()
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    mesh, model = LogicalMesh.on_cluster(cluster, (1, 4)), cm.AnalyticCostModel(cluster)
    restrict, leaves = BASELINES["megatron_sp"](stage, mesh, model)
    result = solve_intra_op(stage, mesh, model, restrict=restrict, leaf_specs=leaves, with_compute=True,
                            rewrite=False)
    assert result.objective_s == pytest.approx(objective_s(result.plan, True), rel=1e-6)
    # Priced edge by edge, the same choice would pay the norms' gathers once per reader.
    problem, choice = result.problem, result.plan.choice
    per_edge = sum(float(e.cost[e.src_spec[choice[e.src]], e.dst_spec[choice[e.dst]]]) for e in problem.edges)
    assert problem.edge_cost_s(choice) < per_edge


def _ladder(model, cluster, config):
    """Megatron-core's recomputation ladder for one configuration: the first of none,
    selective and full that fits."""
    for _, remat, policy in reversed(RECOMPUTE_SEARCH):
        plan = plan_with_method("megatron", model, cluster, megatron=config, remat=remat, recompute=policy)
        if plan.feasible:
            return plan
    return plan


SMALL = "gpt3:hidden=256,layers=4,heads=8,seq=64,vocab=1024,batch=16"


@pytest.mark.parametrize("model", [MODEL, SMALL])
@pytest.mark.parametrize("tp_overlap, measured", [(True, False), (False, False), (True, True)])
def test_megatron_core_weighs_sequence_parallelism_for_a_configuration(model, tp_overlap, measured):
    """tp 4 with memory to spare, Megatron-core searching what the configuration leaves
    open. Sequence parallelism turns each all-reduce into a reduce-scatter and an
    all-gather (the same bytes) and adds the backward's re-gathers of the stashed
    sequence shard; it saves the norms' and residual adds' work on 3/4 of the sequence.
    On alpha-beta links (`measured` False: the DGX's NVSwitch without its nccl-tests
    sweep), in line the re-gathers cost more than that saves, and the grid keeps it off;
    with Megatron-core's tensor-parallel overlap, which Megatron runs only with sequence
    parallelism, they run beside the data-gradient GEMMs and it takes it. On the measured
    sweep, a reduce-scatter or all-gather of these 0.1-4 MB activations reaches half the
    all-reduce's bus bandwidth (a ring all-reduce pipelines its two halves), and that
    outweighs the overlap: it stays off. Either way the choice is the faster of the two
    priced plans. (Explicit attention.)"""
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4, memory_gb=1e3)
    if not measured:
        cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, sweep=None))
    plan = plan_with_method("megatron_core", model, cluster, megatron=MegatronConfig(4, 1, 1, 4),
                            attention="explicit", tp_overlap=tp_overlap)
    takes_it = tp_overlap and not measured
    assert plan.search.megatron["sequence_parallel"] is takes_it
    times = {t["sequence_parallel"]: t["iteration_s"] for t in plan.search.megatron_grid}
    assert set(times) == {False, True} and times[takes_it] < times[not takes_it]
    assert plan.predicted.iteration_s == times[takes_it]


@pytest.mark.slow
def test_megatron_core_takes_sequence_parallelism_where_only_it_fits():
    """At 0.12 GiB a device the fastest configuration that fits needs sequence
    parallelism: without it, the same configuration (at any recomputation) is slower or
    does not fit. (On alpha-beta NVLink: at the measured rates of these small
    collectives, a 4-stage pipeline without tensor parallelism fits and is faster.)"""
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4, memory_gb=0.12)
    cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, sweep=None))
    plan = plan_with_method("megatron_core", MODEL, cluster)
    assert plan.feasible and plan.method == "megatron_core"
    chosen = MegatronConfig(**plan.search.megatron)
    assert chosen.sequence_parallel and chosen.tp > 1
    flipped = _ladder(MODEL, cluster, dataclasses.replace(chosen, sequence_parallel=False))
    assert not flipped.feasible or flipped.predicted.iteration_s > plan.predicted.iteration_s
    tried = [t for t in plan.search.megatron_grid if t["feasible"]]
    assert plan.predicted.iteration_s == min(t["iteration_s"] for t in tried)


@pytest.mark.slow
@pytest.mark.parametrize("config", [MegatronConfig(2, 1, 2, 4), MegatronConfig(2, 2, 1, 2), MegatronConfig(4, 1, 1, 4)])
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_sequence_parallelism_and_the_distributed_optimizer_never_add_memory(config, policy):
    """What Megatron-core's grid prunes on: every stage of every form holds at most what
    the same configuration holds without either option."""
    cluster = cm.get_cluster("dgx-a100", nodes=1, devices_per_node=4, memory_gb=1e3)
    forms = {(sp, do): plan_with_method("megatron", MODEL, cluster, remat=False, recompute=policy,
                                        megatron=dataclasses.replace(config, sequence_parallel=sp,
                                                                     distributed_optimizer=do))
             for sp in (False, True) for do in (False, True)}
    plain = forms[(False, False)]
    for (sp, do), plan in forms.items():
        for st, base in zip(plan.stages, plain.stages, strict=True):
            assert st.memory_bytes <= base.memory_bytes * (1 + 1e-12), (sp, do)
    assert forms[(True, True)].predicted.peak_memory_bytes < plain.predicted.peak_memory_bytes

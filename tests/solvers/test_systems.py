"""System profiles: each method priced as its system ran, overrides recorded."""

from __future__ import annotations

import dataclasses

import pytest

from alpasim import solvers as sv
from alpasim.costmodels import AnalyticCostModel, get_cluster
from alpasim.graphs import forward_graph, training_graph
from alpasim.solvers._intra_op import solve_intra_op
from alpasim.solvers._mesh import LogicalMesh
from alpasim.solvers._stage_costs import layer_graphs
from alpasim.solvers._layer_options import restricted_solve_kwargs
from alpasim.solvers import _systems as systems
from alpasim.solvers._systems import ENTRIES, PRICED, SYSTEMS, resolve
from alpasim.solvers._tp_overlap import _backward_groups, tp_overlap_s

MODEL = "gpt3-350m:batch=16,layers=4"
# Two nodes of two V100s: a data-parallel group over the slow network, so when the
# gradients are reduced is worth seconds, not microseconds.
CLUSTER = get_cluster("aws-p3.16xlarge", nodes=2, devices_per_node=2)
DP4 = sv.MegatronConfig(1, 1, 4, 1)


def test_every_method_names_a_profile_and_every_entry_has_a_source():
    assert {m.system for m in sv.METHODS.values()} <= set(SYSTEMS)
    for profile in SYSTEMS.values():
        assert set(profile.sources) == set(ENTRIES) and all(len(s) > 20 for s in profile.sources.values())
    with pytest.raises(ValueError, match="no source for recompute"):
        dataclasses.replace(SYSTEMS["alpa-osdi22"], sources={e: "x" for e in ENTRIES if e != "recompute"})
    with pytest.raises(ValueError, match="attention must be one of"):
        dataclasses.replace(SYSTEMS["alpa-osdi22"], attention="paged")


def test_the_systems_that_reduced_after_the_backward_are_priced_so():
    """Megatron-LM (2021) and Alpa as published reduced gradients after the backward;
    Megatron-core overlaps them (the drift the profiles fix)."""
    assert not SYSTEMS[sv.METHODS["megatron"].system].grad_overlap
    assert not SYSTEMS[sv.METHODS["alpa"].system].grad_overlap
    assert SYSTEMS[sv.METHODS["megatron_core"].system].grad_overlap
    # And a plan of one of Alpa's baselines is priced so: every gradient's collective
    # after the backward, all of it exposed.
    (stage,) = sv.plan_model(MODEL, CLUSTER, "data_parallel").stages
    assert stage.grad_sync_s > 0 and stage.sync_buckets == () and stage.exposed_sync_s == stage.grad_sync_s


def test_resolve_records_overrides_and_what_is_not_modelled(monkeypatch):
    core = SYSTEMS["megatron-core-0.8"]
    record = resolve(core, grad_overlap=False, recompute=None)
    assert record.overridden == {"grad_overlap": True}
    assert record.settings["grad_overlap"] is False and record.settings["recompute"] == "searched"
    # An entry set to a value the cost model cannot price is listed with the value
    # priced instead (every value is priced today: `PRICED` narrowed to show it).
    monkeypatch.setattr(systems, "PRICED", {**PRICED, "param_gather_overlap": (False,)})
    assert resolve(core).unpriced == {"param_gather_overlap": False}
    with pytest.raises(ValueError, match="recompute must be one of"):
        resolve(core, recompute="sometimes")
    with pytest.raises(TypeError, match="unknown system entry"):
        resolve(core, overlap=True)


def _plan(system: str | None = None, **kw) -> sv.PipelinePlan:
    return sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system=system, **kw)


def test_a_plan_is_priced_and_recorded_as_its_system_ran():
    after = _plan()                                  # Megatron-LM 2021: after the backward
    core = _plan("megatron-core-0.8")
    assert after.system["name"] == "megatron-lm-2021" and after.system["overridden"] == {}
    assert core.system["overridden"] == {}           # the profile's own defaults are no override
    assert (after.model.remat, core.model.remat) == (True, False)           # full; none (searched)
    assert core.search.megatron["distributed_optimizer"] and not after.search.megatron["distributed_optimizer"]
    stage = after.stages[0]
    assert stage.sync_buckets == () and stage.exposed_sync_s == pytest.approx(stage.grad_sync_s)
    # Only the overlap differs: the same configuration, recomputation, optimizer and kernel.
    same = dict(remat=True, distributed_optimizer=False, attention="explicit")
    overlapped = _plan("megatron-core-0.8", **same)
    o = overlapped.stages[0]
    assert o.sync_buckets and o.exposed_sync_s < o.grad_sync_s
    assert overlapped.predicted.iteration_s < after.predicted.iteration_s
    assert overlapped.system["overridden"] == {"optimizer_sharding": "data-parallel", "recompute": "searched",
                                               "attention": "fused"}
    undone = _plan("megatron-core-0.8", overlap=False, **same)
    assert undone.system["overridden"] == {"grad_overlap": True, "optimizer_sharding": "data-parallel",
                                           "recompute": "searched", "attention": "fused"}
    assert undone.predicted.iteration_s == pytest.approx(after.predicted.iteration_s)
    assert any("grad_overlap off (the profile's: on)" in n for n in undone.notes)


def test_a_searched_recomputation_is_the_search_not_an_override():
    """`recompute="auto"` under a profile that recomputes fully is an override to a
    search; the chosen policy is the plan's, and not recorded as the user's. Megatron-
    core's grid searches it under another system's profile too."""
    auto = _plan(recompute="auto")
    assert auto.system["settings"]["recompute"] == "searched"
    assert auto.system["overridden"] == {"recompute": "full"}
    assert any(n.startswith("recompute auto chose") for n in auto.notes)
    grid = sv.plan_model(MODEL, CLUSTER, "megatron_core", megatron=DP4, system="megatron-lm-2021", recompute="auto")
    assert grid.system["overridden"] == {"recompute": "full"}
    assert {row["recompute"] for row in grid.search.megatron_grid} >= {"none"}


def test_a_profiles_recomputation_is_the_plans_unless_given():
    selective = _plan("megatron-lm-2022")
    assert (selective.model.remat, selective.model.recompute) == (False, "selective")
    full = _plan("megatron-lm-2022", remat=True)
    assert (full.model.remat, full.system["overridden"]) == (True, {"recompute": "selective"})
    assert full.predicted.iteration_s > selective.predicted.iteration_s      # the forward again


@pytest.mark.slow
def test_a_profiles_attention_kernel_builds_the_model_unless_given():
    """Megatron-core's fused kernel rebuilds the zoo model with it (the plan's model
    config says so, and the backend rebuilds that); the user's kernel, by option or in
    the spec, is an override; a saved graph keeps its ops, and the record says which."""
    core = _plan("megatron-core-0.8", remat=True)
    assert core.model.source["config"]["attention"] == "fused" and core.system["overridden"] == {
        "recompute": "searched"}
    explicit = _plan("megatron-core-0.8", remat=True, attention="explicit")
    assert explicit.model.source["config"]["attention"] == "explicit"
    assert explicit.system["overridden"] == {"recompute": "searched", "attention": "fused"}
    spec = sv.plan_model(MODEL + ",attention=explicit", CLUSTER, "megatron", megatron=DP4,
                         system="megatron-core-0.8", remat=True)
    assert spec.system["overridden"] == explicit.system["overridden"]
    assert spec.predicted.iteration_s == explicit.predicted.iteration_s != core.predicted.iteration_s
    assert _plan().model.source["config"]["attention"] == "explicit"       # Megatron-LM 2021's own

    import jax
    import jax.numpy as jnp

    from alpasim.graphs import from_jax

    def loss(params, batch):       # an imported graph: its own ops, explicit attention
        h = batch["x"] @ params["w"]
        return jnp.mean(jax.nn.softmax(h @ h.T, axis=-1) @ h)

    spec = jax.ShapeDtypeStruct
    imported = from_jax(loss, {"w": spec((16, 16), jnp.float32)}, {"x": spec((128, 16), jnp.float32)}, name="att")
    graph = sv.plan_model(imported, CLUSTER, "data_parallel", system="megatron-core-0.8", remat=True)
    assert graph.system["unpriced"]["attention"] == "explicit"
    assert any("attention explicit (it ran fused)" in n for n in graph.notes)
    plain = from_jax(lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2), {"w": spec((64, 64), jnp.float32)},
                     {"x": spec((16, 64), jnp.float32)}, name="mlp")
    assert "attention" not in sv.plan_model(plain, CLUSTER, "data_parallel", system="megatron-core-0.8",
                                            remat=True).system["unpriced"]      # no attention to speak of
    with pytest.raises(ValueError, match="attention must be one of explicit, fused"):
        _plan(attention="flash")
    # A family without attention plans under any profile (Wide-ResNet once crashed here).
    wresnet = sv.plan_model("wresnet:channels=8,width=1,image=32,classes=16,batch=8", CLUSTER, "data_parallel",
                            system="megatron-core-0.8", remat=True)
    assert wresnet.feasible and "attention" not in wresnet.system["unpriced"]
    from alpasim.graphs import GPTConfig
    config = GPTConfig(hidden=1024, layers=4, heads=16, batch=16, attention="explicit")
    given = sv.plan_model(config, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", remat=True)
    assert given.system["overridden"]["attention"] == "fused"


def test_the_bucket_size_alone_is_not_an_override_but_none_is():
    assert sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, bucket_bytes=2 ** 20).system["overridden"] == {}
    off = sv.plan_model(MODEL, CLUSTER, "megatron_core", megatron=DP4, bucket_bytes=None, remat=True)
    assert off.system["overridden"]["grad_overlap"] is True and off.stages[0].sync_buckets == ()


@pytest.mark.slow
def test_cli_lists_methods_with_their_profiles_and_refuses_an_unknown_system(cli):
    listing = cli.json("methods")
    assert {r["method"]: r["system"] for r in listing["methods"]}["megatron"] == "megatron-lm-2021"
    assert set(listing["systems"]) == set(SYSTEMS)
    assert all(set(s["sources"]) == set(ENTRIES) for s in listing["systems"].values())
    bad = cli("plan", "--model", MODEL, "--system", "megatron-9")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "megatron-lm-2021" in bad.stderr
    # `--recompute none` and `--no-distributed-optimizer` typed are overrides too.
    args = ("plan", "--model", MODEL, "--cluster", "aws-p3.16xlarge", "--nodes", "2", "--devices-per-node", "2",
            "--method", "megatron", "--tp", "1", "--pp", "1", "--dp", "4", "--microbatch-size", "1")
    plain = cli.json(*args, "--system", "megatron-lm-2022", "--recompute", "none")
    assert (plain["model"]["remat"], plain["model"]["recompute"]) == (False, "none")
    assert plain["system"]["overridden"] == {"recompute": "selective"}
    kept = cli.json(*args, "--system", "megatron-core-0.8", "--no-distributed-optimizer")
    assert kept["search"]["megatron"]["distributed_optimizer"] is False
    assert kept["system"]["overridden"]["optimizer_sharding"] == "data-parallel"
    # A spec's own kernel is the user's, through the command as through Python; so is
    # `--attention`.
    spec = cli.json(*[a if a != MODEL else MODEL + ",attention=explicit" for a in args], "--system",
                    "megatron-core-0.8")
    assert spec["model"]["source"]["config"]["attention"] == "explicit"
    assert spec["system"]["overridden"]["attention"] == "fused"
    fused = cli.json(*args, "--attention", "fused")
    assert fused["model"]["source"]["config"]["attention"] == "fused"
    assert fused["system"]["overridden"] == {"attention": "explicit"}


def test_the_system_record_round_trips_and_a_malformed_one_is_refused(tmp_path):
    import json

    plan = _plan("megatron-core-0.8", overlap=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert sv.load_plan(path).system == plan.system
    data = json.loads(path.read_text())
    data["system"] = {"name": 3}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="system must hold a profile name"):
        sv.load_plan(path)


def test_megatron_core_sizes_its_gradient_buckets_by_the_data_parallel_degree():
    """Megatron-core's DDP buckets hold max(40M, 1M x dp) gradients; PyTorch DDP's
    (Megatron-LM 2021 priced with overlap) 25 MiB; `bucket_bytes` overrides either. The
    overlapped buckets are the stage's weight-gradient bytes over the bucket size."""
    from alpasim.solvers._systems import MEGATRON_CORE_BUCKETS

    assert MEGATRON_CORE_BUCKETS.nbytes(4, 2) == 40e6 * 2 and MEGATRON_CORE_BUCKETS.nbytes(64, 4) == 64e6 * 4
    model = "gpt3:hidden=2048,layers=2,heads=16,seq=256,vocab=4096,batch=16"
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    kw = dict(megatron=DP4, remat=True, distributed_optimizer=False, attention="explicit")
    core = sv.plan_model(model, cluster, "megatron", system="megatron-core-0.8", **kw)
    ddp = sv.plan_model(model, cluster, "megatron", system="megatron-core-0.8", bucket_bytes=25 * 2 ** 20, **kw)
    # Buckets fill within a layer (`_stage_compose.layer_sync`): a block's 12 h^2 weight
    # gradients, here 50 M of them, take ceil(bytes / bucket) each.
    grad = 12 * 2048 ** 2 * 4                     # a block's gradients, reduced from the fp32 accumulator
    blocks = 2
    assert len(ddp.stages[0].sync_buckets) >= blocks * -(-grad // (25 * 2 ** 20))
    assert len(core.stages[0].sync_buckets) < len(ddp.stages[0].sync_buckets)
    # A bucket of parameters is sized in the dtype the gradients are reduced in: the
    # recipe's accumulator (fp32 under mixed-fp32grad, 16-bit under mixed).
    from alpasim.solvers import PlanOptions
    assert PlanOptions(bucket_bytes=MEGATRON_CORE_BUCKETS).at_data_parallel(48, "bfloat16").bucket_bytes == 48e6 * 4
    assert PlanOptions(bucket_bytes=MEGATRON_CORE_BUCKETS, precision="mixed").at_data_parallel(
        48, "bfloat16").bucket_bytes == 48e6 * 2
    assert PlanOptions(bucket_bytes=25.0 * 2 ** 20).at_data_parallel(48, "bfloat16").bucket_bytes == 25 * 2 ** 20
    assert core.predicted.iteration_s != ddp.predicted.iteration_s


def test_the_distributed_optimizer_shards_states_no_layout_divides():
    """Megatron-core shards a flat, padded buffer: with dp 3 no dimension of a 64-wide
    model divides, and still each device keeps a third of the master weights and Adam
    moments (12 of the 18 bytes a parameter takes under mixed-fp32grad)."""
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=6, memory_gb=1e3)
    model = "gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=96,batch=12"
    config = sv.MegatronConfig(2, 1, 3, 1)
    plans = {d: sv.plan_model(model, cluster, "megatron", megatron=config, distributed_optimizer=d, remat=True)
             for d in (False, True)}
    states = {d: sum(s.params_bytes for s in p.stages) for d, p in plans.items()}
    # Per device: the model's parameters over tp 2 (embedding and blocks split, norms and
    # biases replicated); the saving is 12 bytes x (2/3) of each.
    saved = states[False] - states[True]
    per_param = states[False] / 18
    assert saved == pytest.approx(12 * per_param * 2 / 3, rel=0.02)


TP2 = sv.MegatronConfig(2, 1, 2, 1, sequence_parallel=True)


def test_tensor_parallel_overlap_hides_part_of_each_stages_collectives_and_only_theirs():
    """Megatron-core runs its tensor-parallel collectives beside their GEMMs
    (`--tp-comm-overlap`): the forward and the backward both get shorter; turning it off
    is an override the plan records; without tensor parallelism nothing changes (the
    data-parallel gradient sync is not a tensor-parallel collective)."""
    kw = dict(remat=True, distributed_optimizer=False)
    on = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=TP2, system="megatron-core-0.8", **kw)
    off = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=TP2, system="megatron-core-0.8", tp_overlap=False, **kw)
    assert "tp_comm_overlap" not in on.system["unpriced"] and "tp_comm_overlap" not in on.system["overridden"]
    assert off.system["overridden"]["tp_comm_overlap"] is True
    assert any("tp_comm_overlap off (the profile's: on)" in n for n in off.notes)
    (a,), (b,) = on.stages, off.stages
    assert 0 < a.forward_s < b.forward_s and 0 < a.backward_s < b.backward_s
    assert on.predicted.iteration_s < off.predicted.iteration_s
    assert a.sync_s == pytest.approx(b.sync_s)                  # the gradient sync is not TP's
    # Megatron overlaps only with sequence parallelism (its arguments.py refuses the flag
    # otherwise), and there is nothing to overlap without tensor parallelism.
    for config in (DP4, dataclasses.replace(TP2, sequence_parallel=False)):
        both = [sv.plan_model(MODEL, CLUSTER, "megatron", megatron=config, system="megatron-core-0.8", tp_overlap=t,
                              **kw) for t in (True, False)]
        assert both[0].predicted.iteration_s == pytest.approx(both[1].predicted.iteration_s, rel=1e-12), config
    assert any("tp_comm_overlap priced off" in n for n in sv.plan_model(
        MODEL, CLUSTER, "megatron", megatron=dataclasses.replace(TP2, sequence_parallel=False),
        system="megatron-core-0.8", **kw).notes)


def test_a_layers_data_and_weight_gradient_gemms_share_their_overlap():
    """The backward's GEMMs are grouped by the output gradient they read: each group is
    one forward GEMM's data- and weight-gradient pair (Megatron's bulk overlap runs one
    beside the other); a recomputed forward GEMM is paired like a forward one. What is
    hidden never exceeds the collectives it is hidden from."""

    fwd = forward_graph("gpt3:hidden=64,layers=3,heads=4,seq=16,vocab=128,batch=4")
    block = layer_graphs(training_graph(fwd, remat=True))[1]
    groups = _backward_groups(block)
    assert groups and not any(":remat" in name for name in groups)
    by_group: dict[str, set[str]] = {}
    for name, g in groups.items():
        by_group.setdefault(g, set()).add(name.split(":")[0])
    forward_gemms = {op.name for op in block.ops if op.phase == "forward" and op.prim == "einsum"}
    assert all(len(names) == 1 for names in by_group.values())                # one forward GEMM each
    assert {n for names in by_group.values() for n in names} <= forward_gemms
    assert len([n for n in groups if "#1" in n]) >= 4                           # weight gradients grouped too

    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=4)
    mesh = LogicalMesh.on_cluster(cluster, (1, 4))
    model = AnalyticCostModel(cluster)
    plan = solve_intra_op(block, mesh, model, with_compute=True, microbatches=2,
                          **restricted_solve_kwargs("megatron_sp", block, mesh, model)).plan
    hidden, forward = tp_overlap_s(block, plan)
    gemm_collectives = sum(p.collective.time_s(mesh) for p in plan.collectives
                           if not p.per_iteration and block.op_by_name[p.op].prim == "einsum")
    in_forward = sum(p.collective.time_s(mesh) for p in plan.collectives
                     if not p.per_iteration and block.op_by_name[p.op].phase == "forward")
    assert 0 < forward <= in_forward and forward < hidden <= gemm_collectives


def test_the_parameter_gathers_and_the_loss_kernel_are_overrides_the_plan_records(cli):
    """Megatron-core's distributed optimizer on dp 4: its gathers overlap the next forward
    (less exposed, a shorter iteration) unless `--no-param-gather-overlap`; the loss runs
    as Megatron's unfused fp32 kernels unless `--cross-entropy fused` (the loss alone
    gets faster). Both are overrides the plan records; a kernel of no name is refused in
    one line."""
    kw = dict(remat=True, distributed_optimizer=True)
    on = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", **kw)
    off = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", gather_overlap=False,
                        **kw)
    assert off.system["overridden"]["param_gather_overlap"] is True
    assert "param_gather_overlap" not in on.system["overridden"]
    assert on.stages[0].param_gather_s > 0 and off.stages[0].param_gather_s == 0
    assert on.predicted.iteration_s < off.predicted.iteration_s
    fused = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", loss_kernel="fused",
                          **kw)
    assert fused.system["overridden"]["cross_entropy"] == "unfused-fp32"
    assert (on.model.loss_kernel, fused.model.loss_kernel) == ("unfused-fp32", "fused")   # what the backend rebuilds
    assert fused.predicted.iteration_s < on.predicted.iteration_s
    args = ("plan", "--model", MODEL, "--cluster", "aws-p3.16xlarge", "--nodes", "2", "--devices-per-node", "2",
            "--method", "megatron", "--tp", "1", "--pp", "1", "--dp", "4", "--microbatch-size", "1",
            "--system", "megatron-core-0.8", "--distributed-optimizer", "--remat")
    got = cli.json(*args, "--no-param-gather-overlap", "--cross-entropy", "fused")
    assert {k: got["system"]["overridden"][k] for k in ("param_gather_overlap", "cross_entropy")} == \
        {"param_gather_overlap": True, "cross_entropy": "unfused-fp32"}
    bad = cli("plan", *args[1:], "--cross-entropy", "triton")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "unfused-fp32" in bad.stderr


def test_a_llama_under_fused_kernels_stashes_less_and_the_plan_records_them(cli):
    """Megatron-core runs RMSNorm, SwiGLU and RoPE as fused kernels that save their
    inputs: a Llama priced as it ran stashes far less than op by op (the zoo's Llama is
    written op by op), and the plan records the kernels its backend rebuilds; per-op is
    an override. A kernel of no name is refused in one line."""
    model = "llama:hidden=256,layers=2,heads=4,kv_heads=2,ffn=512,seq=256,vocab=512,batch=8"
    kw = dict(megatron=sv.MegatronConfig(2, 1, 2, 1), system="megatron-core-0.8", remat=False, recompute="none")
    fused = sv.plan_model(model, CLUSTER, "megatron", **kw)
    per_op = sv.plan_model(model, CLUSTER, "megatron", kernels="per-op", **kw)
    assert (fused.model.kernels, per_op.model.kernels) == ("fused", "per-op")
    assert "kernels" not in fused.system["overridden"] and per_op.system["overridden"]["kernels"] == "fused"
    assert fused.stages[0].memory["stash_bytes"] < 0.75 * per_op.stages[0].memory["stash_bytes"]
    bad = cli("plan", "--model", model, "--kernels", "xla")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "per-op, fused" in bad.stderr


def test_a_plan_is_simulated_with_its_systems_point_to_point_calls():
    """Megatron-LM's pipeline waits on its sends; a plan priced as it ran is simulated
    so (slower than with its sends overlapped), and as another system ran, not."""
    from alpasim.simulator import simulate

    kw = dict(megatron=sv.MegatronConfig(1, 2, 2, 1), remat=True)
    plan = sv.plan_model(MODEL, CLUSTER, "megatron", **kw)
    assert plan.system["settings"]["p2p"] == "blocking"
    blocked, free = simulate(plan), simulate(plan, blocking_sends=False)
    assert blocked.iteration_s == simulate(plan, blocking_sends=True).iteration_s > free.iteration_s
    llama = sv.plan_model(MODEL, CLUSTER, "megatron", system="llama3", **kw)
    assert llama.system["settings"]["p2p"] == "overlapped"
    assert simulate(llama).iteration_s == simulate(llama, blocking_sends=False).iteration_s


def test_a_parameter_gather_overlap_that_cannot_apply_is_refused_or_priced_off(cli):
    """Megatron-core refuses `--overlap-param-gather` without the distributed optimizer
    or without `--overlap-grad-reduce` (its validate_args): asked for, it is refused in
    one line before planning; the profile's own default is priced off, and the plan
    says so and prices exactly what `--no-param-gather-overlap` does."""
    kw = dict(remat=True, distributed_optimizer=True)
    for given, why in ((dict(distributed_optimizer=False), "distributed optimizer"),
                       (dict(overlap=False), "overlapped gradient reduction")):
        with pytest.raises(sv.OptionConflict, match=why):
            sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8",
                          **{**kw, **given, "gather_overlap": True})
    with pytest.raises(sv.OptionConflict, match="method alpa has none"):
        sv.check_before_planning(MODEL, CLUSTER, "alpa", gather_overlap=True)
    default = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", overlap=False, **kw)
    assert default.system["settings"]["param_gather_overlap"] is False
    assert "overlapped gradient reduction" in default.system["inapplicable"]["param_gather_overlap"]
    assert any("param_gather_overlap priced off" in n for n in default.notes)
    off = sv.plan_model(MODEL, CLUSTER, "megatron", megatron=DP4, system="megatron-core-0.8", overlap=False,
                        gather_overlap=False, **kw)
    assert off.system["inapplicable"] == {}
    # What the planner is handed: the overlap off, as --no-param-gather-overlap hands it.
    from alpasim.solvers._methods import system_options
    handed = [system_options(sv.get_method("megatron"), "megatron-core-0.8", False, True, DP4, {"remat": True,
                                                                                                 **given})[0]
              for given in ({}, {"gather_overlap": False})]
    assert handed[0]["gather_overlap"] is False and handed[0] == handed[1]
    # Megatron-core's grid asked for the overlap searches only configurations that can
    # run it (the distributed optimizer's), and records the sharding it implies.
    grid = sv.plan_model(MODEL, CLUSTER, "megatron_core", remat=True, system="megatron-lm-2021", overlap=True,
                         gather_overlap=True)
    assert grid.search.megatron["distributed_optimizer"] is True and grid.system["inapplicable"] == {}
    assert grid.system["overridden"]["optimizer_sharding"] == "none" and grid.stages[0].param_gather_s > 0
    args = ("plan", "--model", MODEL, "--cluster", "aws-p3.16xlarge", "--nodes", "2", "--devices-per-node", "2",
            "--method", "megatron", "--tp", "1", "--pp", "1", "--dp", "4", "--microbatch-size", "1",
            "--param-gather-overlap")
    bad = cli(*args)
    assert bad.returncode != 0 and bad.lines == [
        "alpasim: error: --param-gather-overlap needs the distributed optimizer (Megatron-core asserts "
        "--use-distributed-optimizer with it)"], bad.stderr


def test_a_flat_buffer_reduce_scatters_its_gradients_and_gathers_its_weights():
    """Megatron-core's distributed optimizer on dp 3, where no dimension of a 64-wide
    block divides: its flat buffer (param_and_grad_buffer.py) reduce-scatters the fp32
    gradients and gathers the 16-bit weights after the step, where Megatron-LM's
    replicated step all-reduces them. Both reduce the fp32 accumulator (18 B a parameter
    under mixed-fp32grad), twice the bytes of the 16-bit gradient the ILP placed the
    collective on; the option prices the all-reduce's gradients as a reduce-scatter
    plus a gather of half their bytes."""
    from alpasim.solvers._layer_options import layer_options

    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=6)
    block = layer_graphs(training_graph(forward_graph("gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=96,batch=12",
                                                      ), remat=True))[1]
    mesh = LogicalMesh.on_cluster(cluster, (3, 2))
    (plain,) = layer_options(block, mesh, cluster, 1, restriction="megatron")
    (flat,) = layer_options(block, mesh, cluster, 1, restriction="megatron_distopt")
    reduced = {(k, axes): b for k, axes, b in plain.grad_groups}
    assert ("all_reduce", (0,)) in reduced and not any(k == "all_reduce" and a == (0,) for k, a, _ in flat.grad_groups)
    grads = reduced[("all_reduce", (0,))]
    plan = solve_intra_op(block, mesh, AnalyticCostModel(cluster), with_compute=True, microbatches=1,
                          **restricted_solve_kwargs("megatron", block, mesh, AnalyticCostModel(cluster))).plan
    placed = sum(p.collective.nbytes for p in plan.collectives
                 if p.per_iteration and (p.collective.kind, tuple(p.collective.axes)) == ("all_reduce", (0,)))
    assert grads == pytest.approx(2 * placed)                  # fp32 accumulator, 16-bit gradient
    assert {(k, a): b for k, a, b in flat.grad_groups}[("reduce_scatter", (0,))] == pytest.approx(grads)
    assert flat.gather_groups == (((0,), pytest.approx(grads / 2)),)
    # One collective per gradient: the all-reduces' seconds become their scatters' and
    # gathers'; the rest of the once-an-iteration time (the update) is the same step
    # (to 1 %: the distributed optimizer's step runs on the few slices that divide).
    assert flat.param_gather_s > 0 and flat.grad_sync_s < plain.grad_sync_s
    assert flat.sync_s - flat.param_gather_s - flat.grad_sync_s == pytest.approx(
        plain.sync_s - plain.grad_sync_s, rel=1e-2)


def _bf16_block_plan(restriction: str):
    """A bf16 GPT block, a dp 4 x tp 2 mesh of an A100 node, and the block's plan under
    `restriction`, priced for one microbatch."""
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=8)
    block = layer_graphs(training_graph(forward_graph(
        "gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=96,batch=16,dtype=bfloat16"), remat=True))[1]
    mesh = LogicalMesh.on_cluster(cluster, (4, 2))
    model = AnalyticCostModel(cluster)
    return block, mesh, solve_intra_op(block, mesh, model, with_compute=True, microbatches=1,
                                       **restricted_solve_kwargs(restriction, block, mesh, model)).plan


def test_a_sliced_parameter_whose_gradient_is_all_reduced_is_gathered_once():
    """Under the distributed optimizer a bias can have its step sliced over dp (a
    loop-back all-gather after it) while its layout all-reduces its gradient (no free
    dimension to scatter onto): Megatron-core's flat buffer reduce-scatters it all the
    same (padded), so it is priced as a reduce-scatter, and its weights are gathered
    once, by the loop-back, not again."""
    from alpasim.solvers._layer_options import _sync_terms

    block, mesh, plan = _bf16_block_plan("megatron_distopt")
    per_iteration = [p for p in plan.collectives if p.per_iteration]
    looped = {p.op.removeprefix("loop-back:"): p.collective.nbytes for p in per_iteration
              if p.op.startswith("loop-back:") and p.collective.kind == "all_gather" and p.collective.axes == (0,)}
    reduced = {p.op: p.collective.nbytes for p in per_iteration
               if (p.collective.kind, p.collective.axes) == ("all_reduce", (0,))}
    # fc1's bias (h 64 x 4 over tp 2): a sliced step, and an all-reduced gradient.
    assert set(reduced) == {"layer1/fc1_bias:bias_grad"} and "layer1/b_fc1" in looped
    _, _, groups, _, gathers = _sync_terms("megatron_distopt", block, plan)
    assert dict(gathers)[(0,)] == pytest.approx(sum(looped.values()))
    # Its gradient is reduce-scattered with the others, on the fp32 accumulator: none is
    # left an all-reduce over dp.
    by_kind = dict(((k, a), b) for k, a, b in groups)
    assert ("all_reduce", (0,)) not in by_kind
    scattered = sum(p.collective.nbytes for p in per_iteration if p.op in block.op_by_name
                    and (p.collective.kind, p.collective.axes) == ("reduce_scatter", (0,)))
    assert by_kind[("reduce_scatter", (0,))] == pytest.approx(2 * (scattered + sum(reduced.values())))


def test_a_sequence_parallel_norms_gradient_is_all_reduced_over_tp_and_scattered_over_dp():
    """With sequence parallelism a norm's (and a row-parallel bias's) gradient is summed
    over both axes; Megatron-core all-reduces it over tp (`_allreduce_layernorm_grads`)
    and its flat buffer reduce-scatters it over dp, the loop-back gathering the sliced
    step's weights: priced so, on the fp32 accumulator, with no all-reduce over dp left
    and no second gather. The option's sync time is its plan's, each collective's
    seconds exchanged for what it is priced as."""
    from alpasim.solvers._resharding import Collective
    from alpasim.solvers._layer_options import _sync_terms

    block, mesh, plan = _bf16_block_plan("megatron_sp_distopt")
    grads = [p for p in plan.collectives if p.per_iteration and block.op_by_name.get(p.op) is not None
             and block.op_by_name[p.op].phase == "backward"]
    both = sum(p.collective.nbytes for p in grads if (p.collective.kind, p.collective.axes) == ("all_reduce", (0, 1)))
    assert both > 0                                            # the norms' and biases' gradients
    sync_s, grad_s, groups, gather_s, gathers = _sync_terms("megatron_sp_distopt", block, plan)
    by = {(k, a): b for k, a, b in groups}
    assert not [key for key in by if key[0] == "all_reduce" and 0 in key[1]]
    assert by[("all_reduce", (1,))] == pytest.approx(2 * both)
    assert by[("reduce_scatter", (0,))] == pytest.approx(2 * sum(p.collective.nbytes for p in grads))
    looped = sum(p.collective.nbytes for p in plan.collectives if p.op.startswith("loop-back:")
                 and p.collective.kind == "all_gather")
    assert dict(gathers)[(0,)] == pytest.approx(looped)       # every step here sliced: gathered once

    def priced(c) -> float:                                     # on the fp32 accumulator, bf16 placed
        if c.kind != "all_reduce" or 0 not in c.axes:
            return Collective(c.kind, 2 * c.nbytes, c.axes).time_s(mesh)
        rest = tuple(a for a in c.axes if a != 0)
        return Collective("reduce_scatter", 2 * c.nbytes, (0,)).time_s(mesh) + (
            Collective("all_reduce", 2 * c.nbytes, rest).time_s(mesh) if rest else 0.0)

    assert grad_s == pytest.approx(sum(priced(p.collective) for p in grads))
    assert sync_s == pytest.approx(plan.sync_s + plan.update_s + grad_s - sum(p.collective.time_s(mesh) for p in grads))


def test_llama3_shards_gradients_and_scatters_them_in_fp32_each_microbatch(monkeypatch):
    """Llama 3's profile shards the gradients over dp (ZeRO-2): each stage's gradient
    accumulators take 1/dp of what Megatron-core's distributed optimizer keeps whole,
    and each microbatch's weight gradients are reduce-scattered on the gradient stream
    at fp32's bytes (its paper, sec. 3.3.2), about twice the bf16 gradient's time. A
    user's --distributed-optimizer asks for ZeRO-1 instead, and the plan says so."""
    from alpasim.solvers import _layer_options

    cluster = get_cluster("dgx-h100", nodes=4)
    model = "llama3-405b:hidden=2048,layers=2,heads=16,kv_heads=4,ffn=8192,seq=256,vocab=1024,batch=16"
    config = sv.MegatronConfig(4, 2, 4, 1, sequence_parallel=True, ends_as_layers=True)

    def plan(**kw):          # a cache of its own each: one keeps what it priced in memory
        return sv.plan_model(model, cluster, "megatron", megatron=config, schedule="interleaved",
                             chunk_options=(2,), cache=sv.DiskCache(enabled=False), **kw)

    llama, core = plan(system="llama3"), plan(system="megatron-core-0.8")
    assert llama.search.megatron["sharded_gradients"] and not core.search.megatron["sharded_gradients"]
    assert llama.system["settings"]["optimizer_sharding"] == "data-parallel-gradients"
    for a, b in zip(llama.stages, core.stages, strict=True):
        assert a.memory["grads_bytes"] == pytest.approx(b.memory["grads_bytes"] / 4, rel=0.01)
        assert a.grad_scatter_s > 0 and b.grad_scatter_s == 0
    monkeypatch.setattr(_layer_options, "ACCUMULATOR_SCATTER", frozenset())
    bf16 = plan(system="llama3")
    for a, b in zip(llama.stages[1:3], bf16.stages[1:3], strict=True):     # the blocks: bandwidth-bound
        assert 1.5 < a.grad_scatter_s / b.grad_scatter_s <= 2.0
    monkeypatch.undo()
    zero1 = plan(system="llama3", distributed_optimizer=True)
    assert zero1.system["settings"]["optimizer_sharding"] == "data-parallel"
    assert zero1.system["overridden"] == {"optimizer_sharding": "data-parallel-gradients"}
    assert all(st.grad_scatter_s == 0 for st in zero1.stages)
    with pytest.raises(ValueError, match="needs the distributed optimizer"):
        sv.MegatronConfig(4, 2, 4, 1, sharded_gradients=True)


def test_cli_plans_sharded_gradients_for_an_explicit_configuration(cli):
    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32"
    args = ("plan", "--model", model, "--cluster", "aws-p3.16xlarge", "--nodes", "1", "--devices-per-node", "4",
            "--method", "megatron", "--tp", "2", "--pp", "1", "--dp", "2", "--microbatch-size", "2")
    shown = cli.json(*args, "--sharded-gradients")
    assert shown["search"]["megatron"]["sharded_gradients"] is True
    assert shown["search"]["megatron"]["distributed_optimizer"] is True
    assert shown["system"]["settings"]["optimizer_sharding"] == "data-parallel-gradients"
    assert shown["system"]["overridden"] == {"optimizer_sharding": "none"}
    refused = cli("plan", "--model", model, "--method", "megatron", "--sharded-gradients")
    assert refused.returncode == 2 and refused.lines == [
        "alpasim: error: --sharded-gradients applies to an explicit Megatron configuration (--tp, --pp, --dp and "
        "--microbatch-size)"]
    clash = cli(*args, "--sharded-gradients", "--no-distributed-optimizer")
    assert clash.returncode == 2 and clash.lines == [
        "alpasim: error: --sharded-gradients needs the distributed optimizer (drop --no-distributed-optimizer)"]


def test_a_chosen_configuration_without_sharded_gradients_says_the_profile_was_not_priced():
    """Megatron-core's grid searches the distributed optimizer, not sharded gradients:
    a configuration it chose with the distributed optimizer, priced under Llama 3's
    profile, records that the profile's sharding ran but ZeRO-1 was priced."""
    from alpasim.solvers._methods import with_system

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32"
    plan = sv.plan_model(model, cluster, "megatron", megatron=sv.MegatronConfig(2, 1, 2, 2, distributed_optimizer=True))
    record = systems.resolve(systems.get_system("llama3"))
    shown = with_system(plan, record).system
    assert shown["settings"]["optimizer_sharding"] == "data-parallel-gradients"
    assert shown["unpriced"] == {"optimizer_sharding": "data-parallel"}
    sharded = dataclasses.replace(plan, search=dataclasses.replace(
        plan.search, megatron={**plan.search.megatron, "sharded_gradients": True}))
    assert with_system(sharded, record).system["unpriced"] == {}


def test_sharded_gradient_scatters_leave_the_backward_whole_under_tensor_parallel_overlap():
    """With Transformer Engine's overlap on (Megatron-core's profile), a stage's busy
    time per microbatch is the distributed optimizer's, scatters or not: they move to
    the gradient stream, and TE's overlap pairs none of them with a GEMM (counted there
    too, they were taken off twice)."""
    cluster = get_cluster("dgx-h100", nodes=4)
    model = "llama3-405b:hidden=2048,layers=2,heads=16,kv_heads=4,ffn=8192,seq=256,vocab=1024,batch=16"
    plans = [sv.plan_model(model, cluster, "megatron", system="megatron-core-0.8", schedule="interleaved",
                           chunk_options=(2,), cache=sv.DiskCache(enabled=False),
                           megatron=sv.MegatronConfig(4, 2, 4, 1, sequence_parallel=True, ends_as_layers=True,
                                                      distributed_optimizer=True, sharded_gradients=sharded))
             for sharded in (False, True)]
    assert plans[1].system["settings"]["tp_comm_overlap"] is True
    for zero1, zero2 in zip(*(p.stages for p in plans), strict=True):
        assert zero2.grad_scatter_s > 0 and zero2.compute_s == pytest.approx(zero1.compute_s, rel=1e-9)

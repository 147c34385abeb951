"""The local runtime against a single device, and the compiled HLO against the plan.

Each model family gets a small plan from the planner itself (the `small_plan` fixture:
B = 2 microbatches, 2 or 3 stages on 1x2 and 2x2 meshes of the 8 virtual CPU
devices). The run trains two steps through the simulator's 1F1B program.

Numerics: loss and every gradient of step 1 must match the single-device step within
`check_numerics`'s tolerances (float32 models; see `alpasim.backends._checks` for the
derivation and the noise floor that Wide-ResNet needs).

Collectives: for every stage, the bytes of all-reduce + all-gather + reduce-scatter +
all-to-all in the HLO of its compiled forward, backward and update must lie within
[1/3, 1.5] of the bytes its intra-op plan predicts (both counted once per program /
once per plan collective). The measured side runs systematically *below* prediction,
for reasons we understand and accept:
- XLA gathers a parameter once per program and reuses it; the plan charges the
  resharding at every op that reads it (forward, rematerialised forward, backward);
- XLA's CPU backend lowers a reduce-scatter to an all-reduce and a slice (same bytes
  by the convention, another kind — hence totals, not per-kind numbers, are held);
- the gradient reduction sits in the backward (once per microbatch) in JAX and in the
  iteration's sync in the plan; counted once each, they agree.
A stage the plan predicts no communication for must compile to (almost) none: at most
a scalar loss reduction.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.backends import check_numerics, compare_collectives, hlo_collectives, measured_memory, run_local
from alpasim.backends._executable import plan_training_graph, split_backward_ops
from alpasim.simulator import Run, build_program
from alpasim.solvers._planning_graph import planning_graph
from alpasim.solvers import PlanOptions, SearchSpace

BAND = (1 / 3, 1.5)
UNPREDICTED_BYTES = 64  # a scalar loss all-reduce at most

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# Compiles whole pipelined plans: `make test-fast` leaves these to `make test`.
pytestmark = pytest.mark.slow


# Llama runs as Megatron's fused kernels would (no remat; RMSNorm, SwiGLU and RoPE
# recomputed from their saved inputs): the stage memory check then holds the smaller
# stash the plan priced to what XLA allocates for the rewritten backward.
FAMILY_OPTIONS = {"llama": dict(remat=False, kernels="fused")}


@needs_8
@pytest.mark.parametrize("family", ["gpt", "moe", "wresnet", "llama", "topk-moe", "gpt-dropout"])
def test_pipelined_step_matches_single_device_and_plan(family, small_plan, tmp_path, reference):
    plan = small_plan(family, **FAMILY_OPTIONS.get(family, {}))
    assert len(plan.stages) >= 2 and len({s.logical_mesh for s in plan.stages}) >= 2, plan.stages
    result = run_local(plan, steps=2)

    ref = reference(plan)
    check = check_numerics(result.losses[0], result.grads, ref)
    assert check["numerics_ok"], check
    assert all(math.isfinite(x) for x in result.losses)
    # The check can fail: summing microbatch gradients instead of averaging them, or
    # losing one parameter's gradient, is caught.
    summed = {p: g * plan.microbatches for p, g in result.grads.items()}
    assert not check_numerics(result.losses[0], summed, ref)["numerics_ok"]
    dropped = dict(list(result.grads.items())[1:])
    assert not check_numerics(result.losses[0], dropped, ref)["numerics_ok"]

    for row in compare_collectives(plan, result.stages):
        if row["predicted_bytes"] == 0:
            assert row["measured_bytes"] <= UNPREDICTED_BYTES, row
        else:
            assert BAND[0] <= row["ratio"] <= BAND[1], row

    # Each stage's memory as XLA compiled it, within issue 13's 10 % of the plan's.
    for st, stage in zip(plan.stages, result.stages, strict=True):
        assert measured_memory(stage, st.inflight_microbatches).total_bytes == pytest.approx(st.memory_bytes, rel=0.1)

    tl = result.timeline
    S, B = len(plan.stages), plan.microbatches
    assert tl.count("compute") == 2 * S * B and tl.count("sync") == 2 * S
    assert tl.iteration_s == result.step_times_s[-1] > 0
    assert tl.chrome_trace(tmp_path / "trace.json").stat().st_size > 0

    # A state round trip restores values that differ from the live ones (a no-op load
    # would keep the shifted parameters).
    stage = result.stages[0]
    state = stage.state_dict()
    stage.load_state_dict({**state, "params": {p: v + 1 for p, v in state["params"].items()}})
    stage.load_state_dict(state)
    for p, v in stage.state_dict()["params"].items():
        np.testing.assert_array_equal(v, state["params"][p])


HLO = """
  %all-reduce.17 = (f32[16,64]{1,0}, f32[256]{0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ag = f32[4,16]{1,0} all-gather(%c), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=1] {'axis_0'}, dimensions={0}
  %ags = (f32[2,16]{1,0}, f32[4,16]{1,0}) all-gather-start(%c), channel_id=6, replica_groups=[2,2]<=[4], dimensions={0}
  %agd = f32[4,16]{1,0} all-gather-done(%ags)
  %rs = bf16[8]{0} reduce-scatter(%d), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %a2a = (f32[8,1,32]{2,1,0}, f32[8,1,32]{2,1,0}) all-to-all(%e, %f), channel_id=3, replica_groups={{0,1}}
  ROOT %cp = s32[3]{0} collective-permute(%g), channel_id=4, source_target_pairs={{0,1},{1,0}}
"""


def test_hlo_collectives_reads_every_text_form():
    got = [(c.kind, c.nbytes, c.group_size) for c in hlo_collectives(HLO)]
    assert got == [("all_reduce", 16 * 64 * 4 + 256 * 4, 2), ("all_gather", 4 * 16 * 4, 2),
                   ("all_gather", 4 * 16 * 4, 2), ("reduce_scatter", 8 * 2 * 4, 4),
                   ("all_to_all", 2 * 8 * 32 * 4, 2), ("collective_permute", 12, 1)]


@needs_8
def test_hlo_collectives_of_a_contraction_sharded_on_its_summed_dim():
    """x (8, 64) @ w (64, 32) with the summed dim on a 4-device axis: XLA must all-reduce
    the per-device partial (8, 32) float32 output, 1 KiB in the planner's convention;
    with the summed dim replicated there must be no collective at all."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("x", "y"))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "y")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("y", None)))
    out = NamedSharding(mesh, PartitionSpec())
    text = jax.jit(jnp.matmul, out_shardings=out).lower(x, w).compile().as_text()
    found = [(c.kind, c.nbytes, c.group_size) for c in hlo_collectives(text)]
    assert found == [("all_reduce", 8 * 32 * 4, 4)]
    rep = NamedSharding(mesh, PartitionSpec())
    x, w = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in (x, w))
    assert hlo_collectives(jax.jit(jnp.matmul, out_shardings=out).lower(x, w).compile().as_text()) == []


@needs_8
@pytest.mark.parametrize("family", ["gpt", "wresnet-17"])
def test_zero_bubble_runs_the_same_step_in_the_simulated_order(family, small_plan, reference):
    """ZB-H1 and ZB-H2 on the local runtime: the backward split into B and W (the weight
    gradients run later, from what B kept) trains the same step as one device, and
    each mesh runs its passes in the order the simulator schedules them."""
    plan = small_plan(family)
    ref = reference(plan)
    train = plan_training_graph(plan, planning_graph(plan.model))
    for schedule in ("zb-h1", "zb-h2"):
        result = run_local(plan, steps=1, schedule=schedule)
        check = check_numerics(result.losses[0], result.grads, ref)
        assert check["numerics_ok"], (schedule, check)
        program = build_program(plan, schedule)
        for k, mesh in enumerate(program.meshes):
            planned = [(i.phase, i.microbatch) for i in mesh if type(i) is Run]
            ran = [(e.name, e.microbatch) for e in result.timeline.events
                   if e.track == f"mesh{k}" and e.kind == "compute"]
            assert ran == planned, (schedule, k)
        assert any(e.name == "backward_weight" for e in result.timeline.events)
        # W is not empty: the weight gradients really are made apart from B.
        assert all(split_backward_ops(stage.ops, train)[1] for stage in result.stages)
        # The whole backward never ran, so it was never compiled; read, it compiles then.
        assert all(stage.compiled.ready == {"forward", "update"} for stage in result.stages)
    smallest = min(result.stages, key=lambda stage: len(stage.ops.backward))
    assert "backward" in smallest.compiled and smallest.compiled["backward"].as_text()
    assert smallest.compiled.ready == {"forward", "backward", "update"}


@needs_8
def test_gpipe_runs_the_same_step_and_imagined_chunks_are_refused(small_plan):
    """GPipe's program (all forwards, then all backwards) trains the same step as 1F1B;
    an interleaved program of a plan of one stage per mesh (the simulator imagining
    each stage as chunks) has nothing to lower per chunk, and both runtimes say so
    before starting anything."""
    from alpasim.backends import run_ray

    plan = small_plan("gpt")
    one_f_one_b = run_local(plan, steps=1)
    gpipe = run_local(plan, steps=1, schedule="gpipe")
    assert gpipe.program.schedule == "gpipe" and gpipe.losses == one_f_one_b.losses
    for p, g in one_f_one_b.grads.items():
        np.testing.assert_allclose(gpipe.grads[p], g, rtol=1e-6, atol=1e-7)
    for run in (run_local, run_ray):
        with pytest.raises(ValueError, match="model chunks per mesh"):
            run(plan, steps=1, schedule="interleaved")


def test_a_plan_priced_with_deepspeeds_bf16_optimizer_is_refused_before_running(small_plan):
    """The `deepspeed-bf16` recipe's kept 16-bit gradients and after-backward pass are
    priced, not lowered: both runtimes refuse such a plan in one line before starting,
    naming the recipe that runs."""
    import dataclasses

    from alpasim.backends import run_ray

    plan = small_plan("gpt")
    ds = dataclasses.replace(plan, model=dataclasses.replace(plan.model, precision="deepspeed-bf16"))
    for run in (run_local, run_ray):
        with pytest.raises(ValueError, match="precision deepspeed-bf16 .* plan with --precision mixed-fp32grad"):
            run(ds, steps=1)


@needs_8
@pytest.mark.parametrize("family", ["gpt", "wresnet-17"])
def test_interleaved_plan_runs_the_same_step_in_the_simulated_order(family, small_plan, reference):
    """A plan the planner cut into 2 chunks per mesh (stage j on mesh j mod S): the local
    runtime lowers every chunk on its mesh, trains the single-device step, and each
    mesh runs its chunks' passes in the order the simulator schedules them."""
    plan = small_plan(family, schedule="interleaved", chunk_options=(2,))
    assert plan.chunks == 2 and len(plan.stages) == 2 * plan.num_meshes
    result = run_local(plan, steps=1)
    check = check_numerics(result.losses[0], result.grads, reference(plan))
    assert check["numerics_ok"], check
    program = build_program(plan)
    assert program.schedule == "interleaved" and program.chunks == 2
    for k, mesh in enumerate(program.meshes):
        planned = [(i.phase, i.microbatch, i.chunk) for i in mesh if type(i) is Run]
        ran = [(e.name, e.microbatch, e.chunk) for e in result.timeline.events
               if e.track == f"mesh{k}" and e.kind == "compute"]
        assert ran == planned and {c for _, _, c in ran} == {0, 1}, k
    # Each chunk's memory as XLA compiled it, against the plan's (its own stash x in
    # flight). Not Wide-ResNet-17's, which the check does not hold on (`conftest.MODELS`).
    if family == "gpt":
        for st, stage in zip(plan.stages, result.stages, strict=True):
            assert measured_memory(stage, st.inflight_microbatches).total_bytes == pytest.approx(st.memory_bytes,
                                                                                             rel=0.1)


@needs_8
def test_a_megatron_plan_with_the_embedding_and_head_as_chunks_trains_the_single_device_step(reference):
    """Megatron-core's interleaved layout with the embedding and the head as pipeline
    layers of their own (`MegatronConfig.ends_as_layers`, Llama 3's): GPT's 2 blocks,
    the embedding and the head are 4 chunks over 2 meshes, the first a lookup alone and
    the last the head alone. The local runtime lowers each chunk on its mesh and trains
    the single-device step."""
    from alpasim import solvers as sv
    from alpasim.costmodels import get_cluster

    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32"
    plan = sv.plan_model(model, get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4), "megatron",
                         megatron=sv.MegatronConfig(2, 2, 1, 2, ends_as_layers=True), schedule="interleaved",
                         chunk_options=(2,))
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    result = run_local(plan, steps=1)
    check = check_numerics(result.losses[0], result.grads, reference(plan))
    assert check["numerics_ok"], check
    assert {e.chunk for e in result.timeline.events if e.kind == "compute"} == {0, 1}


@needs_8
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_weight_read_by_three_layers_trains_the_single_device_step(schedule, shared_weight_graph, reference):
    """Weight `s` read by layers 0, 1 and 3 (owner stage 0): its gradient reaches the
    owner along a chain, stage 3 -> 1 -> 0, so stage 1 must receive stage 3's part before
    it sends its own (it sent first, and lost it: gradient error 0.34). Interleaved on 2
    meshes x 2 chunks, the copies at stages 1 and 3 share mesh 1, whose sync must not
    wait for its own owner's gradient (it deadlocked)."""
    from alpasim.costmodels import get_cluster
    from alpasim.solvers import plan_pipeline

    space, unlapped = SearchSpace(microbatches=2, layers=4, pareto=False), PlanOptions(bucket_bytes=None)
    if schedule == "1f1b":
        plan = plan_pipeline(str(shared_weight_graph), get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4),
                             dataclasses.replace(space, shape_ok=lambda sh: sh.size == 1), unlapped)
        assert len(plan.stages) == 4
    else:
        plan = plan_pipeline(str(shared_weight_graph), get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2),
                             space, dataclasses.replace(unlapped, schedule="interleaved", chunk_options=(2,)))
        assert plan.chunks == 2 and plan.num_meshes == 2
    chain = sorted((t.src_stage, t.dst_stage) for t in plan.transfers if t.per_iteration)
    assert chain == [(1, 0), (3, 1)]
    result = run_local(plan, steps=1)
    check = check_numerics(result.losses[0], result.grads, reference(plan))
    assert check["numerics_ok"], check


@needs_8
def test_half_precision_step_is_checked_against_its_own_rounding_noise(reference):
    """A float16 GPT (the models' default dtype) passes against one device, with the
    tolerance set by a float16-ulp probe; the probe sees noise where a float32-ulp one
    rounded away; summed instead of averaged microbatch gradients still fail."""
    from alpasim.costmodels import get_cluster
    from alpasim.solvers import plan_pipeline

    views = {2: [(1, 2)], 4: [(2, 2)]}
    plan = plan_pipeline("gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8",
                         get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size in views,
                                     views_of=lambda sh: views[sh.size], max_stages=3))
    assert plan.model.dtype == "float16" and len(plan.stages) >= 2
    result = run_local(plan, steps=1)
    ref = reference(plan)
    assert ref.half_precision and ref.noise_grad_err > 1e-4, ref.noise_grad_err
    check = check_numerics(result.losses[0], result.grads, ref)
    assert check["numerics_ok"], check
    summed = {p: g * plan.microbatches for p, g in result.grads.items()}
    assert not check_numerics(result.losses[0], summed, ref)["numerics_ok"]

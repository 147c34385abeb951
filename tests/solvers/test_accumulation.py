"""DeepSpeed's BF16_Optimizer as a precision recipe (`deepspeed-bf16`): the 16-bit
gradients kept beside the fp32 accumulator, the cast-and-add pass after each backward
priced on the whole unreduced gradient, and the accumulator all-reduced whole."""

from __future__ import annotations

import pytest

from alpasim.costmodels import AnalyticCostModel, accumulating_cast, get_cluster
from alpasim.costmodels._compute import KERNEL_LAUNCH_OVERHEAD_S
from alpasim.costmodels._gemm import memory_bandwidth
from alpasim.graphs import build_training_graph, forward_graph, get_recipe, training_graph
from alpasim.solvers._accumulation import unreduced_accumulation_s
from alpasim.solvers._intra_op import solve_intra_op
from alpasim.solvers._mesh import LogicalMesh
from alpasim.solvers._stage_costs import layer_graphs
from alpasim.solvers._layer_options import _sync_terms, restricted_solve_kwargs

SPEC = "gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=96,batch=16,dtype=bfloat16"


def test_the_recipe_keeps_twenty_bytes_a_parameter_and_marks_every_cast():
    recipe = get_recipe("deepspeed-bf16")
    assert recipe.bytes_per_param("bfloat16") == 2 + 4 + 2 + 4 + 8
    assert recipe.keeps_low_precision_grads and recipe.reduce_whole
    assert not get_recipe("mixed-fp32grad").keeps_low_precision_grads
    ds = build_training_graph(SPEC, precision="deepspeed-bf16").graph
    plain = build_training_graph(SPEC, precision="mixed-fp32grad").graph
    casts = [op for op in ds.ops if op.name.endswith(":grad_cast")]
    # One cast per parameter, each the accumulating kind; the plain recipe's are not.
    assert len(casts) == len(ds.params) and all(accumulating_cast(op) for op in casts)
    assert not any(accumulating_cast(op) for op in plain.ops)
    assert [op.prim for op in ds.ops] == [op.prim for op in plain.ops]


def test_the_pass_moves_eighteen_bytes_an_element_in_two_kernels():
    """`lp.grad.to(fp32)` reads 2 and writes 4 bytes, `hp_grad.add_` reads 8 and writes
    4: against the closed form at the device's streaming bandwidth."""
    cluster = get_cluster("dgx-a100")
    g = build_training_graph(SPEC, precision="deepspeed-bf16").graph
    model = AnalyticCostModel(cluster)
    bw = memory_bandwidth(cluster.device.name, cluster.device.memory_bandwidth_bytes_per_s)
    for op in (op for op in g.ops if accumulating_cast(op)):
        n = g.tensors[op.outputs[0]].size
        want = 18 * n / bw + 2 * KERNEL_LAUNCH_OVERHEAD_S
        assert model.op_time_s(op, g.tensors) == pytest.approx(want, rel=1e-12)
        # Split over 2 devices: each moves half, and still launches both kernels.
        assert model.op_time_s(op, g.tensors, num_shards=2) == pytest.approx(9 * n / bw + 2 * KERNEL_LAUNCH_OVERHEAD_S)


def _block_plan(precision: str, restriction: str = "megatron_distopt"):
    """A bf16 GPT block under `precision`, its plan on a dp 4 x tp 2 A100 mesh."""
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=8)
    block = layer_graphs(training_graph(forward_graph(SPEC), precision=precision))[1]
    mesh = LogicalMesh.on_cluster(cluster, (4, 2))
    model = AnalyticCostModel(cluster)
    plan = solve_intra_op(block, mesh, model, with_compute=True, microbatches=1,
                          **restricted_solve_kwargs(restriction, block, mesh, model)).plan
    return block, mesh, model, plan


def test_the_pass_is_priced_on_the_unreduced_gradient_before_its_scatter():
    """Under ZeRO-1 slices each step is sliced over dp, so the ILP prices each cast on a
    slice (after a reduce-scatter, or sliced for the step where the gradient is all-
    reduced); the pass runs every microbatch on the gradient as the backward makes it,
    laid out as its parameter (Megatron's weights are whole over dp): the correction is
    each cast's 18 bytes an element on the parameter's elements a device holds, less
    on the slice's."""
    block, mesh, model, plan = _block_plan("deepspeed-bf16")
    bw = memory_bandwidth(model.device.name, model.device.memory_bandwidth_bytes_per_s)
    want = 0.0
    for op in (op for op in block.ops if accumulating_cast(op)):
        s = plan.strategies[op.name]
        shards = mesh.axis_size(tuple(a for _, axes in s.loops for a in axes))
        param = op.outputs[0].split(":")[1]
        held = plan.specs[param].num_shards(mesh)
        assert held * 4 == shards, op.name       # every step is sliced over dp, no weight is
        n = block.tensors[op.outputs[0]].size
        want += 18 * n / held / bw - 18 * n / shards / bw
    got = unreduced_accumulation_s(block, plan, model)
    assert got == pytest.approx(want, rel=1e-9) and got > 0
    # Without the accumulating recipe, nothing is added.
    block2, _, _, plan2 = _block_plan("mixed-fp32grad")
    assert unreduced_accumulation_s(block2, plan2, model) == 0.0


def test_the_memory_holds_the_kept_gradient_beside_the_accumulator():
    _, _, _, ds = _block_plan("deepspeed-bf16")
    _, _, _, plain = _block_plan("mixed-fp32grad")
    # The fp32 accumulator (4 bytes) and the bf16 gradient kept beside it (2 bytes).
    assert ds.memory.grads_bytes == pytest.approx(plain.memory.grads_bytes * 1.5)
    assert ds.memory.params_bytes == pytest.approx(plain.memory.params_bytes)


def test_the_whole_accumulator_is_all_reduced_and_the_slices_still_gathered():
    block, _, _, ds = _block_plan("deepspeed-bf16")
    plain_block, _, _, plain = _block_plan("mixed-fp32grad")
    _, ds_grad_s, ds_groups, ds_gather_s, ds_gathers = _sync_terms("megatron_distopt", block, ds)
    _, grad_s, groups, gather_s, gathers = _sync_terms("megatron_distopt", plain_block, plain)
    ds_by = {(k, a): b for k, a, b in ds_groups}
    by = {(k, a): b for k, a, b in groups}
    assert ("reduce_scatter", (0,)) not in ds_by and ("reduce_scatter", (0,)) in by
    # The same fp32 bytes over dp, all-reduced where they were scattered.
    assert ds_by[("all_reduce", (0,))] == pytest.approx(by[("reduce_scatter", (0,))] + by.get(("all_reduce", (0,)), 0))
    assert ds_grad_s > grad_s
    # The stepped slices come back by the same all-gathers.
    assert ds_gathers == gathers and ds_gather_s == pytest.approx(gather_s)


def test_the_recipe_prices_only_a_megatron_configuration_with_sharded_states(cli):
    """BF16_Optimizer shards the states (ZeRO-1) and all-reduces whole gradients: a plan
    that keeps the states whole, or a search that prices scatters, is refused in one
    line naming the recipe, before planning."""
    model = "gpt3:hidden=256,layers=2,heads=4,seq=256,vocab=512,batch=8,dtype=bfloat16"
    args = ["plan", "--model", model, "--cluster", "dgx-a100", "--nodes", "1", "--devices-per-node", "4",
            "--precision", "deepspeed-bf16"]
    layout = ["--method", "megatron", "--tp", "2", "--pp", "1", "--dp", "2", "--microbatch-size", "1"]
    for extra in (layout, ["--method", "alpa"]):
        refused = cli(*args, *extra)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "deepspeed-bf16 is DeepSpeed's BF16_Optimizer" in refused.stderr
    ran = cli(*args, *layout, "--distributed-optimizer", "--json")
    assert ran.returncode == 0, ran.stderr
    import json

    plan = json.loads(ran.stdout)
    assert plan["model"]["precision"] == "deepspeed-bf16" and plan["model"]["bytes_per_param"] == 20


def test_an_imported_graph_counts_the_kept_gradient_too():
    """The preflight's states of a graph (not a zoo spec) come from its training graph:
    under the recipe, 20 bytes a parameter as for the zoo's count."""
    from alpasim.graphs import model_source
    from alpasim.solvers._preflight import model_states

    graph = forward_graph(SPEC)
    zoo, imported = model_states(model_source(SPEC), "deepspeed-bf16"), model_states(model_source(graph),
                                                                                     "deepspeed-bf16")
    assert imported.params == zoo.params
    assert imported.total_bytes == pytest.approx(zoo.total_bytes) == pytest.approx(20 * zoo.params)

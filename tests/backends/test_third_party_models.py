"""Models written with flax (linen and nnx) and equinox are imported, saved, planned,
simulated and run (`tests/graphs/jax_models.py` says what each one uses).

Hugging Face's Flax Llama, Mistral and GPT-2 (transformers 4.x) are among them, built
from their config classes with nothing downloaded (tests/conftest.py points HF_HOME into
the session's root and sets HF_HUB_OFFLINE before transformers is first imported).

Independent figures: the user's own function, evaluated by JAX at the same parameter
and batch values (`values_as_tree` maps the graph's leaves back onto its pytrees), for
the loss and for every gradient of a pipelined, sharded step; and, for the model with
dropout (whose masks become graph inputs, so the user's own random draw is not the
step's), `alpasim run`'s check against a single-device step of the graph.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("optax")

from alpasim.backends import hlo_collectives, run_local  # noqa: E402
from alpasim.backends._executable import plan_training_graph  # noqa: E402
from alpasim.backends._hlo import PLANNED_KINDS  # noqa: E402
from alpasim.backends._lowering import lower_graph, random_leaves  # noqa: E402
from alpasim.backends._stages import microbatch_inputs, stage_intra_plan  # noqa: E402
from alpasim.costmodels import get_cluster  # noqa: E402
from alpasim.graphs import from_jax, load_graph, model_source, save_graph, values_as_tree  # noqa: E402
from alpasim.simulator import simulate  # noqa: E402
from alpasim.solvers import SearchSpace, plan_pipeline, planning_graph, planning_units  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "graphs"))
import jax_models  # noqa: E402

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# Compiles whole pipelined plans: `make test-fast` leaves these to `make test`.
pytestmark = pytest.mark.slow


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@functools.cache
def _value_and_grad(loss_fn):
    """The user's own step, compiled once per function (a test that checks one model
    twice compiles it once)."""
    return jax.jit(jax.value_and_grad(loss_fn))


def _own_step(loss_fn, params, batch, graph, leaves, inputs):
    """The user's function's loss and gradients at the graph's leaf values."""
    p = jax.tree.map(jnp.asarray, values_as_tree(graph, params, leaves))
    b = jax.tree.map(jnp.asarray, values_as_tree(graph, batch, inputs, "batch"))
    return _value_and_grad(loss_fn)(p, b)


@functools.cache
def _problem(name):
    """(loss_fn, params, batch) of `name`: a `jax_models` problem, or `hf_<kind>` for
    Hugging Face's (skipped without transformers). Built once a session."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
        return jax_models.hf_problem(name.removeprefix("hf_"))
    return getattr(jax_models, f"{name}_problem")()


@functools.cache
def _imported(name):
    return from_jax(*_problem(name), name=name)


@pytest.mark.parametrize("problem", ["flax_llama", "nnx", "equinox", "hf_llama", "hf_mistral", "hf_gpt2"])
def test_imported_loss_and_gradients_equal_the_models_own(problem):
    """The graph, lowered to JAX op by op, is the user's function: same loss, and JAX's
    gradients of the one equal JAX's gradients of the other."""
    loss_fn, params, batch = _problem(problem)
    graph = _imported(problem)
    assert "batch_note" not in graph.meta           # the batch is marked: plannable at any microbatch
    leaves = random_leaves(graph, 0)
    loss, grads = _own_step(loss_fn, params, batch, graph, leaves, leaves)
    forward = lower_graph(graph, ["loss"])
    names = [p.name for p in graph.params]
    step = jax.jit(jax.value_and_grad(lambda p, rest: forward({**rest, **p})["loss"]))
    value, ours = step({n: leaves[n] for n in names}, {t: v for t, v in leaves.items() if t not in names})
    assert float(value) == pytest.approx(float(loss), rel=1e-6)
    worst = max(jax.tree.leaves(jax.tree.map(_rel, values_as_tree(graph, params, ours), grads)))
    assert worst < 1e-5


def test_the_llama_stack_is_one_layer_per_scan_step_with_its_own_weights():
    graph = _imported("flax_llama")
    assert graph.num_layers == jax_models.L + 2        # embedding | one per scan iteration | head
    stacked = graph.meta["stacked_params"]
    assert all(len(parts) == jax_models.L for parts in stacked.values())
    for leaf, parts in stacked.items():
        assert {graph.tensors[p].shape for p in parts} == {graph.tensors[p].shape for p in parts[:1]}
        assert leaf not in graph.tensors               # the stacked array itself is gone
    prims = {op.prim for op in graph.ops}
    assert {"take_along", "constant"} <= prims          # optax's label pick; RoPE tables and the mask


@needs_8
def test_flax_llama_pipelined_and_sharded_step_equals_the_models_own_gradients(tmp_path):
    loss_fn, params, batch = _problem("flax_llama")
    save_graph(_imported("flax_llama"), tmp_path / "llama.json")
    plan = plan_pipeline(str(tmp_path / "llama.json"), get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size == 4,
                                     views_of=lambda sh: [(2, 2)]))
    assert len(plan.stages) == 2
    _run_is_the_models_own_step(plan, loss_fn, params, batch)


def _run_is_the_models_own_step(plan, loss_fn, params, batch) -> None:
    """One step of `plan` run on the devices gives the user's function's loss (1e-5) and
    gradients (1e-4, norm-wise per leaf), at the run's own parameters and microbatches."""
    graph = planning_graph(plan.model)                 # one microbatch's graph, the run's
    result = run_local(plan, steps=1)
    leaves = random_leaves(graph, 0)
    inputs = {t: np.concatenate([microbatch_inputs(graph, 0, 0, m)[t] for m in range(plan.microbatches)])
              for t in graph.inputs}
    loss, grads = _own_step(loss_fn, params, batch, graph, leaves, inputs)
    assert result.losses[0] == pytest.approx(float(loss), rel=1e-5)
    ours = values_as_tree(graph, params, result.grads)
    assert max(jax.tree.leaves(jax.tree.map(_rel, ours, grads))) < 1e-4


@needs_8
def test_hf_llama_is_planned_simulated_and_run_to_the_models_own_gradients():
    """Hugging Face's Flax Llama in process: planned as its blocks (the embedding, one
    layer per decoder layer, the head, read from `model/layers/<i>`), two stages of 2x2
    meshes whose simulation agrees with the plan's prediction, and one step of the plan
    run on 8 devices gives the model's own loss and gradients (those of the query and
    key projections see RoPE's gathered rows)."""
    loss_fn, params, batch = _problem("hf_llama")
    imported = _imported("hf_llama")
    assert imported.num_layers == jax_models.L + 2
    plan = plan_pipeline(model_source(imported), get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size == 4,
                                     views_of=lambda sh: [(2, 2)]))
    assert len(plan.stages) == 2
    timeline = simulate(plan)
    assert timeline.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=0.1)
    _run_is_the_models_own_step(plan, loss_fn, params, batch)


@needs_8
def test_a_flax_model_with_dropout_is_planned_simulated_and_run_by_the_cli(tmp_path, cli):
    graph_file, plan_file = tmp_path / "llama.json", tmp_path / "plan.json"
    save_graph(from_jax(*jax_models.flax_llama_problem(dropout=True), name="llama"), graph_file)
    masks = [t for t in load_graph(graph_file).inputs if t.startswith("batch/random")]
    assert len(masks) == jax_models.L                  # one dropout mask per layer, an input of the step
    plan = cli.json("plan", "--model", graph_file, "--nodes", "1", "--devices-per-node", "4", "--microbatches", "2",
                    "--out", plan_file, timeout=600)
    assert plan["feasible"]
    cli.json("simulate", plan_file, timeout=120)
    run = cli.json("run", plan_file, "--profile-iters", "0", "--steps", "1", timeout=600)
    assert run["numerics_ok"]


@needs_8
def test_exported_shardings_drive_jax_jit_of_the_models_own_step(tmp_path):
    """`plan_shardings` gives, in the user's own pytrees, the layouts of a one-stage plan
    on 8 devices; `jax.jit` of the user's `value_and_grad` takes them as they are, keeps
    them on its parameters, compiles to collectives within the runtime check's band of the
    plan's, and returns the single-device gradients."""
    from jax.sharding import NamedSharding

    from alpasim.backends import plan_shardings

    loss_fn, params, batch = jax_models.nnx_problem()
    save_graph(from_jax(loss_fn, params, batch, name="nnx"), tmp_path / "nnx.json")
    plan = plan_pipeline(str(tmp_path / "nnx.json"), get_cluster("aws-p3.16xlarge", nodes=1),
                         SearchSpace(microbatches=1, pareto=False, max_stages=1, shape_ok=lambda sh: sh.size == 8,
                                     views_of=lambda sh: [(2, 4)]))
    (stage,) = plan_shardings(plan, params, batch)
    assert dict(stage.mesh.shape) == {"x": 2, "y": 4}
    exported = jax.tree.leaves(stage.params)
    assert len(exported) == len(jax.tree.leaves(params)) and all(isinstance(s, NamedSharding) for s in exported)
    # Sharded somewhere (parameters, or at least the batch over the data-parallel axis).
    assert any(s.spec != jax.sharding.PartitionSpec(*([None] * len(s.spec)))
               for s in exported + jax.tree.leaves(stage.batch))
    graph = planning_graph(plan.model)
    leaves = random_leaves(graph, 0)
    p = jax.tree.map(jnp.asarray, values_as_tree(graph, params, leaves))
    b = jax.tree.map(jnp.asarray, values_as_tree(graph, batch, microbatch_inputs(graph, 0, 0, 0), "batch"))
    step = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(stage.params, stage.batch),
                   out_shardings=(None, stage.grads))
    compiled = step.lower(p, b).compile()
    got = jax.tree.leaves(compiled.input_shardings[0][0])
    assert [s.spec for s in got] == [s.spec for s in exported]
    # The compiled collectives against the plan's, as the runtime's HLO check holds them
    # (totals in the band of tests/backends/test_runtime.py). XLA propagates its own
    # layouts between the pinned parameters, so this is a band, not equality.
    intra = stage_intra_plan(plan, plan_training_graph(plan, graph), 0)
    predicted = sum(pc.collective.nbytes for pc in intra.collectives
                    if intra.mesh.axis_size(pc.collective.axes) > 1 and pc.collective.kind in PLANNED_KINDS)
    measured = sum(c.nbytes for c in hlo_collectives(compiled.as_text()) if c.kind in PLANNED_KINDS)
    assert predicted > 0 and 1 / 3 <= measured / predicted <= 1.5, (measured, predicted)
    loss, grads = step(p, b)
    want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(p, b)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert max(jax.tree.leaves(jax.tree.map(_rel, grads, want))) < 1e-4


def assert_priced_alike(imported, builtin) -> None:
    """The whole model as one stage, under recompute="fusible": the ILP's step time on
    one device and on a 2x2 mesh, and the memory on one device (the same layout, so
    the same bytes; on a mesh the ILP minimises time only), within 5 %."""
    from alpasim.costmodels import AnalyticCostModel
    from alpasim.graphs import build_training_graph, stage_graph
    from alpasim.solvers import LogicalMesh, solve_intra_op

    cluster = get_cluster("aws-p3.16xlarge")
    model = AnalyticCostModel(cluster)
    for shape, check_memory in (((1, 1), True), ((2, 2), False)):
        mesh = LogicalMesh.on_cluster(cluster, shape)
        got = {}
        for label, fwd in (("imported", imported), ("built-in", builtin)):
            g = build_training_graph(fwd, recompute="fusible").graph
            plan = solve_intra_op(stage_graph(g, 0, g.num_layers - 1), mesh, model, with_compute=True).plan
            got[label] = (plan.compute_s + plan.communication_s + plan.sync_s + plan.update_s,
                          plan.memory.total_bytes)
        (ti, mi), (tb, mb) = got["imported"], got["built-in"]
        assert ti == pytest.approx(tb, rel=0.05), shape
        if check_memory:
            assert mi == pytest.approx(mb, rel=0.05)


def test_a_flax_gpt_is_priced_like_the_built_in_gpt_of_its_shape():
    """The same GPT written in flax and built in: per-layer planning units, one tensor
    across each boundary, and under recompute="fusible" (which makes the stash
    independent of how finely the model is written) the predicted step time and memory
    of the whole model as one stage within 5 % of the built-in's; on four devices the
    ILP's time within 5 % too. (`benchmarks/bench_imported_vs_builtin.py` prints these
    and the planning times.)"""
    from alpasim.graphs import build_training_graph, forward_graph

    shape = dict(hidden=256, layers=2, heads=8, seq=128, vocab=1024, batch_size=8)
    imported = from_jax(*jax_models.flax_gpt_problem(**shape), name="flax-gpt")
    builtin = planning_units(forward_graph("gpt3:hidden=256,layers=2,heads=8,seq=128,vocab=1024,batch=8,"
                                           "dtype=float32"))
    assert imported.num_layers == builtin.num_layers == 4          # embedding, two blocks, head
    blocks = [[op.prim for op in imported.ops if op.layer == n] for n in (1, 2)]
    assert blocks[0] == blocks[1]
    train = build_training_graph(imported).graph
    crossing = {t for op in train.ops if op.phase == "forward" for t in op.inputs
                if t in train.producer and train.producer[t].layer != op.layer}
    assert len(crossing) == 3                                      # the residual stream, once per boundary
    assert_priced_alike(imported, builtin)


def test_imported_flax_llama_costs_what_the_built_in_one_does():
    """An imported flax Llama and the built-in family of one shape: the same planning
    units and parameters, and a stage of both priced alike by the ILP (within 5 %, as
    the GPT pair; their ops differ: JAX's softmax is a chain of elementwise ops, its
    einsums transpose their results, its RoPE tables are captured constants)."""
    from alpasim.graphs import forward_graph

    # Llama-like proportions (SwiGLU of 2.75 h, 4 query heads a KV head): at toy sizes the
    # importer's extra layout ops (JAX's einsum transposes, captured tables) weigh more.
    shape = dict(hidden=1024, layers=2, heads=16, kv_heads=4, ffn=2816, seq=512, vocab=8192, batch_size=8)
    imported = from_jax(*jax_models.flax_llama3_problem(**shape), name="flax-llama")
    builtin = planning_units(forward_graph("llama:hidden=1024,layers=2,heads=16,kv_heads=4,ffn=2816,seq=512,"
                                           "vocab=8192,batch=8,dtype=float32"))
    assert imported.num_layers == builtin.num_layers
    assert imported.num_params() == builtin.num_params()
    assert_priced_alike(imported, builtin)

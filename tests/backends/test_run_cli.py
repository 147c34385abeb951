"""`alpasim run` end to end, the serial-runtime simulation, and the profiled predictions.

The stage-profiled prediction (each compiled stage timed alone, composed by the
simulator: Alpa's own profiling) is held within STAGE_BAND of the measured median;
`benchmarks/bench_run.py` on the idle machine measured 0.83-1.16 for GPT, MoE and
Wide-ResNet over four to six runs each. Profiling and run follow each other closely and share the
machine's load, so the band can be narrower than the op-level one; a composition that
drops a microbatch (0.5x) or the backward (~0.3x) fails it.

The op-level profiled prediction is held to a wider band around the measured median:
predicted / measured in [0.25, 3.0] for a small GPT on 8 virtual CPU devices. The band
is that wide because the quick profile's fits are unstable. On one day on the 2-core
machine three runs of this test read 0.43, 0.68 and 0.83 and two fresh clones 1.64 and
2.04: the predicted step moved from 0.15 s to 0.65 s while the measured one stayed at
0.28-0.36 s. One quiet profile, reused, gave 0.84-0.96 over four runs (two of them of
the code before the fused QKV block): the spread is the profile's. Its three matmul
sizes leave the fit free to charge matmuls by the byte (one run fitted 1.9 GB/s to
them), and the profile runs first in the serial lane, right after the install. It
still fails a prediction off by 4x below or 3x above, e.g. one that forgets the serial
executor or the dispatch cost.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import pytest

from alpasim.backends import host_cluster, predict_run, run_local
from alpasim.costmodels import ProfiledCostModel, get_cluster
from alpasim.simulator import Send, build_program, simulate, synthetic_plan
from alpasim.solvers import PlanOptions, SearchSpace, plan_pipeline


TINY_GPT = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32"
WRESNET_17 = "wresnet:channels=8,width=1,image=64,classes=16,batch=8,depth=17"
# XLA's own optimisation level and fusion emitters, as a user's run compiles (the
# parallel lane compiles otherwise: the Makefile); the device count is the tests'.
USERS_XLA = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
SMALL_GPT = "gpt3:hidden=256,layers=4,heads=8,seq=64,vocab=512,batch=16,dtype=fp32"
VIEWS = {2: [(1, 2)], 4: [(2, 2)]}
PROFILED_BAND = (0.25, 3.0)
STAGE_BAND = (0.6, 1.5)

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def small_plan(model: str, cluster=None, cost_model=None):
    """A pipelined plan of `model` (planned once per model on the default cluster)."""
    if cluster is None and cost_model is None:
        return _default_plan(model)
    return _plan(model, cluster, cost_model)


@functools.cache
def _default_plan(model: str):
    return _plan(model, get_cluster("aws-p3.16xlarge", nodes=1), None)


def _plan(model: str, cluster, cost_model):
    return plan_pipeline(model, cluster,
                         SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size in VIEWS,
                                     views_of=lambda sh: VIEWS[sh.size], max_stages=3),
                         PlanOptions(cost_model=cost_model))


@pytest.mark.slow
def test_run_json_reports_numerics_timing_and_collectives(tmp_path, cli):
    path = tmp_path / "plan.json"
    small_plan(TINY_GPT).save(path)
    trace = tmp_path / "trace.json"
    # As a user runs it (USERS_XLA), so the numerics users get are checked here too.
    r = cli("run", str(path), "--steps", "2", "--json", "--trace", str(trace), env=USERS_XLA)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["numerics_ok"] is True
    assert got["max_abs_loss_err"] <= got["loss_tol"] and got["max_rel_grad_err"] <= got["grad_tol"]
    assert got["runtime"] == "local" and got["steps"] == 2 and len(got["step_times_s"]) == 2
    assert got["measured_step_s"] > 0 and got["predicted_step_s_analytic"] > 0
    assert got["predicted_step_s_profiled"] is None and got["ratio_profiled"] is None
    # Stage profiling is on by default: it is the prediction reported.
    assert got["predicted_step_s"] == got["predicted_step_s_stage_profiled"] > 0
    assert got["ratio"] == got["ratio_stage_profiled"] == pytest.approx(got["predicted_step_s"] / got["measured_step_s"])
    assert [row["stage"] for row in got["stage_profile"]] == list(range(len(got["collectives"])))
    assert len(got["collectives"]) == len(json.loads(path.read_text())["stages"]) >= 2
    for row in got["collectives"]:
        assert set(row["predicted"]) >= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
        assert set(row["measured"]) >= set(row["predicted"])
    # Memory per stage: the plan's prediction beside the compiled programs' measurement.
    plan_stages = json.loads(path.read_text())["stages"]
    assert len(got["stages"]) == len(plan_stages)
    for row, st in zip(got["stages"], plan_stages, strict=True):
        mem = row["memory"]
        assert mem["predicted_bytes"] == st["memory_bytes"] and mem["measured_bytes"] > 0
        assert mem["ratio"] == pytest.approx(mem["predicted_bytes"] / mem["measured_bytes"])
        assert set(mem["measured"]["programs"]) == {"forward", "backward", "update"}
        assert mem["measured"]["inflight"] == st["inflight_microbatches"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("cat") == "compute" for e in events) > 0, events[:5]


@pytest.mark.slow
def test_run_compares_the_compiled_programs_with_what_was_priced_and_solves_no_ilp(monkeypatch, quick_profile):
    """`run` reads each stage's predicted collectives from the plan (what its layers were
    priced with), and a profiled re-pricing replays each stage's recorded strategies, so
    it solves no intra-op ILP: patched to raise, the run completes, with a cost model
    too. A plan from before the record says it has no prediction rather than inventing
    one."""
    from alpasim.backends._executable import plan_training_graph
    from alpasim.backends._stages import stage_intra_plan
    from alpasim.experiments import run_report
    from alpasim.solvers import _intra_op, planning_graph

    plan = small_plan(TINY_GPT)
    loaded = ProfiledCostModel.load(quick_profile[1], get_cluster("aws-p3.16xlarge", nodes=1))
    model = loaded.with_cluster(host_cluster(loaded, loaded.meta["num_devices"]))
    profiled = small_plan(TINY_GPT, model.cluster, model)
    # The replayed plan is the priced one, op for op: a one-layer stage moves exactly its
    # record (a longer one also reshards between its layers, which the table's
    # composition leaves out).
    train = plan_training_graph(plan, planning_graph(plan.model))
    single = [k for k, st in enumerate(plan.stages) if st.layers[0] == st.layers[1]]
    assert single
    for k in single:
        replayed = stage_intra_plan(plan, train, k)
        assert replayed.collective_bytes() == pytest.approx(plan.stages[k].collective_bytes)
        layer = plan.stages[k].layers[0]
        assert [replayed.strategies[op.name].name for op in train.ops if op.layer == layer] == \
            list(plan.stages[k].layer_strategies[0])
    assert all(st.collective_bytes for st in plan.stages) and any(sum(st.collective_bytes.values())
                                                                  for st in plan.stages)

    def solve_ilp(*args, **kwargs):
        raise AssertionError("alpasim run solved an intra-op ILP")

    monkeypatch.setattr(_intra_op, "solve_ilp", solve_ilp)
    got = run_report(plan, steps=1, profile_iters=0)
    assert got["numerics_ok"] is True
    for row, st in zip(got["collectives"], plan.stages, strict=True):
        assert row["predicted"] == {k: st.collective_bytes.get(k, 0.0) for k in row["predicted"]}
        assert row["predicted_bytes"] == pytest.approx(sum(st.collective_bytes.values()))
    assert run_report(profiled, steps=1, profile_iters=0, cost_model=model)["predicted_step_s_profiled"] > 0
    older = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, collective_bytes=None)
                                                   for st in plan.stages))
    rows = run_report(older, steps=1, profile_iters=0)["collectives"]
    assert all(r["predicted"] is None and r["ratio"] is None and r["measured_bytes"] >= 0 for r in rows)


@pytest.mark.parametrize("content", [None, "{not json", '{"schema": "alpasim.plan/1"}'])
def test_run_bad_plan_file_is_one_line_and_exit_2(tmp_path, content, cli):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    r = cli("run", str(path))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "plan.json" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_wide_resnet_compiled_as_users_compile_it_trains_the_single_device_step(tmp_path, cli):
    """Convolutions, batch norm and max pooling (every kind of ResNet block once) under
    XLA's defaults (USERS_XLA): the pipelined step equals one device's."""
    path = tmp_path / "plan.json"
    small_plan(WRESNET_17).save(path)
    got = cli.json("run", str(path), "--steps", "1", "--profile-iters", "0", env=USERS_XLA)
    assert got["numerics_ok"] is True and len(got["stages"]) >= 2, got


@pytest.mark.slow
def test_run_without_stage_profiling_and_a_bad_iteration_count(tmp_path, cli):
    path = tmp_path / "plan.json"
    small_plan(TINY_GPT).save(path)
    bad = cli("run", str(path), "--profile-iters", "-1")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--profile-iters" in bad.stderr
    r = cli("run", str(path), "--steps", "1", "--profile-iters", "0", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["predicted_step_s_stage_profiled"] is None and got["stage_profile"] is None
    assert got["predicted_step_s"] == got["predicted_step_s_analytic"]


def test_a_plan_larger_than_the_host_is_refused_in_one_line(tmp_path, cli):
    path = tmp_path / "plan.json"
    small_plan(TINY_GPT).save(path)
    data = json.loads(path.read_text())
    for st in data["stages"]:
        st["memory_bytes"] = 1e13  # 10 TB per device: no host has that
    path.write_text(json.dumps(data))
    r = cli("run", str(path), "--steps", "1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "GiB" in r.stderr and "host" in r.stderr and "Traceback" not in r.stderr


def test_the_backend_rebuilds_the_graph_with_the_loss_kernel_the_plan_was_priced_with():
    """`plan_training_graph` (what `run` executes and `predict_run` re-prices) marks the
    cross-entropy with the kernel the planner priced, read back from the plan file: a
    Megatron plan's unfused fp32 loss is not re-priced as a fused one. A plan file from
    before the model recorded it takes its system profile's kernel; one from before
    profiles, the fused kernel every plan was priced with then."""
    from alpasim.backends._executable import plan_training_graph
    from alpasim.graphs import LOSS_LOGITS
    from alpasim.solvers import MegatronConfig, plan_from_json, plan_model, planning_graph

    def kernels(record) -> set:
        plan = plan_from_json(record)
        graph = plan_training_graph(plan, planning_graph(plan.model))
        return {op.attrs.get("kernel", "fused") for op in graph.ops if op.prim in LOSS_LOGITS}

    plan = plan_model(TINY_GPT, get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2), "megatron",
                      megatron=MegatronConfig(1, 1, 2, 2))
    record = json.loads(json.dumps(plan.to_json()))
    assert record["model"]["loss_kernel"] == record["system"]["settings"]["cross_entropy"] == "unfused-fp32"
    assert kernels(record) == {"unfused-fp32"}
    del record["model"]["loss_kernel"]
    assert kernels(record) == {"unfused-fp32"}
    # A setting the cost model could not price was priced as the entry's `unpriced` value.
    unpriced = {**record["system"], "unpriced": {"cross_entropy": "fused"}}
    assert kernels({**record, "system": unpriced}) == {"fused"}
    # The model's record comes first: a plan priced fused under a profile that runs unfused.
    assert kernels({**record, "model": {**record["model"], "loss_kernel": "fused"}}) == {"fused"}
    record["system"] = {}
    assert kernels(record) == {"fused"}


def test_serial_executor_takes_the_sum_of_all_instruction_times():
    """One executor: every Run, GradSync and Send (until its tensor lands) runs alone,
    so the iteration is their sum whatever the schedule; each pays `dispatch_s`, and a
    Send's copy takes latency + bytes / bandwidth on the (otherwise idle) link."""
    cluster = get_cluster("dgx-a100", nodes=1)
    f, b, sync, B, d = [1.0, 2.0, 0.5], [2.0, 3.0, 1.5], 0.25, 4, 0.01
    plan = synthetic_plan(f, b, B, cluster=cluster, sync_s=sync, hidden_shape=(1024, 1024), dtype="float32")
    for schedule in ("1f1b", "gpipe"):
        program = build_program(plan, schedule)
        sends = program.count(Send)
        copy_s = cluster.intra_node.latency_s + 1024 * 1024 * 4 / cluster.intra_node.bytes_per_s
        want = B * sum(f) + B * sum(b) + 3 * sync + (2 * B * 3 + 3) * d + sends * (d + copy_s)
        tl = simulate(plan, program, cluster=cluster, executors=1, dispatch_s=d)
        assert tl.iteration_s == pytest.approx(want, rel=1e-9)
        # Free-running meshes overlap: strictly faster than the serial sum.
        assert simulate(plan, program, cluster=cluster).iteration_s < want - 1.0


@needs_8
@pytest.mark.serial  # measures time: `make test` runs it alone, on an idle machine
def test_profiled_prediction_is_near_the_measured_step(tmp_path, quick_profile):
    _, path, _ = quick_profile
    loaded = ProfiledCostModel.load(path, get_cluster("aws-p3.16xlarge", nodes=1))
    model = loaded.with_cluster(host_cluster(loaded, loaded.meta["num_devices"]))
    plan = small_plan(SMALL_GPT, model.cluster, model)
    assert len(plan.stages) >= 2
    result = run_local(plan, steps=5, profile_iters=3)
    pred = predict_run(plan, cost_model=model, intra_plans=[s.intra_plan for s in result.stages],
                       stage_times=result.stage_profile)
    ratio = pred["predicted_step_s_profiled"] / result.measured_step_s
    assert PROFILED_BAND[0] <= ratio <= PROFILED_BAND[1], (ratio, pred, result.step_times_s)
    stage_ratio = pred["predicted_step_s_stage_profiled"] / result.measured_step_s
    assert STAGE_BAND[0] <= stage_ratio <= STAGE_BAND[1], (stage_ratio, pred, result.step_times_s)
    assert pred["predicted_step_s"] == pred["predicted_step_s_stage_profiled"]

    # The composition in closed form: one executor runs every profiled call (B forwards
    # and B backwards per stage, one update each), then each send pays a dispatch and
    # its copy on the profile's link — these boundary tensors take well under 5 ms.
    B, d = plan.microbatches, pred["dispatch_s"]
    calls = sum(B * (t.forward_s + t.backward_s) + t.update_s for t in result.stage_profile)
    sends = result.program.count(Send)
    assert sends >= 2 * B
    assert calls + sends * d < pred["predicted_step_s_stage_profiled"] <= calls + sends * (d + 5e-3)

    # Each stage is priced with the profile's measured factors for its mesh size (4
    # busy devices for a 2x2 mesh): doubling every factor doubles every stage time.
    table = model.meta["concurrency_scale"]
    for row, st in zip(pred["stages"], plan.stages, strict=True):
        assert row["scale"] == table[str(len(st.devices))] and row["core_share"] == 1.0, row
    doubled = dataclasses.replace(model, meta={**model.meta, "concurrency_scale": {
        n: {c: 2 * f for c, f in factors.items()} for n, factors in table.items()}})
    twice = predict_run(plan, cost_model=doubled, intra_plans=[s.intra_plan for s in result.stages])
    for a, b in zip(pred["stages"], twice["stages"], strict=True):
        for key in ("forward_s", "backward_s", "update_s"):
            assert b[key] == pytest.approx(2 * a[key], rel=1e-9), key

    # The re-solve path (no intra plans given) prices the same shardings.
    again = predict_run(plan, cost_model=model)
    assert again["predicted_step_s"] == pytest.approx(pred["predicted_step_s_profiled"], rel=1e-6)
    assert host_cluster(model, 8).num_devices == 8

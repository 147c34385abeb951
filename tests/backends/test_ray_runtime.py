"""The Ray runtime against the local runtime, a single device, a killed actor and a
program that never sends.

One Ray cluster for the run of `ray` tests (`ray_cluster`: 2 CPUs; the mesh actors
reserve none). Each run has one actor per mesh, a process of its own with as many
virtual CPU devices as the plan has (its stages on the plan's device ids), started for it
or kept from the previous run where the devices fit; the plans are the `small_plan`
fixture's (3 stages, 1x2 and 2x2 meshes).

Agreement with `run_local`: both runtimes execute the same compiled stage programs (the
same HLO, checked) on the same devices with the same data, and Ray moves tensors
losslessly (host numpy), so the losses and gradients should be the same floats; we
allow 1e-6 relative (norm-wise for gradients), far below `check_numerics`'s 1e-5 / 1e-4
against the single device. Measured: bitwise equal.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import numpy as np
import pytest

from alpasim.backends import (RayRuntimeError, check_numerics, compare_collectives, idle_actors, run_local, run_ray,
                              stop_idle_actors)
from alpasim.simulator import Send, build_program
from alpasim.solvers import PlanOptions, SearchSpace

ray = pytest.importorskip("ray")
# They run on `ray_cluster`'s cluster: one worker runs them all (tests/conftest.py).
pytestmark = pytest.mark.ray

RTOL = 1e-6
STEPS = 2
# Far above a Recv's 2 s timeout plus starting and compiling the actors (about 15 s on
# two idle cores; Ray runs its workers niced, so on a loaded machine it took over 90 s),
# far below a hang.
HANG_S = 300


@pytest.fixture(scope="module")
def gpt_local(small_plan):
    return run_local(small_plan("gpt"), steps=STEPS)


def _program(compiled) -> str:
    """A compiled program's HLO text without its debug information (the Python stack
    that traced each op, which differs between the driver and an actor)."""
    blocks = [b for b in compiled.as_text().split("\n\n")
              if b.split("\n", 1)[0] not in ("FileNames", "FunctionNames", "FileLocations", "StackFrames")]
    return re.sub(r", metadata=\{[^}]*\}", "", "\n\n".join(blocks))


def _rel_err(got: dict, want: dict) -> float:
    return max(np.linalg.norm(got[p] - w) / max(np.linalg.norm(w), 1e-30) for p, w in want.items())


@pytest.mark.parametrize("family", ["gpt", "moe"])
def test_ray_matches_local_and_single_device(family, ray_cluster, small_plan, gpt_local, reference):
    plan = small_plan(family)
    local = gpt_local if family == "gpt" else run_local(plan, steps=STEPS)
    # GPT's actors first time their stages alone; that must leave the run's numbers as they are.
    iters = 2 if family == "gpt" else 0
    result = run_ray(plan, steps=STEPS, profile_iters=iters)
    assert [t.stage for t in result.stage_profile] == list(range(len(plan.stages)) if iters else [])
    assert all(min(t.forward_s, t.backward_s, t.update_s) > 0 for t in result.stage_profile)

    np.testing.assert_allclose(result.losses, local.losses, rtol=RTOL, atol=0)
    assert set(result.grads) == set(local.grads)
    assert _rel_err(result.grads, local.grads) <= RTOL
    check = check_numerics(result.losses[0], result.grads, reference(plan))
    assert check["numerics_ok"], check
    assert all(math.isfinite(x) for x in result.losses) and result.restarts == []

    # The same stages, so the same collectives in their HLO (fetched from the actors):
    # the very programs, since an actor lowers its stage on the plan's device ids.
    assert [s.device_ids for s in result.stages] == [tuple(st.devices) for st in plan.stages]
    assert compare_collectives(plan, result.stages) == compare_collectives(plan, local.stages)
    for remote, here in zip(result.stages, local.stages, strict=True):
        assert {n: _program(c) for n, c in remote.compiled.items()} == {n: _program(c) for n, c in here.compiled.items()}

    tl, B = result.timeline, plan.microbatches
    for k in range(len(plan.stages)):
        mesh = [e for e in tl.events if e.track == f"mesh{k}"]
        assert sum(e.kind == "compute" for e in mesh) == 2 * B, k
        assert [e.name for e in mesh if e.kind == "sync"] == ["grad_sync", "update"], k
    assert all(0 <= e.start_s <= e.end_s <= tl.iteration_s for e in tl.events)
    assert tl.iteration_s == result.step_times_s[-1] > 0


def test_a_finished_runs_actors_serve_the_next_run(ray_cluster, small_plan):
    """A finished run hands its actors to the next run of this driver (`_ray_runtime`'s
    module doc): the same processes serve it, its stages lowered afresh and its state
    reset, so it computes the first run's step to the bit."""
    plan = small_plan("gpt")
    seen = []
    first = run_ray(plan, steps=1, on_step=lambda step, actors: seen.append(set(actors)))
    assert idle_actors() == plan.num_meshes
    second = run_ray(plan, steps=1, on_step=lambda step, actors: seen.append(set(actors)))
    assert seen[1] == seen[0] and idle_actors() == plan.num_meshes
    assert second.losses == first.losses
    assert all(np.array_equal(second.grads[p], g) for p, g in first.grads.items())


def _wait_until_dead(actor) -> None:
    """ray.kill is asynchronous: a call submitted at once can still be answered (the
    actor is threaded), so wait until the actor refuses calls, and fail if it never does."""
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers after 30 s"
        time.sleep(0.1)


def test_killed_actor_is_restarted_and_the_step_redone(ray_cluster, small_plan, gpt_local):
    killed = []

    def kill_mesh1(step, actors):
        if step == 0:
            ray.kill(actors[1])
            _wait_until_dead(actors[1])        # dead before step 2 starts
            killed.append(actors[1])

    result = run_ray(small_plan("gpt"), steps=STEPS, on_step=kill_mesh1)
    assert killed and [(r["step"], r["mesh"]) for r in result.restarts] == [(1, 1)]
    assert result.losses == gpt_local.losses   # step 2 from the reloaded checkpoint
    assert result.restarts[0]["restart_s"] > 0


def test_ray_runs_zero_bubble_as_the_local_runtime_does(ray_cluster, small_plan, reference):
    """ZB-H1 on the actors: each mesh's B and W programs, the step equal to the local
    runtime's and to one device, three passes per microbatch on every mesh."""
    plan = small_plan("gpt")
    local = run_local(plan, steps=1, schedule="zb-h1")
    result = run_ray(plan, steps=1, schedule="zb-h1")
    np.testing.assert_allclose(result.losses, local.losses, rtol=RTOL, atol=0)
    assert _rel_err(result.grads, local.grads) <= RTOL
    assert check_numerics(result.losses[0], result.grads, reference(plan))["numerics_ok"]
    for k in range(len(plan.stages)):
        names = [e.name for e in result.timeline.events if e.track == f"mesh{k}" and e.kind == "compute"]
        assert sorted(set(names)) == ["backward_input", "backward_weight", "forward"]
        assert len(names) == 3 * plan.microbatches


def test_ray_runs_an_interleaved_plan_as_the_local_runtime_does(ray_cluster, small_plan, reference):
    """A plan cut into 2 chunks per mesh: each actor lowers both of its chunks and walks
    its interleaved list; the step equals the local runtime's and one device's."""
    plan = small_plan("gpt", schedule="interleaved", chunk_options=(2,))
    assert plan.chunks == 2
    local = run_local(plan, steps=1)
    result = run_ray(plan, steps=1)
    np.testing.assert_allclose(result.losses, local.losses, rtol=RTOL, atol=0)
    assert _rel_err(result.grads, local.grads) <= RTOL
    assert check_numerics(result.losses[0], result.grads, reference(plan))["numerics_ok"]
    assert [s.index for s in result.stages] == list(range(len(plan.stages)))
    for k in range(plan.num_meshes):
        chunks = sorted({e.chunk for e in result.timeline.events if e.track == f"mesh{k}" and e.kind == "compute"})
        assert chunks == [0, 1]


def test_ray_keeps_two_copies_of_a_weight_on_one_mesh_apart(ray_cluster, shared_weight_graph, reference):
    """Interleaved, the copies of weight `s` at stages 1 and 3 sit on one actor: each
    takes its own message of the owner's summed gradient (one key per copy; under one
    key the second overwrote the first and the other copy waited until the timeout)."""
    from alpasim.costmodels import get_cluster
    from alpasim.solvers import plan_pipeline

    plan = plan_pipeline(str(shared_weight_graph), get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2),
                         SearchSpace(microbatches=2, layers=4, pareto=False),
                         PlanOptions(bucket_bytes=None, schedule="interleaved", chunk_options=(2,)))
    seen = []
    result = run_ray(plan, steps=1, timeout_s=60, on_step=lambda step, actors: seen.extend(actors))
    assert check_numerics(result.losses[0], result.grads, reference(plan))["numerics_ok"]
    # The module's last run: its actors, kept for a next run, stop when asked.
    assert idle_actors() == len(seen) == 2
    stop_idle_actors()
    assert idle_actors() == 0
    for actor in seen:
        _wait_until_dead(actor)


@pytest.mark.timeout(HANG_S)
def test_a_receive_whose_send_never_comes_fails_within_the_timeout(ray_cluster, small_plan):
    # The 2 s bounds the step's waits only: loading the program, which a busy machine
    # may slow past it, has its own (`_ray_runtime.CALL_TIMEOUT_S`), so this runs
    # beside other tests.
    plan = small_plan("gpt")
    program = build_program(plan, plan.schedule)
    # Mesh 0 forgets to send microbatch 0's activation to mesh 1.
    mesh0 = tuple(i for i in program.meshes[0] if not (isinstance(i, Send) and i.microbatch == 0))
    broken = dataclasses.replace(program, meshes=(mesh0, *program.meshes[1:]))
    start = time.monotonic()
    with pytest.raises(RayRuntimeError, match=r"step 0, mesh \d: TimeoutError: mesh \d: Recv\(.*\) waits for "
                                              r"tensor '.+' from mesh \d; nothing arrived within 2 s"):
        run_ray(plan, steps=1, timeout_s=2.0, program=broken)
    assert time.monotonic() - start < HANG_S
    assert idle_actors() == 0          # a failed run's actors are stopped, not kept for the next

"""A real profile on 8 virtual CPU devices: it runs, writes a valid model, and predicts sanely.

Run in a subprocess: the device count must be set before JAX starts, and other tests
in this process have already started it with one device.
"""

from __future__ import annotations

import pytest

from alpasim.costmodels import COLLECTIVE_KINDS, OP_CLASSES, ProfiledCostModel, get_cluster
from alpasim.graphs import GraphBuilder

# Measures time: `make test` runs these alone, on an idle machine, before the others.
pytestmark = pytest.mark.serial


def test_quick_profile_writes_a_loadable_model(quick_profile):
    printed, path, wall = quick_profile
    model = ProfiledCostModel.load(path, get_cluster("aws-p3.16xlarge", nodes=1))
    assert printed["out"] == str(path) and printed["ops"] == model.to_json()["ops"]
    assert model.meta["num_devices"] == 8 and model.meta["platform"] == "cpu" and model.meta["grid"] == "quick"
    assert set(model.ops) == set(OP_CLASSES)
    assert {k for k, _ in model.collectives} == set(COLLECTIVE_KINDS)
    assert {n for k, n in model.collectives if k == "all_reduce"} == {2, 4, 8}
    # Every class re-timed with only 1, 2 or 4 of the 8 devices busy (collectives from 2).
    scale = model.meta["concurrency_scale"]
    assert set(scale) == {"1", "2", "4"}
    for n, factors in scale.items():
        want = set(OP_CLASSES) | ({"collective"} if n != "1" else set())
        assert set(factors) == want and all(f > 0 for f in factors.values()), (n, factors)
    # One busy device gets at least the cores that eight share: no class is slower alone.
    assert max(scale["1"].values()) < 1.0, scale["1"]
    print(f"quick profile: {wall:.1f} s in all, {model.meta['profile_s']:.1f} s measuring")


def test_profiled_predictions_are_positive_and_grow_with_size(quick_profile):
    _, path, _ = quick_profile
    model = ProfiledCostModel.load(path, get_cluster("aws-p3.16xlarge", nodes=1))
    for kind in ("matmul", "tanh", "softmax", "layer_norm"):
        times = []
        for m in (64, 256, 1024):
            b = GraphBuilder(kind)
            x = b.input("x", (m, 256), "float32")
            if kind == "matmul":
                y = b.einsum("mk,kn->mn", x, b.param("w", (256, 256), "float32"))
            elif kind == "tanh":
                y = b.ew("tanh", x)
            elif kind == "softmax":
                y = b.one("softmax", [x], axis=-1)
            else:
                y = b.one("layer_norm", [x, b.param("g", (256,), "float32"), b.param("c", (256,), "float32")])
            g = b.build([y])
            times.append(model.op_time_s(g.ops[0], g.tensors))
        assert all(t > 0 for t in times) and times == sorted(times) and times[-1] > times[0], (kind, times)
    axes = model.mesh_axes((1, 8))
    for kind in COLLECTIVE_KINDS:
        times = [model.collective_time_s(kind, s, axes) for s in (1e4, 1e6, 1e8)]
        assert all(t > 0 for t in times) and times[-1] > times[0], (kind, times)


def test_a_serial_step_from_measured_times_does_not_add_the_plans_gradient_scatters():
    """A measured backward holds a sharded-gradient plan's scatters already: one shared
    executor runs every instruction in turn, so the step is the sum of the measured
    forward, backward and update times, whatever the plan priced on its stream."""
    import dataclasses

    from alpasim.backends._predict import _serial_step_s
    from alpasim.simulator import synthetic_plan

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    plan = synthetic_plan([0.1, 0.1], [0.2, 0.2], 3, cluster=cluster)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, grad_scatter_s=5.0) for st in plan.stages))
    step = _serial_step_s(plan, [(1.0, 2.0, 0.5), (1.0, 2.0, 0.5)], None, 0.0)
    assert step == pytest.approx(2 * 3 * (1.0 + 2.0) + 2 * 0.5)

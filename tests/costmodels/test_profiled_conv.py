"""Convolutions in the profiled model: a class per conv primitive, fitted and used, and
profiles without them (written before they existed) still load and price convs as matmuls.

Independent answers: the fit is checked on timings made from a known model at the FLOPs
and bytes of real conv ops; pricing against the closed form launch + F s_f + M s_b.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from alpasim.costmodels import (
    OP_CLASSES,
    CollectiveFit,
    CollectiveSample,
    Link,
    OpFit,
    OpSample,
    ProfiledCostModel,
    fit_profile,
    get_cluster,
    op_class,
    traffic_bytes,
)
from alpasim.graphs import Op, Tensor, op_flops

BASE = {"matmul": OpFit(5e-6, 1 / 20e9, 1 / 50e9), "elementwise": OpFit(2e-6, 1 / 5e9, 1 / 10e9),
        "softmax": OpFit(8e-6, 1 / 2e9, 1 / 4e9), "normalization": OpFit(4e-6, 1 / 3e9, 1 / 8e9)}
CONV = {"conv": OpFit(3e-6, 1 / 10e9, 1 / 1e9), "conv_input_grad": OpFit(4e-6, 1 / 2e9, 1 / 1e9),
        "conv_filter_grad": OpFit(6e-6, 1 / 1e9, 1 / 1e9)}
COLLECTIVES = {("all_reduce", 2): CollectiveFit(20e-6, 1 / 8e9)}


@pytest.fixture
def cluster():
    return get_cluster("aws-p3.16xlarge", nodes=1)


def conv_ops(batch: int, image: int, c: int, k: int) -> list[tuple[Op, dict[str, Tensor]]]:
    """conv2d, its input gradient and its filter gradient ('same' padding, C -> C)."""
    x, w = Tensor("x", (batch, image, image, c), "float32"), Tensor("w", (k, k, c, c), "float32", "param")
    dy = Tensor("dy", x.shape, "float32")
    geo = {"strides": (1, 1), "padding": ((k // 2, k // 2), (k // 2, k // 2))}
    out = []
    for prim, ins, y, extra in (("conv2d", [x, w], x, {}), ("conv2d_input_grad", [dy, w], x, {"input_shape": x.shape}),
                                ("conv2d_filter_grad", [x, dy], w, {"filter_shape": w.shape})):
        tensors = {t.name: t for t in ins} | {"y": Tensor("y", y.shape, "float32")}
        out.append((Op(prim, prim, tuple(t.name for t in ins), ("y",), {**geo, **extra}), tensors))
    return out


GRID = [(b, i, c, k) for b, i in ((2, 32), (2, 16), (8, 4), (8, 2)) for c in (8, 32, 128) for k in (1, 3)]


def test_each_conv_primitive_has_its_own_class():
    classes = [op_class(op) for op, _ in conv_ops(2, 8, 16, 3)]
    assert classes == ["conv", "conv_input_grad", "conv_filter_grad"]
    assert set(classes) <= set(OP_CLASSES)


def test_conv_ops_are_priced_by_their_fit_not_the_matmul_one(cluster):
    model = ProfiledCostModel("conv", {**BASE, **CONV}, COLLECTIVES, Link("l", 64.0, 1e-5), cluster)
    for op, tensors in conv_ops(8, 4, 64, 3):
        fit = CONV[op_class(op)]
        f, m = op_flops(op, tensors), traffic_bytes(op, tensors)
        assert model.op_time_s(op, tensors) == pytest.approx(fit.launch_s + f * fit.seconds_per_flop
                                                             + m * fit.seconds_per_byte)
        assert model.op_time_s(op, tensors, num_shards=4) == pytest.approx(fit.time_s(f / 4, m / 4))
        assert model.op_time_s(op, tensors) != pytest.approx(BASE["matmul"].time_s(f, m))


def test_a_profile_without_conv_classes_loads_and_prices_convs_as_matmuls(cluster):
    full = ProfiledCostModel("conv", {**BASE, **CONV}, COLLECTIVES, Link("l", 64.0, 1e-5), cluster)
    data = json.loads(json.dumps(full.to_json()))
    for c in CONV:
        del data["ops"][c]
    old = ProfiledCostModel.from_json(data, cluster)
    assert set(old.ops) == set(BASE) and old.to_json()["ops"] == data["ops"]
    for op, tensors in conv_ops(2, 16, 16, 3):
        f, m = op_flops(op, tensors), traffic_bytes(op, tensors)
        assert old.op_time_s(op, tensors) == pytest.approx(BASE["matmul"].time_s(f, m))


def test_fit_on_synthetic_conv_timings_recovers_the_conv_fits(cluster):
    rng = np.random.default_rng(1)
    samples = [OpSample(c, f, m, fit.time_s(f, m) * rng.uniform(0.97, 1.03))
               for c, fit in BASE.items() for f, m in ((1e5, 1e5), (1e7, 1e6), (1e9, 1e7), (1e6, 1e7), (1e8, 1e8))]
    for shape in GRID:
        for op, tensors in conv_ops(*shape):
            fit = CONV[op_class(op)]
            f, m = op_flops(op, tensors), traffic_bytes(op, tensors)
            samples.append(OpSample(op_class(op), f, m, fit.time_s(f, m) * rng.uniform(0.97, 1.03)))
    colls = [CollectiveSample("all_reduce", 2, s, COLLECTIVES[("all_reduce", 2)].time_s(s)) for s in (1e4, 1e6, 1e8)]
    fitted = fit_profile(samples, colls, cluster)
    for c, want in CONV.items():
        got = fitted.ops[c]
        assert got.launch_s == pytest.approx(want.launch_s, rel=0.3), c
        assert got.seconds_per_flop == pytest.approx(want.seconds_per_flop, rel=0.1), c
        assert got.seconds_per_byte == pytest.approx(want.seconds_per_byte, rel=0.2), c
    # Without conv samples the classes are left out, and the matmul fit prices convs.
    no_conv = fit_profile([s for s in samples if s.op_class not in CONV], colls, cluster)
    assert set(no_conv.ops) == set(BASE)

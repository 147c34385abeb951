"""The profiled cost model: its formulas, JSON round trip, bad files, and the fit.

The independent check of the fit: timings generated from a known model (plus 3%
multiplicative noise) must give back that model's parameters.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from alpasim.costmodels import (
    OP_CLASSES,
    PROFILE_SCHEMA,
    AnalyticCostModel,
    CollectiveFit,
    CollectiveSample,
    CostModel,
    Link,
    MeshAxis,
    OpFit,
    OpSample,
    ProfiledCostModel,
    ProfileFormatError,
    collective_time_s,
    fit_profile,
    get_cluster,
)
from alpasim.graphs import GraphBuilder

KNOWN_OPS = {"matmul": OpFit(5e-6, 1 / 20e9, 1 / 50e9), "elementwise": OpFit(2e-6, 1 / 5e9, 1 / 10e9),
             "softmax": OpFit(8e-6, 1 / 2e9, 1 / 4e9), "normalization": OpFit(4e-6, 1 / 3e9, 1 / 8e9),
             "conv": OpFit(3e-6, 1 / 10e9, 1 / 20e9), "conv_input_grad": OpFit(3e-6, 1 / 4e9, 1 / 8e9),
             "conv_filter_grad": OpFit(3e-6, 1 / 2e9, 1 / 4e9)}
KNOWN_COLLECTIVES = {(k, n): CollectiveFit(20e-6 * n, n / 16e9)
                     for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") for n in (2, 4, 8)}
KNOWN_COLLECTIVES[("send_recv", 2)] = CollectiveFit(50e-6, 1 / 30e9)


@pytest.fixture
def cluster():
    return get_cluster("aws-p3.16xlarge", nodes=2)


@pytest.fixture
def model(cluster) -> ProfiledCostModel:
    return ProfiledCostModel("test", KNOWN_OPS, KNOWN_COLLECTIVES, Link("measured", 64.0, 10e-6), cluster,
                             {"note": "hand-made"})


def matmul_graph(m: int):
    b = GraphBuilder("mm")
    x = b.input("x", (m, 256), "float32")
    y = b.einsum("mk,kn->mn", x, b.param("w", (256, 512), "float32"))
    return b.build([b.ew("tanh", y)])


def test_profiled_model_prices_ops_with_its_fits(model):
    assert isinstance(model, CostModel)
    g = matmul_graph(1024)
    mm, tanh = g.ops[0], g.ops[1]
    flops, nbytes = 2 * 1024 * 256 * 512, 4 * (1024 * 256 + 256 * 512 + 1024 * 512)
    assert model.op_time_s(mm, g.tensors) == pytest.approx(5e-6 + flops / 20e9 + nbytes / 50e9)
    assert model.op_time_s(mm, g.tensors, num_shards=4) == pytest.approx(5e-6 + flops / 4 / 20e9 + nbytes / 4 / 50e9)
    assert model.op_time_s(tanh, g.tensors) > KNOWN_OPS["elementwise"].launch_s
    with pytest.raises(ValueError, match="num_shards"):
        model.op_time_s(mm, g.tensors, num_shards=0)
    analytic = AnalyticCostModel(model.cluster)
    assert model.op_time_s(mm, g.tensors) != pytest.approx(analytic.op_time_s(mm, g.tensors))


def test_scaled_multiplies_each_class_and_the_collectives(model):
    g = matmul_graph(1024)
    mm, tanh = g.ops[0], g.ops[1]
    axes = model.mesh_axes((1, 4))
    half = model.scaled({"matmul": 0.5, "collective": 3.0})
    assert half.op_time_s(mm, g.tensors) == pytest.approx(0.5 * model.op_time_s(mm, g.tensors), rel=1e-12)
    assert half.op_time_s(tanh, g.tensors) == model.op_time_s(tanh, g.tensors)  # not named: unchanged
    assert half.collective_time_s("all_reduce", 1 << 20, axes) == pytest.approx(
        3.0 * model.collective_time_s("all_reduce", 1 << 20, axes), rel=1e-12)
    assert half.digest != model.digest and model.scaled({}).digest == model.digest
    for bad in (0.0, -1.0, "2", True):
        with pytest.raises(ProfileFormatError, match="positive"):
            model.scaled({"matmul": bad})


def test_binding_puts_the_measured_link_inside_nodes(model, cluster):
    assert model.cluster.intra_node == model.link and model.cluster.inter_node == cluster.inter_node
    assert model.device == cluster.device
    inside, across = model.mesh_axes((1, 8))[1], model.mesh_axes((2, 8))[0]
    assert inside.link == model.link and across.link == cluster.inter_node_per_device
    # Measured axis: the fit; the same bytes over the network: the analytic ring.
    assert model.collective_time_s("all_reduce", 1e6, [inside]) == pytest.approx(160e-6 + 1e6 * 8 / 16e9)
    assert model.collective_time_s("all_reduce", 1e6, [across]) == collective_time_s("all_reduce", 1e6, [across])
    assert model.collective_time_s("all_gather", 1e6, [MeshAxis(3, model.link)]) == pytest.approx(
        collective_time_s("all_gather", 1e6, [MeshAxis(3, model.link)]))   # size 3 was never measured
    assert model.collective_time_s("send_recv", 1e6, [MeshAxis(2, model.link)]) == pytest.approx(50e-6 + 1e6 / 30e9)
    assert model.collective_time_s("all_reduce", 0, [inside]) == 0.0
    two = model.collective_time_s("all_reduce", 1e6, [across, inside])
    assert two == pytest.approx(model.collective_time_s("all_reduce", 1e6, [inside])
                                + collective_time_s("all_reduce", 1e6 / 8, [across]))


def test_json_round_trip_and_digest(model, cluster, tmp_path):
    data = json.loads(json.dumps(model.to_json()))
    assert data["schema"] == PROFILE_SCHEMA == "alpasim.costmodel/1"
    back = ProfiledCostModel.from_json(data, cluster)
    assert back == model and back.digest == model.digest and back.meta == model.meta
    path = tmp_path / "profile.json"
    model.save(path)
    assert ProfiledCostModel.load(path, cluster) == model
    # meta is no part of the digest; a parameter is.
    data["meta"] = {"host": "elsewhere"}
    assert ProfiledCostModel.from_json(data, cluster).digest == model.digest
    data["ops"]["matmul"]["launch_s"] *= 2
    assert ProfiledCostModel.from_json(data, cluster).digest != model.digest


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(schema="alpasim.cluster/1"), "field 'schema' must be 'alpasim.costmodel/1'"),
    (lambda d: d["ops"].pop("softmax"), "missing field 'ops.softmax'"),
    (lambda d: d["ops"]["matmul"].pop("launch_s"), "missing field 'ops.matmul.launch_s'"),
    (lambda d: d["ops"]["matmul"].update(seconds_per_flop=-1), "'ops.matmul.seconds_per_flop' must be a finite"),
    (lambda d: d["ops"]["matmul"].update(seconds_per_flop="fast"), "'ops.matmul.seconds_per_flop'"),
    (lambda d: d["collectives"].update(broadcast={}), "'collectives.broadcast' is no collective"),
    (lambda d: d["collectives"]["all_reduce"].update(one={"alpha_s": 0, "seconds_per_byte": 0}),
     "'collectives.all_reduce.one' must be keyed by an axis size"),
    (lambda d: d["link"].update(bandwidth_gbps=0), "field 'link'"),
    (lambda d: d.update(meta=[]), "field 'meta' must be an object"),
])
def test_bad_profiles_name_the_field(model, cluster, edit, message):
    data = json.loads(json.dumps(model.to_json()))
    edit(data)
    with pytest.raises(ProfileFormatError, match=message.replace("(", r"\(")):
        ProfiledCostModel.from_json(data, cluster)


def test_bad_profile_files(cluster, tmp_path):
    with pytest.raises(ProfileFormatError, match="no such file"):
        ProfiledCostModel.load(tmp_path / "missing.json", cluster)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileFormatError, match="not valid JSON"):
        ProfiledCostModel.load(bad, cluster)
    bad.write_text("[1, 2]")
    with pytest.raises(ProfileFormatError, match="top level must be a JSON object"):
        ProfiledCostModel.load(bad, cluster)


def synthetic_samples(noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    jitter = lambda: float(np.exp(rng.normal(0, noise)))  # noqa: E731
    ops = []
    for c, fit in KNOWN_OPS.items():
        for size in np.geomspace(1e4, 1e8, 8):
            for flops_per_byte in (0.25, 1.0, 8.0):   # independent FLOP and byte columns
                flops, nbytes = size * flops_per_byte, size
                ops.append(OpSample(c, flops, nbytes, fit.time_s(flops, nbytes) * jitter()))
    colls = [CollectiveSample(k, n, s, fit.time_s(s) * jitter())
             for (k, n), fit in KNOWN_COLLECTIVES.items() for s in np.geomspace(1e3, 1e8, 6)]
    return ops, colls


def test_fit_recovers_known_parameters(cluster):
    ops, colls = synthetic_samples(noise=0.03)
    fitted = fit_profile(ops, colls, cluster, name="synthetic")
    for c in OP_CLASSES:
        want, got = KNOWN_OPS[c], fitted.ops[c]
        assert got.launch_s == pytest.approx(want.launch_s, rel=0.15), c
        assert got.seconds_per_flop == pytest.approx(want.seconds_per_flop, rel=0.1), c
        assert got.seconds_per_byte == pytest.approx(want.seconds_per_byte, rel=0.1), c
    for key, want in KNOWN_COLLECTIVES.items():
        got = fitted.collectives[key]
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=0.15), key
        assert got.seconds_per_byte == pytest.approx(want.seconds_per_byte, rel=0.1), key
    errors = fitted.meta["rms_relative_error"]       # the link is one ring fit of all kinds: not held here
    assert all(err < 0.06 for key, err in errors.items() if key != "link"), errors
    assert fitted.cluster.intra_node == fitted.link


def test_fit_of_ring_timings_recovers_the_link(cluster):
    """Timings made by the analytic ring formulas on a known link give that link back."""
    link = Link("truth", 40.0, 25e-6)
    colls = [CollectiveSample(k, n, s, collective_time_s(k, s, [MeshAxis(n, link)]))
             for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv") for n in (2, 4, 8)
             if k != "send_recv" or n == 2 for s in np.geomspace(1e3, 1e8, 5)]
    ops, _ = synthetic_samples(noise=0.0)
    fitted = fit_profile(ops, colls, cluster)
    assert fitted.link.bandwidth_gbps == pytest.approx(40.0, rel=1e-3)
    assert fitted.link.latency_s == pytest.approx(25e-6, rel=1e-3)


def test_fit_rejects_too_few_or_bad_samples(cluster):
    ops, colls = synthetic_samples(noise=0.0)
    with pytest.raises(ProfileFormatError, match="op class 'softmax' needs at least 3 samples"):
        fit_profile([s for s in ops if s.op_class != "softmax"], colls, cluster)
    broken = [OpSample(s.op_class, s.flops, s.nbytes, 0.0 if i == 0 else s.time_s) for i, s in enumerate(ops)]
    with pytest.raises(ProfileFormatError, match="positive, finite timings"):
        fit_profile(broken, colls, cluster)

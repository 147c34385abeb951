import subprocess
import sys

import pytest

from alpasim.costmodels import (
    AnalyticCostModel,
    ClusterError,
    CostModel,
    MeshAxis,
    collective_time_s,
    get_cluster,
    mesh_axes,
    op_time_s,
)
from alpasim.graphs import GraphBuilder


def test_analytic_model_implements_the_protocol(p3):
    model = AnalyticCostModel(p3)
    assert isinstance(model, CostModel)
    assert model.device == p3.device and model.cluster == p3
    b = GraphBuilder("mm")
    g = b.build([b.einsum("mk,kn->mn", b.input("x", (512, 1024), "float16"), b.param("w", (1024, 256), "float16"))])
    op = g.ops[0]
    assert model.op_time_s(op, g.tensors) == op_time_s(op, g.tensors, p3.device)
    assert model.op_time_s(op, g.tensors, num_shards=4) == op_time_s(op, g.tensors, p3.device, 4)
    axes = model.mesh_axes((2, 8))
    assert axes == mesh_axes(p3, (2, 8))
    assert model.collective_time_s("all_gather", 1e8, axes) == collective_time_s("all_gather", 1e8, axes)


def test_protocol_accepts_other_models_and_rejects_incomplete_ones(p3):
    class ConstantModel:
        cluster = p3
        device = p3.device

        def op_time_s(self, op, tensors, num_shards=1):
            return 1e-3

        def collective_time_s(self, kind, nbytes, axes):
            return 0.0

    class NoCollectives:
        cluster = p3
        device = p3.device

        def op_time_s(self, op, tensors, num_shards=1):
            return 1e-3

    assert isinstance(ConstantModel(), CostModel)
    assert not isinstance(NoCollectives(), CostModel)


def test_faster_cluster_is_faster():
    slow, fast = AnalyticCostModel(get_cluster("aws-p3.16xlarge")), AnalyticCostModel(get_cluster("dgx-h100"))
    for model_axes in ((2, 8), (16,)):
        t_slow = slow.collective_time_s("all_reduce", 1e9, slow.mesh_axes(model_axes))
        t_fast = fast.collective_time_s("all_reduce", 1e9, fast.mesh_axes(model_axes))
        assert t_fast < t_slow
    assert isinstance(slow.mesh_axes((8,))[0], MeshAxis)


def test_model_is_frozen_and_validated(p3):
    with pytest.raises(ClusterError, match="Cluster"):
        AnalyticCostModel("aws-p3.16xlarge")  # type: ignore[arg-type]
    assert hash(AnalyticCostModel(p3)) == hash(AnalyticCostModel(p3))


def test_costmodels_imports_no_runtime_frameworks():
    code = ("import sys, alpasim.costmodels; "
            "print(sorted(m for m in ('jax', 'simpy', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""Planning with a profiled cost model: other stage times, its own cache entries, recorded in the plan."""

from __future__ import annotations

import pytest

from alpasim.costmodels import CollectiveFit, Link, OpFit, ProfiledCostModel, get_cluster
from alpasim.simulator import simulate
from alpasim.solvers import CostModelRef, DiskCache, PlanOptions, RunOptions, SearchSpace, plan_pipeline

MODEL = "gpt3:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=8"


@pytest.fixture
def profiled() -> ProfiledCostModel:
    """A slow, CPU-like device: every op is far slower than on a V100."""
    ops = {c: OpFit(20e-6, 1 / 20e9, 1 / 10e9) for c in ("matmul", "elementwise", "softmax", "normalization")}
    collectives = {(k, n): CollectiveFit(40e-6 * n, 1e-9) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                                     "all_to_all") for n in (2, 4, 8)}
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    return ProfiledCostModel("cpu-like", ops, collectives, Link("cpu memcpy", 80.0, 20e-6), cluster)


def test_profiled_plan_differs_from_analytic_and_never_shares_cache_entries(profiled, tmp_path):
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=2)
    cache = DiskCache(root=tmp_path)
    analytic = plan_pipeline(MODEL, cluster, SearchSpace(microbatches=2), run=RunOptions(cache=cache))
    measured = plan_pipeline(MODEL, cluster, SearchSpace(microbatches=2), PlanOptions(cost_model=profiled),
                             RunOptions(cache=cache))
    assert measured.search.ilp_solves > 0 and measured.search.cache_hits == 0
    assert measured.search.cost_model == CostModelRef("cpu-like", profiled.digest)
    assert analytic.search.cost_model is None
    # A CPU-like model is orders of magnitude slower than the V100 datasheet.
    assert measured.predicted.iteration_s > 10 * analytic.predicted.iteration_s
    assert measured.cluster.spec["intra_node"] == profiled.link.to_json()
    # Both are served from their own entries the second time.
    again = plan_pipeline(MODEL, cluster, SearchSpace(microbatches=2), run=RunOptions(cache=cache))
    assert again.search.ilp_solves == 0
    assert again.predicted.iteration_s == pytest.approx(analytic.predicted.iteration_s)
    again = plan_pipeline(MODEL, cluster, SearchSpace(microbatches=2), PlanOptions(cost_model=profiled),
                          RunOptions(cache=cache))
    assert again.search.ilp_solves == 0
    assert again.predicted.iteration_s == pytest.approx(measured.predicted.iteration_s)


def test_simulating_a_profiled_plan_uses_the_measured_link(profiled):
    plan = plan_pipeline(MODEL, profiled.cluster, SearchSpace(microbatches=2), PlanOptions(cost_model=profiled))
    timeline = simulate(plan)
    # With one stage the simulated iteration is the plan's; with more, eq. 2 bounds it below.
    assert timeline.iteration_s >= 0.99 * plan.predicted.iteration_s
    assert timeline.iteration_s <= 1.5 * plan.predicted.iteration_s

"""The planner's three input records (`solvers._plan_inputs`): each refuses a bad value
where it is made, before any pricing, and the planner entry takes nothing else."""

from __future__ import annotations

import inspect

import pytest

from alpasim.costmodels import get_cluster
from alpasim.solvers import PlanOptions, RunOptions, SearchSpace, plan_pipeline
from alpasim.solvers._plan_inputs import split_options
from alpasim.solvers._systems import MEGATRON_CORE_BUCKETS


def test_plan_pipeline_takes_a_source_a_cluster_and_three_records():
    params = list(inspect.signature(plan_pipeline).parameters)
    assert params == ["model", "cluster", "space", "options", "run"]


@pytest.mark.parametrize("kw, message", [
    (dict(schedule="gpipe"), "unknown planner schedule 'gpipe'"),
    (dict(chunk_options=(1, 2)), "chunks per mesh must be integers >= 2"),
    (dict(chunk_options=()), "chunks per mesh must be integers >= 2"),
    (dict(chunk_options=(True, 3)), "chunks per mesh must be integers >= 2"),
    (dict(bucket_bytes=0), "gradient bucket must be a finite number of bytes > 0"),
    (dict(bucket_bytes=float("inf")), "gradient bucket must be a finite number"),
    (dict(bucket_bytes="25MB"), "gradient bucket must be a finite number"),
    (dict(recompute="some"), "unknown recompute policy 'some'"),
    (dict(loss_kernel="fast"), "unknown cross-entropy kernel 'fast'"),
    (dict(kernels="xla"), "unknown kernels 'xla'"),
    (dict(epsilon=-0.1), "epsilon must be a finite number >= 0"),
    (dict(epsilon=float("nan")), "epsilon must be a finite number >= 0"),
])
def test_plan_options_refuse_what_cannot_be_priced(kw, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(microbatches=0), "microbatches must be a positive integer or 'auto'"),
    (dict(microbatches="4"), "microbatches must be a positive integer or 'auto'"),
    (dict(max_stages=0), "max_stages must be a positive integer"),
    (dict(microbatch_multiple=True), "microbatch_multiple must be a positive integer"),
    (dict(layers=0), "layers must be a positive integer"),
    (dict(num_stages=2.0), "num_stages must be a positive integer"),
])
def test_a_search_space_refuses_degrees_that_cannot_be(kw, message):
    with pytest.raises(ValueError, match=message):
        SearchSpace(**kw)


def test_records_are_frozen_and_chunks_become_a_tuple():
    options = PlanOptions(chunk_options=[2, 3])
    assert options.chunk_options == (2, 3)
    with pytest.raises(AttributeError):
        options.remat = False                                   # type: ignore[misc]
    assert hash(SearchSpace(microbatches=4)) == hash(SearchSpace(microbatches=4))


def test_system_buckets_are_sized_before_planning():
    """A system's buckets are a rule in the data-parallel degree: the planner takes only
    a size, so an unsized rule is refused before any work."""
    options = PlanOptions(bucket_bytes=MEGATRON_CORE_BUCKETS)
    with pytest.raises(ValueError, match="sized for a data-parallel degree first"):
        plan_pipeline("gpt3-350m", get_cluster("aws-p3.16xlarge", nodes=1), SearchSpace(), options)
    # fp32 accumulators: max(40 M, 1 M x 64) parameters of 4 bytes.
    assert options.at_data_parallel(64, "float16").bucket_bytes == 64e6 * 4


def test_common_options_split_into_the_records():
    cache_marker = object()
    narrowing, options, run = split_options(dict(microbatches=8, pareto=False, remat=False, precision="mixed",
                                                 map_fn=map, progress=print, cache=cache_marker))
    assert narrowing == {"microbatches": 8, "pareto": False}
    assert options == PlanOptions(remat=False, precision="mixed")
    assert run == RunOptions(map_fn=map, cache=cache_marker, progress=print)

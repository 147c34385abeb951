import pytest

from alpasim.costmodels import AnalyticCostModel, Link, get_cluster


@pytest.fixture
def slow_link() -> Link:
    """1 GB/s per direction with 50 us per step (a cross-node network)."""
    return Link("test-slow-1GB/s", 8.0, 5e-5)


@pytest.fixture
def fast_link() -> Link:
    """100 GB/s per direction with 10 us per step (NVLink-like)."""
    return Link("test-fast-100GB/s", 800.0, 1e-5)


@pytest.fixture(scope="session")
def p3():
    """The paper's node (aws-p3.16xlarge) and its analytic cost model."""
    cluster = get_cluster("aws-p3.16xlarge")
    return cluster, AnalyticCostModel(cluster)

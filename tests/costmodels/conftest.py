import pytest

from alpasim.costmodels import Cluster, Device, Link, get_cluster


@pytest.fixture
def link_100gb() -> Link:
    """100 GB/s per direction (800 Gbit/s) with 10 us per step: round numbers for closed forms."""
    return Link("test-100GB/s", 800.0, 1e-5)


@pytest.fixture
def slow_link() -> Link:
    """1 GB/s per direction with 50 us per step."""
    return Link("test-1GB/s", 8.0, 5e-5)


@pytest.fixture
def p3() -> Cluster:
    return get_cluster("aws-p3.16xlarge")


@pytest.fixture
def toy_device() -> Device:
    """100 TFLOP/s half, 10 TFLOP/s fp32, 1 TB/s HBM, 1 GiB."""
    return Device("toy", {"float16": 100e12, "bfloat16": 100e12, "float32": 10e12}, 2**30, 1e12)

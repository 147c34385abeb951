"""Shared builders for the simulator tests: small clusters and synthetic plans."""

from __future__ import annotations

import pytest

from alpasim.costmodels import get_cluster


@pytest.fixture
def two_nodes():
    """2 nodes x 2 V100s with one 25 Gb/s card per node (aws-p3.16xlarge, shrunk)."""
    return get_cluster("aws-p3.16xlarge", nodes=2, devices_per_node=2)

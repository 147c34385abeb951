"""Experiments: the paper's figures and tables in simulation, and what-if sweeps."""

from ._points import DEFAULT_CLUSTER as DEFAULT_CLUSTER
from ._points import Point as Point
from ._points import Result as Result
from ._points import paper_cluster as paper_cluster
from ._points import run_point as run_point
from ._points import run_points as run_points

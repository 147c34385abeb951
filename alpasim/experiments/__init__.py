"""Experiments: the paper's figures and tables in simulation, and what-if sweeps."""

from ._points import DEFAULT_CLUSTER as DEFAULT_CLUSTER
from ._points import Point as Point
from ._points import Result as Result
from ._points import paper_cluster as paper_cluster
from ._points import run_point as run_point
from ._points import run_points as run_points
from ._compare import Comparison as Comparison
from ._compare import compare as compare
from ._compare import method_name as method_name
from ._compare import plan_summary as plan_summary
from ._sweep import AXES as SWEEP_AXES
from ._sweep import SweepReport as SweepReport
from ._sweep import sweep as sweep
from ._sweep import sweep_cluster as sweep_cluster
from ._sweep import sweep_cell as sweep_cell
from ._reproduce import FIGURES as FIGURES
from ._reproduce import Figure as Figure
from ._reproduce import Report as Report
from ._reproduce import figure_points as figure_points
from ._reproduce import point_json as point_json
from ._reproduce import ratio as ratio
from ._reproduce import reproduce as reproduce
from ._reproduce import scaling_efficiency as scaling_efficiency
from ._sweep import value_label as value_label

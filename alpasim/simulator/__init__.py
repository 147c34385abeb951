"""Simulator: pipeline schedules as per-mesh programs, a SimPy engine and timelines."""

from ._engine import plan_cluster as plan_cluster
from ._engine import simulate as simulate
from ._network import FluidNetwork as FluidNetwork
from ._program import Free as Free
from ._program import GradSync as GradSync
from ._program import Program as Program
from ._program import Recv as Recv
from ._program import Run as Run
from ._program import Send as Send
from ._program import StageTransfer as StageTransfer
from ._program import Update as Update
from ._routes import CROSS_MESH_METHODS as CROSS_MESH_METHODS
from ._schedules import SCHEDULES as SCHEDULES
from ._schedules import build_program as build_program
from ._synthetic import synthetic_plan as synthetic_plan
from ._timeline import Event as Event
from ._timeline import MeshInfo as MeshInfo
from ._timeline import Timeline as Timeline
from ._choose import AUTO_SCHEDULES as AUTO_SCHEDULES
from ._choose import choose_schedule as choose_schedule
from ._choose import schedule_options as schedule_options

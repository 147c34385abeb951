"""Backends: JAX semantics of the primitive set, then JAX and Ray execution of programs.

Importing this package imports jax; `import alpasim` alone does not.
"""

from ._lowering import LOWERINGS as LOWERINGS
from ._lowering import LoweringError as LoweringError
from ._lowering import graph_leaves as graph_leaves
from ._lowering import lower_graph as lower_graph
from ._lowering import random_leaves as random_leaves
from ._lowering import top2_gating as top2_gating
from ._lowering import topk_gating as topk_gating
from ._ray_pool import ray_map_fn as ray_map_fn
from ._ray_pool import ray_shutdown as ray_shutdown
from ._profile import host_cluster as host_cluster
from ._profile import profile_backend as profile_backend
from ._stages import microbatch_inputs as microbatch_inputs
from ._stages import partition as partition
from ._executable import lower_stage as lower_stage
from ._executable import stage_inputs as stage_inputs
from ._stage_ops import layer_stash_sum as layer_stash_sum
from ._memory import ProgramMemory as ProgramMemory
from ._memory import per_device_bytes as per_device_bytes
from ._memory import MeasuredMemory as MeasuredMemory
from ._memory import measured_memory as measured_memory
from ._export import plan_shardings as plan_shardings
from ._runtime import RunResult as RunResult
from ._runtime import run_local as run_local
from ._predict import predict_run as predict_run
from ._checks import Reference as Reference
from ._checks import check_numerics as check_numerics
from ._checks import reference_step as reference_step
from ._hlo import compare_collectives as compare_collectives
from ._hlo import hlo_collectives as hlo_collectives
from ._ray_runtime import RayRuntimeError as RayRuntimeError
from ._ray_runtime import idle_actors as idle_actors
from ._ray_runtime import stop_idle_actors as stop_idle_actors
from ._ray_runtime import run_ray as run_ray

"""Backends: JAX semantics of the primitive set, then JAX and Ray execution of programs.

Importing this package imports jax; `import alpasim` alone does not.
"""

from ._lowering import LOWERINGS as LOWERINGS
from ._lowering import LoweringError as LoweringError
from ._lowering import eval_op as eval_op
from ._lowering import graph_leaves as graph_leaves
from ._lowering import lower_graph as lower_graph
from ._lowering import random_leaves as random_leaves
from ._lowering import top2_gating as top2_gating
from ._ray_pool import ray_map_fn as ray_map_fn
from ._ray_pool import ray_shutdown as ray_shutdown

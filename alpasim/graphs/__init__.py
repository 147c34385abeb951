"""Operator graphs: types, primitives, training-graph derivation, model zoo, JAX import."""

from ._autodiff import AdamConfig as AdamConfig
from ._autodiff import training_graph as training_graph
from ._builder import GraphBuilder as GraphBuilder
from ._primitives import DimMap as DimMap
from ._primitives import PrimitiveError as PrimitiveError
from ._primitives import PRIMITIVES as PRIMITIVES
from ._primitives import ELEMENTWISE as ELEMENTWISE
from ._primitives import is_heavy as is_heavy
from ._primitives import op_bytes as op_bytes
from ._primitives import op_dims as op_dims
from ._primitives import op_flops as op_flops
from ._primitives import op_kind as op_kind
from ._primitives import parse_einsum as parse_einsum
from ._primitives import MATMUL_KINDS as MATMUL_KINDS
from ._types import DTYPE_BYTES as DTYPE_BYTES
from ._types import GraphError as GraphError
from ._types import Op as Op
from ._types import OpGraph as OpGraph
from ._types import Tensor as Tensor

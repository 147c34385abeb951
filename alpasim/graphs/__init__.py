"""Operator graphs: types, primitives, training-graph derivation, model zoo, JAX import.

Public surface only; the modules behind it are private. Importing this package does
not import jax; `from_jax` imports it when called.
"""

from ._autodiff import AdamConfig as AdamConfig
from ._autodiff import AutodiffError as AutodiffError
from ._autodiff import VJP_RULES as VJP_RULES
from ._autodiff import is_weight_grad as is_weight_grad
from ._autodiff import weight_grad_params as weight_grad_params
from ._autodiff import training_graph as training_graph
from ._batch import BatchError as BatchError
from ._batch import batch_size as batch_size
from ._batch import mark_batch as mark_batch
from ._batch import resize_batch as resize_batch
from ._build import BuiltGraph as BuiltGraph
from ._source import ModelSource as ModelSource
from ._source import graph_digest as graph_digest
from ._source import model_source as model_source
from ._source import source_from_record as source_from_record
from ._build import build_training_graph as build_training_graph
from ._build import flops_by_kind as flops_by_kind
from ._build import load_forward as load_forward
from ._build import read_graph_file as read_graph_file
from ._build import ops_by_phase as ops_by_phase
from ._builder import GraphBuilder as GraphBuilder
from ._clustering import Clustering as Clustering
from ._clustering import assign_layers as assign_layers
from ._clustering import cluster_ops as cluster_ops
from ._clustering import received_bytes_matrix as received_bytes_matrix
from ._jax_import import from_jax as from_jax
from ._jax_import import values_as_tree as values_as_tree
from ._prims_layout import constant_array as constant_array
from ._prims_layout import constant_params as constant_params
from ._jsonfile import read_json_file as read_json_file
from ._jax_import import training_graph_from_jax as training_graph_from_jax
from ._jax_values import JaxImportError as JaxImportError
from ._precision import DEFAULT_RECIPE as DEFAULT_RECIPE
from ._precision import RECIPES as RECIPES
from ._precision import PrecisionRecipe as PrecisionRecipe
from ._precision import UnknownRecipeError as UnknownRecipeError
from ._precision import get_recipe as get_recipe
from ._primitives import ELEMENTWISE as ELEMENTWISE
from ._primitives import MATMUL_KINDS as MATMUL_KINDS
from ._primitives import PRIMITIVES as PRIMITIVES
from ._primitives import DimMap as DimMap
from ._primitives import PrimitiveError as PrimitiveError
from ._primitives import is_heavy as is_heavy
from ._primitives import op_bytes as op_bytes
from ._primitives import op_dims as op_dims
from ._primitives import op_flops as op_flops
from ._primitives import op_kind as op_kind
from ._primitives import parse_einsum as parse_einsum
from ._resnet import WResNetConfig as WResNetConfig
from ._serialize import GraphFormatError as GraphFormatError
from ._slicing import stage_graph as stage_graph
from ._serialize import graph_from_json as graph_from_json
from ._serialize import graph_to_json as graph_to_json
from ._serialize import load_graph as load_graph
from ._serialize import save_graph as save_graph
from ._transformer import GPTConfig as GPTConfig
from ._transformer import MoEConfig as MoEConfig
from ._types import DTYPE_BYTES as DTYPE_BYTES
from ._types import GraphError as GraphError
from ._types import Op as Op
from ._types import OpGraph as OpGraph
from ._types import Tensor as Tensor
from ._zoo import PAPER_GPUS as PAPER_GPUS
from ._zoo import ZOO as ZOO
from ._zoo import ModelSpecError as ModelSpecError
from ._zoo import UnknownModelError as UnknownModelError
from ._zoo import forward_graph as forward_graph
from ._zoo import model_from_json as model_from_json
from ._zoo import model_names as model_names
from ._zoo import model_to_json as model_to_json
from ._zoo import resolve_model as resolve_model


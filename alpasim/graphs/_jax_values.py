"""Values of the JAX importer: the error type, dtype names and constant splats."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._types import DTYPE_BYTES

class JaxImportError(ValueError):
    """A JAX function that alpasim's primitive set cannot express."""


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPE_BYTES:
        raise JaxImportError(f"dtype {name} has no alpasim equivalent; expected one of {sorted(DTYPE_BYTES)}")
    return name


# ------------------------------------------------------------------ values
@dataclass(frozen=True, slots=True)
class Splat:
    """A constant array of `shape` whose elements all equal `value` (a Python scalar)."""

    value: bool | int | float
    shape: tuple[int, ...]
    dtype: str

    def cast(self, dtype: str) -> Splat:
        return Splat(py_scalar(self.value, dtype), self.shape, dtype)


def py_scalar(value: Any, dtype: str) -> bool | int | float:
    """`value` as the Python scalar a `dtype` element holds (floats rounded to float32)."""
    if dtype == "bool":
        return bool(value)
    if dtype.startswith("int"):
        return int(value)
    return float(np.float32(value))


@dataclass(frozen=True, slots=True, eq=False)
class Random:
    """A value computed from PRNG keys and constants only (dropout's key, its random
    bits, the mask compared from them). It becomes a graph *input* of its shape where a
    graph op first reads it (`_Importer.materialize`): the mask is data of the step,
    drawn by whoever feeds the batch, and the backward reuses it as the forward's."""

    shape: tuple[int, ...]
    dtype: str


Value = str | Splat | Random  # a tensor name, a splat, or a random value

FOLD: dict[str, Callable[..., Any]] = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt,
    "logistic": lambda x: 1.0 / (1.0 + np.exp(-x)), "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "square": np.square, "abs": np.abs, "sign": np.sign, "sin": np.sin, "cos": np.cos, "erf": math.erf,
    "reciprocal": lambda x: 1.0 / x, "not": np.logical_not, "identity": lambda x: x,
    "stop_gradient": lambda x: x,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "max": np.maximum, "min": np.minimum, "gt": np.greater, "ge": np.greater_equal, "lt": np.less,
    "le": np.less_equal, "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "select": lambda p, t, f: t if p else f,
}

"""Mixed-precision recipes: which dtype each kind of training state is kept in.

A recipe is what frameworks call their precision policy. Per parameter element, with
Adam:

    recipe          weights  gradient accumulator  fp32 master  Adam m, v   bytes
    mixed-fp32grad  16-bit   fp32                  yes          fp32        2+4+4+8 = 18
    mixed           16-bit   16-bit                yes          fp32        2+2+4+8 = 16
    fp32            fp32     fp32                  no           fp32        4+4+8   = 16

`mixed-fp32grad` is Megatron-LM's default (`main_grad` accumulated in fp32; its
theoretical-memory formula counts 18 B/param without the distributed optimizer); `mixed`
is the ZeRO paper's accounting (16 B/param, "2 + 2 + K" with K = 12); `fp32` trains in
single precision. Under `mixed` the microbatch gradients are summed in half precision,
which loses digits as the microbatch count grows; the default is therefore
`mixed-fp32grad`. The 16-bit dtype is the model's own (float16 or bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._prims_nn import LOSS_LOGITS

HALF = frozenset({"float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class PrecisionRecipe:
    """How a training step keeps its weights, gradients and optimizer states."""

    name: str
    weights: str            # "model" (the model's dtype) or "float32"
    grad_accum: str         # "float32" or "weights" (the weights' dtype)

    def weight_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.weights == "model" else self.weights

    def grad_dtype(self, weight_dtype: str) -> str:
        return weight_dtype if self.grad_accum == "weights" else self.grad_accum

    def bytes_per_param(self, model_dtype: str = "float16") -> int:
        """Weights + gradient accumulator + (master) + Adam m and v, per element."""
        from ._types import DTYPE_BYTES

        w = self.weight_dtype(model_dtype)
        master = 4 if w in HALF else 0
        return DTYPE_BYTES[w] + DTYPE_BYTES[self.grad_dtype(w)] + master + 8

    def to_json(self) -> dict:
        return {"recipe": self.name, "weights": self.weights, "grad_accum": self.grad_accum}


RECIPES: dict[str, PrecisionRecipe] = {
    "mixed-fp32grad": PrecisionRecipe("mixed-fp32grad", "model", "float32"),
    "mixed": PrecisionRecipe("mixed", "model", "weights"),
    "fp32": PrecisionRecipe("fp32", "float32", "float32"),
}
DEFAULT_RECIPE = "mixed-fp32grad"


class UnknownRecipeError(ValueError):
    """A `--precision` name that is not a recipe."""


def get_recipe(name: str | PrecisionRecipe | None) -> PrecisionRecipe:
    if isinstance(name, PrecisionRecipe):
        return name
    key = DEFAULT_RECIPE if name is None else name
    if key not in RECIPES:
        raise UnknownRecipeError(f"unknown precision recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[key]


# How the loss kernel runs: "fused" (one pass over the logits each way, as XLA fuses a
# log-softmax) or "unfused-fp32" (Megatron-LM's vocab-parallel cross-entropy on
# `logits.float()`: a cast, max, subtract, exp, sum and divide, each its own PyTorch
# kernel, the softmax kept in fp32 for the backward; `costmodels._compute.loss_bytes`).
LOSS_KERNELS = ("fused", "unfused-fp32")


def with_loss_kernel(graph, kernel: str):
    """`graph` with its cross-entropy ops marked to run as `kernel` (op param `kernel`;
    absent: fused). Only pricing reads it: the values computed are the same."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"unknown loss kernel {kernel!r}; choose one of {', '.join(LOSS_KERNELS)}")
    if kernel == "fused" or not any(op.prim in LOSS_LOGITS for op in graph.ops):
        return graph
    return graph.replace(ops=[op.replace(params={**op.attrs, "kernel": kernel}) if op.prim in LOSS_LOGITS else op
                              for op in graph.ops])

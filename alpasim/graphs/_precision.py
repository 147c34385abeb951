"""Mixed-precision recipes: which dtype each kind of training state is kept in.

A recipe is what frameworks call their precision policy. Per parameter element, with
Adam:

    recipe          weights  gradient accumulator  fp32 master  Adam m, v   bytes
    mixed-fp32grad  16-bit   fp32                  yes          fp32        2+4+4+8 = 18
    mixed           16-bit   16-bit                yes          fp32        2+2+4+8 = 16
    fp32            fp32     fp32                  no           fp32        4+4+8   = 16

    deepspeed-bf16  16-bit   fp32 (+ 16-bit grad)  yes          fp32        2+4+2+4+8 = 20

`mixed-fp32grad` is Megatron-LM's default (`main_grad` accumulated in fp32; its
theoretical-memory formula counts 18 B/param without the distributed optimizer); `mixed`
is the ZeRO paper's accounting (16 B/param, "2 + 2 + K" with K = 12); `fp32` trains in
single precision. Under `mixed` the microbatch gradients are summed in half precision,
which loses digits as the microbatch count grows; the default is therefore
`mixed-fp32grad`. The 16-bit dtype is the model's own (float16 or bfloat16).

`deepspeed-bf16` is DeepSpeed's `BF16_Optimizer` (deepspeed/runtime/bf16_optimizer.py,
chosen by a config's `"bf16": {"enabled": true}` at ZeRO stage 0; BLOOM-176B trained
with it, bigscience tr11 README, "Deepspeed config"). The backward writes each
microbatch's gradients in the weights' dtype (`lp.grad`, kept until the next backward
starts: 2 more bytes a parameter); after it, `update_hp_grads` casts each one to fp32 and
adds it into the fp32 accumulator, `hp_grad.add_(lp.grad.to(fp32))`, a pass of its own
over every gradient (`accumulation` "after-backward": the cast reads 2 bytes and writes
4, the add reads 8 and writes 4, `costmodels._compute`). The accumulator is kept whole
and all-reduced over data parallelism (`PipelineEngine._bf16_reduce_grads`,
`buffered_allreduce_fallback`: "It doesn't shard the static fp32 buffer it reuses",
the README) even though each rank steps only its slice of the states and all-gathers
the updated 16-bit weights (`update_lp_params`): `reduce_whole`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._prims_nn import LOSS_LOGITS

HALF = frozenset({"float16", "bfloat16"})
ACCUMULATIONS = ("in-backward", "after-backward")


@dataclass(frozen=True, slots=True)
class PrecisionRecipe:
    """How a training step keeps its weights, gradients and optimizer states."""

    name: str
    weights: str            # "model" (the model's dtype) or "float32"
    grad_accum: str         # "float32" or "weights" (the weights' dtype)
    # "in-backward": each gradient cast into the accumulator as the backward completes
    # it (Megatron's main_grad); "after-backward": written in the weights' dtype, kept,
    # and cast and added into the accumulator by a pass after the backward (module doc).
    accumulation: str = "in-backward"
    reduce_whole: bool = False      # the accumulator all-reduced whole over dp (module doc)

    def __post_init__(self) -> None:
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"recipe {self.name}: accumulation must be one of {', '.join(ACCUMULATIONS)}, "
                             f"got {self.accumulation!r}")

    @property
    def keeps_low_precision_grads(self) -> bool:
        """The backward's 16-bit gradients are kept beside the accumulator."""
        return self.accumulation == "after-backward"

    def weight_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.weights == "model" else self.weights

    def grad_dtype(self, weight_dtype: str) -> str:
        return weight_dtype if self.grad_accum == "weights" else self.grad_accum

    def bytes_per_param(self, model_dtype: str = "float16") -> int:
        """Weights + gradient (`grad_bytes`) + (master) + Adam m and v, per element."""
        from ._types import DTYPE_BYTES

        w = self.weight_dtype(model_dtype)
        master = 4 if w in HALF else 0
        return DTYPE_BYTES[w] + self.grad_bytes(w) + master + 8

    def grad_bytes(self, weight_dtype: str) -> int:
        """A parameter's gradient bytes: the accumulator, and the 16-bit gradient kept
        beside it where the recipe keeps one."""
        from ._types import DTYPE_BYTES

        kept = DTYPE_BYTES[weight_dtype] if self.keeps_low_precision_grads else 0
        return DTYPE_BYTES[self.grad_dtype(weight_dtype)] + kept

    def to_json(self) -> dict:
        return {"recipe": self.name, "weights": self.weights, "grad_accum": self.grad_accum,
                "accumulation": self.accumulation, "reduce_whole": self.reduce_whole}


RECIPES: dict[str, PrecisionRecipe] = {
    "mixed-fp32grad": PrecisionRecipe("mixed-fp32grad", "model", "float32"),
    "mixed": PrecisionRecipe("mixed", "model", "weights"),
    "fp32": PrecisionRecipe("fp32", "float32", "float32"),
    "deepspeed-bf16": PrecisionRecipe("deepspeed-bf16", "model", "float32", accumulation="after-backward",
                                      reduce_whole=True),
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

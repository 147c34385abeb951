"""The numerical check of a distributed step: loss and every gradient against one device.

`reference_step` evaluates the planner's microbatch forward graph whole, on one
device, with `jax.value_and_grad`, for each microbatch of the step, and averages: the
same graph, parameters (`random_leaves(graph, seed)`) and data
(`microbatch_inputs`) the distributed run uses, so any difference is the
distribution's — shardings, collectives, the pipeline's transfers and gradient
accumulation. (For GPT and MoE this average is also the full-batch gradient: samples
do not interact. Wide-ResNet's batch norm uses each microbatch's statistics, as
pipelined training does.)

Tolerances (`check_numerics`), for float32 models: the distributed step computes the
same sums in another order — partial sums of sharded contractions all-reduced, B
microbatch gradients accumulated — so each value differs by rounding only,
O(sqrt(n)) ulps for a sum of n terms (float32 eps = 1.2e-7; n <= 1e4 here). We allow
1e-5 relative on the loss and 1e-4 on each gradient's norm-wise relative error
||g - g_ref|| / ||g_ref||: two orders above that noise, far below a real bug (a wrong
layout, a lost microbatch or a missing all-reduce moves gradients by O(1)). Norm-wise,
not element-wise, because elements that are zero up to rounding would make an
element-wise relative error meaningless; for the same reason a parameter's error is
measured against at least `GRAD_NORM_FLOOR` of the largest gradient norm. Half-precision models get 1e-2 and 5e-2
(eps 1e-3 for float16, 8e-3 for bfloat16, with float32 softmax, norms and loss).

Some graphs amplify rounding far beyond that: a deep randomly initialised ResNet with
batch norm over a few samples per channel moves its gradients by ~1% when its
parameters move by one ulp. So `reference_step` also measures the graph's own noise
(the same step with parameters perturbed by one ulp of their dtype) and the tolerances are
the larger of the fixed ones and `NOISE_FACTOR` times that noise: in float32 the
distributed step may be as far from the reference as ten ulp-sized perturbations
would move it. In half precision the probe perturbs by a half-precision ulp and the
factor is `HALF_NOISE_FACTOR` (3): before, a float32-ulp probe rounded away in float16
parameters, measured no noise, and the fixed 5e-2 flagged a correct float16 GPT step
(5.08e-2) as a mismatch. The price is a looser check in half precision — 0.20
relative on the README's float16 GPT — which still fails doubled (summed) gradients
and lost ones, but not an error of a few percent.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from alpasim.graphs import OpGraph
from alpasim.solvers import PipelinePlan, planning_graph

from ._lowering import lower_graph, random_leaves
from ._stages import microbatch_inputs

FP32_LOSS_RTOL, FP32_GRAD_RTOL = 1e-5, 1e-4
HALF_LOSS_RTOL, HALF_GRAD_RTOL = 1e-2, 5e-2
HALF = ("float16", "bfloat16")
# A gradient smaller than this fraction of the largest one is measured against that
# floor: its rounding comes from terms as large as the big gradients' (GPT's key bias
# has a mathematically zero gradient, ~1e-11, and an error of the same size).
GRAD_NORM_FLOOR = 1e-3


# The rounding-noise probe: parameters scaled by (1 + ulp * N(0, 1)), one ulp of their
# own dtype (a float32 ulp would round away in a float16 parameter), and the step run
# again; a distributed step may differ from the reference by NOISE_FACTOR times as
# much as the reference differs from itself.
NOISE_FACTOR = 10.0
# A half-precision ulp is ~8000 float32 ulps: one such perturbation is already the size
# of the rounding every parameter read carries, so a few of them bound the distribution's
# reordering (measured: the README's GPT in float16 on one 4x2 mesh differs from the
# reference by 0.8 of its one-ulp noise, 5.5e-2 against 6.7e-2).
HALF_NOISE_FACTOR = 3.0
# The probe is drawn this many times and the largest deviation kept: one draw can miss
# a graph's worst conditioning by far (the backend tests' Wide-ResNet with 2
# microbatches, max-pools after batch norm, passed or failed its check on the draw).
NOISE_SAMPLES = 4


def _ulp(v: np.ndarray) -> float:
    """Relative size of one unit in the last place of `v`'s float dtype."""
    return float(jax.dtypes.finfo(v.dtype).eps)


@dataclass(frozen=True)
class Reference:
    """Single-device loss and gradients (graph parameter name -> array) of one step, and
    how far one ulp of parameter noise moves them (the graph's conditioning)."""

    loss: float
    grads: dict[str, np.ndarray]
    half_precision: bool
    noise_loss_err: float = 0.0
    noise_grad_err: float = 0.0


def reference_step(plan_or_graph: PipelinePlan | OpGraph, *, seed: int = 0, microbatches: int | None = None,
                   step: int = 0) -> Reference:
    """Mean over the step's microbatches of the whole graph's loss and gradients on
    `jax.devices()[0]` (a plan gives its graph and microbatch count)."""
    if isinstance(plan_or_graph, PipelinePlan):
        graph = planning_graph(plan_or_graph.model)
        microbatches = microbatches or plan_or_graph.microbatches
    else:
        graph, microbatches = plan_or_graph, microbatches or 1
    (loss,) = graph.outputs
    forward = lower_graph(graph, [loss])
    leaves = random_leaves(graph, seed)
    params = {p.name: leaves[p.name] for p in graph.params if p.is_float}
    step_fn = jax.jit(jax.value_and_grad(lambda p, d: forward({**d, **p})[loss]))
    device = jax.devices()[0]

    def mean_step(values: dict) -> tuple[float, dict[str, np.ndarray]]:
        values = jax.device_put(values, device)
        total, grads = 0.0, {p: np.zeros(v.shape, np.float64) for p, v in values.items()}
        for m in range(microbatches):
            value, g = step_fn(values, jax.device_put(microbatch_inputs(graph, seed, step, m), device))
            total += float(value)
            for p in grads:
                grads[p] += np.asarray(g[p], np.float64)
        return total / microbatches, {p: g / microbatches for p, g in grads.items()}

    value, grads = mean_step(params)
    rng = np.random.default_rng(seed + 1)
    loss_noise = grad_noise = 0.0
    for _ in range(NOISE_SAMPLES):
        noisy = {p: (v * (1 + _ulp(v) * rng.standard_normal(v.shape))).astype(v.dtype) for p, v in params.items()}
        noisy_value, noisy_grads = mean_step(noisy)
        loss_noise = max(loss_noise, abs(noisy_value - value))
        grad_noise = max(grad_noise, _max_rel_err(noisy_grads, grads)[0])
    half = any(p.dtype in HALF for p in graph.params)
    return Reference(value, grads, half, loss_noise, grad_noise)


def _max_rel_err(grads: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str | None]:
    """Worst ||g - want|| / max(||want||, floor) over parameters, and which one."""
    norms = {p: float(np.linalg.norm(g)) for p, g in want.items()}
    floor = GRAD_NORM_FLOOR * max(norms.values(), default=0.0) or np.finfo(np.float32).tiny
    errs = {p: float(np.linalg.norm(np.asarray(grads[p], np.float64) - w)) / max(norms[p], floor)
            for p, w in want.items() if p in grads}
    worst = max(errs, key=errs.get, default=None)
    return (errs[worst] if worst else 0.0), worst


def check_numerics(loss: float, grads: dict[str, np.ndarray], reference: Reference) -> dict:
    """max_abs_loss_err, max_rel_grad_err (norm-wise, worst parameter), numerics_ok and
    the tolerances used (module doc). A parameter missing from `grads` fails."""
    loss_rtol, grad_rtol = (HALF_LOSS_RTOL, HALF_GRAD_RTOL) if reference.half_precision else \
        (FP32_LOSS_RTOL, FP32_GRAD_RTOL)
    loss_err = abs(loss - reference.loss)
    missing = sorted(set(reference.grads) - set(grads))
    rel, worst = _max_rel_err(grads, reference.grads)
    factor = HALF_NOISE_FACTOR if reference.half_precision else NOISE_FACTOR
    loss_tol = max(loss_rtol * max(1.0, abs(reference.loss)), factor * reference.noise_loss_err)
    grad_tol = max(grad_rtol, factor * reference.noise_grad_err)
    ok = not missing and loss_err <= loss_tol and rel <= grad_tol
    return {"numerics_ok": bool(ok), "max_abs_loss_err": loss_err, "max_rel_grad_err": rel,
            "worst_param": worst, "missing_grads": missing, "loss": loss, "reference_loss": reference.loss,
            "loss_tol": loss_tol, "grad_tol": grad_tol, "noise_loss_err": reference.noise_loss_err,
            "noise_grad_err": reference.noise_grad_err}

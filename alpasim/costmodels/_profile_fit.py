"""Fitting a `ProfiledCostModel` from timings: weighted non-negative least squares.

The backend's microbenchmarks (`alpasim.backends.profile_backend`) produce samples;
this module turns them into parameters and knows nothing of JAX, so the fit can be
checked on synthetic timings from a known model.

Every fit minimises the *relative* error, sum_i ((model_i - t_i) / t_i)^2: timings
span four orders of magnitude and an absolute fit would ignore the small kernels,
which are most of a training step's op count. Coefficients are constrained >= 0
(`scipy.optimize.nnls`; a negative launch time or bandwidth means noise, not
physics) and columns are scaled to unit norm first so FLOPs (1e9) and the constant
column (1) are solved on equal terms.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._collectives import COLLECTIVE_KINDS
from ._hardware import Cluster, Link
from ._profiled import FALLBACK_CLASS, OP_CLASSES, CollectiveFit, OpFit, ProfiledCostModel, ProfileFormatError

# Ring passes per (n - 1) steps: an all-reduce is a reduce-scatter plus an all-gather.
RING_PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
# A fitted link that shows no per-byte cost at all still needs a finite bandwidth.
MAX_LINK_GBPS = 1e6


@dataclass(frozen=True, slots=True)
class OpSample:
    """One timed op shard: its class, per-shard FLOPs and traffic bytes, seconds."""

    op_class: str
    flops: float
    nbytes: float
    time_s: float


@dataclass(frozen=True, slots=True)
class CollectiveSample:
    """One timed collective: kind, mesh-axis size, bytes (`_collectives` conventions), seconds."""

    kind: str
    axis_size: int
    nbytes: float
    time_s: float


def relative_nnls(columns: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, float]:
    """(coefficients >= 0, RMS relative error) of times ~ columns @ coefficients."""
    a = columns / times[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    from scipy.optimize import nnls    # 0.2 s to import; only a profile's fit needs it

    x, _ = nnls(a / norms, np.ones(len(times)))
    coef = x / norms
    rel = columns @ coef / times - 1.0
    return coef, float(np.sqrt(np.mean(rel ** 2)))


def _check_times(samples: Sequence[Any], what: str) -> np.ndarray:
    times = np.array([s.time_s for s in samples], dtype=float)
    if not len(times) or not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ProfileFormatError(f"fit: {what} needs positive, finite timings, got {times.tolist()}")
    return times


def fit_ops(samples: Iterable[OpSample]) -> tuple[dict[str, OpFit], dict[str, float]]:
    """Per class: (launch_s, seconds_per_flop, seconds_per_byte) and the RMS relative error.

    A class of `FALLBACK_CLASS` without samples is left out (its fallback prices it)."""
    by_class: dict[str, list[OpSample]] = {}
    for s in samples:
        by_class.setdefault(s.op_class, []).append(s)
    fits, errors = {}, {}
    for c in OP_CLASSES:
        rows = by_class.get(c, [])
        if not rows and c in FALLBACK_CLASS:
            continue
        if len(rows) < 3:
            raise ProfileFormatError(f"fit: op class {c!r} needs at least 3 samples, got {len(rows)}")
        times = _check_times(rows, f"op class {c!r}")
        cols = np.array([[1.0, s.flops, s.nbytes] for s in rows])
        coef, errors[c] = relative_nnls(cols, times)
        fits[c] = OpFit(*map(float, coef))
    return fits, errors


def fit_collectives(samples: Iterable[CollectiveSample]
                    ) -> tuple[dict[tuple[str, int], CollectiveFit], dict[str, float]]:
    """Per (kind, axis size) with two or more sizes: alpha_s + S * seconds_per_byte, and errors."""
    groups: dict[tuple[str, int], list[CollectiveSample]] = {}
    for s in samples:
        if s.kind not in COLLECTIVE_KINDS:
            raise ProfileFormatError(f"fit: unknown collective {s.kind!r}")
        groups.setdefault((s.kind, s.axis_size), []).append(s)
    fits, errors = {}, {}
    for key, rows in sorted(groups.items()):
        if len({s.nbytes for s in rows}) < 2:
            continue  # one size cannot separate alpha from beta
        times = _check_times(rows, f"collective {key}")
        coef, err = relative_nnls(np.array([[1.0, s.nbytes] for s in rows]), times)
        fits[key] = CollectiveFit(float(coef[0]), float(coef[1]))
        errors[f"{key[0]}@{key[1]}"] = err
    return fits, errors


def fit_link(samples: Sequence[CollectiveSample], name: str) -> tuple[Link, float]:
    """One Link (latency, bandwidth) that best explains every sample with the ring formulas."""
    rows = []
    for s in samples:
        if s.kind == "send_recv":
            rows.append([1.0, s.nbytes])
        else:
            k = RING_PASSES[s.kind] * (s.axis_size - 1)
            rows.append([k, k / s.axis_size * s.nbytes])
    times = _check_times(samples, "the link fit")
    (latency, seconds_per_byte), err = relative_nnls(np.array(rows), times)
    gbps = MAX_LINK_GBPS if seconds_per_byte <= 0 else min(8.0 / (seconds_per_byte * 1e9), MAX_LINK_GBPS)
    return Link(name, gbps, float(latency)), err


def fit_profile(op_samples: Sequence[OpSample], collective_samples: Sequence[CollectiveSample], cluster: Cluster,
                *, name: str = "profiled", meta: Mapping[str, Any] | None = None) -> ProfiledCostModel:
    """A `ProfiledCostModel` bound to `cluster`; `meta` gains the fit's RMS relative errors."""
    ops, op_err = fit_ops(op_samples)
    collectives, coll_err = fit_collectives(collective_samples)
    link, link_err = fit_link(list(collective_samples), f"{name} (fitted)")
    fit_errors = {**{f"op:{k}": v for k, v in op_err.items()}, **{f"collective:{k}": v for k, v in coll_err.items()},
                  "link": link_err}
    info = {**dict(meta or {}), "samples": len(op_samples) + len(collective_samples),
            "rms_relative_error": {k: round(v, 4) for k, v in fit_errors.items() if math.isfinite(v)}}
    return ProfiledCostModel(name, ops, collectives, link, cluster, info)

"""`ProfiledCostModel`: the `CostModel` interface with parameters fitted from timings.

`alpasim profile` (in `alpasim.backends`) times primitives and collectives on the
current JAX backend and fits the parameters below (`fit_profile`); this module holds
them, prices ops and collectives with them, and round-trips them through JSON
(schema ``alpasim.costmodel/1``). Planning and simulation take the model instead of
`AnalyticCostModel`.

Compute, per primitive class (`OP_CLASSES`: matmul, elementwise, softmax,
normalization, conv, conv_input_grad, conv_filter_grad), per shard of an op split
`num_shards` ways:

    time = launch_s + F * seconds_per_flop + M * seconds_per_byte

F and M are the FLOPs and traffic bytes the analytic roofline uses (`op_flops`,
`traffic_bytes`), so both models classify ops identically. The sum (instead of the
roofline's max) is what a least-squares fit can find, and on CPUs, where a matmul's
loads do not fully hide behind its arithmetic, it is also the better form. The
analytic model's efficiency curve eff(F) = MAX * F / (F + F_half) turns into exactly
this shape (a fixed cost plus F / (MAX * peak)); small-matmul inefficiency therefore
lands in `launch_s`. Views (reshape) cost nothing, as in the analytic model.

Convolutions have three classes of their own, one per primitive: conv (conv2d),
conv_input_grad and conv_filter_grad. On XLA:CPU they are different algorithms: the
forward conv runs at about the einsum rate, while the gradients (the transposed
convolutions `jax.vjp` produces, with the batch or the output features as the
contracted dimension) run 3-50x slower per FLOP at the 8-128 channels of a small
Wide-ResNet shard; one fit over all three would be off by that much. These classes
are optional: a profile written before them prices convs at the matmul fit
(`FALLBACK_CLASS`).

Collectives, per kind and mesh-axis size n measured: alpha_s + S * seconds_per_byte,
with S in the collective conventions of `_collectives` (gathered tensor for all-gather,
full tensor for reduce-scatter, one device's buffer for all-to-all). Several axes are
summed hierarchically exactly as in `_collectives.collective_time_s`. An axis whose
size was not measured, or whose link is not the profiled one (an inter-node axis: a
profile of one host knows nothing of its network), uses the ring formulas on its link.

`link` is one effective Link fitted to every collective sample with the ring
formulas. Binding the model to a cluster puts it in place of the cluster's intra-node
link, so that everything that prices communication from links (the solvers' meshes,
the simulator's cross-mesh transfers) sees the measured fabric too. A profile thus
describes one node's devices: bind it to a cluster of such nodes.

Ignored: dtype (the profile times float32; half precision on a GPU would need its own
profile), fusion across ops (the fits come from ops timed one by one, so an op's fit
is priced whole even where the analytic model charges it inside a fused kernel; a
profile that timed fused chains could price them: with fusion applied to these fits,
`alpasim run`'s profiled prediction of a 4-layer GPT on the 8 CPU devices fell from
within the 0.25-1.5 band of the measured step to 0.19-0.24), and per-call dispatch of
a whole stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpasim.graphs import Op, Tensor, op_flops, op_kind

from ._collectives import COLLECTIVE_KINDS, MeshAxis, _check_bytes, collective_time_s, mesh_axes
from ._compute import check_shards, traffic_bytes
from ._fusion import VIEW_PRIMS, OpAccess
from ._hardware import Cluster, Device, Link

PROFILE_SCHEMA = "alpasim.costmodel/1"
OP_CLASSES = ("matmul", "elementwise", "softmax", "normalization", "conv", "conv_input_grad", "conv_filter_grad")
# Classes a profile may lack (older profiles), and the class that prices them then.
FALLBACK_CLASS = {"conv": "matmul", "conv_input_grad": "matmul", "conv_filter_grad": "matmul"}
# The three convolutions are three algorithms on XLA:CPU (module doc), one class each.
_CLASS_OF_PRIM = {"conv2d": "conv", "conv2d_input_grad": "conv_input_grad", "conv2d_filter_grad": "conv_filter_grad"}
REQUIRED_OP_CLASSES = tuple(c for c in OP_CLASSES if c not in FALLBACK_CLASS)
# Primitive kinds (`alpasim.graphs.op_kind`) priced by each class; every other kind
# (elementwise, layout, embedding, optimizer, gating) is streaming work priced as
# "elementwise". Softmax and norms are apart because at equal bytes a softmax (exp and
# two passes) takes 2-3x a layer norm on the CPU; reductions and pooling are one pass
# with a reduction, like a norm.
_CLASS_OF_KIND = {"einsum": "matmul", "attention": "matmul", "conv": "conv", "softmax": "softmax", "loss": "softmax",
                  "normalization": "normalization", "reduction": "normalization", "pooling": "normalization"}


class ProfileFormatError(ValueError):
    """A cost-model profile that is not valid JSON, has the wrong schema or a bad field."""


def op_class(op: Op) -> str:
    """The `OP_CLASSES` entry that prices `op`."""
    return _CLASS_OF_PRIM.get(op.prim) or _CLASS_OF_KIND.get(op_kind(op), "elementwise")


@dataclass(frozen=True, slots=True)
class OpFit:
    """time = launch_s + flops * seconds_per_flop + bytes * seconds_per_byte (one shard)."""

    launch_s: float
    seconds_per_flop: float
    seconds_per_byte: float

    def time_s(self, flops: float, nbytes: float) -> float:
        return self.launch_s + flops * self.seconds_per_flop + nbytes * self.seconds_per_byte


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """time = alpha_s + nbytes * seconds_per_byte, for one collective kind on one axis size."""

    alpha_s: float
    seconds_per_byte: float

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.seconds_per_byte


@dataclass(frozen=True, slots=True)
class ProfiledCostModel:
    """Fitted compute and collective costs (module doc), bound to a `cluster`.

    `ops` maps each of `OP_CLASSES` to its `OpFit` (those of `FALLBACK_CLASS` may be
    missing: the fallback class prices them); `collectives` maps (kind, axis
    size) to a `CollectiveFit`; `link` is the effective fitted link. The bound
    `cluster` is the given one with `intra_node` replaced by `link`. `meta` (where and
    how it was measured) is carried along but is no part of the model's `digest`.
    """

    name: str
    ops: Mapping[str, OpFit]
    collectives: Mapping[tuple[str, int], CollectiveFit]
    link: Link
    cluster: Cluster
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        missing = [c for c in REQUIRED_OP_CLASSES if c not in self.ops]
        if missing:
            raise ProfileFormatError(f"profile {self.name!r}: no fit for op class {missing[0]!r}")
        for kind, n in self.collectives:
            if kind not in COLLECTIVE_KINDS:
                raise ProfileFormatError(f"profile {self.name!r}: unknown collective {kind!r}")
        object.__setattr__(self, "ops", dict(self.ops))
        object.__setattr__(self, "collectives", dict(self.collectives))
        if self.cluster.intra_node != self.link:
            object.__setattr__(self, "cluster", dataclasses.replace(self.cluster, intra_node=self.link))

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def device(self) -> Device:
        return self.cluster.device

    def with_cluster(self, cluster: Cluster) -> ProfiledCostModel:
        """The same fit bound to another cluster (its intra-node link becomes `link`)."""
        return dataclasses.replace(self, cluster=cluster)

    def scaled(self, factors: Mapping[str, float]) -> ProfiledCostModel:
        """Every op class's fit times `factors[class]` and every collective's times
        `factors["collective"]` (missing: 1) — e.g. a profile's `concurrency_scale` for
        a mesh of n devices running alone."""
        for key, f in factors.items():
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
                raise ProfileFormatError(f"profile {self.name!r}: scale of {key!r} must be a positive number, got {f!r}")
        ops = {c: OpFit(*(x * factors.get(c, 1.0) for x in dataclasses.astuple(f))) for c, f in self.ops.items()}
        c = factors.get("collective", 1.0)
        collectives = {k: CollectiveFit(*(x * c for x in dataclasses.astuple(f))) for k, f in self.collectives.items()}
        return dataclasses.replace(self, ops=ops, collectives=collectives)

    # ------------------------------------------------------------ costs
    def op_time_s(self, op: Op, tensors: Mapping[str, Tensor], num_shards: int = 1,
                  access: OpAccess | None = None, split: Mapping[str, int] | None = None) -> float:
        check_shards(op, num_shards)
        if op.prim in VIEW_PRIMS:
            return 0.0
        flops = op_flops(op, tensors) / num_shards
        # `access` (the op's charge in a fused kernel) is not used: the fits come from
        # ops timed one by one on the backend (module doc); nor is `split`: a class's
        # fit prices FLOPs and bytes, not shapes.
        return self.fit_of(op_class(op)).time_s(flops, traffic_bytes(op, tensors) / num_shards)

    def fit_of(self, op_class_name: str) -> OpFit:
        """The fit that prices `op_class_name` (its fallback's when the profile has none)."""
        fit = self.ops.get(op_class_name)
        return fit if fit is not None else self.ops[FALLBACK_CLASS[op_class_name]]

    def collective_time_s(self, kind: str, nbytes: float, axes: Sequence[MeshAxis]) -> float:
        """Hierarchical sum over axes (see `_collectives`), each axis priced by its fit."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")
        nbytes = _check_bytes(nbytes)
        group = [a for a in axes if a.size > 1]
        if not group or nbytes == 0:
            return 0.0
        if kind == "send_recv":
            fit = self.collectives.get(("send_recv", 2))
            slowest = min(group, key=lambda a: (a.link.bytes_per_s, -a.link.latency_s))
            if fit is None or slowest.link != self.link:
                return collective_time_s(kind, nbytes, group)
            return fit.time_s(nbytes)
        total, piece = 0.0, float(nbytes)
        for axis in sorted(group, key=lambda a: -a.link.bytes_per_s):
            fit = self.collectives.get((kind, axis.size))
            if fit is not None and axis.link == self.link:
                total += fit.time_s(piece)
            else:
                total += collective_time_s(kind, piece, [axis])
            if kind != "all_to_all":
                piece /= axis.size
        return total

    def mesh_axes(self, shape: Sequence[int]) -> tuple[MeshAxis, ...]:
        """Axes of a logical mesh of `shape` on the first devices of the bound cluster."""
        return mesh_axes(self.cluster, shape)

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """The fitted parameters (schema `alpasim.costmodel/1`); the cluster is not saved."""
        return {
            "schema": PROFILE_SCHEMA, "name": self.name,
            "ops": {c: dataclasses.asdict(f) for c, f in sorted(self.ops.items())},
            "collectives": {kind: {str(n): dataclasses.asdict(f) for (k, n), f in sorted(self.collectives.items())
                                   if k == kind}
                            for kind in sorted({k for k, _ in self.collectives})},
            "link": self.link.to_json(), "meta": dict(self.meta),
        }

    @property
    def digest(self) -> str:
        """SHA-256 of the fitted parameters (not `meta`): a cache key for what they price."""
        body = {k: v for k, v in self.to_json().items() if k != "meta"}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def describe(self) -> dict[str, str]:
        """{name, digest}: what a plan records about the model that priced it."""
        return {"name": self.name, "digest": self.digest}

    @classmethod
    def from_json(cls, data: Any, cluster: Cluster, source: str = "profile") -> ProfiledCostModel:
        """Parse `to_json`'s output and bind it to `cluster`; errors name the bad field."""
        r = _Fields(data, source, "")
        schema = r.get("schema", str)
        if schema != PROFILE_SCHEMA:
            raise ProfileFormatError(f"{source}: field 'schema' must be {PROFILE_SCHEMA!r}, got {schema!r}")
        ops_r = r.sub("ops")
        ops = {}
        for c in OP_CLASSES:
            if c in FALLBACK_CLASS and c not in ops_r.data:
                continue
            f = ops_r.sub(c)
            ops[c] = OpFit(f.number("launch_s"), f.number("seconds_per_flop"), f.number("seconds_per_byte"))
        collectives = {}
        coll_r = r.sub("collectives")
        for kind in coll_r.data:
            if kind not in COLLECTIVE_KINDS:
                raise ProfileFormatError(f"{source}: field 'collectives.{kind}' is no collective; expected some "
                                         f"of {COLLECTIVE_KINDS}")
            per_n = coll_r.sub(kind)
            for n_text in per_n.data:
                if not (isinstance(n_text, str) and n_text.isdigit() and int(n_text) >= 2):
                    raise ProfileFormatError(f"{source}: field 'collectives.{kind}.{n_text}' must be keyed by an "
                                             "axis size >= 2")
                f = per_n.sub(n_text)
                collectives[(kind, int(n_text))] = CollectiveFit(f.number("alpha_s"), f.number("seconds_per_byte"))
        lk = r.sub("link")
        try:
            link = Link(lk.get("name", str), lk.number("bandwidth_gbps"), lk.number("latency_s"))
        except ValueError as e:
            raise ProfileFormatError(f"{source}: field 'link': {e}") from None
        meta = r.data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise ProfileFormatError(f"{source}: field 'meta' must be an object, got {meta!r}")
        return cls(r.get("name", str), ops, collectives, link, cluster, dict(meta))

    @classmethod
    def load(cls, path: str | Path, cluster: Cluster) -> ProfiledCostModel:
        """Read a profile JSON file and bind it to `cluster`."""
        p = Path(path)
        if not p.is_file():
            raise ProfileFormatError(f"{path}: no such file")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProfileFormatError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(data, cluster, str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


class _Fields:
    """Typed access to one JSON object of a profile; errors quote the dotted field path."""

    def __init__(self, data: Any, source: str, path: str) -> None:
        if not isinstance(data, Mapping):
            where = f"field {path!r}" if path else "top level"
            raise ProfileFormatError(f"{source}: {where} must be a JSON object, got {type(data).__name__}")
        self.data, self.source, self.path = data, source, path

    def _where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _value(self, key: str) -> Any:
        if key not in self.data:
            raise ProfileFormatError(f"{self.source}: missing field {self._where(key)!r}")
        return self.data[key]

    def get(self, key: str, kind: type) -> Any:
        value = self._value(key)
        if not isinstance(value, kind):
            raise ProfileFormatError(f"{self.source}: field {self._where(key)!r} must be {kind.__name__}, "
                                     f"got {value!r}")
        return value

    def number(self, key: str) -> float:
        """A finite number >= 0 (fitted times and rates are never negative)."""
        value = self._value(key)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0):
            raise ProfileFormatError(f"{self.source}: field {self._where(key)!r} must be a finite number >= 0, "
                                     f"got {value!r}")
        return float(value)

    def sub(self, key: str) -> _Fields:
        return _Fields(self._value(key), self.source, self._where(key))

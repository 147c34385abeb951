"""`ShardingSpec`: for each tensor dimension, the mesh axes it is split on (seed 3.4.2).

Per dimension: ``()`` replicated (R), ``(0,)`` S0, ``(1,)`` S1, ``(0, 1)`` S01 (split
into n0*n1 blocks, axis 0 major). Printed as the paper does: ``S0R``, ``RS1``,
``S01R``. A mesh axis shards at most one dimension. A dimension must be divisible by
the number of its shards: the enumerators never produce an uneven spec, and
`check_spec` names the dimension when one is asked for (JAX would pad, and padding
would make the cost model lie).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ._mesh import LogicalMesh


class ShardingError(ValueError):
    """A sharding spec that does not fit its tensor or mesh."""


# dims as given -> (dims normalised to ints, their hash, the mesh axes used, sorted)
_CHECKED: dict[tuple, tuple[tuple[tuple[int, ...], ...], int, tuple[int, ...]]] = {}


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """Mesh axes per tensor dimension; hashable, printable like the paper."""

    dims: tuple[tuple[int, ...], ...]

    _hash: int = field(init=False, repr=False, compare=False)
    _axes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The planner makes specs by the hundred thousand, from a few dozen distinct
        # `dims`: each is checked and normalised once (`_CHECKED`).
        try:
            known = _CHECKED.get(self.dims)
        except TypeError:                                  # given as lists
            known = None
        if known is None:
            key = tuple(tuple(d) for d in self.dims)       # lists and generators are stored as tuples
            dims = tuple(tuple(int(a) for a in d) for d in key)
            used = [a for d in dims for a in d]
            if any(a not in (0, 1) for a in used):
                raise ShardingError(f"sharding spec {dims!r}: mesh axes are 0 and 1")
            if len(set(used)) != len(used):
                raise ShardingError(f"sharding spec {dims!r}: a mesh axis shards at most one dimension")
            known = _CHECKED[key] = (dims, hash(dims), tuple(sorted(used)))
        object.__setattr__(self, "dims", known[0])
        object.__setattr__(self, "_hash", known[1])
        object.__setattr__(self, "_axes", known[2])

    def __hash__(self) -> int:  # specs key the resharding caches, millions of lookups a plan: hash once
        return self._hash

    @classmethod
    def replicated(cls, rank: int) -> ShardingSpec:
        return cls(((),) * rank)

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """'S0R' -> ((0,), ()); 'S01R' -> ((0, 1), ()); '' or 'scalar' (as printed) is rank 0."""
        if text == "scalar":
            return cls(())
        dims, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "R":
                dims.append(())
                i += 1
            elif c == "S":
                j = i + 1
                while j < len(text) and text[j] in "01":
                    j += 1
                if j == i + 1:
                    raise ShardingError(f"sharding spec {text!r}: 'S' needs mesh axes, e.g. S0")
                dims.append(tuple(int(a) for a in text[i + 1:j]))
                i = j
            else:
                raise ShardingError(f"sharding spec {text!r}: unexpected {c!r}")
        return cls(tuple(dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes_used(self) -> tuple[int, ...]:
        return self._axes

    def dim_of_axis(self, axis: int) -> tuple[int, int] | None:
        """(tensor dim, position among that dim's axes) sharded on `axis`, or None."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i, d.index(axis)
        return None

    def num_shards(self, mesh: LogicalMesh) -> int:
        return mesh.axis_size(self._axes)

    def shard_shape(self, shape: Sequence[int], mesh: LogicalMesh) -> tuple[int, ...]:
        check_spec(self, shape, mesh)
        return tuple(n // mesh.axis_size(d) for n, d in zip(shape, self.dims))

    def partition_spec(self, axis_names: tuple[str, str] = ("x", "y")) -> tuple:
        """The `jax.sharding.PartitionSpec` arguments: None, a name, or a tuple of names."""
        out = []
        for d in self.dims:
            names = tuple(axis_names[a] for a in d)
            out.append(None if not names else names[0] if len(names) == 1 else names)
        return tuple(out)

    def __str__(self) -> str:
        return "".join("R" if not d else "S" + "".join(map(str, d)) for d in self.dims) or "scalar"


def check_spec(spec: ShardingSpec, shape: Sequence[int], mesh: LogicalMesh) -> None:
    """Raise ShardingError unless `spec` fits a tensor of `shape` on `mesh`."""
    if spec.rank != len(shape):
        raise ShardingError(f"spec {spec} has {spec.rank} dims, tensor shape {tuple(shape)} has {len(shape)}")
    for i, (n, d) in enumerate(zip(shape, spec.dims)):
        k = mesh.axis_size(d)
        if n % k:
            raise ShardingError(f"spec {spec}: dimension {i} of size {n} does not split into {k} equal shards "
                                f"on mesh {mesh}")


def spec_fits(spec: ShardingSpec, shape: Sequence[int], mesh: LogicalMesh) -> bool:
    return spec.rank == len(shape) and all(n % mesh.axis_size(d) == 0 for n, d in zip(shape, spec.dims))


def all_specs(shape: Sequence[int], mesh: LogicalMesh) -> list[ShardingSpec]:
    """Every valid spec of a tensor on `mesh` (axes of size 1 are never used)."""
    rank = len(shape)
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    options: list[tuple[int | None, ...]] = [()]
    for a in live:
        options = [o + (d,) for o in options for d in [None, *range(rank)]]
    out = []
    for choice in options:
        dims: list[list[int]] = [[] for _ in range(rank)]
        for a, d in zip(live, choice):
            if d is not None:
                dims[d].append(a)
        spec = ShardingSpec(tuple(tuple(d) for d in dims))
        if spec_fits(spec, shape, mesh):
            out.append(spec)
    return out

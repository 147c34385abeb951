"""`LogicalMesh`: a 2-D view of a set of devices, each axis with its own link.

The intra-op pass takes the mesh shape as given (seed 3.4.1): the inter-op pass picks
which physical devices form a submesh and in which logical shape. Axis 0 is the
slower axis by convention when a mesh spans nodes (devices are laid row-major, node
by node, so axis 1 stays inside a node). The mesh is abstract — sizes and links, no
device handles — so solving and caching never depend on which devices exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from alpasim.costmodels import Cluster, Link, MeshAxis, mesh_axes


@dataclass(frozen=True, slots=True)
class LogicalMesh:
    """A (n0, n1) mesh with one `MeshAxis` (size and link) per axis."""

    axes: tuple[MeshAxis, MeshAxis]

    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        axes = tuple(self.axes)
        if len(axes) != 2 or not all(isinstance(a, MeshAxis) for a in axes):
            raise ValueError(f"a logical mesh has exactly two MeshAxis axes, got {self.axes!r}")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "_hash", hash(axes))

    def __hash__(self) -> int:  # meshes key every cost cache: hash once
        return self._hash

    @classmethod
    def of(cls, shape: Sequence[int], links: Link | Sequence[Link]) -> LogicalMesh:
        """A mesh of `shape` whose axes use `links` (one link for both, or one per axis)."""
        shape = tuple(int(n) for n in shape)
        if len(shape) != 2:
            raise ValueError(f"a logical mesh is 2-D, got shape {shape}")
        if isinstance(links, Link):
            links = (links, links)
        return cls((MeshAxis(shape[0], links[0]), MeshAxis(shape[1], links[1])))

    @classmethod
    def on_cluster(cls, cluster: Cluster, shape: Sequence[int]) -> LogicalMesh:
        """A mesh laid row-major over the first prod(shape) devices of `cluster`."""
        axes = mesh_axes(cluster, shape)
        if len(axes) != 2:
            raise ValueError(f"a logical mesh is 2-D, got shape {tuple(shape)}")
        return cls((axes[0], axes[1]))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.axes[0].size, self.axes[1].size)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axes: Sequence[int]) -> int:
        """Number of shards along a group of mesh axes."""
        n = 1
        for a in axes:    # a plain loop: the planner asks this millions of times, of one or two axes
            n *= self.axes[a].size
        return n

    def __str__(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4); a single number n means (1, n)."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"mesh shape {text!r} is not like '2x4'") from None
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh shape {text!r} must be two positive integers like '2x4'")
    return shape  # type: ignore[return-value]

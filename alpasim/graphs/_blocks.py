"""Layers of an imported graph from its parameter tree: a stack of blocks is a stack of layers.

A model written with a Python loop over blocks (`Block_0`, `Block_1` in flax.linen,
`blocks/0` in an `nnx.List`, `h/0` in Hugging Face's Flax GPT-2) traces into one flat
op sequence. Its parameter paths still say where each block is, and planning it as
those blocks — the embedding, one layer per block, the head, as the zoo's planning
units — gives the planner layers that are the same from block to block, so their
stage costs are solved once and reused, as for a built-in model.

* **The stack**: among path components of the form ``<stem><sep><i>`` (or a bare
  index), grouped by the path before them and their stem, the shallowest group with at
  least two indices whose members are alike (the same sub-paths with the same shapes).
* **Layers**, in program order: the ops before the first read of block 0's parameters
  are the embedding; the first read of block i's starts block i (so the first ops of a
  block that read only the previous block's output, such as a norm's reductions, stay
  with that block); after the last block has started, the first read of a parameter
  no block read (the final norm's) starts the head. Ops that make values from
  parameters and constants alone (a broadcast bias, a causal mask) are made in each
  layer that reads them, just before their first reader there (``<tensor>@<layer>``
  for the copies), so no stage receives a constant from another.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ._types import Op, Tensor

_INDEXED = re.compile(r"^(.*?)[_\-.]?(\d+)$")


def block_of_params(params: Mapping[str, Tensor]) -> dict[str, int] | None:
    """Parameter -> block index for the stack described above, or None if there is none."""
    groups: dict[tuple, dict[int, dict[tuple, tuple]]] = {}
    for name, t in params.items():
        parts = name.split("/")
        for d, part in enumerate(parts[:-1]):
            m = _INDEXED.match(part)
            if m is None:
                continue
            key = (d, tuple(parts[:d]), m.group(1))
            rest = tuple(parts[d + 1:])
            groups.setdefault(key, {}).setdefault(int(m.group(2)), {})[rest] = t.shape
    for key in sorted(groups, key=lambda k: (k[0], -len(groups[k]))):
        members = groups[key]
        if len(members) >= 2 and all(m == next(iter(members.values())) for m in members.values()):
            d, prefix, stem = key
            out = {}
            for name in params:
                parts = name.split("/")
                if len(parts) > d + 1 and tuple(parts[:d]) == prefix:
                    m = _INDEXED.match(parts[d])
                    if m is not None and m.group(1) == stem and int(m.group(2)) in members:
                        out[name] = int(m.group(2))
            return out
    return None


def block_layers(ops: Sequence[Op], tensors: Mapping[str, Tensor]) -> tuple[list[Op], dict[str, Tensor]] | None:
    """`ops` (forward, one layer) relabelled one layer per block (module doc), with the
    tensors of the makers copied into further layers; None when there is no stack."""
    params = {n for n, t in tensors.items() if t.role == "param"}
    block = block_of_params({n: tensors[n] for n in params})
    if not block:
        return None
    order = sorted(set(block.values()))
    rank = {b: i + 1 for i, b in enumerate(order)}        # 0 is the embedding
    last = len(order)
    producer = {t: op for op in ops for t in op.outputs}
    maker: set[str] = set()
    reads: dict[str, set[str]] = {}        # maker -> parameters it is made from
    for op in ops:   # made from parameters and constants only: placed with its readers
        if all(t in params or (t in producer and producer[t].name in maker) for t in op.inputs):
            maker.add(op.name)
            reads[op.name] = {t for t in op.inputs if t in params}.union(
                *(reads[producer[t].name] for t in op.inputs if t in producer))
    body = [op for op in ops if op.name not in maker]
    layer: dict[str, int] = {}
    anchor: list[bool] = []
    current, seen = 0, set()
    for op in body:
        used = {t for t in op.inputs if t in params}.union(
            *(reads[producer[t].name] for t in op.inputs if t in producer and producer[t].name in maker))
        own = [rank[block[t]] for t in used if t in block]
        fresh = [t for t in used if t not in block and t not in seen]
        seen |= used
        if own:
            current = max(current, *own)
        elif fresh and current == last:
            current = last + 1                            # the head: a parameter no block used
        anchor.append(bool(used))
        layer[op.name] = current
    _place_boundaries(body, layer, anchor, producer, tensors)
    # Makers: each layer that reads one gets its own copy, made where it is first read.
    need: dict[str, set[int]] = {}
    readers: dict[str, list[Op]] = {}
    for op in ops:
        for t in op.inputs:
            if t in producer:
                readers.setdefault(producer[t].name, []).append(op)
    for op in reversed(ops):
        if op.name in maker:
            need[op.name] = set().union(*(need[r.name] if r.name in maker else {layer[r.name]}
                                          for r in readers.get(op.name, ()))) or {0}
    dense = {n: i for i, n in enumerate(sorted({layer[op.name] for op in ops if op.name not in maker}
                                                | {n for ns in need.values() for n in ns}))}
    new_tensors: dict[str, Tensor] = {}
    copy_of: dict[tuple[str, int], str] = {}         # (tensor, layer) -> its copy there
    out: list[Op] = []
    pending: dict[int, list[Op]] = {}                # makers not yet placed, per layer

    def place(m: Op, n: int) -> None:
        suffix = "" if n == min(need[m.name]) else f"@{dense[n]}"
        ins = tuple(copy_of.get((t, n), t) for t in m.inputs)
        outs = tuple(t + suffix for t in m.outputs)
        for t, c in zip(m.outputs, outs):
            copy_of[(t, n)] = c
            if c != t:
                new_tensors[c] = Tensor(c, tensors[t].shape, tensors[t].dtype, tensors[t].role)
        out.append(m.replace(name=m.name + suffix, inputs=ins, outputs=outs, layer=dense[n]))

    for op in ops:
        if op.name in maker:
            for n in sorted(need[op.name]):
                pending.setdefault(n, []).append(op)
            continue
        n = layer[op.name]
        for m in pending.pop(n, ()):
            place(m, n)
        out.append(op.replace(inputs=tuple(copy_of.get((t, n), t) for t in op.inputs), layer=dense[n]))
    for n, makers in pending.items():   # read by nothing that is not a maker: keep them
        for m in makers:
            place(m, n)
    return out, new_tensors


def _place_boundaries(body: Sequence[Op], layer: dict[str, int], anchor: Sequence[bool],
                      producer: Mapping[str, Op], tensors: Mapping[str, Tensor]) -> None:
    """Move each boundary between two layers, among the ops after the last parameter
    read of the first and up to the first of the second, to where the fewest bytes
    cross it (after a residual add, not halfway through the next norm)."""
    index = {op.name: i for i, op in enumerate(body)}
    n = len(body)
    for i in range(1, n):
        u, v = layer[body[i - 1].name], layer[body[i].name]
        if u == v:
            continue
        a = max((j for j in range(i) if anchor[j] and layer[body[j].name] == u), default=i - 1)
        end = next((j for j in range(i, n) if layer[body[j].name] != v), n)
        best, best_bytes = i, None
        for c in range(a + 1, i + 1):
            crossing = {t for k in range(c, end) for t in body[k].inputs
                        if t in producer and index.get(producer[t].name, n) < c}
            size = sum(tensors[t].nbytes for t in crossing)
            if best_bytes is None or size < best_bytes:
                best, best_bytes = c, size
        for k in range(best, i):
            layer[body[k].name] = v

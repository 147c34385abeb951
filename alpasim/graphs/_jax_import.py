"""Import a JAX loss function as a forward `OpGraph`.

`from_jax(loss_fn, params, batch)` traces `loss_fn(params, batch)` with abstract shapes
(`jax.make_jaxpr` on `jax.ShapeDtypeStruct` leaves: nothing is allocated), inlines the
nested jaxprs that JAX wraps around library code (`jit`, `custom_jvp_call`,
`custom_vjp_call`, `remat`/checkpoint, `closed_call`), and maps every JAX primitive
onto alpasim's coarse set: `dot_general` becomes an `einsum` whose equation is built
from the dimension numbers, `conv_general_dilated` a `conv2d` (with transposes around
it when the layout is not NHWC/HWIO), a lookup `gather` (`jnp.take` along one axis, ids
of any rank) an `embedding` of the table seen as rows, and so on
(`SUPPORTED` lists them). The training graph then comes from alpasim's own VJP rules,
so planning a JAX model never needs JAX again.

How the jaxpr maps, where it is not one-to-one:

* A jaxpr variable holds either a graph tensor or a `Splat`, a constant whose
  elements are all equal (a literal, a broadcast literal, folded scalar arithmetic).
  Splats fold with numpy and become a `full` op only where a tensor is needed, so
  guards such as `jnp.var`'s `where(n > 0, ..., nan)` leave no ops behind.
* A splat operand of a binary elementwise op becomes its `scalar` param.
* JAX's binary ops broadcast rank-0 operands and size-1 axes implicitly; alpasim's
  elementwise ops need equal shapes, so explicit `broadcast` ops are inserted
  (composed with the `broadcast_in_dim` that made the size-1 axes, if any).
* `jax.nn.relu` (a custom_jvp around `max(x, 0)`) becomes the `relu` function.
* Ops whose results do not reach the loss are dropped.

Op and tensor names carry the nesting of the JAX functions they come from
(`log_softmax/exp`). Every op is in layer 0; clustering assigns layers later. Importing
this module does not import jax; calling `from_jax` does.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._autodiff import AdamConfig, training_graph
from ._batch import BatchError, mark_batch
from ._blocks import block_layers
from ._builder import GraphBuilder
from ._types import OpGraph, Tensor
from ._jax_values import FOLD, JaxImportError, Random, Splat, Value, dtype_name, py_scalar
from ._prims_layout import constant_params
from ._jax_rules import ELEMENTWISE_FNS, HANDLERS, INLINE, PASSTHROUGH, SUPPORTED, out_aval


def from_jax(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any, *, name: str = "imported",
             batch_axis: int | None = 0) -> OpGraph:
    """The forward `OpGraph` of `loss_fn(params, batch)`, ending in its scalar loss.

    `params` and `batch` are pytrees of arrays or `jax.ShapeDtypeStruct`s; only their
    shapes and dtypes are used. Parameter leaves become tensors of role ``param``
    named by their key path (``layers/0/w``), batch leaves tensors of role ``input``
    (``batch/x``).

    `batch_axis`: the axis of every batch leaf that is the batch (None: none). The
    function is traced a second time at twice that batch and the graph records what
    moves with it (`graphs.mark_batch`), so the planner can rebuild it at any
    microbatch size. Where the two traces do not line up (the function's structure
    depends on its batch) the graph is left unmarked, and `meta["batch_note"]` says why.
    """
    p_abs, b_abs = _abstract(params), _abstract(batch)
    graph = _import(loss_fn, p_abs, b_abs, name)
    if batch_axis is None:
        return graph
    try:
        size, doubled = _doubled(b_abs, batch_axis)
        return mark_batch(graph, _import(loss_fn, p_abs, doubled, name), size, 2 * size)
    except Exception as e:  # noqa: BLE001 - any failure of the second trace leaves the graph unmarked
        return graph.replace(meta={**graph.meta, "batch_note": f"batch not marked: {type(e).__name__}: {e}"})


def _unit_insertion(old: Sequence[int], new: Sequence[int]) -> tuple[int, ...] | None:
    """Where each axis of `old` lands in `new` when `new` only inserts size-1 axes."""
    dims, j = [], 0
    for i, n in enumerate(new):
        if j < len(old) and old[j] == n:
            dims.append(i)
            j += 1
        elif n != 1:
            return None
    return tuple(dims) if j == len(old) else None


def _doubled(b_abs: Any, axis: int) -> tuple[int, Any]:
    """(the batch size, the batch pytree at twice it) along `axis` of every leaf."""
    import jax

    leaves = jax.tree_util.tree_leaves(b_abs)
    sizes = {leaf.shape[axis] if 0 <= axis < len(leaf.shape) else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise BatchError(f"the batch leaves do not share one size along axis {axis}")
    (size,) = sizes

    def grow(leaf):
        shape = list(leaf.shape)
        shape[axis] *= 2
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return size, jax.tree_util.tree_map(grow, b_abs)


def _import(loss_fn: Callable[[Any, Any], Any], p_abs: Any, b_abs: Any, name: str) -> OpGraph:
    import jax

    closed = jax.make_jaxpr(loss_fn)(p_abs, b_abs)
    outs = closed.out_avals
    if len(outs) != 1 or outs[0].shape != () or dtype_name(outs[0].dtype) not in ("float32", "float16", "bfloat16"):
        got = ", ".join(a.str_short() for a in outs)
        raise JaxImportError(f"loss_fn must return one scalar float loss, got ({got})")
    unsupported = _unsupported(closed.jaxpr)
    flow = sorted(set(unsupported) & CONTROL_FLOW)
    if flow:
        raise JaxImportError(f"{flow[0]} at {unsupported[flow[0]] or 'an unknown line'}: data-dependent control "
                             f"flow has no static graph; use lax.scan (unrolled) or jnp.where")
    if unsupported:
        where = "; ".join(f"{p} at {line}" if line else p for p, line in sorted(unsupported.items()))
        raise JaxImportError(f"unsupported JAX primitives: {where}; alpasim maps only these (nested calls and "
                             f"scans are inlined, PRNG code becomes graph inputs): {', '.join(SUPPORTED)}")

    b = GraphBuilder(name)
    leaves = []
    avals = iter(v.aval for v in closed.jaxpr.invars)  # canonical dtypes (no float64 without x64)
    for tree, role, root in ((p_abs, "param", "params"), (b_abs, "input", "batch")):
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            base = _path_name(path) or root
            if role == "input" and base != root:
                base = f"{root}/{base}"
            aval = next(avals)
            t = Tensor(b.fresh(base), aval.shape, dtype_name(aval.dtype), role)
            b.add_tensor(t)
            if role == "input":
                b.inputs.append(t.name)
            leaves.append(t.name)
    imp = _Importer(b)
    with b.scope(layer=0):
        (loss,) = imp.inline(closed.jaxpr, closed.consts, leaves)
        loss = imp.tensor(loss)
        if b.tensors[loss].role != "activation":  # the loss is a leaf itself: give it a producer
            loss = b.ew("identity", loss, name="loss")
    sizes = Counter()
    for t in b.tensors.values():
        if t.role == "param" and t.is_float:
            sizes[t.dtype] += t.size
    meta = {"family": "jax", "function": getattr(loss_fn, "__name__", repr(loss_fn)),
            "dtype": sizes.most_common(1)[0][0] if sizes else b.dtype(loss)}
    n_params = len(jax.tree_util.tree_leaves(p_abs))
    meta["param_leaves"], meta["batch_leaves"] = leaves[:n_params], leaves[n_params:]
    if imp.split_params:
        meta["stacked_params"] = {leaf: [parts[i] for i in sorted(parts)] for leaf, parts in imp.split_params.items()}
    return _finish(b, loss, meta, set(imp.split_params))


def values_as_tree(graph: OpGraph, tree: Any, values: dict[str, Any], part: str = "params",
                   combine: Callable[[str, list[Any]], Any] | None = None) -> Any:
    """`tree` (the params or batch pytree `from_jax` read) with each leaf replaced by the
    value of its graph tensor in `values` (graph tensor name -> value); a stacked
    parameter that a scan split comes back stacked (`combine(leaf, part values)`,
    default `np.stack`). How a graph-side answer (random leaves, a run's gradients, a
    plan's layouts) is handed to the user's own function."""
    import jax

    names = graph.meta.get(f"{'param' if part == 'params' else 'batch'}_leaves")
    if names is None:
        raise ValueError(f"graph {graph.name!r} records no {part} leaves (not imported by this version's from_jax)")
    stacked = graph.meta.get("stacked_params", {})
    def stack(leaf: str, parts: list[Any]) -> Any:
        missing = [p for p, v in zip(stacked[leaf], parts) if v is None]
        if missing:
            raise KeyError(missing[0])
        return np.stack([np.asarray(v) for v in parts])

    combine = combine or stack
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if len(leaves) != len(names):
        raise ValueError(f"{part} tree has {len(leaves)} leaves; graph {graph.name!r} was imported from {len(names)}")
    out = [combine(n, [values.get(p) for p in stacked[n]]) if n in stacked else values[n] for n in names]
    return jax.tree_util.tree_unflatten(treedef, out)


def training_graph_from_jax(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any, *, remat: bool = False,
                            optimizer: AdamConfig | None = None, name: str = "imported") -> OpGraph:
    """`training_graph(from_jax(...))`: forward, alpasim-derived backward and Adam updates."""
    return training_graph(from_jax(loss_fn, params, batch, name=name), remat=remat, optimizer=optimizer)


# ------------------------------------------------------------------ leaves
def _abstract(tree: Any) -> Any:
    import jax

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))

    return jax.tree_util.tree_map(leaf, tree)


def _path_name(path: Sequence[Any]) -> str:
    """`layers/0/w` for the key path of ``params["layers"][0]["w"]``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# A captured constant travels inside the graph file (base64): tables up to this size.
MAX_CONSTANT_ELEMENTS = 1 << 22


def _body(eqn: Any) -> tuple[Any, list[Any]]:
    """The (open jaxpr, consts) of a call-like equation."""
    for key in _BODY_KEYS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        if hasattr(sub, "consts"):
            return sub.jaxpr, list(sub.consts)
        return sub, []
    raise JaxImportError(f"{eqn.primitive.name}: no nested jaxpr among params {sorted(eqn.params)}")


# Primitives of PRNG code: they make `Random` values (`_jax_values.Random`), never ops.
RANDOM_PRIMS = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split",
                          "random_bits", "threefry2x32", "shift_right_logical", "shift_left",
                          "bitcast_convert_type", "random_clone"})
# Control flow alpasim's static graphs cannot express (scan is unrolled instead).
CONTROL_FLOW = frozenset({"cond", "while", "switch"})


def _random_dtype(dtype: Any) -> str:
    import jax

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "key"
    name = np.dtype(dtype).name
    return name if name in ("bool", "float32", "float16", "bfloat16", "int32") else "uint32"


def _unsupported(jaxpr: Any, outer: str = "") -> dict[str, str]:
    """The primitives of `jaxpr` (nested calls included) that have no mapping, each
    with the user's source line of its first use (inside library code, the line of the
    call the user wrote, `outer`)."""
    out: dict[str, str] = {}
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        line = _source_line(eqn) or outer
        if prim in INLINE:
            out = {**_unsupported(_body(eqn)[0], line), **out}
        elif prim == "scan":
            out = {**_unsupported(eqn.params["jaxpr"].jaxpr, line), **out}
        elif (prim not in HANDLERS and prim not in ELEMENTWISE_FNS and prim not in PASSTHROUGH
              and prim not in RANDOM_PRIMS):
            out.setdefault(prim, line)
    return out


def _source_line(eqn: Any) -> str:
    """`file:line (function)` of the user code that made `eqn`, or ''."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a private JAX API: the message only loses its location
        return ""


def _is_relu(eqn: Any) -> bool:
    """Whether a custom_jvp call is `jax.nn.relu`: its body is `max(x, 0)` (maybe under a jit)."""
    jaxpr, _ = _body(eqn)
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in ("jit", "pjit"):
        jaxpr = _body(jaxpr.eqns[0])[0]
    if len(jaxpr.invars) != 1 or len(jaxpr.eqns) != 1:
        return False
    (e,) = jaxpr.eqns
    consts = [v for v in e.invars if hasattr(v, "val")]
    return (e.primitive.name == "max" and len(consts) == 1 and np.all(np.asarray(consts[0].val) == 0)
            and jaxpr.invars[0] in e.invars and list(jaxpr.outvars) == list(e.outvars))


class _Importer:
    """Walks a jaxpr, emitting graph ops into a builder."""

    def __init__(self, b: GraphBuilder) -> None:
        from jax.extend import core

        self.b = b
        self._literal, self._dropvar = core.Literal, core.DropVar
        self._bcast: dict[str, tuple[str, tuple[int, ...]]] = {}  # broadcast output -> (source, dims)
        self._perm: dict[str, tuple[str, tuple[int, ...]]] = {}  # transpose output -> (source, perm)
        self.split_params: dict[str, dict[int, str]] = {}   # stacked leaf -> iteration -> its parameter
        self.concat_parts: dict[str, list[Value]] = {}   # last-axis concatenation -> its operands
        self._random: dict[Random, str] = {}   # a random value (hashed by identity) -> the input it became
        self._scan_depth = 0
        self._layer_base = 0

    # ------------------------------------------------------------ walking
    def inline(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value]) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self._const(c)
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [self._read(env, v) for v in eqn.invars]
            outs = self._eqn(eqn, ins)
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, self._dropvar):
                    self._check(eqn, var, val)
                    env[var] = val
        return [self._read(env, v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list[Value]) -> list[Value]:
        prim = eqn.primitive.name
        if prim == "scan":
            return self._scan(eqn, ins)
        if prim not in INLINE and (prim in RANDOM_PRIMS or any(isinstance(v, Random) for v in ins)):
            if not any(isinstance(v, str) for v in ins):    # keys, bits, masks: still random
                return [Random(tuple(v.aval.shape), _random_dtype(v.aval.dtype)) for v in eqn.outvars]
            ins = [self.materialize(v) if isinstance(v, Random) else v for v in ins]
        if prim in INLINE:
            if prim == "custom_jvp_call" and _is_relu(eqn):
                return [self.ew("relu", ins, out_aval(eqn))]
            jaxpr, consts = _body(eqn)
            name = re.sub(r"\W", "", str(eqn.params.get("name", ""))).strip("_")  # "<lambda>" -> "lambda"
            prefix = self.b.prefix + name + "/" if name else self.b.prefix
            with self.b.scope(prefix=prefix):
                return self.inline(jaxpr, consts, ins)
        if prim in PASSTHROUGH:
            return ins
        if prim in ELEMENTWISE_FNS:
            return [self.ew(ELEMENTWISE_FNS[prim], ins, out_aval(eqn))]
        return HANDLERS[prim](self, eqn, ins)

    def materialize(self, v: Random) -> str:
        """The graph input a random value becomes where a graph op reads it (`Random`)."""
        name = self._random.get(v)
        if name is None:
            if v.dtype == "key":
                raise JaxImportError("a PRNG key reaches a graph op; only values drawn from keys (dropout masks) "
                                     "can become graph inputs")
            with self.b.scope(prefix=""):
                t = Tensor(self.b.fresh("batch/random"), v.shape, v.dtype, "input")
            self.b.add_tensor(t)
            self.b.inputs.append(t.name)
            self._random[v] = name = t.name
        return name

    # ------------------------------------------------------------ scan
    def _scan(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """`lax.scan` unrolled: the body inlined once per iteration, each iteration one
        layer of the graph (the outermost scan's; ops before it and after it are layers
        of their own), so a layer stack under `nn.scan` reaches the planner as layers of
        one kind. A stacked parameter the scan slices is split into one parameter per
        iteration (`<leaf>/<i>`; `meta["stacked_params"]` maps them back), so each layer
        owns its weights and a pipeline can cut between them."""
        p = eqn.params
        body, nc, ncar, length = p["jaxpr"], int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
        consts, carry, xs = ins[:nc], list(ins[nc:nc + ncar]), ins[nc + ncar:]
        outer = self._scan_depth == 0
        self._scan_depth += 1
        steps: dict[int, list[Value]] = {}
        try:
            for i in (range(length - 1, -1, -1) if p["reverse"] else range(length)):
                if outer:
                    self.b.layer = self._layer_base + 1 + i
                with self.b.scope(prefix=f"{self.b.prefix}scan{i}/"):
                    outs = self.inline(body.jaxpr, body.consts, list(consts) + carry + [self._index(x, i) for x in xs])
                carry, steps[i] = outs[:ncar], outs[ncar:]
        finally:
            self._scan_depth -= 1
        if outer:
            self._layer_base += length + 1
            self.b.layer = self._layer_base
        ys = [self._stack([steps[i][j] for i in range(length)]) for j in range(len(body.jaxpr.outvars) - ncar)]
        return carry + ys

    def _index(self, x: Value, i: int) -> Value:
        """x[i] along the scanned axis: a splat's slice, one iteration's own parameter
        (for a stacked parameter leaf), or a slice of a computed tensor."""
        if isinstance(x, Splat):
            return Splat(x.value, x.shape[1:], x.dtype)
        if isinstance(x, Random):
            return Random(x.shape[1:], x.dtype)
        shape = self.b.shape(x)
        t = self.b.tensors[x]
        if t.role == "param":      # a leaf: no op makes a parameter
            names = self.split_params.setdefault(x, {})
            if i not in names:
                with self.b.scope(prefix=""):     # named after the leaf, not the scope
                    part = Tensor(self.b.fresh(f"{x}/{i}"), shape[1:], t.dtype, "param")
                self.b.add_tensor(part)
                names[i] = part.name
            return names[i]
        y = self.op("slice", [x], name="slice", start=(i,) + (0,) * (len(shape) - 1), limit=(i + 1,) + shape[1:])
        return self.op("reshape", [y], shape=shape[1:])

    def _stack(self, values: list[Value]) -> Value:
        """The per-iteration outputs stacked on a new leading axis."""
        if all(isinstance(v, Splat) for v in values) and len({v.value for v in values}) == 1:
            v = values[0]
            return Splat(v.value, (len(values),) + v.shape, v.dtype)
        if all(isinstance(v, Random) for v in values):
            return Random((len(values),) + values[0].shape, values[0].dtype)
        return self.stack([self.materialize(v) if isinstance(v, Random) else v for v in values], 0)

    def stack(self, values: Sequence[Value], axis: int) -> str:
        """`values` (tensors or splats of one shape) stacked on a new `axis`."""
        shape = values[0].shape if isinstance(values[0], Splat) else self.b.shape(values[0])
        unit = tuple(shape[:axis]) + (1,) + tuple(shape[axis:])
        return self.concat([self.reshape(self.tensor(v), unit) for v in values], axis)

    def concat(self, xs: Sequence[str], axis: int) -> str:
        """`xs` concatenated along `axis`, in concatenate ops of at most 8 operands."""
        xs = list(xs)
        while len(xs) > 1:
            xs = [self.op("concatenate", xs[k:k + 8], name="concatenate", axis=axis) if len(xs[k:k + 8]) > 1
                  else xs[k] for k in range(0, len(xs), 8)]
        return xs[0]

    def _read(self, env: dict[Any, Value], atom: Any) -> Value:
        if isinstance(atom, self._literal):
            if _random_dtype(atom.aval.dtype) in ("key", "uint32"):    # bit twiddling of PRNG code
                return Random(tuple(atom.aval.shape), "uint32")
            dtype = dtype_name(atom.aval.dtype)
            return Splat(py_scalar(np.asarray(atom.val).item(), dtype), tuple(atom.aval.shape), dtype)
        return env[atom]

    def _const(self, c: Any) -> Value:
        """A captured array: a splat when its elements are all equal, else a `constant`
        op that carries its values (a RoPE table, a causal mask)."""
        kind = _random_dtype(getattr(c, "dtype", np.asarray(c).dtype))
        if kind in ("key", "uint32"):        # a captured PRNG key (or its raw data)
            return Random(tuple(np.shape(c)), kind)
        arr = np.asarray(c)
        dtype = dtype_name(arr.dtype)
        if arr.size and np.all(arr == arr.flat[0]):
            return Splat(py_scalar(arr.flat[0].item(), dtype), arr.shape, dtype)
        if arr.size > MAX_CONSTANT_ELEMENTS:
            raise JaxImportError(f"loss_fn captures a constant array of shape {arr.shape} ({dtype}), more than "
                                 f"{MAX_CONSTANT_ELEMENTS} elements; pass it in `params` or `batch` instead")
        return self.op("constant", [], name="constant", **constant_params(arr.astype(np.dtype(dtype))))

    def _check(self, eqn: Any, var: Any, val: Value) -> None:
        if isinstance(val, Random):
            return
        shape, dtype = (val.shape, val.dtype) if isinstance(val, Splat) else \
            (self.b.shape(val), self.b.dtype(val))
        want = (tuple(var.aval.shape), dtype_name(var.aval.dtype))
        if (shape, dtype) != want:
            raise JaxImportError(f"{eqn.primitive.name} mapped to a {dtype}{list(shape)} value but JAX gives "
                                 f"{want[1]}{list(want[0])} (equation: {eqn})")

    # ------------------------------------------------------------ emitting
    def op(self, prim: str, inputs: Sequence[str], **kw: Any) -> str:
        return self.b.one(prim, list(inputs), **kw)

    def tensor(self, v: Value, shape: Sequence[int] | None = None) -> str:
        """`v` as a tensor; a splat becomes a `full` op (of `shape` if given)."""
        if isinstance(v, str):
            return v
        return self.op("full", [], name="full", shape=tuple(v.shape if shape is None else shape),
                       value=v.value, dtype=v.dtype)

    def broadcast(self, x: str, shape: Sequence[int], dims: Sequence[int]) -> str:
        """broadcast_in_dim, composed with the broadcast that made `x` if there is one."""
        shape, dims = tuple(shape), tuple(dims)
        if self.b.shape(x) == shape:
            return x
        if x in self._bcast:
            x, inner = self._bcast[x]
            dims = tuple(dims[d] for d in inner)
        out = self.op("broadcast", [x], shape=shape, dims=dims)
        self._bcast[out] = (x, dims)
        return out

    def broadcast_to(self, x: str, shape: tuple[int, ...]) -> str:
        """JAX's implicit broadcast of a binary operand: rank 0, or size-1 axes."""
        rank = len(self.b.shape(x))
        return self.broadcast(x, shape, () if rank == 0 else range(rank))

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        shape = tuple(shape)
        if isinstance(x, Splat):
            return Splat(x.value, shape, x.dtype)
        if self.b.shape(x) == shape:
            return x
        src = self._bcast.get(x, (None,))[0]
        if src is not None and self.b.shape(src) == shape:  # undo a broadcast that only added unit axes
            return src
        out = self.op("reshape", [x], shape=shape)
        dims = _unit_insertion(self.b.shape(x), shape)
        if dims is not None:
            # Adding unit axes is a broadcast: one that follows composes with it, so a
            # bias reaches its add as one broadcast of the parameter, and its gradient
            # is the reduction that makes it (not a reshape of one).
            self._bcast[out] = (x, dims)
        return out

    def ew(self, fn: str, ins: Sequence[Value], out: tuple[tuple[int, ...], str]) -> Value:
        """`fn` of `ins`, of (shape, dtype) `out`; folded when all operands are splats."""
        shape, dtype = out
        splats = [i for i, v in enumerate(ins) if isinstance(v, Splat)]
        if len(splats) == len(ins) and fn in FOLD:
            with np.errstate(all="ignore"):
                value = FOLD[fn](*(v.value for v in ins))
            return Splat(py_scalar(value, dtype), shape, dtype)
        if len(ins) == 2 and len(splats) == 1:
            (pos,) = splats
            x = self.broadcast_to(ins[1 - pos], shape)
            return self.op("elementwise", [x], name=fn, fn=fn, scalar=ins[pos].value, scalar_pos=pos)
        xs = [self.tensor(v, shape) if isinstance(v, Splat) else self.broadcast_to(v, shape) for v in ins]
        return self.op("elementwise", xs, name=fn, fn=fn)


# ----------------------------------------------------------------- finish
def _finish(b: GraphBuilder, loss: str, meta: dict[str, Any], split: set[str] = frozenset()) -> OpGraph:
    """Drop ops that do not reach the loss, number the layers left 0..n-1, drop stacked
    parameters that were split per scan iteration, name the loss ``loss`` and build
    the graph."""
    live, ops = {loss}, []
    for op in reversed(b.ops):
        if live.intersection(op.outputs):
            live.update(op.inputs)
            ops.append(op)
    ops.reverse()
    whole = sorted(split & live)
    if whole:
        raise JaxImportError(f"parameter {whole[0]!r} is both scanned over and read whole; alpasim splits a "
                             f"scanned parameter into one per iteration")
    number = {layer: n for n, layer in enumerate(sorted({op.layer for op in ops}))}
    ops = [op.replace(layer=number[op.layer]) for op in ops]
    if len(number) == 1:    # no scan: a loop over blocks is read from the parameter paths
        blocks = block_layers(ops, b.tensors)
        if blocks is not None:
            ops, copies = blocks
            b.tensors.update(copies)
            live.update(copies)
    rename = {loss: "loss"} if "loss" not in b.tensors else {}
    sub = lambda t: rename.get(t, t)  # noqa: E731
    ops = [op.replace(inputs=tuple(map(sub, op.inputs)), outputs=tuple(map(sub, op.outputs))) for op in ops]
    tensors = {sub(n): Tensor(sub(n), t.shape, t.dtype, t.role) for n, t in b.tensors.items()
               if (t.role != "activation" or n in live) and n not in split}
    return OpGraph(b.name, tensors, ops, b.inputs, [sub(loss)], meta)


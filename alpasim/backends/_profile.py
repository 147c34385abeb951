"""`alpasim profile`: microbenchmarks on the current JAX backend, fitted into a cost model.

What is timed, and how (the choices matter for predictions of real runs):

- Compute ops are this package's own lowerings (`eval_op`) of small graphs ops —
  square einsums, elementwise add/tanh, softmax, layer norm — jitted on a mesh of
  *all* devices with the batch dimension sharded, so every device runs its shard at
  once: what a pipeline stage does, and on a CPU with virtual devices (threads that
  share the cores) a shard is slower when all devices are busy. The sample's FLOPs
  and bytes are one shard's, from the same `op_flops`/`traffic_bytes` the models use.
- Inside a stage an op costs its kernel, not a jit dispatch (~0.2 ms for 8 CPU devices,
  recorded as `meta.dispatch_s`). Each op therefore runs in a `lax.fori_loop` with a
  traced trip count, one compilation timed at 1 and at 1 + K iterations; the sample is
  (T(1 + K) - T(1)) / K. The loop carries the op's output into its next input (shape
  preserving ops only; einsum weights are orthogonal so values neither blow up nor
  decay into denormals).
- Convolutions: conv2d, its input gradient and its filter gradient (each its own op
  class: on XLA:CPU the transposed convolutions of the backward are other algorithms,
  3-50x slower per FLOP at a few dozen channels) over shard shapes like a small
  Wide-ResNet's — (batch, image, image, C), C -> C, kernel 1 or 3, 'same' padding —
  inside `shard_map` on the same all-device mesh, so a filter gradient's sum over the
  batch stays local (in a stage its all-reduce is a planned collective). The filter
  gradient's output is not the carry's shape: 1e-30 x its sum is added to the carry.
- Collectives (all-reduce, all-gather, reduce-scatter, all-to-all) run the same way
  inside `shard_map` on an (N/n, n) mesh over its axis of size n in {2, 4, 8} — all N
  devices busy, n per group. All-gather and reduce-scatter need a local slice or tile
  to keep the loop's shape: their samples include that copy.
- send_recv is `jax.device_put` of one device's array to another device, timed whole
  (dispatch included): that is how the runtime moves tensors between meshes.

Every time is the median of several runs after a warm-up, with `block_until_ready`.
The fit (weighted non-negative least squares) is `alpasim.costmodels.fit_profile`.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpasim.costmodels import (
    Cluster,
    CollectiveSample,
    Device,
    Link,
    OpSample,
    ProfiledCostModel,
    fit_profile,
    host_memory_bytes,
    op_class,
    traffic_bytes,
)
from alpasim.graphs import Op, Tensor, op_flops

from ._lowering import eval_op

# Each timed loop aims at this much work, so that T(1 + K) - T(1) stands well above
# the run-to-run noise of a dispatch (tens of microseconds on a CPU).
TARGET_LOOP_S = 4e-3
MAX_LOOP_ITERATIONS = 32
# ... and the loop must be at least this share of T(1 + K); else K grows up to the max.
MIN_LOOP_SHARE = 0.3
MAX_RETRY_LOOP_S = 0.02
# Rough rates used only to pick K before anything is measured.
GUESS_FLOPS_PER_S = 1e10
GUESS_BYTES_PER_S = 2e9


@dataclass(frozen=True, slots=True)
class ProfileSizes:
    """The benchmark grid: per-shard sizes of each op family and collective bytes."""

    matmul: tuple[tuple[int, int], ...]     # (m, k): shard x (1, m, k) times w (k, k)
    elements: tuple[int, ...]               # elementwise shard sizes
    rows: tuple[tuple[int, int], ...]       # (rows, hidden) for softmax / layer norm
    convs: tuple[tuple[int, int, int, int], ...]  # (batch, image, C, k): shard (batch, image, image, C), C -> C
    collective_bytes: tuple[int, ...]       # S per collective (costmodels conventions)
    axis_sizes: tuple[int, ...]
    repeats: int


FULL = ProfileSizes(matmul=((32, 64), (128, 128), (512, 128), (256, 256), (256, 512), (512, 512)),
                    elements=(1 << 12, 1 << 15, 1 << 18, 1 << 20),
                    rows=((32, 128), (256, 256), (1024, 512), (4096, 256)),
                    convs=((2, 32, 8, 3), (2, 16, 16, 3), (2, 32, 16, 1), (2, 8, 32, 3), (2, 16, 64, 1), (8, 4, 64, 3),
                           (8, 4, 64, 1), (8, 2, 128, 3), (8, 4, 128, 1), (8, 2, 256, 1)),
                    collective_bytes=(1 << 13, 1 << 16, 1 << 19, 1 << 22), axis_sizes=(2, 4, 8), repeats=7)
QUICK = ProfileSizes(matmul=((32, 64), (128, 128), (256, 256)), elements=(1 << 12, 1 << 16, 1 << 20),
                     rows=((32, 128), (256, 256), (2048, 256)),
                     convs=((2, 16, 16, 3), (2, 32, 16, 1), (8, 4, 64, 3), (8, 2, 128, 1)),
                     collective_bytes=(1 << 14, 1 << 21), axis_sizes=(2, 4, 8), repeats=3)


def _median_s(fn: Callable, args: Sequence, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm caches and thread pools
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _loop_iterations(guess_s: float) -> int:
    return int(min(MAX_LOOP_ITERATIONS, max(2, math.ceil(TARGET_LOOP_S / max(guess_s, 1e-7)))))


def _loop(step: Callable, shardings: Sequence) -> Callable:
    """`step` (carry -> carry on args[0]) inside a fori_loop with a traced trip count:
    one compilation serves every K, and every timing of the same case."""
    def loop(n, x, *rest):
        return lax.fori_loop(0, n, lambda _, c: step(c, *rest), x)

    return jax.jit(loop, in_shardings=(None, *shardings), out_shardings=shardings[0])


def _per_iteration_s(fn: Callable, args: Sequence, guess_s: float, repeats: int) -> float:
    """(T(1 + K) - T(1)) / K of a `_loop` function."""
    k = _loop_iterations(guess_s)
    once = _median_s(fn, (1, *args), repeats)
    while True:
        many = _median_s(fn, (1 + k, *args), repeats)
        # The loop must stand well above the noise of `once` (the guess was too slow).
        per_iteration = max((many - once) / k, once / (1 + k) * MIN_LOOP_SHARE)
        if many - once >= MIN_LOOP_SHARE * many or 4 * k * per_iteration > MAX_RETRY_LOOP_S:
            return per_iteration
        k *= 4


# ------------------------------------------------------------------ compute
def _compute_cases(sizes: ProfileSizes) -> list[tuple[Op, dict[str, Tensor]]]:
    """Per-shard ops whose first input is carried through the loop (shape preserving)."""
    cases = []

    def case(prim: str, params: dict, ins: list[Tensor], name: str) -> None:
        tensors = {t.name: t for t in ins}
        tensors["y"] = Tensor("y", ins[0].shape, "float32")
        cases.append((Op(name, prim, tuple(t.name for t in ins), ("y",), params), tensors))

    for m, k in sizes.matmul:
        case("einsum", {"equation": "bmk,kn->bmn"},
             [Tensor("x", (1, m, k), "float32"), Tensor("w", (k, k), "float32", "param")], f"einsum {m}x{k}x{k}")
    for n in sizes.elements:
        case("elementwise", {"fn": "add"}, [Tensor("x", (1, n), "float32"), Tensor("b", (1, n), "float32")],
             f"add {n}")
        case("elementwise", {"fn": "tanh"}, [Tensor("x", (1, n), "float32")], f"tanh {n}")
    for r, h in sizes.rows:
        case("softmax", {"axis": -1}, [Tensor("x", (1, r, h), "float32")], f"softmax {r}x{h}")
        case("layer_norm", {}, [Tensor("x", (1, r, h), "float32"), Tensor("g", (h,), "float32", "param"),
                                Tensor("beta", (h,), "float32", "param")], f"layer_norm {r}x{h}")
    return cases


def _conv_cases(sizes: ProfileSizes) -> list[tuple[Op, dict[str, Tensor]]]:
    """conv2d, its input gradient and its filter gradient, stride 1 and 'same' padding
    with C -> C channels, so that the first input (x, dy, x) is carried by the loop."""
    cases = []
    for batch, image, c, k in sizes.convs:
        x, w = Tensor("x", (batch, image, image, c), "float32"), Tensor("w", (k, k, c, c), "float32", "param")
        dy = Tensor("dy", x.shape, "float32")
        geo = {"strides": (1, 1), "padding": ((k // 2, k // 2), (k // 2, k // 2))}
        shape = f"{batch}x{image}x{image}x{c} k{k}"
        for prim, ins, out, extra in (("conv2d", [x, w], x, {}),
                                      ("conv2d_input_grad", [dy, w], x, {"input_shape": x.shape}),
                                      ("conv2d_filter_grad", [x, dy], w, {"filter_shape": w.shape})):
            tensors = {t.name: t for t in ins}
            tensors["y"] = Tensor("y", out.shape, "float32")
            cases.append((Op(f"{prim} {shape}", prim, tuple(t.name for t in ins), ("y",), {**geo, **extra}),
                          tensors))
    return cases


def _grid_cases(sizes: ProfileSizes) -> list[tuple[Op, dict[str, Tensor]]]:
    """Every compute case of the grid, in the order `time_compute` samples them."""
    return _compute_cases(sizes) + _conv_cases(sizes)


def _conv_step(op: Op, mesh: Mesh) -> Callable:
    """carry -> carry of one device's shard (`shard_map`: a filter gradient's sum over
    the batch stays local, as in a stage, where its all-reduce is a planned collective).
    A filter gradient does not have the carry's shape: 1e-30 x its sum (a pass over the
    small filter) is added to the carry, which keeps the loop from hoisting it."""
    specs = tuple(P() if t == "w" else P("d") for t in op.inputs)

    def local(x, *rest):
        y = eval_op(op, (x, *rest))[0]
        return x + 1e-30 * jnp.sum(y) if y.shape != x.shape else y

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("d"), check_vma=False)


def _operand(t: Tensor, mesh: Mesh, rng: np.random.Generator) -> tuple[jax.Array, NamedSharding]:
    """A global array whose dim 0 is sharded over every device (params replicated)."""
    if t.role == "param" and len(t.shape) == 4:  # a conv filter, scaled to keep the carry's variance
        value = rng.standard_normal(t.shape) / math.sqrt(t.shape[0] * t.shape[1] * t.shape[2])
        sharding = NamedSharding(mesh, P())
    elif t.role == "param":
        value = np.linalg.qr(rng.standard_normal(t.shape))[0] if len(t.shape) == 2 else rng.standard_normal(t.shape)
        sharding = NamedSharding(mesh, P())
    else:
        value = rng.standard_normal((t.shape[0] * mesh.size, *t.shape[1:]))
        sharding = NamedSharding(mesh, P("d"))
    # Placed from the host: a device array would be converted and sliced by programs of
    # its own, two compilations per operand (a quarter of a quick profile's).
    return jax.device_put(np.asarray(value, np.float32), sharding), sharding


def time_compute(mesh: Mesh, sizes: ProfileSizes, log: Callable[[str], None],
                 cases: Sequence[tuple[Op, dict[str, Tensor]]] | None = None, rounds: int = 1) -> list[OpSample]:
    """One sample per case; with `rounds` > 1, the least of that many timings of one
    compilation (interference only ever adds time)."""
    rng = np.random.default_rng(0)
    samples = []
    for op, tensors in cases if cases is not None else _grid_cases(sizes):
        flops = op_flops(op, tensors)
        nbytes = traffic_bytes(op, tensors)
        args, shardings = zip(*(_operand(tensors[t], mesh, rng) for t in op.inputs))
        if op.prim.startswith("conv2d"):
            step = _conv_step(op, mesh)
        else:
            step = lambda x, *rest, op=op: eval_op(op, (x, *rest))[0]  # noqa: E731
        guess = flops / GUESS_FLOPS_PER_S + nbytes / GUESS_BYTES_PER_S
        fn = _loop(step, shardings)
        t = min(_per_iteration_s(fn, args, guess, sizes.repeats) for _ in range(rounds))
        samples.append(OpSample(op_class(op), flops, nbytes, t))
        log(f"{op.name:<34} {t * 1e6:10.1f} us")
    return samples


# ------------------------------------------------------------------ collectives
def _collective_step(kind: str, n: int) -> Callable:
    """carry -> carry on one device's buffer, running collective `kind` over axis 'c' of size n."""
    if kind == "all_reduce":
        return lambda x: lax.psum(x, "c")
    if kind == "all_gather":
        return lambda x: lax.all_gather(x, "c", tiled=True)[: x.shape[0]]
    if kind == "reduce_scatter":
        return lambda x: jnp.tile(lax.psum_scatter(x, "c", tiled=True), n)
    return lambda x: lax.all_to_all(x.reshape(n, -1), "c", 0, 0).reshape(x.shape)


def time_collectives(devices: Sequence, sizes: ProfileSizes, log: Callable[[str], None],
                      kinds: Sequence[str] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"),
                      ) -> list[CollectiveSample]:
    samples = []
    total = len(devices)
    for n in sizes.axis_sizes:
        if n > total or total % n:
            continue
        mesh = Mesh(np.array(devices).reshape(total // n, n), ("r", "c"))
        spec = P(("r", "c"))
        sharding = NamedSharding(mesh, spec)
        for kind in kinds:
            fn = _loop(jax.shard_map(_collective_step(kind, n), mesh=mesh, in_specs=spec, out_specs=spec),
                       (sharding,))
            for nbytes in sizes.collective_bytes:
                # all-gather's S is the gathered tensor: each device starts with S / n.
                per_device = nbytes // n if kind == "all_gather" else nbytes
                elems = max(per_device // 4 // n, 1) * n  # divisible by n for scatter / all-to-all
                x = jax.device_put(np.zeros((elems * total,), np.float32), sharding)  # zeros: psum never overflows
                t = _per_iteration_s(fn, (x,), 2 * nbytes / GUESS_BYTES_PER_S, sizes.repeats)
                s = elems * 4 * (n if kind == "all_gather" else 1)
                samples.append(CollectiveSample(kind, n, s, t))
                log(f"{kind:<15} n={n} {s:>9} B {t * 1e6:10.1f} us")
    return samples


def time_send_recv(devices: Sequence, sizes: ProfileSizes, log: Callable[[str], None]) -> list[CollectiveSample]:
    if len(devices) < 2:
        return []
    samples = []
    for nbytes in sizes.collective_bytes:
        x = jax.device_put(np.ones((nbytes // 4,), np.float32), devices[0])
        t = _median_s(lambda a: jax.device_put(a, devices[1]), (x,), sizes.repeats)
        samples.append(CollectiveSample("send_recv", 2, nbytes // 4 * 4, t))
        log(f"{'send_recv':<15} n=2 {nbytes:>9} B {t * 1e6:10.1f} us")
    return samples


def time_concurrency_scale(devices: Sequence, sizes: ProfileSizes, full: Sequence[OpSample],
                           full_collectives: Sequence[CollectiveSample],
                           log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """How an op's shard time changes when only the first n devices are busy.

    The grid is timed with every device busy. A pipeline stage on this host runs on a
    mesh of n devices while the others idle (the local runtime runs one mesh at a
    time), and on a CPU whose cores the virtual devices share, that is not simply
    n / N of the contention: on this 2-core host, 4 of 8 devices ran matmuls and
    elementwise ops about twice as fast as all 8, 1 of 8 five to ten times as fast,
    normalisation only three to four times. So per op class, the largest
    case of the grid is timed again on the first n devices (n = 1, 2, 4, ... < N) and
    the ratio to its all-devices time is kept (each side the lesser of two timings);
    "collective" is an all-reduce over pairs of devices, the largest size, timed once
    against the grid's time. Returns {str(n): {class: ratio}}.
    """
    total = len(devices)
    cases = _grid_cases(sizes)
    largest: dict[str, int] = {}
    for i, sample in enumerate(full):
        j = largest.get(sample.op_class)
        if j is None or sample.flops + sample.nbytes > full[j].flops + full[j].nbytes:
            largest[sample.op_class] = i
    pair = {s.nbytes: s.time_s for s in full_collectives if (s.kind, s.axis_size) == ("all_reduce", 2)}
    picked = sorted(largest.values())
    picked_cases = [cases[i] for i in picked]
    # The all-devices reference is the grid's time or a second timing now, whichever is
    # less; each subset is timed twice and its lesser time kept. Interference only ever
    # adds time, and one slow sample of either side made a ratio of 0.2 read 1.2.
    reference = [min(full[i].time_s, a.time_s) for i, a in
                 zip(picked, time_compute(Mesh(np.array(devices), ("d",)), sizes, lambda _: None, picked_cases),
                     strict=True)]
    out: dict[str, dict[str, float]] = {}
    n = 1
    while n < total:
        if total % n == 0:
            mesh = Mesh(np.array(devices[:n]), ("d",))
            again = time_compute(mesh, sizes, lambda _: None, picked_cases, rounds=2)
            scale = {full[i].op_class: a.time_s / r for i, a, r in zip(picked, again, reference, strict=True)}
            if n >= 2 and pair:
                top = max(pair)
                sub = dataclasses.replace(sizes, collective_bytes=(top,), axis_sizes=(2,))
                (one,) = time_collectives(list(devices[:n]), sub, lambda _: None, kinds=("all_reduce",))
                scale["collective"] = one.time_s / pair[one.nbytes]
            out[str(n)] = scale
            log(f"busy {n} of {total} devices: " + ", ".join(f"{c} x{f:.2f}" for c, f in sorted(scale.items())))
        n *= 2
    return out


def dispatch_s(mesh: Mesh, repeats: int) -> float:
    """Seconds of one jitted call of a trivial op on every device of `mesh` (any axes)."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    x = jax.device_put(np.ones((mesh.size,), np.float32), sharding)
    return _median_s(jax.jit(lambda a: a + 1.0, out_shardings=sharding), (x,), repeats)


# ------------------------------------------------------------------ entry point
def host_cluster(model: ProfiledCostModel, num_devices: int) -> Cluster:
    """One node of the profiled devices, with the fitted rates as its datasheet.

    Peak = 1 / seconds_per_flop of matmuls, memory bandwidth = 1 / seconds_per_byte of
    elementwise ops, memory = the host's RAM shared evenly (what virtual CPU devices get).
    """
    mm, ew = model.ops["matmul"], model.ops["elementwise"]
    peak = 1.0 / mm.seconds_per_flop if mm.seconds_per_flop > 0 else 1e12
    bandwidth = 1.0 / ew.seconds_per_byte if ew.seconds_per_byte > 0 else 1e12
    ram = host_memory_bytes() or 2 ** 34
    device = Device(model.name, {"float32": peak}, max(int(ram // num_devices), 1), bandwidth)
    return Cluster(f"{model.name} host", 1, num_devices, device, model.link,
                   Link("none (one host)", model.link.bandwidth_gbps, model.link.latency_s))


def profile_backend(*, quick: bool = False, devices: Sequence | None = None,
                    log: Callable[[str], None] = lambda _: None) -> ProfiledCostModel:
    """Time the benchmark grid (`QUICK` or `FULL`) on `devices` (default: all) and fit.

    The result is bound to `host_cluster` (one node of these devices); bind it to the
    cluster you plan for with `with_cluster`.
    """
    t0 = time.perf_counter()
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < 2:
        raise ValueError("profile: collectives need at least 2 devices; on a CPU set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 (or --cpu-devices 8)")
    sizes = QUICK if quick else FULL
    mesh = Mesh(np.array(devices), ("d",))
    ops = time_compute(mesh, sizes, log)
    collectives = time_collectives(devices, sizes, log) + time_send_recv(devices, sizes, log)
    scale = time_concurrency_scale(devices, sizes, ops, collectives, log)
    platform_name = devices[0].platform
    name = f"{platform_name} x{len(devices)}"
    meta = {"platform": platform_name, "device_kind": devices[0].device_kind, "num_devices": len(devices),
            "concurrency": len(devices), "host": platform.node(), "jax_version": jax.__version__,
            "grid": "quick" if quick else "full", "dispatch_s": dispatch_s(mesh, sizes.repeats),
            "concurrency_scale": scale}
    # The host cluster is made of the fitted rates, so the fit binds to a stand-in first.
    placeholder = Cluster("unbound", 1, len(devices), Device("unbound", {"float32": 1.0}, 1, 1.0),
                          Link("unbound", 1.0, 0.0), Link("unbound", 1.0, 0.0))
    meta["profile_s"] = time.perf_counter() - t0
    model = fit_profile(ops, collectives, placeholder, name=name, meta=meta)
    return model.with_cluster(host_cluster(model, len(devices)))

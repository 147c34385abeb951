"""`alpasim profile`: measure this machine's devices into a profiled cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table


from ._common import JsonOpt, app, emit_json, ensure_cpu_devices, fail, note, out, writable_file, writing


@app.command()
def profile(
    out_path: Annotated[Path, typer.Option("--out", help="Write the fitted cost model JSON here.")] = Path(
        "profile.json"),
    quick: Annotated[bool, typer.Option("--quick", help="A smaller benchmark grid (about 15 s on 2 CPU "
                                        "cores instead of about 30 s).")] = False,
    cpu_devices: Annotated[Optional[int], typer.Option("--cpu-devices", help="On the CPU: run as this many "
                                                       "virtual devices (default: XLA_FLAGS, else 8).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Microbenchmark ops and collectives on the current JAX backend and fit a cost model.

    The JSON it writes is what `plan --cost-model` and `simulate --cost-model` read.
    Collectives need at least two devices; on a CPU it asks XLA for 8 virtual devices
    unless XLA_FLAGS sets a count or `--cpu-devices` another."""
    writable_file(out_path, "--out")
    if cpu_devices is None:
        ensure_cpu_devices(8)
    else:
        if cpu_devices < 1:
            fail(f"--cpu-devices must be at least 1, got {cpu_devices}")
        import jax

        jax.config.update("jax_num_cpu_devices", cpu_devices)
    from alpasim import backends

    model = backends.profile_backend(quick=quick, log=lambda line: note(f"profile: {line}"))
    with writing(out_path, "--out"):
        model.save(out_path)
    if as_json:
        emit_json({"out": str(out_path), **model.to_json()})
        return
    t = Table(title=f"profile {model.name} ({model.meta['grid']} grid, {model.meta['profile_s']:.1f} s)")
    for col in ("op class", "launch", "GFLOP/s", "GB/s", "fit error (rms)"):
        t.add_column(col)
    errors = model.meta["rms_relative_error"]
    for c, f in model.ops.items():
        t.add_row(c, f"{f.launch_s * 1e6:.1f} us", f"{1e-9 / f.seconds_per_flop:.1f}" if f.seconds_per_flop else "-",
                  f"{1e-9 / f.seconds_per_byte:.1f}" if f.seconds_per_byte else "-", f"{errors[f'op:{c}']:.0%}")
    out.print(t)
    out.print(f"fitted link: {model.link.bandwidth_gbps:.1f} Gbit/s, {model.link.latency_s * 1e6:.1f} us latency; "
              f"jit dispatch {model.meta['dispatch_s'] * 1e6:.0f} us; wrote {out_path}")

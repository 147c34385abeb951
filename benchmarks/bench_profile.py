"""How long `alpasim profile` takes on this machine, and what it fits.

Runs the quick and the full grid on 8 virtual CPU devices (each in its own process,
as the CLI would) and prints wall time, the per-class compute fits, a few collective
fits and the effective link. On a 2-core machine the 8 devices are threads sharing
the cores, so the numbers are those of a busy stage, not of one idle device. The wall
and measuring times are also given in reference units (seconds / the reference loop's,
`_reference`, timed in this process before the first grid and again at the end).

    .venv/bin/python benchmarks/bench_profile.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_profile` from the repository root
    from benchmarks._reference import in_ref, print_reference


def profile(grid: str) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        args = [sys.executable, "-m", "alpasim.cli", "profile", "--cpu-devices", "8", "--out", str(out), "--json"]
        t0 = time.perf_counter()
        subprocess.run(args + (["--quick"] if grid == "quick" else []), check=True, capture_output=True)
        return time.perf_counter() - t0, json.loads(out.read_text())


def main(grids: tuple[str, ...] = ("quick", "full")) -> None:
    ref_s = print_reference()
    for grid in grids:
        wall, p = profile(grid)
        meta = p["meta"]
        print(f"{grid}: {wall:.1f} s wall ({meta['profile_s']:.1f} s measuring, {meta['samples']} samples), "
              f"jit dispatch {meta['dispatch_s'] * 1e6:.0f} us; wall {in_ref(wall, ref_s)} ref, "
              f"measuring {in_ref(meta['profile_s'], ref_s)} ref")
        for c, f in p["ops"].items():
            gflops = f"{1e-9 / f['seconds_per_flop']:.1f} GFLOP/s" if f["seconds_per_flop"] else "-"
            gbps = f"{1e-9 / f['seconds_per_byte']:.1f} GB/s" if f["seconds_per_byte"] else "-"
            print(f"  {c:<14} launch {f['launch_s'] * 1e6:6.1f} us  {gflops:>16}  {gbps:>12}  "
                  f"rms err {meta['rms_relative_error'][f'op:{c}']:.0%}")
        for kind in ("all_reduce", "all_gather", "all_to_all"):
            for n, f in sorted(p["collectives"][kind].items(), key=lambda kv: int(kv[0])):
                print(f"  {kind:<14} n={n}  alpha {f['alpha_s'] * 1e6:6.1f} us  "
                      f"{1e-9 / max(f['seconds_per_byte'], 1e-30):.2f} GB/s")
        link = p["link"]
        print(f"  link {link['bandwidth_gbps']:.1f} Gbit/s, {link['latency_s'] * 1e6:.1f} us", flush=True)
    print_reference("at the end")


if __name__ == "__main__":
    main()

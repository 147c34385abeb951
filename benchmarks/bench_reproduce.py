"""Wall time of `alpasim reproduce fig7a` with a cold cache and again warm.

Cold: a fresh temporary ALPASIM_CACHE_DIR, so every point (and every layer solve
under it) is planned from scratch; warm: the same command again, every point a cache
hit. The issue asks for cold under 10 minutes on the 2-core dev machine and warm in
seconds. Each line also gives the wall and CPU seconds in reference units (seconds /
the reference loop's, `_reference`, timed in this process before the cold run and again
at the end).

    .venv/bin/python benchmarks/bench_reproduce.py [--figure fig7a] [--max-gpus N] [--workers 2]
        [--out-dir DIR] [--cache-dir DIR]

`--out-dir` keeps the figure's files (e.g. `docs/figures`); `--cache-dir` names a new,
empty cache directory to fill instead of a temporary one (so the cold run also warms a
cache that later commands can use).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_reproduce` from the repository root
    from benchmarks._reference import in_ref, print_reference


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; CPU counts the command and its worker processes,
    so it stays comparable when other jobs share the machine."""
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, _children_cpu_s() - cpu0


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--figure", default="fig7a")
    ap.add_argument("--max-gpus", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out-dir")
    ap.add_argument("--cache-dir")
    args = ap.parse_args()
    if args.cache_dir and os.path.exists(args.cache_dir) and os.listdir(args.cache_dir):
        sys.exit(f"--cache-dir {args.cache_dir} is not empty: a cold run needs an empty cache")
    with tempfile.TemporaryDirectory(prefix="alpasim-bench-") as tmp:
        env = {**os.environ, "ALPASIM_CACHE_DIR": args.cache_dir or os.path.join(tmp, "cache")}
        cmd = [sys.executable, "-m", "alpasim.cli", "reproduce", args.figure, "--out-dir",
               args.out_dir or os.path.join(tmp, "out"), "--workers", str(args.workers)]
        if args.max_gpus:
            cmd += ["--max-gpus", str(args.max_gpus)]
        ref_s = print_reference()
        for what in ("cold", "warm"):
            wall, cpu = timed(cmd, env)
            print(f"reproduce {args.figure}: {what} cache {wall:.1f} s wall, {cpu:.1f} s CPU "
                  f"(load average {os.getloadavg()[0]:.1f}); wall {in_ref(wall, ref_s)} ref, "
                  f"CPU {in_ref(cpu, ref_s)} ref", flush=True)
        print_reference("at the end")


if __name__ == "__main__":
    main()

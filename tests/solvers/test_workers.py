"""Planner worker processes never outlive the planner, and Ctrl-C stops it at once.

Independent check: the kernel's own process table (/proc), read before and after the
parent `alpasim plan` is killed, interrupted or terminated mid-search; and the cache
directory afterwards, every entry of which must still parse.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.serial,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table in /proc")]

def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def start_plan(tmp_path: Path, cli) -> tuple[subprocess.Popen, list[int]]:
    """`alpasim plan` of a model that plans for about 20 s, once its two pool workers
    run and the planner has cached its first result (the pool's first job, its longest,
    handed back), so a signal lands in the middle of the ILP solves."""
    proc = cli.popen("plan", "--model", "gpt3-2.6b", "--nodes", "1", "--workers", "2", "--json",
                     env={"ALPASIM_CACHE_DIR": str(tmp_path / "cache")})
    deadline = time.monotonic() + 60
    cached = lambda: any((tmp_path / "cache").rglob("*.json"))  # noqa: E731
    while not (cached() and len(children(proc.pid)) >= 2) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = children(proc.pid)
    assert len(workers) >= 2 and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else workers
    assert cached(), "no stage cost cached within 60 s"
    return proc, workers


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_no_worker_outlives_the_planner(tmp_path, sig, cli):
    proc, workers = start_plan(tmp_path, cli)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    stopped_s = time.monotonic() - t0
    if sig != signal.SIGKILL:
        # One line, the conventional status (128 + signal), within 2 s.
        assert proc.returncode == 128 + sig, err
        lines = err.strip().splitlines()            # the planner's progress lines, then the one error
        assert lines[-1] == "alpasim: error: " + ("interrupted" if sig == signal.SIGINT else "terminated")
        assert all(ln.startswith("alpasim: alpa: ") for ln in lines[:-1]) and "Traceback" not in err
        assert stopped_s < 2.0
    deadline = time.monotonic() + 5.0
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if alive(w)]
    entries = list((tmp_path / "cache").rglob("*"))
    assert not [e for e in entries if e.suffix == ".tmp"]
    for e in entries:
        if e.is_file():
            json.loads(e.read_text())

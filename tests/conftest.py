"""The test session's own directories, and one way to run the `alpasim` command.

Hermetic: a test reads and writes nothing outside directories this session made. Every
place a command or a library would persist something is pointed, before anything else
is imported, into one session root:

- `ALPASIM_CACHE_DIR`: the stage-cost cache (`solvers.DiskCache`), cold at the start, so
  a test that plans does its work on every machine, not only where `~/.cache/alpasim`
  happens to hold the answer (a warm home cache hid a 38 s plan behind a 1.9 s one).
- `HOME`, `XDG_CACHE_HOME`, `XDG_CONFIG_HOME`, `MPLCONFIGDIR`, `HF_HOME`: what
  matplotlib, Ray (`~/.ray`) and Hugging Face write under the user's home.
- `TMPDIR`, `RAY_TMPDIR`: Ray's session files (and `address="auto"`'s lookup of a running
  cluster, which must find this session's cluster, never the user's).
- `JAX_COMPILATION_CACHE_DIR`: one XLA compilation cache. Most of the backend tests'
  time is XLA:CPU compiling stage programs, and many tests (in this process and in CLI
  subprocesses) lower the same small plans on the same 8 virtual devices; a program
  compiled once is then loaded. Figures read from a loaded executable (XLA's memory
  analysis, the HLO's collectives) are those of the compiled one.
- Hypothesis keeps no example database (it would replay an earlier run's examples), and
  what else it stores (`HYPOTHESIS_STORAGE_DIRECTORY`, `.hypothesis/` by default) stays
  in the root.

XLA: eight virtual CPU devices, added to any `XLA_FLAGS` given (`make test`'s parallel
lane gives LLVM's optimisation level 0 and XLA:CPU's legacy fusion emitters there: see
the Makefile).

`make test` makes the root (`ALPASIM_TEST_ROOT`) and hands it to both of its pytest runs,
so the serial and the parallel lane share the stage cache (XLA's entries differ: XLA's
flags are part of their key, and the lanes compile at different levels); a plain `pytest`
makes its own.
pytest-xdist's workers inherit the environment, so they share the session's root. The
process that made the root removes it at the end. Variables that would point a test at
the user's own state (`RAY_ADDRESS`, `ALPASIM_*`) are dropped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT_VAR = "ALPASIM_TEST_ROOT"


def _session_root() -> tuple[Path, bool]:
    """The session's root directory, and whether this process made it (and removes it)."""
    given = os.environ.get(ROOT_VAR)
    if given:
        return Path(given), False
    root = Path(tempfile.mkdtemp(prefix="alpasim-test-"))
    os.environ[ROOT_VAR] = str(root)
    return root, True


def _isolate(root: Path) -> None:
    for name in [k for k in os.environ if k.startswith("ALPASIM_") and k != ROOT_VAR] + ["RAY_ADDRESS"]:
        os.environ.pop(name, None)
    dirs = {
        "ALPASIM_CACHE_DIR": "stage-cache",
        "HOME": "home",
        "XDG_CACHE_HOME": "home/.cache",
        "XDG_CONFIG_HOME": "home/.config",
        "MPLCONFIGDIR": "home/.config/matplotlib",
        "HF_HOME": "home/.cache/huggingface",
        "TMPDIR": "tmp",
        "RAY_TMPDIR": "tmp",
        "JAX_COMPILATION_CACHE_DIR": "xla-cache",
        "HYPOTHESIS_STORAGE_DIRECTORY": "hypothesis",
    }
    for var, sub in dirs.items():
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # OpenBLAS (numpy's, scipy's) starts a thread per core in every process that imports
    # it, and its threads spin while they wait for work: 0.125 CPU-s of each `alpasim
    # models --json` (15.33 CPU-s against 16.83 over 12 runs each, interleaved), in a
    # suite that starts dozens of processes (commands, CLI zygotes, Ray's workers and
    # actors) on two busy cores. Nothing here multiplies matrices big enough for a
    # second thread to pay; JAX's programs run on XLA's own threads. (pytest's own
    # process has numpy already, from jaxtyping's pytest plugin; its workers and every
    # child inherit this.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    tempfile.tempdir = None               # recomputed from TMPDIR at the next use


ROOT, _OWNED = _session_root()
_isolate(ROOT)

from alpasim._gc import relax_gc  # noqa: E402  (after the environment is the session's)

relax_gc()   # as the command does (alpasim/_gc.py): 8.7 CPU-s of collecting in the two workers, not 31.6

from hypothesis import settings  # noqa: E402  (after HOME moved)

settings.register_profile("hermetic", database=None)
settings.load_profile("hermetic")


def pytest_unconfigure(config):
    if _OWNED and not hasattr(config, "workerinput"):
        shutil.rmtree(ROOT, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# Scheduling on pytest-xdist's workers (`--dist loadscope`): a module's tests on one
# worker (its fixtures are built once), and every test marked `ray` (it uses a Ray
# cluster) on one worker, one after the other, so they share one cluster (`ray_cluster`)
# and at most one more, a command's own, runs beside it. The scheduler sees only test
# ids, so each worker writes the ids of its `ray` tests into the session root as it
# collects (every worker collects them all, before anything is scheduled). xdist's own
# groups are not used: pytest 9.2 ignores the id suffix they are made of
# (pytest-dev/pytest-xdist#1386).
RAY_TESTS = "ray-tests"


def pytest_collection_modifyitems(config, items):
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        ids = [item.nodeid for item in items if item.get_closest_marker("ray")]
        (ROOT / f"{RAY_TESTS}-{worker}.json").write_text(json.dumps(ids))


@pytest.hookimpl(optionalhook=True)          # a hook of pytest-xdist's: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRay(LoadScopeScheduling):
        """loadscope, with the `ray` tests of every module one scope, and the scopes
        that took longest (`module_seconds.json`) handed out first: the longest-first
        order keeps the last minutes from running one long module on one worker while
        the other idles."""

        _ray: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._ray is None:
                self._ray = {i for f in ROOT.glob(f"{RAY_TESTS}-*.json") for i in json.loads(f.read_text())}
            return "ray" if nodeid in self._ray else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The heaviest scope still queued goes next; the worker is sent the indexes
            # of its tests in its own collection, so the collections stay untouched.
            seconds = _module_seconds()
            heaviest = max(self.workqueue, key=lambda scope: seconds.get(scope, 0))   # the first of equals
            self.workqueue.move_to_end(heaviest, last=False)
            super()._assign_work_unit(node)

    return ModulesAndRay(config, log)


@functools.cache
def _module_seconds() -> dict[str, float]:
    """Seconds per scope from `module_seconds.json` (written by `tests/module_seconds.py`;
    "ray" is the Ray runtime's module, which holds most `ray` tests). Only an order: a
    missing or stale file changes which scope starts first, never what runs."""
    try:
        seconds = json.loads(Path(__file__).with_name("module_seconds.json").read_text())
    except (OSError, ValueError):
        return {}
    seconds["ray"] = seconds.get("tests/backends/test_ray_runtime.py", 0)
    return seconds


@pytest.fixture
def ray_cluster():
    """The local Ray cluster (2 CPUs) of a run of consecutive `ray` tests: the first one
    starts it, and it stops after the last (`pytest_runtest_teardown` below), so it is
    never up while an untouched test runs, such as a timed one of the serial lane. The
    scheduler above runs the `ray` tests of a worker one after the other, so they share
    one start (3 s and 5 CPU-seconds here). Its GCS address, for commands that join an
    existing cluster. A command that starts a cluster of its own (`sweep --ray`) starts
    it beside this one: `ray.init()` without an address joins only a cluster `ray start`
    made (ray_current_cluster), and the session's environment has no RAY_ADDRESS."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of consecutive `ray` tests (its fixtures torn down), the cluster
    `ray_cluster` started is stopped."""
    yield
    ray = sys.modules.get("ray")
    if (ray is not None and item.get_closest_marker("ray") is not None
            and (nextitem is None or nextitem.get_closest_marker("ray") is None) and ray.is_initialized()):
        ray.shutdown()


# ---------------------------------------------------------------------------------------
# The `alpasim` command, as a user runs it.


@dataclass(frozen=True)
class CliRun:
    """One finished `alpasim` command: what `subprocess.run` gives, and its wall time."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        """stderr's lines (a refusal is exactly one)."""
        return self.stderr.strip().splitlines()

    def json(self) -> dict:
        """stdout as the one JSON object of `--json`, after asserting the command succeeded."""
        assert self.returncode == 0, (self.args, self.stderr[-2000:])
        return json.loads(self.stdout)


def _entry_point() -> tuple[str, ...]:
    """The command a user types: the venv's console script, or `python -m alpasim.cli`."""
    script = Path(sys.executable).with_name("alpasim")
    return (str(script),) if script.exists() else (sys.executable, "-m", "alpasim.cli")


class Cli:
    """Runs the `alpasim` command as a new process and waits for it (`timeout` seconds,
    then it is killed), with the session's environment (its directories, XLA's flags)
    plus `env`, in a scratch directory of the session unless `cwd` is given (a default
    output path such as `out/sweep` lands there, never in the checkout).

    The process is forked from `cli_zygote.py`, which imported the command once for the
    session: the same `main()` the console script runs, in a process of its own, without
    importing alpasim again each time (0.35 s of a 0.45 s refusal). `fresh=True` runs the
    real entry point (`command`) instead, and `popen` starts it without waiting."""

    command = _entry_point()

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.runs = 0
        self.zygote: subprocess.Popen | None = None
        self._read = b""             # the zygote's answers read but not yet taken, a line at a time

    def environment(self, env: dict | None = None) -> dict:
        return {**os.environ, **(env or {})}

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 300,
                 cwd: Path | str | None = None, fresh: bool = False) -> CliRun:
        """The finished command; `fresh` starts the real entry point instead of a fork
        (what a time to the first line must include: importing everything)."""
        args = tuple(map(str, args))
        if fresh:
            t0 = time.perf_counter()
            proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout,
                                  env=self.environment(env), cwd=cwd or self.scratch)
            return CliRun(args, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0)
        self.runs += 1
        out, err = self.scratch / f"{self.runs}.out", self.scratch / f"{self.runs}.err"
        request = {"args": list(args), "env": self.environment(env), "cwd": str(cwd or self.scratch),
                   "stdout": str(out), "stderr": str(err)}
        t0 = time.perf_counter()
        code = self._fork(request, timeout)
        run = CliRun(args, code, out.read_text(), err.read_text(), time.perf_counter() - t0)
        out.unlink()
        err.unlink()
        return run

    def _fork(self, request: dict, timeout: float) -> int:
        """The exit status of the command `request` describes, run by the zygote. Killed
        on a time-out or when the test is interrupted, as `subprocess.run` does."""
        if self.zygote is None or self.zygote.poll() is not None:
            self.zygote = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                           env=self.environment())
            self._read = b""
        self.zygote.stdin.write((json.dumps(request) + "\n").encode())
        pid = int(self._answer(time.monotonic() + 60).split()[1])
        try:
            return int(self._answer(time.monotonic() + timeout).split()[2])
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._answer(time.monotonic() + 60)          # the killed child's exit line
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(request["args"], timeout) from None
            raise

    def _answer(self, deadline: float) -> str:
        """The zygote's next line, read straight from its pipe (no read-ahead buffer that
        `select` cannot see)."""
        while b"\n" not in self._read:
            ready, _, _ = select.select([self.zygote.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("alpasim", deadline)
            chunk = os.read(self.zygote.stdout.fileno(), 4096)
            assert chunk, "the CLI zygote died"
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return line.decode()

    def json(self, *args: str, **kwargs) -> dict:
        """`ARGS --json`, asserted to succeed, as its JSON object."""
        return self(*args, "--json", **kwargs).json()

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*self.command, *map(str, args)], env=self.environment(env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.scratch)

    def close(self) -> None:
        if self.zygote is None:
            return
        self.zygote.stdin.close()
        try:
            self.zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()


@pytest.fixture(scope="session")
def cli(tmp_path_factory) -> Cli:
    """The one way tests run the `alpasim` command (`Cli`)."""
    runner = Cli(tmp_path_factory.mktemp("cli"))
    yield runner
    runner.close()

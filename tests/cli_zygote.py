"""A process that has imported the `alpasim` command and forks one child per command run.

The test suite runs the `alpasim` command a few hundred times, and most of each run is
Python importing alpasim, numpy, typer and rich again (0.35 s of a 0.45 s refusal on
the 2-core machine). This process imports them once; each request forks a child that
is a fresh process in everything a test looks at (its own environment, working
directory, stdout, stderr, exit status, signal handlers), running the same `main()`
the console script runs. JAX is never imported here, so no child inherits its threads:
a command that needs JAX imports it in the child, after its environment is set.

Protocol, one JSON object a line on stdin: {"args", "env", "cwd", "stdout", "stderr"}
(the last two are file paths the child writes). For each, this process answers
"pid N" once the child runs and "exit N STATUS" when it ends (STATUS as
`subprocess` reports it: the exit code, or minus the signal that killed it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import alpasim.cli  # noqa: F401  (the point: imported once, before any fork)

# What commands import lazily, after the fork, in most runs: scipy.sparse (every command
# that builds an ILP, 150 ms of CPU each) and typer's parameter adapters (pydantic behind
# them; every command, 80 ms). Neither starts a thread.
import scipy.sparse  # noqa: F401

with contextlib.suppress(ImportError):     # a private module of recent typers only
    import typer._adapters  # noqa: F401


def _child(request: dict) -> None:
    """Become the command: never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdin = open(os.devnull)
        sys.argv = ["alpasim", *request["args"]]
        try:
            alpasim.cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    except BaseException:       # what the interpreter would print for an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()      # what the interpreter runs at exit; os._exit skips it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(f"exit {pid} {code}", flush=True)


if __name__ == "__main__":
    serve()

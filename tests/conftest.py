"""One XLA compilation cache for the whole test session.

Most of the backend tests' time is XLA:CPU compiling stage programs, and many tests
in this process and in CLI subprocesses lower the same small plans on the same 8
virtual devices (the runtime, memory and CLI tests); a program compiled once is then
loaded from JAX's persistent cache. (Ray actors inherit it too, but compile for their
own mesh's device count, so they rarely find another run's entry.) The cache lives in
a fresh directory per session, set before anything imports jax, so no run reads what
another left behind, and it is removed at the end. Figures read from a loaded
executable (XLA's memory analysis, the HLO's collectives) are those of the compiled one.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="alpasim-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)

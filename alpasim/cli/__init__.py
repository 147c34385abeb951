"""The `alpasim` command: one module per subcommand, sharing `_common`.

Every subcommand takes `--json` to print exactly one JSON object on stdout; tables
and progress go to the terminal otherwise, logs to stderr. A user mistake (unknown
name, malformed spec or file, impossible cluster) prints one line on stderr and exits
with status 2 — never a traceback. What a command reports is built in
`alpasim.experiments` (graph, intra-op, simulation and run reports, sweeps,
comparisons, reproductions); the modules here parse options and print.
"""

from __future__ import annotations

# Importing a command's module registers it with `app`, in the order `--help` lists them.
from . import catalog, graph, intra, plan, simulate, profile, run, reproduce, sweep, compare, validate  # noqa: F401
from ._common import USER_ERRORS as USER_ERRORS
from ._common import app as app
from ._common import main as main

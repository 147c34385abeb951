"""The one error a report builder raises for a user's mistake (a batch a graph cannot
take, a layer range out of bounds, a plan this machine cannot run, an output path that
cannot be written): the CLI prints it as one line and exits 2."""

from __future__ import annotations


class ReportError(ValueError):
    """A report that cannot be made from what the user asked for; the message says why."""

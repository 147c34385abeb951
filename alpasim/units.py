"""How every message and table writes a size: one formatter, binary units (GPU memory
is sold in GiB), the largest unit the size reaches with two decimals, so a budget of
1 KiB never reads "0.00 GiB"."""

from __future__ import annotations

import math

_UNITS = (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))


def format_bytes(x: float) -> str:
    """1.5 * 2**30 -> "1.50 GiB", 1024 -> "1.00 KiB", 12 -> "12 B" (negative and
    non-finite values as they are, so a bad value is never disguised)."""
    if not math.isfinite(x):
        return f"{x} B"
    for unit, scale in _UNITS:
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"

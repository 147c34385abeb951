"""Write `tests/module_seconds.json` from a JUnit XML report: seconds per test module,
which tests/conftest.py's scheduler uses to start the longest modules first.

    .venv/bin/python -m pytest -n 2 --dist loadscope -m "not serial" --junitxml=/tmp/j.xml
    .venv/bin/python tests/module_seconds.py /tmp/j.xml

The file only orders the work: a stale or missing entry changes which module starts
first, never what runs.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).with_name("module_seconds.json")
ROOT = Path(__file__).parent.parent


def module_seconds(report: Path) -> dict[str, int]:
    """Seconds per module file, from each test case's `classname` (the dotted module
    path, then any class names) and `time`."""
    totals: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and not (ROOT / ("/".join(parts) + ".py")).exists():
            parts.pop()
        totals["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return {m: round(s) for m, s in sorted(totals.items(), key=lambda kv: -kv[1]) if round(s) > 0}


if __name__ == "__main__":
    OUT.write_text(json.dumps(module_seconds(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {OUT}")

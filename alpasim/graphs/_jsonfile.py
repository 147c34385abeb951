"""Reading a JSON file as data, with errors that name the file (graphs, models, clusters, plans)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_file(path: str | Path, error: type[Exception]) -> Any:
    """Parsed JSON of `path`; `error(message)` when it is missing or not JSON."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{path}: is a directory, not a JSON file")
    if not p.is_file():
        raise error(f"{path}: no such file")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None

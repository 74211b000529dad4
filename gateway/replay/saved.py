"""The last replay report, kept in the data dir for the admin console."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

REPORT_FILE = "last-replay.json"


def save_report(report: dict[str, Any], data_dir: Path) -> Path:
    """Write the report atomically (the console may read it at any moment)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / REPORT_FILE
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".last-replay.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_report(data_dir: Path) -> dict[str, Any] | None:
    """The saved report, or None when there is none (or it does not read)."""
    try:
        loaded = json.loads((data_dir / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None

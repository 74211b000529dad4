"""What machine a benchmark ran on, printed with every result."""

from __future__ import annotations

import os
import platform
import sqlite3
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    """nproc, CPU model, Python and SQLite versions, platform."""
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
    }


def describe() -> str:
    return ", ".join(f"{k}={v}" for k, v in machine_info().items())

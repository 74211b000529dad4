"""The thread the control plane's database calls run on: :class:`Database` opens
``ControlPlaneStore`` there and runs each call there, so the event loop never waits on disk
and one process never contends with itself. ``PostgresDatabase`` (``pg_storage.py``) runs
the same calls on pooled PostgreSQL connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from .limits import Limits
from .storage import ControlPlaneStore

T = TypeVar("T")


class Database:
    """Runs :class:`ControlPlaneStore` calls on one dedicated thread."""

    def __init__(self, path: Path, limits: Limits | None = None) -> None:
        self._path = path
        self._limits = limits
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control-plane-db")
        self._store: ControlPlaneStore | None = None

    @property
    def store(self) -> ControlPlaneStore:
        if self._store is None:
            raise RuntimeError("database is not open")
        return self._store

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._store = await loop.run_in_executor(
            self._executor, ControlPlaneStore, self._path, self._limits
        )

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._store is not None:
            await loop.run_in_executor(self._executor, self._store.close)
            self._store = None
        self._executor.shutdown(wait=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on the database thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

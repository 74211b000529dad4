"""The running rule table and its hot reload (file watch and SIGHUP).

A new table is loaded and validated whole, then swapped in with one assignment, so a
request sees either the old table or the new one, never a mix. A table that does not
validate is refused: the running one stays, the problems are logged and counted.
Counters carry over because counter keys depend only on region, rule id, identity and
window, never on the table's version.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from gateway.metrics import Metrics
from gateway.policy.loader import RuleLoadError, load_rules, rule_files
from gateway.policy.model import RuleTable

log = logging.getLogger("gateway.rules")


class RuleSource:
    """Holds the current ``RuleTable`` and knows how to reload it from its paths."""

    def __init__(
        self, paths: Sequence[str], regions: Sequence[str], metrics: Metrics, table: RuleTable
    ) -> None:
        self.paths = tuple(paths)
        self.regions = tuple(regions)
        self.table = table
        self._metrics = metrics
        self._fingerprint = self._stat()
        self.last_error: str | None = None
        metrics.rules_loaded.set(table.loaded_at)
        metrics.rules_count.set(len(table.rules))

    @classmethod
    def load(cls, paths: Sequence[str], regions: Sequence[str], metrics: Metrics) -> RuleSource:
        table = load_rules(paths, regions)
        metrics.rule_reloads.labels("ok").inc()
        return cls(paths, regions, metrics, table)

    def reload(self, reason: str) -> bool:
        """Load the files again; True when a new table is in force."""
        self._fingerprint = self._stat()
        try:
            table = load_rules(self.paths, self.regions)
        except RuleLoadError as exc:
            self.last_error = str(exc)
            self._metrics.rule_reloads.labels("error").inc()
            log.error(
                "rule reload (%s) refused, still serving table %s:\n%s",
                reason,
                self.table.digest[:12],
                exc,
            )
            return False
        if table.digest == self.table.digest:
            self._metrics.rule_reloads.labels("unchanged").inc()
            return False
        previous = self.table
        self.table = table
        self.last_error = None
        self._metrics.rule_reloads.labels("ok").inc()
        self._metrics.rules_loaded.set(table.loaded_at)
        self._metrics.rules_count.set(len(table.rules))
        log.info(
            "rules reloaded (%s): %d rules from %s, table %s (was %s)",
            reason,
            len(table.rules),
            ", ".join(table.sources),
            table.digest[:12],
            previous.digest[:12],
        )
        return True

    def _stat(self) -> tuple[tuple[str, int, int], ...]:
        """Names, sizes and mtimes of every rule file: cheap to poll, catches edits and
        files added to or removed from a rules directory."""
        try:
            files = rule_files(self.paths)
        except RuleLoadError:
            return ()
        out = []
        for file in files:
            try:
                st = os.stat(file)
            except OSError:
                continue
            out.append((str(Path(file)), st.st_size, st.st_mtime_ns))
        return tuple(out)

    def changed_on_disk(self) -> bool:
        return self._stat() != self._fingerprint

    async def watch(self, interval: float) -> None:
        """Poll the files; polling needs no extra dependency and works on every mount."""
        while True:
            await asyncio.sleep(interval)
            if self.changed_on_disk():
                # Editors write in several steps; give the write a moment to finish.
                await asyncio.sleep(min(0.2, interval))
                self.reload("file changed")

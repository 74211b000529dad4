"""The running rule table and its hot reload (file watch and SIGHUP).

A new table is loaded and validated whole, then swapped in with one assignment, so a
request sees either the old table or the new one, never a mix. A table that does not
validate is refused: the running one stays, the problems are logged and counted.
Counters carry over because counter keys depend only on region, rule id, identity and
window, never on the table's version.

Loading runs in a worker thread (``reload_async``, which the watcher and
``request_reload`` use), so a large or hostile file never holds the event loop; whatever
a load raises is a refusal, never the end of the watcher.
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
        # Whether reloads are logged at INFO / ERROR: with --workers, the supervisor says
        # it once and each worker only at DEBUG (they read the same files).
        self.announce = True
        self.paths = tuple(paths)
        self.regions = tuple(regions)
        self.table = table
        self._metrics = metrics
        self._fingerprint = self._stat()
        self.last_error: str | None = None
        # Loads may overlap (the watcher's and a SIGHUP's, each in a thread): each takes a
        # ticket when it starts, and an outcome counts only if no later load's has.
        self._tickets = 0
        self._settled = 0
        self._requests: set[asyncio.Task[bool]] = set()  # running request_reload tasks
        metrics.rules_loaded.set(table.loaded_at)
        metrics.rules_count.set(len(table.rules))

    @classmethod
    def load(cls, paths: Sequence[str], regions: Sequence[str], metrics: Metrics) -> RuleSource:
        table = load_rules(paths, regions)
        metrics.rule_reloads.labels("ok").inc()
        return cls(paths, regions, metrics, table)

    def reload(self, reason: str, *, asked: bool = False) -> bool:
        """Load the files again, here and now (on the event loop if called from it);
        True when a new table is in force. ``asked``: an operator asked for it (SIGHUP),
        so a table found unchanged is said at INFO too (see ``_settle``)."""
        ticket = self._start()
        return self._settle(ticket, reason, self._load(), asked)

    async def reload_async(self, reason: str, *, asked: bool = False) -> bool:
        """``reload`` with the reading and parsing in a worker thread."""
        ticket = self._start()
        outcome = await asyncio.to_thread(self._load)
        return self._settle(ticket, reason, outcome, asked)

    def request_reload(self, reason: str) -> None:
        """For a signal handler on the running loop (an operator's SIGHUP): start
        ``reload_async`` and return."""
        task = asyncio.get_running_loop().create_task(self.reload_async(reason, asked=True))
        self._requests.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._requests.discard)

    def _start(self) -> int:
        self._fingerprint = self._stat()  # before reading: an edit during the load shows
        self._tickets += 1
        return self._tickets

    def _load(self) -> RuleTable | Exception:
        """The new table or why not (runs in a worker thread for ``reload_async``)."""
        try:
            return load_rules(self.paths, self.regions)
        except Exception as exc:  # whatever the files hold: a refusal, not a dead watcher
            return exc

    def _settle(
        self, ticket: int, reason: str, outcome: RuleTable | Exception, asked: bool = False
    ) -> bool:
        """Apply a load's outcome and say so. After a refused reload, a load that
        succeeds says at INFO that the rules are valid again and which table is in force
        (the ERROR must not be the last word); a table found unchanged is said at INFO
        when an operator asked (SIGHUP), else at DEBUG (the watcher's polls)."""
        if ticket < self._settled:
            return False  # a load started later has settled already: this one is older
        self._settled = ticket
        if isinstance(outcome, Exception):
            self._refuse(reason, outcome)
            return False
        table = outcome
        # A load that succeeds clears the last error, also when it gives the running table
        # again (a bad edit reverted): nothing refused is pending any more.
        was_refused = self.last_error is not None
        self.last_error = None
        level = logging.INFO if self.announce else logging.DEBUG
        if table.digest == self.table.digest:
            self._metrics.rule_reloads.labels("unchanged").inc()
            log.log(
                level if was_refused or asked else logging.DEBUG,
                "rules %s (%s): table unchanged, still serving %s from %s (table %s)",
                "valid again" if was_refused else "reloaded",
                reason,
                table.size_text,
                ", ".join(table.sources),
                table.digest[:12],
            )  # (the table named as the start-up line names it)
            return False
        previous = self.table
        self.table = table
        self._metrics.rule_reloads.labels("ok").inc()
        self._metrics.rules_loaded.set(table.loaded_at)
        self._metrics.rules_count.set(len(table.rules))
        log.log(
            level,
            "rules reloaded (%s)%s: %s from %s, table %s (was %s)",
            reason,
            ", valid again after the refused reload" if was_refused else "",
            table.size_text,
            ", ".join(table.sources),
            table.digest[:12],
            previous.digest[:12],
        )
        return True

    def _refuse(self, reason: str, exc: Exception) -> None:
        self._metrics.rule_reloads.labels("error").inc()
        if isinstance(exc, RuleLoadError):
            self.last_error = str(exc)
            log.log(
                logging.ERROR if self.announce else logging.DEBUG,
                "rule reload (%s) refused, still serving table %s:\n%s",
                reason,
                self.table.digest[:12],
                exc,
            )
            return
        # The loader turns every problem into a RuleLoadError; anything else is a bug in
        # it, still a refusal (with the traceback, to report it).
        self.last_error = f"the rule files could not be loaded: {type(exc).__name__}: {exc}"
        log.error(
            "rule reload (%s) refused, still serving table %s: %s",
            reason,
            self.table.digest[:12],
            self.last_error,
            exc_info=exc,
        )

    def _stat(self) -> tuple[tuple[str, int, int], ...]:
        """Names, sizes and mtimes of every rule file: cheap to poll, catches edits and
        files added to or removed from a rules directory."""
        try:
            files = rule_files(self.paths)
        except (RuleLoadError, OSError):  # gone, or a directory we may not list: the
            return ()  # load reports it
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
            try:
                if self.changed_on_disk():
                    # Editors write in several steps; give the write a moment to finish.
                    await asyncio.sleep(min(0.2, interval))
                    await self.reload_async("file changed")
            except Exception:  # the watcher outlives anything one round raises
                self._metrics.rule_reloads.labels("error").inc()
                log.exception("rule watcher: this round failed; still watching")

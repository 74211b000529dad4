"""Known API keys: the key file, its immutable snapshot and its hot reload.

The file holds no key in clear, only SHA-256 digests::

    keys:
      - {sha256: <64 hex digits>, consumer: acme, tier: gold}   # tier optional

A key is known when the SHA-256 of its bytes is listed; it then counts as its consumer,
so the keys of one consumer share that consumer's counters and rotating a key never
resets a quota. A bad file is refused whole: a half-valid set would silently drop keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from gateway.identity import safe_yaml

log = logging.getLogger("gateway.identity")

MAX_KEY_FILE_BYTES: Final = 4 * 1024 * 1024
ENTRY_FIELDS: Final = frozenset({"sha256", "consumer", "tier"})
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
# Consumer and tier names reach log lines and metric labels: a plain, short alphabet
# keeps both readable and unforgeable.
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}")


class KeyFileError(ValueError):
    """A key file is refused; the message names the file, the entry and the field. It
    shows no value that failed validation (a key pasted where its hash belongs must not
    reach a log line), only consumer and tier names already known to be names."""


@dataclass(frozen=True, slots=True)
class Consumer:
    """Who a known key belongs to; ``tier`` picks a rule's tier limits when set."""

    name: str
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One line of the key file, as parsed (``sha256`` lower-case hex)."""

    sha256: str
    consumer: str
    tier: str | None


class KeyRing:
    """An immutable snapshot of the known keys: digest → consumer."""

    __slots__ = ("by_digest", "consumers", "digest", "entries", "source")

    def __init__(self, entries: tuple[KeyEntry, ...], digest: str, source: str) -> None:
        self.entries = entries
        self.digest = digest  # SHA-256 of the file's bytes: tells reloads that change nothing
        self.source = source
        # One Consumer object per name, shared by its keys.
        people = {e.consumer: Consumer(e.consumer, e.tier) for e in entries}
        self.consumers: Mapping[str, Consumer] = people
        # SHA-256 of a key -> its consumer (the data plane looks keys up here directly)
        self.by_digest: dict[bytes, Consumer] = {
            bytes.fromhex(e.sha256): people[e.consumer] for e in entries
        }

    @classmethod
    def empty(cls, source: str = "") -> KeyRing:
        return cls((), hashlib.sha256(b"").hexdigest(), source)

    def lookup(self, key: bytes) -> Consumer | None:
        """The consumer of a presented key, or None when it is not known.

        A plain dict lookup, not ``hmac.compare_digest``: what a timing difference could
        reveal is how the SHA-256 of the attacker's own guess compares with stored
        digests, and learning bits of a digest does not help find a key whose SHA-256
        has them (preimage resistance; generated keys carry 256 bits of entropy).
        """
        return self.by_digest.get(hashlib.sha256(key).digest())

    def __len__(self) -> int:
        return len(self.by_digest)

    def __iter__(self) -> Iterator[KeyEntry]:
        return iter(self.entries)


def load_key_file(path: str | Path) -> KeyRing:
    """Read and validate a key file; ``KeyFileError`` if anything in it is wrong."""
    name = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"{name}: cannot read: {exc.strerror or exc}") from exc
    return parse_key_file(data, name)


def parse_key_file(data: bytes, name: str) -> KeyRing:
    """Validate a key file's bytes (``name`` only labels the errors)."""
    return KeyRing(parse_entries(data, name), hashlib.sha256(data).hexdigest(), name)


def parse_entries(data: bytes, name: str) -> tuple[KeyEntry, ...]:
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{name}: over {MAX_KEY_FILE_BYTES} bytes")
    try:
        doc = safe_yaml.load(data)
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{name}: not valid YAML: {safe_yaml.describe_error(exc)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # a tag whose value does not construct (!!int x, a bad !!timestamp ...)
        raise KeyFileError(f"{name}: not valid YAML ({type(exc).__name__})") from None
    # An empty document is refused rather than read as "no keys": it is what a file
    # caught half-written looks like, and revoking every key by accident is worse.
    if not isinstance(doc, dict) or "keys" not in doc:
        raise KeyFileError(f"{name}: expected a mapping with a 'keys' list (keys: [] for none)")
    extra = sorted(str(k) for k in doc if k != "keys")
    if extra:
        raise KeyFileError(f"{name}: unknown top-level key {extra[0]!r} (only 'keys')")
    items = doc["keys"]
    if items is None:
        items = []
    if not isinstance(items, list):
        raise KeyFileError(f"{name}: 'keys' must be a list")
    entries: list[KeyEntry] = []
    seen: dict[str, int] = {}
    tiers: dict[str, tuple[str | None, int]] = {}
    for index, item in enumerate(items, start=1):
        entry = _entry(item, f"{name}: entry #{index}")
        if entry.sha256 in seen:
            raise KeyFileError(
                f"{name}: entry #{index}, field 'sha256': the same digest as entry "
                f"#{seen[entry.sha256]}"
            )
        seen[entry.sha256] = index
        # A consumer's keys share one set of counters, so they must share one tier too.
        first = tiers.setdefault(entry.consumer, (entry.tier, index))
        if first[0] != entry.tier:
            raise KeyFileError(
                f"{name}: entry #{index}, field 'tier': consumer {entry.consumer!r} has tier "
                f"{first[0]!r} in entry #{first[1]} and {entry.tier!r} here (one tier per consumer)"
            )
        entries.append(entry)
    return tuple(entries)


def _entry(item: Any, where: str) -> KeyEntry:
    if not isinstance(item, dict):
        raise KeyFileError(f"{where}: expected a mapping with sha256, consumer and tier")
    unknown = sorted(str(k) for k in item if k not in ENTRY_FIELDS)
    if unknown:
        raise KeyFileError(
            f"{where}, field {unknown[0]!r}: unknown field (allowed: consumer, sha256, tier)"
        )
    digest = item.get("sha256")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise KeyFileError(f"{where}, field 'sha256': expected the key's SHA-256 as 64 hex digits")
    consumer = item.get("consumer")
    if consumer is None:
        raise KeyFileError(f"{where}, field 'consumer': missing")
    tier = item.get("tier")
    return KeyEntry(
        sha256=digest.lower(),
        consumer=_name(consumer, f"{where}, field 'consumer'"),
        tier=None if tier is None else _name(tier, f"{where}, field 'tier'"),
    )


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise KeyFileError(f"{where}: expected a string (quote it)")
    if not NAME_PATTERN.fullmatch(value):
        raise KeyFileError(
            f"{where}: not a name (letters, digits and . _ @ : -, starting with a letter "
            "or digit, at most 128)"
        )
    return value


def valid_name(value: str) -> bool:
    """Whether ``value`` can be a consumer or tier name."""
    return NAME_PATTERN.fullmatch(value) is not None


class KeySource:
    """The current key ring of one file, replaced whole when the file changes.

    Readers take ``source.ring`` once per request; a reload swaps the attribute, so a
    request never sees half of two files.
    """

    def __init__(self, path: str | Path, on_reload: Callable[[str], None] | None = None) -> None:
        """Load the file now: a bad file at start-up raises ``KeyFileError``.
        ``on_reload`` is told each reload's outcome: "ok", "unchanged" or "error"."""
        self.path = Path(path)
        self._on_reload = on_reload
        self._fingerprint = self._stat()
        self.ring = load_key_file(self.path)
        self.last_error: str | None = None

    def reload(self, reason: str = "requested") -> bool:
        """Re-read the file. True when a new ring is in place; on an error the previous
        ring stays, ``last_error`` says why, and False is returned."""
        # Fingerprint before reading: an edit landing mid-read changes it again, so the
        # next poll reads once more; recorded after, that edit could go unnoticed.
        self._fingerprint = self._stat()
        try:
            ring = load_key_file(self.path)
        except KeyFileError as exc:
            self.last_error = str(exc)
            self._report("error")
            log.error(
                "api keys not reloaded (%s), keeping the previous %d keys: %s",
                reason,
                len(self.ring),
                exc,
            )
            return False
        refused_before, self.last_error = self.last_error, None
        if ring.digest == self.ring.digest:
            self._report("unchanged")
            if refused_before is not None:  # the operator fixed the file: say it is over
                log.info(
                    "api keys valid again (%s): unchanged, still %d keys of %d consumers "
                    "from %s",
                    reason, len(self.ring), len(self.ring.consumers), self.path,
                )  # fmt: skip
            return False
        previous, self.ring = self.ring, ring
        self._report("ok")
        log.info(
            "api keys reloaded (%s): %d keys of %d consumers from %s (was %d keys of %d)",
            reason,
            len(ring),
            len(ring.consumers),
            self.path,
            len(previous),
            len(previous.consumers),
        )
        return True

    def changed_on_disk(self) -> bool:
        return self._stat() != self._fingerprint

    async def watch(self, interval: float) -> None:
        """Poll the file every ``interval`` seconds and reload it when it changed. Runs
        until cancelled: an unexpected error is logged and the watch goes on, since a
        dead watcher would keep revoked keys working without anyone noticing."""
        while True:
            await asyncio.sleep(interval)
            try:
                if self.changed_on_disk():
                    # Editors write in several steps; give the write a moment to finish.
                    await asyncio.sleep(min(0.2, interval))
                    self.reload("file changed")
            except Exception:
                log.exception("api key file watch of %s failed; still watching", self.path)

    def _stat(self) -> tuple[int, int, int, int] | None:
        # Inode and device catch a file replaced by rename (as `gateway keys` writes it),
        # size and mtime an edit in place.
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _report(self, outcome: str) -> None:
        if self._on_reload is not None:
            self._on_reload(outcome)

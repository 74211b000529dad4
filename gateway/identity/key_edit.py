"""Changes to a key file: add a newly generated key, revoke keys (``gateway keys``).

Only digests are ever written. The file is rewritten whole through a temporary file and
``os.replace``, so the gateway's watcher reads either the old file or the new one, never
half of one. Edits keep the operator's comments and layout where the list is a plain
block list: the new text is accepted only if it parses to exactly the expected entries,
otherwise the file is written afresh from its entries (comments are then lost, entries
never are).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from gateway.identity import safe_yaml
from gateway.identity.keys import KeyEntry, KeyFileError, parse_entries, valid_name

# Recognisable in logs, configs and secret scanners; the rest is 256 random bits.
KEY_PREFIX: Final = "gk_"
MIN_HASH_PREFIX: Final = 8
SHOWN_HASH_DIGITS: Final = 12
_HEX = re.compile(r"[0-9a-f]+")
HEADER: Final = (
    "# API keys the gateway knows, as SHA-256 digests only: the keys themselves are never\n"
    "# stored. Edited by `gateway keys add` / `gateway keys revoke`.\n"
)


def new_key() -> str:
    """A strong random API key (``gk_`` + 43 URL-safe characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str | bytes) -> str:
    """The hex SHA-256 that the key file lists for ``key``."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def add_key(path: str | Path, consumer: str, tier: str | None = None) -> str:
    """Generate a key for ``consumer``, append its SHA-256 to the file (created, mode
    0600, when absent) and return the key: the only time it exists in clear.

    Without ``tier`` a known consumer keeps its tier; a different tier is refused, since
    one consumer's keys share one set of counters.
    """
    if not valid_name(consumer):
        raise ValueError(f"consumer {consumer!r} is not a name (letters, digits, . _ @ : -)")
    if tier is not None and not valid_name(tier):
        raise ValueError(f"tier {tier!r} is not a name (letters, digits, . _ @ : -)")
    target = _target(path)
    with _locked(target.parent):
        text, entries = _read(target, missing_ok=True)
        known = next((e for e in entries if e.consumer == consumer), None)
        if known is not None:
            if tier is None:
                tier = known.tier
            elif tier != known.tier:
                raise ValueError(
                    f"consumer {consumer!r} has tier {known.tier!r} in {target}; change it in "
                    "the file for all its keys, or revoke them first"
                )
        key = new_key()
        entry = KeyEntry(key_digest(key), consumer, tier)
        wanted = (*entries, entry)
        edited = None if text is None else _with_entry(text, entry)
        _write(target, _checked(edited, wanted, target))
    return key


def revoke(path: str | Path, consumer: str | None = None, hash_prefix: str | None = None) -> int:
    """Remove every key of ``consumer``, or the one key whose SHA-256 starts with
    ``hash_prefix`` (at least 8 hex digits, matching exactly one entry). Returns how
    many keys were removed; the file is not rewritten when none was."""
    if (consumer is None) == (hash_prefix is None):
        raise ValueError("give either a consumer or a hash prefix")
    prefix = None
    if hash_prefix is not None:
        prefix = hash_prefix.strip().lower()
        if len(prefix) < MIN_HASH_PREFIX or len(prefix) > 64 or not _HEX.fullmatch(prefix):
            raise ValueError(
                f"a hash prefix is {MIN_HASH_PREFIX} to 64 hex digits of the key's SHA-256"
            )
    target = _target(path)
    with _locked(target.parent):
        text, entries = _read(target, missing_ok=False)
        if prefix is not None:
            drop = [i for i, e in enumerate(entries) if e.sha256.startswith(prefix)]
            if len(drop) != 1:
                raise ValueError(
                    f"{len(drop)} keys in {target} have a SHA-256 starting with {prefix}"
                    + ("; give more digits" if drop else "")
                )
        else:
            drop = [i for i, e in enumerate(entries) if e.consumer == consumer]
            if not drop:
                return 0
        wanted = tuple(e for i, e in enumerate(entries) if i not in drop)
        edited = None if text is None else _without_entries(text, drop)
        _write(target, _checked(edited, wanted, target))
    return len(drop)


def render(entries: Sequence[KeyEntry]) -> str:
    """A whole key file for ``entries``, in the layout the edits expect."""
    if not entries:
        return HEADER + "keys: []\n"
    return HEADER + "keys:\n" + "".join(_line(e, 2) + "\n" for e in entries)


def _line(entry: KeyEntry, indent: int) -> str:
    # Names quoted (JSON strings are YAML strings): an unquoted consumer such as 1234,
    # yes or null would read back as a number, a boolean or nothing.
    tier = "" if entry.tier is None else f", tier: {json.dumps(entry.tier)}"
    return (
        f"{' ' * indent}- {{sha256: {entry.sha256}, consumer: {json.dumps(entry.consumer)}{tier}}}"
    )


def _checked(edited: str | None, wanted: tuple[KeyEntry, ...], target: Path) -> bytes:
    if edited is not None:
        data = edited.encode()
        try:
            if parse_entries(data, str(target)) == wanted:
                return data
        except KeyFileError:
            pass
    return render(wanted).encode()


def _with_entry(text: str, entry: KeyEntry) -> str | None:
    """``text`` with ``entry`` appended after the last item of a block list, or None
    when the list is not one this edit understands."""
    found = _block_items(text)
    if found is None:
        return None
    lines, starts, spans = found
    first = lines[starts[0]]  # the new item is indented as the first one is
    lines.insert(spans[-1][1], _line(entry, len(first) - len(first.lstrip(" "))))
    out = "\n".join(lines)
    return out if out.endswith("\n") else out + "\n"


def _without_entries(text: str, drop: Sequence[int]) -> str | None:
    """``text`` without the listed items (and their own comments), or None."""
    found = _block_items(text)
    if found is None:
        return None
    lines, _, spans = found
    gone = {n for i in drop for n in range(*spans[i])}
    kept = [line for n, line in enumerate(lines) if n not in gone]
    out = "\n".join(kept)
    if len(drop) == len(spans):
        # 'keys:' with nothing under it reads as null; say "none" explicitly.
        out = re.sub(r"(?m)^keys:[ \t]*$", "keys: []", out, count=1)
    return out


def _block_items(text: str) -> tuple[list[str], list[int], list[tuple[int, int]]] | None:
    """The file's lines, the line of each item's "-" in its block ``keys:`` list and the
    lines each item spans: the comment lines right above its "-", then its own lines up
    to the next item, without the comments and blank lines that end it (they lead the
    next item)."""
    try:
        root = safe_yaml.compose(text)
    except yaml.YAMLError:
        return None
    if not isinstance(root, MappingNode):
        return None
    seq = next((v for k, v in root.value if isinstance(k, ScalarNode) and k.value == "keys"), None)
    if not isinstance(seq, SequenceNode) or seq.flow_style or not seq.value:
        return None
    lines = text.split("\n")
    starts = [item.start_mark.line for item in seq.value]
    end_mark = seq.end_mark
    end = end_mark.line if end_mark.column == 0 else end_mark.line + 1
    bounds = [*starts, min(end, len(lines))]
    spans = []
    for i, start in enumerate(starts):
        if not lines[start].lstrip().startswith("-"):
            return None  # "-" on a line of its own: leave such layouts to render()
        stop = bounds[i + 1]
        while stop > start + 1 and _comment_or_blank(lines[stop - 1]):
            stop -= 1
        begin = start
        while begin > 0 and lines[begin - 1].lstrip().startswith("#"):
            begin -= 1
        spans.append((begin, stop))
    return lines, starts, spans


def _comment_or_blank(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _read(target: Path, *, missing_ok: bool) -> tuple[str | None, tuple[KeyEntry, ...]]:
    """The file's text (None when absent, or not UTF-8) and its validated entries."""
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return None, ()
        raise KeyFileError(f"{target}: no such file") from None
    except OSError as exc:
        raise KeyFileError(f"{target}: cannot read: {exc.strerror or exc}") from exc
    entries = parse_entries(data, str(target))  # a bad file is never edited
    try:
        return data.decode("utf-8"), entries
    except UnicodeDecodeError:
        return None, entries


def _target(path: str | Path) -> Path:
    # Through a symlink to the file it names, so the link stays a link.
    return Path(os.path.realpath(path))


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise edits of files in ``folder``: two `keys add` at once would otherwise
    each rewrite the file from what they read, and one key would be lost."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # also releases the lock


def _write(target: Path, data: bytes) -> None:
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o600
    temp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode != 0o600:
            os.chmod(temp, mode)  # an operator's chosen mode survives the rewrite
        os.replace(temp, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    # The rename itself is durable only once the folder is synced.
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)

"""What the SQLite and PostgreSQL storages share about a stored item: its row as read back
(``_Row``) and the answer built from it, namespaces as dot-joined text, the namespaces
listing's prefix and suffix match, and the write rules both follow (the recency step of a
rewritten item, the TTL sweep's batch size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.upstreams.store.models import Item, Namespace, SearchItem, StoreListNamespacesRequest

SWEEP_BATCH = 500
# Keeps a rewritten item strictly newer than before, so "last updated first" holds even
# when two writes land within the clock's resolution.
_UPDATED_AT_STEP = 0.000001


@dataclass(frozen=True, slots=True)
class _Row:
    namespace: str
    key: str
    value: str
    created_at: float
    updated_at: float
    id: int
    ttl_minutes: float | None

    def as_item(self) -> Item:
        return {
            "namespace": self.namespace.split("."),
            "key": self.key,
            "value": json.loads(self.value),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
        }

    def as_search_item(self, score: float | None) -> SearchItem:
        return {**self.as_item(), "score": score}


def answer_items(rows: list[tuple[_Row, float | None]]) -> list[SearchItem]:
    """The answer's items, best first, from ``rows`` (emptied on the way: each row's JSON
    text is dropped once parsed, so an answer never holds both in full)."""
    rows.reverse()
    items: list[SearchItem] = []
    while rows:
        row, score = rows.pop()
        items.append(row.as_search_item(score))
    return items


def _iso(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, tz=UTC).isoformat()


def _dotted(namespace: Namespace) -> str:
    return ".".join(namespace)


def _namespace_matches(labels: list[str], request: StoreListNamespacesRequest) -> bool:
    for pattern, from_end in ((request.prefix, False), (request.suffix, True)):
        if pattern is None:
            continue
        if len(pattern) > len(labels):
            return False
        window = labels[len(labels) - len(pattern) :] if from_end else labels[: len(pattern)]
        if any(p not in ("*", label) for p, label in zip(pattern, window, strict=True)):
            return False
    return True

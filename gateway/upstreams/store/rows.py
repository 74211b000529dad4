"""What the SQLite and PostgreSQL storages share about a stored item: its row as read back
(``_Row``) and the answer built from it, namespaces as dot-joined text, the namespaces
listing's walk (``NamespaceWalk``) with its prefix and suffix match, the search depth bound,
and the write rules both follow (the recency step of a rewritten item, the TTL sweep's batch
size).

An answer carries each value as the JSON text stored for it, spliced between the item's other
fields (``_Row.item_json``), never parsed: the text was made by ``json.dumps`` of the
validated value when it was written (compact, ``ensure_ascii=False``, no NaN or infinity),
which is exactly what re-serialising its parsed form gives, and parsed values can take about
24 times the memory of their text (``answers.py``), plus the CPU of parsing and serialising
again. ``as_item`` (parsed) serves Python callers only: tools, benchmarks and tests.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.models import (
    Item,
    Namespace,
    SearchItem,
    StoreListNamespacesRequest,
    StoreSearchRequest,
)

SWEEP_BATCH = 500
# Keeps a rewritten item strictly newer than before, so "last updated first" holds even
# when two writes land within the clock's resolution.
_UPDATED_AT_STEP = 0.000001


def _encode(data: Any) -> str:
    # As app.py's answers: compact, non-ASCII characters as themselves.
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


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
        """The item with its value parsed (for Python callers; answers use ``item_json``)."""
        return {
            "namespace": self.namespace.split("."),
            "key": self.key,
            "value": json.loads(self.value),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
        }

    def as_search_item(self, score: float | None) -> SearchItem:
        return {**self.as_item(), "score": score}

    def item_json(self) -> str:
        """The item as JSON text (a GET's answer), the same as ``as_item`` serialised."""
        return self._json({})

    def search_item_json(self, score: float | None) -> str:
        """The found item as JSON text, the same as ``as_search_item`` serialised."""
        return self._json({"score": score})

    def _json(self, more: dict[str, Any]) -> str:
        # The keys in as_item's order; the stored value text goes in as it is (see above).
        head = _encode({"namespace": self.namespace.split("."), "key": self.key})
        tail = _encode(
            {"created_at": _iso(self.created_at), "updated_at": _iso(self.updated_at), **more}
        )
        return f'{head[:-1]},"value":{self.value},{tail[1:]}'


def answer_items(rows: list[tuple[_Row, float | None]]) -> list[SearchItem]:
    """The items, best first, from ``rows``, values parsed (for Python callers; the HTTP
    answer is ``search_answer``). ``rows`` is emptied on the way."""
    rows.reverse()
    items: list[SearchItem] = []
    while rows:
        row, score = rows.pop()
        items.append(row.as_search_item(score))
    return items


def search_answer(rows: list[tuple[_Row, float | None]]) -> bytes:
    """A search's answer, ``{"items": [...]}`` in UTF-8, from ``rows`` (best first), each
    value's stored text spliced in. ``rows`` is emptied on the way: each row is dropped
    once encoded, so the answer never holds a row and its encoding both, but for one item."""
    rows.reverse()
    parts = [b'{"items":[']
    while rows:
        row, score = rows.pop()
        if len(parts) > 1:
            parts.append(b",")
        parts.append(row.search_item_json(score).encode())
    parts.append(b"]}")
    return b"".join(parts)


def item_answer(row: _Row | None) -> bytes:
    """A GET's answer in UTF-8: the item, or ``null``."""
    return b"null" if row is None else row.item_json().encode()


def _iso(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, tz=UTC).isoformat()


def _dotted(namespace: Namespace) -> str:
    return ".".join(namespace)


# -- the search depth bound ---------------------------------------------------------------


def check_search_depth(request: StoreSearchRequest, max_depth: int) -> None:
    """Refuse (422) a search with a query whose page ends past ``max_depth``
    (``store.max_search_depth``): ranking holds every candidate before the page, (id,
    score) pairs to ``offset + limit`` (twice that for hybrid) and, for word ranking, the
    database's top-N sort of as many rows, so the page's end must be bounded. Listing mode
    (no query) reads its page straight off an index and keeps ``offset`` up to its own
    bound."""
    if request.search_query() is None:
        return
    depth = request.offset + request.limit
    if depth > max_depth:
        raise StoreRequestError(
            422,
            f"offset: a search with a query ranks at most store.max_search_depth "
            f"({max_depth}) items, and offset + limit is {depth}; narrow the search with "
            "namespace_prefix or filter, or page through the items without a query "
            "(listing mode, newest update first)",
        )


# -- the namespaces listing -----------------------------------------------------------------


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


def _walk_is_done(last_wanted: str, walked: str, depth: int | None, seen: set[str]) -> bool:
    """Whether no namespace after ``walked`` can show a new value sorting before
    ``last_wanted`` (the offset + limit-th value shown so far).

    A later namespace N > walked shows N itself or, cut to ``depth`` labels, a prefix of N.
    Such a value V sorts before ``walked`` only if V is a proper prefix of ``walked``: then V
    holds exactly ``depth`` labels, ends inside the depth-th label of ``walked`` (at its end,
    or where ``walked`` has a character below '.', e.g. '-' in ``a-b`` for ``a.x``), and
    N continues V with '.'. Every other later value sorts after ``walked``.
    """
    if last_wanted >= walked:
        return False
    if depth is None:
        return True
    labels = walked.split(".")
    if len(labels) < depth:
        return True
    label_start = sum(len(label) + 1 for label in labels[: depth - 1])
    label_end = label_start + len(labels[depth - 1])
    for end in range(label_start + 1, min(label_end + 1, len(walked))):
        if walked[end] <= ".":
            candidate = walked[:end]
            if candidate not in seen and candidate < last_wanted:
                return False
    return True


class NamespaceWalk:
    """The namespaces listing, walked the same way on both storages.

    The storage feeds ``visit`` the distinct live namespaces in ``[low, high)`` in order
    (dotted text, code point order: SQLite's BINARY collation and PostgreSQL's "C" one),
    starting at ``start`` (included, or excluded when ``after``), and seeks again from
    ``start`` when ``visit`` answers False, until ``start`` is None. The walk stops early:

    * once a namespace cut to ``max_depth`` labels has been shown, every namespace below
      the cut one shows the same, so the walk seeks past them (to ``cut + '/'``);
    * once offset + limit namespaces are shown and nothing the rest of the walk could show
      sorts before them (see ``_walk_is_done``), it stops.

    A storage reading in batches calls ``batch_ended`` when a full batch gave no verdict
    (more may follow) and ``exhausted`` when the range ran out.
    """

    def __init__(self, request: StoreListNamespacesRequest) -> None:
        self._request = request
        literal: list[str] = []
        for label in request.prefix or ():
            if label == "*":
                break
            literal.append(label)
        self.low = _dotted(tuple(literal))
        # '/' is the character after '.': [p, p + '/') is p and every namespace below it.
        self.high: str | None = self.low + "/" if literal else None
        self.start: str | None = self.low
        self.after = False
        # How many namespaces the storage read from the database for this walk (its cost;
        # counted by the storage, which may read a batch past where the walk stops).
        self.fetched = 0
        self._wanted = request.offset + request.limit
        self._depth = request.max_depth
        self._shown: list[str] = []  # sorted
        self._seen: set[str] = set()
        self._skip_to: str | None = None

    def visit(self, namespace: str) -> bool:
        """Take the next namespace of the walk; False: stop this seek (``start`` says
        where to seek next, None when the walk is done)."""
        if self._skip_to is not None:
            if namespace < self._skip_to:
                # In a subtree already shown: seek past it.
                self.start, self.after, self._skip_to = self._skip_to, False, None
                return False
            self._skip_to = None
        depth = self._depth
        labels = namespace.split(".")
        cut = depth is not None and len(labels) > depth
        dotted = ".".join(labels[:depth]) if cut else namespace
        shown = self._shown
        if dotted not in self._seen and _namespace_matches(labels, self._request):
            self._seen.add(dotted)
            bisect.insort(shown, dotted)
        if len(shown) >= self._wanted and _walk_is_done(
            shown[self._wanted - 1], namespace, depth, self._seen
        ):
            self.start = None
            return False
        if cut and dotted in self._seen:
            self._skip_to = dotted + "/"
        return True

    def batch_ended(self, last: str) -> None:
        """A batch ended at ``last`` with the walk still going: go on after it (or past the
        subtree being skipped, which sorts after ``last``)."""
        if self._skip_to is not None:
            self.start, self.after, self._skip_to = self._skip_to, False, None
        else:
            self.start, self.after = last, True

    def exhausted(self) -> None:
        """The range holds no more namespaces: the walk is done."""
        self.start = None

    def page(self) -> list[list[str]]:
        """The listing's page: the shown namespaces ``[offset, offset + limit)``, as labels."""
        request = self._request
        page = self._shown[request.offset : request.offset + request.limit]
        return [namespace.split(".") for namespace in page]

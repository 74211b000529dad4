"""What text of an item is searchable, and how a natural-language query becomes an FTS5 query."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MAX_QUERY_TERMS = 32
MAX_INDEX_PATHS = 64
MAX_INDEX_PATH_LENGTH = 512

# unicode61 splits on everything that is not a letter or a digit; match it so a query
# term is one FTS token, not an accidental phrase.
_TERM = re.compile(r"[^\W_]+", re.UNICODE)

# Words so common that matching them alone says nothing; dropped from a query unless the
# query has nothing else.
_STOPWORDS_TEXT = """
a an and are as at be by do does for from has have how i in is it its me my of on or so than
that the their them there these they this to was we were what when where which who why will
with you your
"""
_STOPWORDS = frozenset(_STOPWORDS_TEXT.split())

PathStep = str | int | None  # key, index, or None for "every element"


# A field path of the ``index`` argument: ``$`` (the whole value), or keys and indexes as in
# ``a.b``, ``items[*].text``, ``list[-1]``. This expression is the rule (the model checks it
# and the OpenAPI document carries it); ``index_steps`` only splits what it accepted.
_KEY = r"[^.\[\]]+"
_INDEX = r"\[(?:\*|-?[0-9]+)\]"
INDEX_PATH_PATTERN = rf"^(?:\$|(?:{_KEY}|{_INDEX})(?:{_INDEX}|\.(?:{_KEY}|{_INDEX}))*)$"
_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\*|-?[0-9]+)\]")


def index_steps(paths: list[str] | None) -> tuple[tuple[PathStep, ...], ...] | None:
    """The steps of each validated field path; None (whole value) stays None, and an empty
    list (``index: false`` or ``[]``) means no searchable text."""
    if paths is None:
        return None
    return tuple(() if path == "$" else _steps(path) for path in paths)


def _steps(path: str) -> tuple[PathStep, ...]:
    steps: list[PathStep] = []
    for key, index in _PATH_TOKEN.findall(path):
        if key:
            steps.append(key)
        else:
            steps.append(None if index == "*" else int(index))
    return tuple(steps)


def searchable_text(value: Any, paths: tuple[tuple[PathStep, ...], ...] | None) -> str | None:
    """The text FTS indexes for ``value``: string and number leaves under the paths.

    Each node of the value is indexed at most once, whatever the paths: a node selected
    again (``["$", "$"]``) or lying under a node already selected (``$`` with ``t`` and
    ``t[*]``) adds nothing. Without this, ``index: ["$"] * 64`` stored 64 copies of the
    value's text and multiplied its BM25 term frequencies. The selected nodes are then
    disjoint subtrees, so the text is never longer than that of the whole value.
    """
    if paths == ():
        return None
    if paths is None:
        roots = [value]
    else:
        located = [pair for p in paths for pair in _select_located(value, p, ())]
        roots = _outermost(located)
    pieces = [piece for root in roots for piece in _leaves(root)]
    return "\n".join(pieces) if pieces else None


Location = tuple[str | int, ...]  # keys and non-negative indexes from the top of the value


def _outermost(located: list[tuple[Location, Any]]) -> list[Any]:
    """The nodes of ``located`` (first selection order) that are neither a repeat nor
    below another selected node."""
    chosen = {location for location, _ in located}
    seen: set[Location] = set()
    roots: list[Any] = []
    for location, node in located:
        if location in seen:
            continue
        seen.add(location)
        if any(location[:depth] in chosen for depth in range(len(location))):
            continue  # its text comes with its selected ancestor
        roots.append(node)
    return roots


def _select(node: Any, steps: tuple[PathStep, ...]) -> Iterator[Any]:
    for _, selected in _select_located(node, steps, ()):
        yield selected


def _select_located(
    node: Any, steps: tuple[PathStep, ...], at: Location
) -> Iterator[tuple[Location, Any]]:
    """The nodes the steps select below ``node`` (found at ``at``), with their locations."""
    if not steps:
        yield at, node
        return
    step, rest = steps[0], steps[1:]
    if isinstance(step, str):
        if isinstance(node, dict) and step in node:
            yield from _select_located(node[step], rest, (*at, step))
    elif step is None:
        children = node if isinstance(node, list) else []
        for index, child in enumerate(children):
            yield from _select_located(child, rest, (*at, index))
    elif isinstance(node, list) and -len(node) <= step < len(node):
        index = step % len(node)  # list[-1] and list[n-1] are one node
        yield from _select_located(node[index], rest, (*at, index))


def nodes_at(value: Any, steps: tuple[PathStep, ...]) -> Iterator[Any]:
    """The values one field path selects (the embedding index embeds each on its own)."""
    return _select(value, steps)


def _leaves(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, bool) or node is None:
        return
    elif isinstance(node, int | float):
        yield str(node)
    elif isinstance(node, list):
        for child in node:
            yield from _leaves(child)
    elif isinstance(node, dict):
        for child in node.values():
            yield from _leaves(child)


def match_expression(query: str) -> str | None:
    """An FTS5 MATCH expression: any of the query's terms (OR), so BM25 ranks partial matches.

    None when the query has no searchable term (it then matches nothing).
    """
    chosen = query_terms(query)
    if not chosen:
        return None
    # Quoted, each term is a plain string to FTS5: no operator or column syntax gets through.
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in chosen)


def query_terms(query: str) -> list[str]:
    """The distinct lower-cased terms a query searches for (stopwords dropped unless the
    query has nothing else), at most ``MAX_QUERY_TERMS``; both storages use these."""
    terms: list[str] = []
    for term in _TERM.findall(query.lower()):
        if term not in terms:
            terms.append(term)
    meaningful = [t for t in terms if t not in _STOPWORDS]
    return (meaningful or terms)[:MAX_QUERY_TERMS]

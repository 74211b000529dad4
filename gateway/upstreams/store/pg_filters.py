"""Search filters compiled to PostgreSQL predicates over the item's value as ``jsonb``.

The same meaning as the SQLite compiler (``filters.py``): a key is a path of field names
(``user.name``), each step an object key (arrays are not indexed into, although ``#>``
would); equality is JSON equality (key order and 1 vs 1.0 do not matter), ``$ne`` needs
the field present, ordering compares numbers with numbers and strings with strings (by code
point, as SQLite's BINARY collation does), a null ordering bound is an infinite one (any
number), anything else is "no match". Equality clauses also add a containment test
(``doc @> {"user": {"name": operand}}``) that the GIN ``jsonb_path_ops`` index on the value
serves; ordering clauses are checked on the rows the other conditions leave.
"""

from __future__ import annotations

from typing import Any

from psycopg.types.json import Jsonb

from gateway.upstreams.store.filters import FilterClause, _sql_number

_COMPARISON = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}


def has_nul(value: Any) -> bool:
    """Whether a JSON value holds U+0000, which PostgreSQL text and jsonb cannot keep."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    return False


def json_text_has_nul(text: str) -> bool:
    """``has_nul`` of the value ``json.dumps`` wrote as ``text``, without walking the value
    again: U+0000 in any string or key is written as the escape ``\\u0000``; the same six
    characters after an escaped backslash (``\\\\u0000``, text that only reads so) are not
    one, so the backslashes before each are counted (an odd number: an escape)."""
    found = text.find("\\u0000")
    while found != -1:
        start = found
        while start > 0 and text[start - 1] == "\\":
            start -= 1
        if (found - start) % 2 == 0:
            return True
        found = text.find("\\u0000", found + 1)
    return False


def compile_pg_filter(clauses: tuple[FilterClause, ...], doc: str) -> tuple[str, list[Any]]:
    """SQL (ANDed, ``%s`` parameters) for ``clauses`` over the jsonb expression ``doc``."""
    parts: list[str] = []
    params: list[Any] = []
    for clause in clauses:
        sql, clause_params = _clause(clause, doc)
        parts.append(sql)
        params.extend(clause_params)
    return (" AND ".join(parts) if parts else "TRUE"), params


Sql = tuple[str, list[Any]]


def _param(value: Any) -> Sql:
    return "%s", [value]


def _sql(*pieces: str | Sql) -> Sql:
    """Text and (sql, params) pieces joined, parameters in the order their marks appear."""
    text: list[str] = []
    params: list[Any] = []
    for piece in pieces:
        if isinstance(piece, str):
            text.append(piece)
        else:
            text.append(piece[0])
            params.extend(piece[1])
    return "".join(text), params


class _Field:
    """SQL for the field at ``path`` in ``doc``: its value as jsonb (``value``) and as text
    (``text``), SQL NULL when absent, and the condition that every step above it is an
    object (``parents``)."""

    def __init__(self, doc: str, path: tuple[str, ...]) -> None:
        self.path = path
        if len(path) == 1:
            self.value = _sql(f"({doc} -> ", _param(path[0]), ")")
            self.text = _sql(f"({doc} ->> ", _param(path[0]), ")")
        else:
            self.value = _sql(f"({doc} #> ", _param(list(path)), "::text[])")
            self.text = _sql(f"({doc} #>> ", _param(list(path)), "::text[])")
        # '#>' indexes into arrays when a step reads as an integer ('0', ' 1', '+1'):
        # requiring an object at every level above keeps arrays out, as on SQLite.
        parents = [
            _sql(f"jsonb_typeof({doc} #> ", _param(list(path[:depth])), "::text[]) = 'object'")
            for depth in range(1, len(path))
        ]
        self.parents = _sql(*_joined(parents, " AND ")) if parents else ("TRUE", [])

    def containing(self, operand: Any) -> Sql:
        """The jsonb document ``{"a": {"b": operand}}`` for the path ``a.b``."""
        nested = operand
        for name in reversed(self.path):
            nested = {name: nested}
        return _param(Jsonb(nested))


def _joined(pieces: list[Sql], separator: str) -> list[str | Sql]:
    joined: list[str | Sql] = []
    for piece in pieces:
        if joined:
            joined.append(separator)
        joined.append(piece)
    return joined


def _clause(clause: FilterClause, doc: str) -> Sql:
    operand = clause.operand
    if any(has_nul(name) for name in clause.path):
        return "FALSE", []  # no stored value has such a key
    field = _Field(doc, clause.path)
    if clause.operator in ("$eq", "$ne"):
        if has_nul(operand):
            # No stored value holds U+0000 (PostgreSQL cannot keep it): never equal.
            if clause.operator == "$eq":
                return "FALSE", []
            return _sql("(", field.value, " IS NOT NULL AND ", field.parents, ")")
        if clause.operator == "$eq":
            return _sql(
                f"({doc} @> ",
                field.containing(operand),
                " AND ",
                field.parents,
                " AND ",
                field.value,
                " = ",
                _param(Jsonb(operand)),
                ")",
            )
        return _sql("(", field.parents, " AND ", field.value, " <> ", _param(Jsonb(operand)), ")")
    comparison = _COMPARISON[clause.operator]
    if operand is None:
        # A null bound is an infinite one (the SDK's inf and -inf): any number is within it.
        return _sql("(jsonb_typeof(", field.value, ") = 'number' AND ", field.parents, ")")
    if isinstance(operand, bool):
        return "FALSE", []
    if isinstance(operand, int | float):
        bound = float(_sql_number(operand))
        return _when(
            field, "number", _sql(field.value, f"::float8 {comparison} ", _param(bound), "::float8")
        )
    if isinstance(operand, str):
        if "\x00" in operand:
            # Cut at the NUL: s > "ab\0x" is s >= "ab\0..." i.e. s > "ab" for NUL-free s.
            operand = operand.split("\x00", 1)[0]
            comparison = {"$gt": ">", "$gte": ">", "$lt": "<=", "$lte": "<="}[clause.operator]
        return _when(
            field,
            "string",
            _sql(field.text, f' COLLATE "C" {comparison} ', _param(operand), ' COLLATE "C"'),
        )
    return "FALSE", []


def _when(field: _Field, json_type: str, comparison: Sql) -> Sql:
    """``comparison`` when the field holds a ``json_type`` below objects, else FALSE (the
    CASE keeps a cast from running on a value of another type)."""
    return _sql(
        "(CASE WHEN jsonb_typeof(",
        field.value,
        f") = '{json_type}' AND ",
        field.parents,
        " THEN ",
        comparison,
        " ELSE FALSE END)",
    )

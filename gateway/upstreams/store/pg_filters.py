"""Search filters compiled to PostgreSQL predicates over the item's value as ``jsonb``.

The same meaning as the SQLite compiler (``filters.py``): equality is JSON equality (key
order and 1 vs 1.0 do not matter), ``$ne`` needs the key present, ordering compares
numbers with numbers and strings with strings (by code point, as SQLite's BINARY collation
does), anything else is "no match". Equality clauses also add a containment test
(``doc @> {"key": operand}``) that the GIN ``jsonb_path_ops`` index on the value serves;
ordering clauses are checked on the rows the other conditions leave.
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


def compile_pg_filter(clauses: tuple[FilterClause, ...], doc: str) -> tuple[str, list[Any]]:
    """SQL (ANDed, ``%s`` parameters) for ``clauses`` over the jsonb expression ``doc``."""
    parts: list[str] = []
    params: list[Any] = []
    for clause in clauses:
        sql, clause_params = _clause(clause, doc)
        parts.append(sql)
        params.extend(clause_params)
    return (" AND ".join(parts) if parts else "TRUE"), params


def _clause(clause: FilterClause, doc: str) -> tuple[str, list[Any]]:
    key, operand = clause.key, clause.operand
    if has_nul(key):
        return "FALSE", []  # no stored value has such a key
    if clause.operator in ("$eq", "$ne"):
        if has_nul(operand):
            # No stored value holds U+0000 (PostgreSQL cannot keep it): never equal.
            return ("FALSE", []) if clause.operator == "$eq" else (f"({doc} ? %s)", [key])
        if clause.operator == "$eq":
            return (
                f"({doc} @> %s AND {doc} -> %s = %s)",
                [Jsonb({key: operand}), key, Jsonb(operand)],
            )
        return f"({doc} ? %s AND {doc} -> %s <> %s)", [key, key, Jsonb(operand)]
    comparison = _COMPARISON[clause.operator]
    if isinstance(operand, bool):
        return "FALSE", []
    if isinstance(operand, int | float):
        return (
            f"(CASE WHEN jsonb_typeof({doc} -> %s) = 'number' "
            f"THEN ({doc} -> %s)::float8 {comparison} %s::float8 ELSE FALSE END)",
            [key, key, float(_sql_number(operand))],
        )
    if isinstance(operand, str) and "\x00" not in operand:
        return (
            f"(CASE WHEN jsonb_typeof({doc} -> %s) = 'string' "
            f'THEN ({doc} ->> %s) COLLATE "C" {comparison} %s COLLATE "C" ELSE FALSE END)',
            [key, key, operand],
        )
    if isinstance(operand, str):
        # Cut at the NUL: s > "ab\0x" is s >= "ab\0..." i.e. s > "ab" for NUL-free s.
        head = operand.split("\x00", 1)[0]
        lenient = {"$gt": ">", "$gte": ">", "$lt": "<=", "$lte": "<="}[clause.operator]
        return (
            f"(CASE WHEN jsonb_typeof({doc} -> %s) = 'string' "
            f'THEN ({doc} ->> %s) COLLATE "C" {lenient} %s COLLATE "C" ELSE FALSE END)',
            [key, key, head],
        )
    return "FALSE", []

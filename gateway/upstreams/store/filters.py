"""Search filters on fields of an item's value, compiled to SQLite predicates.

A filter key is a path into the value: field names joined by ``.`` (``user.access-level`` is
``value["user"]["access-level"]``), as langgraph's stores address nested fields; every step
is an object key (an array is not indexed into). A plain value means exact JSON equality; an
object whose keys all start with ``$`` is a set of operators (``$eq $ne $gt $gte $lt $lte``),
ANDed. Ordering operators compare numbers with numbers and strings with strings; any other
pairing is "no match", never an error. A ``null`` bound of an ordering operator is an
infinite one (see ``_member_predicate``). ``$ne`` matches items that have the field with any
other value; items without the field do not match any clause.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from gateway.upstreams.http_api.json_values import check_json_tree, invalid_at

Operator = Literal["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"]
OPERATORS: tuple[Operator, ...] = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")
_SQL_COMPARISON = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
# A filter names at most this many keys (each with at most the six operators).
MAX_FILTER_KEYS = 64
# A filter key names at most this many fields (SQLite nests one json_each per field, and a
# query may join at most 64 tables; values nest at most 64 levels anyway).
MAX_FILTER_PATH_FIELDS = 32
# Bounds on the whole filter, not only on each key: what a search costs grows with the
# conditions (operators counted) and with the field names across all keys (each distinct
# path prefix is one json_each walk of an item's value per item in scope). 64 keys with
# six operators each (384 conditions) once took one query to 1.3 GB; the keys bound alone
# did not bound the work.
MAX_FILTER_CONDITIONS = 128
MAX_FILTER_TOTAL_PATH_FIELDS = 128
# What a filter key may be: field names joined by '.', none empty. Any other character is
# fine (keys are bound as parameters, never spliced into SQL).
FILTER_KEY_PATTERN = rf"^[^.]+(?:\.[^.]+){{0,{MAX_FILTER_PATH_FIELDS - 1}}}$"

# Name of the SQLite function (registered on every connection) that canonicalises JSON
# text, so object equality does not depend on key order.
CANONICAL_JSON_SQL_FUNCTION = "store_canonical_json"


@dataclass(frozen=True, slots=True)
class FilterClause:
    """One condition on one field of the value; ``key`` is the filter's key as given."""

    key: str
    operator: Operator
    operand: Any

    @property
    def path(self) -> tuple[str, ...]:
        """The field names from the top of the value down (``"a.b"`` is ``("a", "b")``)."""
        return tuple(self.key.split("."))


def check_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` when every key is a path of non-empty field names, at most
    ``MAX_FILTER_PATH_FIELDS`` of them (langgraph's stores raise on keys they cannot use)."""
    for key in raw:
        fields = key.split(".")
        if "" in fields:
            raise invalid_at(
                [key],
                "invalid filter key: expected field names joined by '.' (such as "
                "'user.name'), none of them empty",
            )
        if len(fields) > MAX_FILTER_PATH_FIELDS:
            raise invalid_at(
                [key], f"invalid filter key: at most {MAX_FILTER_PATH_FIELDS} field names"
            )
    return raw


def check_cost(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` when its conditions (each operator counts) and its field names (summed over
    the keys) stay within ``MAX_FILTER_CONDITIONS`` and ``MAX_FILTER_TOTAL_PATH_FIELDS``."""
    conditions = sum(
        len(condition) if _is_operator_object(condition) else 1 for condition in raw.values()
    )
    if conditions > MAX_FILTER_CONDITIONS:
        raise invalid_at(
            [],
            f"filter too costly: {conditions} conditions (operators counted); at most "
            f"{MAX_FILTER_CONDITIONS}",
        )
    fields = sum(len(key.split(".")) for key in raw)
    if fields > MAX_FILTER_TOTAL_PATH_FIELDS:
        raise invalid_at(
            [],
            f"filter too costly: {fields} field names across its keys; at most "
            f"{MAX_FILTER_TOTAL_PATH_FIELDS}",
        )
    return raw


def check_operators(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` when every condition that names an operator names only known ones."""
    for key, condition in raw.items():
        if _is_operator_object(condition):
            for op in condition:
                if op not in OPERATORS:
                    raise invalid_at(
                        [key], f"unknown operator {op!r}; supported: {', '.join(OPERATORS)}"
                    )
    return raw


def filter_clauses(raw: dict[str, Any] | None) -> tuple[FilterClause, ...]:
    """The clauses of a validated filter, in order."""
    clauses: list[FilterClause] = []
    for key, condition in (raw or {}).items():
        if _is_operator_object(condition):
            clauses.extend(FilterClause(key, op, operand) for op, operand in condition.items())
        else:
            clauses.append(FilterClause(key, "$eq", condition))
    return tuple(clauses)


def _is_operator_object(condition: object) -> bool:
    return isinstance(condition, dict) and any(key.startswith("$") for key in condition)


# What a condition is, for the OpenAPI document: an object of operators, an object with no
# key starting with "$" (compared whole), or any other JSON value.
CONDITION_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"enum": list(OPERATORS)},
            "minProperties": 1,
            "description": "Operators, ANDed",
        },
        {
            "type": "object",
            "propertyNames": {"not": {"pattern": "^\\$"}},
            "description": "An object, equal as a whole",
        },
        {"type": ["array", "string", "number", "boolean", "null"]},
    ]
}

Filter = Annotated[
    dict[str, Any],
    Field(
        max_length=MAX_FILTER_KEYS,
        json_schema_extra={
            "additionalProperties": CONDITION_SCHEMA,
            "propertyNames": {"pattern": FILTER_KEY_PATTERN},
        },
        description=(
            "Fields of the value, ANDed; a key is a path of field names joined by '.' "
            "('user.name' is value.user.name). A plain value is exact JSON equality; an "
            "object of operators ($eq $ne $gt $gte $lt $lte) compares (a null bound of "
            "$gt $gte $lt $lte is infinite: any number)"
        ),
    ),
    AfterValidator(check_json_tree),
    AfterValidator(check_keys),
    AfterValidator(check_operators),
    AfterValidator(check_cost),
]
"""A search filter: at most ``MAX_FILTER_KEYS`` keys, each a path of non-empty field names,
known operators, storable JSON, at most ``MAX_FILTER_CONDITIONS`` conditions and
``MAX_FILTER_TOTAL_PATH_FIELDS`` field names in all."""


def canonical_json(value: Any) -> str:
    """JSON text that is equal for equal JSON values (sorted keys, 1.0 written as 1)."""
    # Through text and back: the decoder normalises the numbers (see _number), and neither
    # step recurses in Python, so depth is bounded only by the C codec's own checks.
    return _canonical_text(json.dumps(value, ensure_ascii=False, allow_nan=False))


def canonical_json_text(text: object) -> str | None:
    """SQLite-callable form of ``canonical_json`` over JSON text; None for anything else.

    Registered as a SQLite function: an exception raised here would abort the whole query
    (a 500), so any failure, a document too deep for the codec included, returns None,
    which equals no operand (see ``_equality``).
    """
    if not isinstance(text, str):
        return None
    try:
        return _canonical_text(text)
    except Exception:
        return None


def _canonical_text(text: str) -> str:
    return json.dumps(
        json.loads(text, parse_float=_number),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is integral (1.0 -> 1)."""
    number = float(text)
    return int(number) if number.is_integer() else number


# How many levels of the filter's path tree share one json_each walk per object (see
# ``compile_filter``); keys deeper than that get one walk each. Each shared level nests a
# subquery, and SQLite's parser stack overflows on a few dozen nested subqueries.
_SHARED_WALK_LEVELS = 3


def compile_filter(clauses: tuple[FilterClause, ...], value_column: str) -> tuple[str, list[Any]]:
    """One SQL predicate and its parameters for ``clauses`` (ANDed) over ``value_column``.

    SQLite parses the JSON again for every json_each in a statement and keeps each parse
    until the statement ends, so one walk per clause cost memory in proportion to clauses
    times the value's size (384 clauses over a 0.9 MB value: 1.3 GB). Here the paths form a
    tree (``a``, ``a.b`` and ``a.c`` share ``a``): its top ``_SHARED_WALK_LEVELS`` levels
    are one walk per object, shared by every clause below it, and below those each key is
    one walk with all its conditions. The value itself is therefore walked once.

    A shared walk over an object's members counts the members whose key the filter names
    at that node and whose conditions hold; all hold when the count is the number of such
    keys. That equals one ``EXISTS`` per clause because an object holds each key at most
    once (values are written by ``json.dumps`` of a dict), so no key is counted twice and
    the conditions on one key are all about one member. Keys are compared as values, so no
    JSON path is ever built from a key (SQLite's path syntax cannot quote every key).
    """
    if not clauses:
        return "1", []
    root = _PathNode()
    for clause in clauses:
        node = root
        for name in clause.path:
            node = node.children.setdefault(name, _PathNode())
        node.clauses.append(clause)
    return _shared_walk(root, value_column, 0)


@dataclass(slots=True)
class _PathNode:
    """The clauses on one field (``clauses``) and the fields named below it."""

    clauses: list[FilterClause] = field(default_factory=list)
    children: dict[str, _PathNode] = field(default_factory=dict)

    def below(self, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], _PathNode]]:
        """Every node under this one that has clauses, with its path from here."""
        for name, child in self.children.items():
            if child.clauses:
                yield (*path, name), child
            yield from child.below((*path, name))


def _object_members(alias: str) -> str:
    # Arrays are not indexed into and json_each never parses a string as JSON: only an
    # object has members to walk (NULL gives json_each no rows).
    return f"CASE WHEN {alias}.type = 'object' THEN {alias}.value END"


def _shared_walk(node: _PathNode, source: str, level: int) -> tuple[str, list[Any]]:
    """True when every field named below ``node`` is a member of the object ``source``
    and its conditions hold: one json_each walk of ``source``."""
    alias = f"w{level}"
    cases: list[str] = []
    params: list[Any] = []
    for name, child in node.children.items():
        condition, condition_params = _member_holds(child, alias, level)
        cases.append(f"WHEN ? THEN ({condition})")
        params.append(name)
        params.extend(condition_params)
    sql = (
        f"(SELECT count(*) FROM json_each({source}) AS {alias} "
        f"WHERE CASE {alias}.key {' '.join(cases)} ELSE 0 END) = {len(node.children)}"
    )
    return sql, params


def _member_holds(node: _PathNode, alias: str, level: int) -> tuple[str, list[Any]]:
    """The conditions of ``node``, and of the fields below it, on the json_each row
    ``alias`` that holds its field."""
    parts: list[str] = []
    params: list[Any] = []
    for clause in node.clauses:
        predicate, predicate_params = _member_predicate(clause, alias)
        parts.append(f"({predicate})")
        params.extend(predicate_params)
    if node.children and level + 1 < _SHARED_WALK_LEVELS:
        below, below_params = _shared_walk(node, _object_members(alias), level + 1)
        parts.append(f"({below})")
        params.extend(below_params)
    elif node.children:
        for path, leaf in node.below():
            below, below_params = _key_walk(path, leaf.clauses, _object_members(alias))
            parts.append(f"({below})")
            params.extend(below_params)
    return " AND ".join(parts), params


def _key_walk(
    path: tuple[str, ...], clauses: list[FilterClause], source: str
) -> tuple[str, list[Any]]:
    """True when the field at ``path`` in the object ``source`` exists and every clause on
    it holds: one json_each per field name, joined, each over the object its parent row
    holds."""
    aliases = [f"k{depth}" for depth in range(len(path))]
    sources = [f"json_each({source}) AS {aliases[0]}"]
    sources.extend(
        f"json_each({_object_members(parent)}) AS {alias}"
        for parent, alias in itertools.pairwise(aliases)
    )
    conditions = [f"{alias}.key = ?" for alias in aliases]
    params: list[Any] = list(path)
    for clause in clauses:
        predicate, predicate_params = _member_predicate(clause, aliases[-1])
        conditions.append(f"({predicate})")
        params.extend(predicate_params)
    return f"EXISTS (SELECT 1 FROM {', '.join(sources)} WHERE {' AND '.join(conditions)})", params


def _member_predicate(clause: FilterClause, f: str) -> tuple[str, list[Any]]:
    """A predicate on the json_each row ``f`` (columns ``type`` and ``value``)."""
    if clause.operator == "$eq":
        return _equality(clause.operand, f)
    if clause.operator == "$ne":
        sql, params = _equality(clause.operand, f)
        return f"NOT ({sql})", params
    comparison = _SQL_COMPARISON[clause.operator]
    operand = clause.operand
    if operand is None:
        # JSON has no infinity: the SDK sends $lt: inf and $gt: -inf as null. A null bound is
        # read as that infinite bound, which every number is within (strings, as ever, are
        # not ordered against a number).
        return f"{f}.type IN ('integer', 'real')", []
    if isinstance(operand, bool):
        return "0", []
    if isinstance(operand, int | float):
        return f"{f}.type IN ('integer', 'real') AND {f}.value {comparison} ?", [
            _sql_number(operand)
        ]
    if isinstance(operand, str):
        return f"{f}.type = 'text' AND {f}.value {comparison} ?", [operand]
    return "0", []


def _equality(operand: Any, f: str) -> tuple[str, list[Any]]:
    if operand is None:
        return f"{f}.type = 'null'", []
    if operand is True:
        return f"{f}.type = 'true'", []
    if operand is False:
        return f"{f}.type = 'false'", []
    if isinstance(operand, int | float):
        return f"{f}.type IN ('integer', 'real') AND {f}.value = ?", [_sql_number(operand)]
    if isinstance(operand, str):
        return f"{f}.type = 'text' AND {f}.value = ?", [operand]
    kind = "array" if isinstance(operand, list) else "object"
    # IS, not =: a stored value the function cannot canonicalise (None; only one nested far
    # deeper than any operand may be) equals no operand, so $eq is false and $ne true.
    return (
        f"{f}.type = '{kind}' AND {CANONICAL_JSON_SQL_FUNCTION}({f}.value) IS ?",
        [canonical_json(operand)],
    )


def _sql_number(number: float) -> float:
    # SQLite integers are 64-bit; larger JSON integers are compared as reals, as SQLite's
    # JSON functions store them.
    if isinstance(number, int) and not -(2**63) <= number < 2**63:
        try:
            return float(number)
        except OverflowError:  # beyond double range: SQLite reads such a stored one as +-inf
            return math.inf if number > 0 else -math.inf
    return number

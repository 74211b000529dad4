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
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from gateway.upstreams.http_api.json_values import check_json_tree, invalid_at

Operator = Literal["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"]
OPERATORS: tuple[Operator, ...] = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")
_SQL_COMPARISON = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
# A filter names at most this many keys (each with at most the six operators).
MAX_FILTER_KEYS = 64
# A filter key names at most this many fields (SQLite joins one json_each per field, and a
# query may join at most 64 tables; values nest at most 64 levels anyway).
MAX_FILTER_PATH_FIELDS = 32
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
]
"""A search filter: at most ``MAX_FILTER_KEYS`` keys, each a path of non-empty field names,
known operators, storable JSON."""


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


def compile_filter(clauses: tuple[FilterClause, ...], value_column: str) -> tuple[str, list[Any]]:
    """SQL predicates (ANDed) and their parameters for ``clauses`` over ``value_column``."""
    parts: list[str] = []
    params: list[Any] = []
    for clause in clauses:
        source, source_params = _field_source(clause.path, value_column)
        predicate, predicate_params = _member_predicate(clause)
        parts.append(f"EXISTS (SELECT 1 FROM {source} AND ({predicate}))")
        params.extend(source_params)
        params.extend(predicate_params)
    return (" AND ".join(parts) if parts else "1"), params


def _field_source(path: tuple[str, ...], value_column: str) -> tuple[str, list[Any]]:
    """``FROM``/``WHERE`` text yielding one json_each row ``f`` for the field at ``path``
    (none when it is absent), and its parameters.

    One json_each per field name, each over the object its parent row holds: keys are
    compared as values, so no JSON path is ever built from a key (SQLite's path syntax
    cannot quote every key). A parent that is not an object gives json_each NULL, hence no
    rows: arrays are not indexed into, and json_each never parses a string as JSON.
    """
    aliases = [f"f{depth}" for depth in range(len(path) - 1)] + ["f"]
    sources = [f"json_each({value_column}) AS {aliases[0]}"]
    for parent, alias in itertools.pairwise(aliases):
        sources.append(
            f"json_each(CASE WHEN {parent}.type = 'object' THEN {parent}.value END) AS {alias}"
        )
    conditions = " AND ".join(f"{alias}.key = ?" for alias in aliases)
    return f"{', '.join(sources)} WHERE {conditions}", list(path)


def _member_predicate(clause: FilterClause) -> tuple[str, list[Any]]:
    """A predicate on the json_each row ``f`` (columns ``type`` and ``value``)."""
    if clause.operator == "$eq":
        return _equality(clause.operand)
    if clause.operator == "$ne":
        sql, params = _equality(clause.operand)
        return f"NOT ({sql})", params
    comparison = _SQL_COMPARISON[clause.operator]
    operand = clause.operand
    if operand is None:
        # JSON has no infinity: the SDK sends $lt: inf and $gt: -inf as null. A null bound is
        # read as that infinite bound, which every number is within (strings, as ever, are
        # not ordered against a number).
        return "f.type IN ('integer', 'real')", []
    if isinstance(operand, bool):
        return "0", []
    if isinstance(operand, int | float):
        return f"f.type IN ('integer', 'real') AND f.value {comparison} ?", [_sql_number(operand)]
    if isinstance(operand, str):
        return f"f.type = 'text' AND f.value {comparison} ?", [operand]
    return "0", []


def _equality(operand: Any) -> tuple[str, list[Any]]:
    if operand is None:
        return "f.type = 'null'", []
    if operand is True:
        return "f.type = 'true'", []
    if operand is False:
        return "f.type = 'false'", []
    if isinstance(operand, int | float):
        return "f.type IN ('integer', 'real') AND f.value = ?", [_sql_number(operand)]
    if isinstance(operand, str):
        return "f.type = 'text' AND f.value = ?", [operand]
    kind = "array" if isinstance(operand, list) else "object"
    # IS, not =: a stored value the function cannot canonicalise (None; only one nested far
    # deeper than any operand may be) equals no operand, so $eq is false and $ne true.
    return (
        f"f.type = '{kind}' AND {CANONICAL_JSON_SQL_FUNCTION}(f.value) IS ?",
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

"""Loads rule files and refuses bad ones with errors naming the file, the rule and the field.

A rule file is YAML with a top-level ``rules:`` list (see ``rules/default.yaml`` and
``docs/rules.md``). Several files are loaded in name order and evaluated as one list.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.policy.model import (
    PATH_KINDS,
    UUID_GROUP_PREFIX,
    IdentityKind,
    LimitSpec,
    MatchAlternative,
    PathKind,
    PathMatcher,
    Rule,
    RuleTable,
)
from gateway.policy.reachability import shadowing_rule

DEFAULT_REGIONS = frozenset({"us", "eu", "us2"})
# us2 has no column of its own in the service description: it takes the us values.
REGION_FALLBACKS = {"us2": "us"}
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})
RULE_KEYS = frozenset(
    {"id", "category", "match", "identity", "limits", "shadow", "unlimited", "failure_mode",
     "description"}
)  # fmt: skip
MATCH_KEYS = frozenset({"methods", *PATH_KINDS})
ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
LIMIT_PATTERN = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
MAX_WINDOW_SECONDS = 7 * 86400
MAX_COUNT = 10**9
MAX_FILE_BYTES = 1_048_576
TEMPLATE_TYPES = {
    # Any one segment here; the matcher then keeps it only if Python's uuid.UUID reads it
    # once percent-decoded (model.is_uuid_segment), so a client cannot leave a UUID-keyed
    # rule by writing the same id in another spelling that server (or a stricter one)
    # would serve: braces, "urn:"/"uuid:" wherever, hyphens anywhere, "+", "0x", "_"...
    "uuid": r"[^/]+",
    "int": r"[0-9]+",
    "str": r"[^/]+",
}
TEMPLATE_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_]+))?\}")


@dataclass(frozen=True, slots=True)
class RuleProblem:
    file: str
    rule: str | None  # "'id' (#n)" or "#n"
    field: str | None
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.rule:
            where += f": rule {self.rule}"
        if self.field:
            where += f", field {self.field!r}"
        return f"{where}: {self.message}"


class RuleLoadError(Exception):
    """One or more problems in the rule files; the table was not loaded."""

    def __init__(self, problems: Sequence[RuleProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in problems))


def rule_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand files and directories (``*.yaml``/``*.yml`` in name order)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()
            )
            if not found:
                raise RuleLoadError([RuleProblem(str(path), None, None, "no *.yaml files")])
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise RuleLoadError([RuleProblem(str(path), None, None, "no such file or directory")])
    return files


def load_rules(
    paths: Iterable[str | Path],
    regions: Iterable[str] = DEFAULT_REGIONS,
    now: Callable[[], float] = time.time,
) -> RuleTable:
    """Load and validate every rule file; raise ``RuleLoadError`` listing every problem."""
    files = rule_files(paths)
    texts: list[tuple[str, bytes]] = []
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise RuleLoadError([RuleProblem(str(file), None, None, str(exc))]) from exc
        if len(data) > MAX_FILE_BYTES:
            raise RuleLoadError(
                [RuleProblem(str(file), None, None, f"file is over {MAX_FILE_BYTES} bytes")]
            )
        texts.append((str(file), data))
    return load_rules_from_texts(texts, regions, now)


def load_rules_from_texts(
    texts: Sequence[tuple[str, bytes | str]],
    regions: Iterable[str] = DEFAULT_REGIONS,
    now: Callable[[], float] = time.time,
) -> RuleTable:
    known = frozenset(regions) | DEFAULT_REGIONS
    problems: list[RuleProblem] = []
    rules: list[Rule] = []
    seen_ids: dict[str, str] = {}
    digest = hashlib.sha256()
    for name, text in texts:
        raw = text.encode() if isinstance(text, str) else text
        digest.update(name.encode() + b"\0" + raw + b"\0")
        for rule in _parse_file(name, raw, known, problems):
            if rule.id in seen_ids:
                problems.append(
                    RuleProblem(
                        name,
                        f"{rule.id!r} (#{rule.index})",
                        "id",
                        f"duplicate rule id, first defined in {seen_ids[rule.id]}",
                    )
                )
                continue
            seen_ids[rule.id] = name
            rules.append(rule)
    if not problems:
        for position, rule in enumerate(rules):
            earlier = shadowing_rule(rule, rules[:position])
            if earlier is not None:
                problems.append(
                    RuleProblem(
                        rule.source,
                        f"{rule.id!r} (#{rule.index})",
                        "match",
                        f"unreachable: every request it matches is taken first by rule "
                        f"{earlier.id!r} ({earlier.source} #{earlier.index}); move it above",
                    )
                )
    if problems:
        raise RuleLoadError(problems)
    if not rules:
        raise RuleLoadError([RuleProblem(", ".join(n for n, _ in texts), None, None, "no rules")])
    return RuleTable(
        rules=tuple(rules),
        sources=tuple(n for n, _ in texts),
        digest=digest.hexdigest(),
        loaded_at=now(),
        regions=known,
        by_region={
            region: tuple(r for r in rules if r.unlimited or r.limits_for(region))
            for region in known
        },
    )


def _parse_file(
    name: str, raw: bytes, regions: frozenset[str], problems: list[RuleProblem]
) -> list[Rule]:
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problems.append(RuleProblem(name, None, None, f"not valid YAML: {exc}"))
        return []
    if not isinstance(doc, dict):
        problems.append(RuleProblem(name, None, None, "expected a mapping with a 'rules' list"))
        return []
    extra = set(doc) - {"rules", "version"}
    if extra:
        problems.append(RuleProblem(name, None, None, f"unknown top-level key(s): {sorted(extra)}"))
    items = doc.get("rules")
    if not isinstance(items, list):
        problems.append(RuleProblem(name, None, "rules", "expected a list of rules"))
        return []
    rules = []
    for index, item in enumerate(items, start=1):
        rule = _parse_rule(name, index, item, regions, problems)
        if rule is not None:
            rules.append(rule)
    return rules


class _RuleContext:
    """Collects problems for one rule, labelled with the file and rule."""

    def __init__(self, file: str, index: int, problems: list[RuleProblem]) -> None:
        self.file = file
        self.index = index
        self.label = f"#{index}"
        self.problems = problems
        self.failed = False

    def error(self, field: str | None, message: str) -> None:
        self.failed = True
        self.problems.append(RuleProblem(self.file, self.label, field, message))


def _parse_rule(
    file: str, index: int, item: Any, regions: frozenset[str], problems: list[RuleProblem]
) -> Rule | None:
    ctx = _RuleContext(file, index, problems)
    if not isinstance(item, dict):
        ctx.error(None, "expected a mapping")
        return None
    rule_id = item.get("id")
    if not isinstance(rule_id, str) or not ID_PATTERN.fullmatch(rule_id):
        ctx.error("id", "required; lower-case letters, digits, '.', '_' or '-', at most 64")
    else:
        ctx.label = f"{rule_id!r} (#{index})"
    unknown = set(item) - RULE_KEYS
    if unknown:
        ctx.error(None, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(RULE_KEYS)}")
    category = item.get("category", "")
    if not isinstance(category, str):
        ctx.error("category", "must be a string")
    shadow = _bool(ctx, item, "shadow")
    unlimited = _bool(ctx, item, "unlimited")
    if shadow and unlimited:
        ctx.error("shadow", "a rule cannot be both shadow and unlimited")
    identity = _identity(ctx, item.get("identity", "ip" if unlimited else None))
    failure_mode = item.get("failure_mode", "open")
    if failure_mode not in ("open", "closed"):
        ctx.error("failure_mode", f"must be 'open' or 'closed', not {failure_mode!r}")
    alternatives = _alternatives(ctx, item.get("match"))
    limits: dict[str, tuple[LimitSpec, ...]] = {}
    if unlimited:
        if "limits" in item:
            ctx.error("limits", "an unlimited rule takes no limits")
    else:
        limits = _limits(ctx, item.get("limits"), regions)
    if ctx.failed or identity is None or alternatives is None:
        return None
    return Rule(
        id=str(rule_id),
        category=str(category),
        alternatives=alternatives,
        identity=identity,
        limits=limits,
        shadow=shadow,
        unlimited=unlimited,
        fail_open=failure_mode == "open",
        source=file,
        index=index,
        matcher=_compile(alternatives),
    )


def _bool(ctx: _RuleContext, item: Mapping[str, Any], key: str) -> bool:
    value = item.get(key, False)
    if not isinstance(value, bool):
        ctx.error(key, f"must be true or false, not {value!r}")
        return False
    return value


def _identity(ctx: _RuleContext, value: Any) -> IdentityKind | None:
    try:
        return IdentityKind(value)
    except ValueError:
        allowed = ", ".join(k.value for k in IdentityKind)
        ctx.error("identity", f"required; one of {allowed}, not {value!r}")
        return None


def _alternatives(ctx: _RuleContext, value: Any) -> tuple[MatchAlternative, ...] | None:
    if value is None:
        value = {}
    items = value if isinstance(value, list) else [value]
    if not items:
        ctx.error("match", "an empty list matches nothing; leave 'match' out to match all")
        return None
    result = []
    for position, entry in enumerate(items):
        field = "match" if not isinstance(value, list) else f"match[{position}]"
        alternative = _alternative(ctx, field, entry)
        if alternative is not None:
            result.append(alternative)
    return tuple(result) if len(result) == len(items) else None


def _alternative(ctx: _RuleContext, field: str, entry: Any) -> MatchAlternative | None:
    if not isinstance(entry, dict):
        ctx.error(field, "expected a mapping with 'methods' and/or one path form")
        return None
    unknown = set(entry) - MATCH_KEYS
    if unknown:
        ctx.error(field, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(MATCH_KEYS)}")
        return None
    methods: frozenset[str] | None = None
    if "methods" in entry:
        raw = entry["methods"]
        raw = [raw] if isinstance(raw, str) else raw
        if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
            ctx.error(f"{field}.methods", "expected a non-empty list of HTTP methods")
            return None
        upper = {m.upper() for m in raw}
        bad = upper - METHODS
        if bad:
            ctx.error(f"{field}.methods", f"unknown method(s) {sorted(bad)}")
            return None
        if "GET" in upper:
            upper.add("HEAD")  # a HEAD is a GET without the body: the same limit applies
        methods = frozenset(upper)
    forms = [k for k in PATH_KINDS if k in entry]
    if len(forms) > 1:
        ctx.error(field, f"give one path form, not {forms}")
        return None
    if not forms:
        return MatchAlternative(methods, PathMatcher(PathKind.ANY, ""))
    kind = PathKind(forms[0])
    value = entry[forms[0]]
    path_field = f"{field}.{kind.value}"
    if not isinstance(value, str) or not value:
        ctx.error(path_field, "expected a non-empty string")
        return None
    if kind in (PathKind.PATH, PathKind.PREFIX, PathKind.TEMPLATE) and not value.startswith("/"):
        ctx.error(path_field, f"must start with '/': {value!r}")
        return None
    if kind is PathKind.PREFIX and value != "/" and value.endswith("/"):
        ctx.error(path_field, "a prefix is whole segments; drop the trailing '/'")
        return None
    pattern: re.Pattern[str] | None = None
    if kind is PathKind.REGEX:
        try:
            pattern = re.compile(value)
        except re.error as exc:
            ctx.error(path_field, f"bad regular expression: {exc}")
            return None
    elif kind is PathKind.TEMPLATE:
        pattern = _template(ctx, path_field, value)
        if pattern is None:
            return None
    if kind is PathKind.PREFIX and value == "/":
        kind = PathKind.ANY
    return MatchAlternative(methods, PathMatcher(kind, value, pattern))


def _template(ctx: _RuleContext, field: str, value: str) -> re.Pattern[str] | None:
    """``/runs/{uuid}`` or ``/runs/{run_id:uuid}``: a parameter is one typed segment."""
    parts: list[str] = []
    position = 0
    for number, param in enumerate(TEMPLATE_PARAM.finditer(value)):
        parts.append(re.escape(value[position : param.start()]))
        name, kind = param.group(1), param.group(2)
        if kind is None:
            kind = name if name in TEMPLATE_TYPES else "str"
        if kind not in TEMPLATE_TYPES:
            ctx.error(field, f"unknown parameter type {kind!r}; one of {sorted(TEMPLATE_TYPES)}")
            return None
        if kind == "uuid":  # a named group: the matcher checks what it took
            parts.append(f"(?P<{UUID_GROUP_PREFIX}{number}>{TEMPLATE_TYPES[kind]})")
        else:
            parts.append(f"(?:{TEMPLATE_TYPES[kind]})")
        position = param.end()
    rest = value[position:]
    if "{" in rest or "}" in rest:
        ctx.error(field, "unbalanced '{' or '}' in template")
        return None
    parts.append(re.escape(rest))
    return re.compile("".join(parts))


def _limits(
    ctx: _RuleContext, value: Any, regions: frozenset[str]
) -> dict[str, tuple[LimitSpec, ...]]:
    if not isinstance(value, dict) or not value:
        ctx.error("limits", "required: a mapping of region (or 'default') to 'count/seconds'")
        return {}
    parsed: dict[str, tuple[LimitSpec, ...]] = {}
    for region, spec in value.items():
        field = f"limits.{region}"
        if region != "default" and region not in regions:
            ctx.error(field, f"unknown region {region!r}; known: {sorted(regions)} or 'default'")
            continue
        specs = spec if isinstance(spec, list) else [spec]
        limits: list[LimitSpec] = []
        for raw in specs:
            limit = _limit(ctx, field, raw)
            if limit is not None:
                limits.append(limit)
        windows = [limit.seconds for limit in limits]
        if len(set(windows)) != len(windows):
            ctx.error(field, "two limits with the same window; keep the smaller count")
        if not specs:
            ctx.error(field, "expected 'count/seconds' or a list of them")
        parsed[str(region)] = tuple(limits)
    default = parsed.pop("default", None)
    for region in regions:
        if region in parsed:
            continue
        fallback = REGION_FALLBACKS.get(region)
        if fallback is not None and fallback in parsed:
            parsed[region] = parsed[fallback]
        elif default is not None:
            parsed[region] = default
    return parsed


def _limit(ctx: _RuleContext, field: str, raw: Any) -> LimitSpec | None:
    match = LIMIT_PATTERN.fullmatch(raw) if isinstance(raw, str) else None
    if match is None:
        ctx.error(field, f"bad limit {raw!r}: write 'count/seconds', e.g. '100/60'")
        return None
    count, seconds = int(match.group(1)), int(match.group(2))
    if not 1 <= count <= MAX_COUNT:
        ctx.error(field, f"bad limit {raw!r}: count must be 1..{MAX_COUNT}")
        return None
    if not 1 <= seconds <= MAX_WINDOW_SECONDS:
        ctx.error(field, f"bad limit {raw!r}: seconds must be 1..{MAX_WINDOW_SECONDS}")
        return None
    return LimitSpec(count, seconds)


def _compile(alternatives: tuple[MatchAlternative, ...]) -> Callable[[str, str], bool]:
    """One closure per rule, built once at load time so matching does no parsing."""
    tests = tuple(a.compiled() for a in alternatives)
    if len(tests) == 1:
        return tests[0]
    return lambda method, path: any(test(method, path) for test in tests)

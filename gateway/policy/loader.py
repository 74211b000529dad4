"""Loads rule files and refuses bad ones with errors naming the file, the rule and the field.

A rule file is YAML with a top-level ``rules:`` list (see ``rules/default.yaml`` and
``docs/rules.md``). Several files are loaded in name order and evaluated as one list.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import re
import reprlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, ScalarEvent

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

# Where a table leaves a region it is told of without limits (``unlimited_regions``).
# Shown where the process configures logging (``gateway serve``: at start-up and on
# every reload); silent in one-shot commands, which report for themselves.
log = logging.getLogger("gateway.rules.regions")
log.addHandler(logging.NullHandler())
DEFAULT_REGIONS = frozenset({"us", "eu", "us2"})
# us2 has no column of its own in the service description: it takes the us values.
REGION_FALLBACKS = {"us2": "us"}
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})
RULE_KEYS = frozenset(
    {"id", "category", "match", "identity", "limits", "shadow", "unlimited", "failure_mode",
     "description", "tiers", "refusal"}
)  # fmt: skip
# A ceiling takes a rule's keys but unlimited (it would exempt nothing) and tiers.
CEILING_KEYS = RULE_KEYS - {"unlimited", "tiers"}
TIER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}")  # as key files name tiers
MATCH_KEYS = frozenset({"methods", *PATH_KINDS})
ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# ID_PATTERN in words, for messages.
ID_RULE = (
    "lower-case letters, digits, '.', '_' or '-' (starting with a letter or digit), at most 64"
)
LIMIT_PATTERN = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
MAX_WINDOW_SECONDS = 7 * 86400
MAX_COUNT = 10**9
MAX_FILE_BYTES = 1_048_576
# Bounds on the table as a whole. Finding unreachable rules compares every pair of rules
# and, per pair, their match alternatives: these keep that to about two seconds of a
# worker thread at worst, whatever the files hold (the default table has 30 rules).
MAX_RULES = 1000
MAX_ALTERNATIVES = 2000  # match alternatives over all rules (a rule without a list has 1)
MAX_PROBLEMS = 100  # listed in one refusal; the rest are counted, not built into messages
TEMPLATE_TYPES = {
    # Any one segment here; the matcher then keeps it only if a common reader (Python's,
    # Java's or .NET's) takes it for a UUID once percent-decoded
    # (uuid_readings.is_uuid_segment), so a client cannot leave a UUID-keyed rule by
    # writing the same id in another spelling an upstream would serve.
    "uuid": r"[^/]+",
    "int": r"[0-9]+",
    "str": r"[^/]+",
}
TEMPLATE_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_]+))?\}")

# Values quoted in problem messages are cut short: a value may be (through aliases) large,
# and the message is logged, kept as the last reload error and shown on the console.
_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel = 3


def _show(value: Any) -> str:
    """A short repr, for messages (never raises: repr of an int of over 4300 digits does)."""
    try:
        return _SHOW.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


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


# --- YAML, bounded ------------------------------------------------------------------------
#
# ``yaml.safe_load`` builds no arbitrary objects, but is otherwise unbounded: its composer
# recurses once per nesting level (a few thousand levels raise RecursionError), and an
# alias is shared, not copied, so a few hundred bytes of anchors ("billion laughs") load
# quickly into a value that anything walking it (a repr in an error message, a merge key)
# expands to billions of nodes. So the event stream is checked first, in one flat pass
# that builds nothing, and the document is built only if it is within every bound.


@dataclass(frozen=True, slots=True)
class YamlBounds:
    """What one YAML document may cost. The defaults fit any sensible rule or config file
    (the default rule table is ~500 nodes, 6 levels deep, no aliases)."""

    max_bytes: int = MAX_FILE_BYTES
    max_depth: int = 64  # nested collections; the composer's recursion stays far from the limit
    max_nodes: int = 100_000  # nodes once every alias is expanded
    max_chars: int = 2 * MAX_FILE_BYTES  # scalar characters once every alias is expanded
    max_scalar: int = 65_536  # one scalar (an integer like 1:0:0:... costs quadratic time)
    max_aliases: int = 10_000


try:  # libyaml: the same documents and errors, in a tenth of the time
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment,unused-ignore]


def load_yaml_bounded(text: bytes | str, source: str, bounds: YamlBounds = YamlBounds()) -> Any:
    """The document ``yaml.safe_load`` would build from ``text``, or ``RuleLoadError``
    (naming ``source``) if it is not valid YAML, is over any of ``bounds``, or fails in any
    other way: nothing else is raised, whatever ``text`` holds."""
    try:
        if len(text) > bounds.max_bytes:
            raise _Refused(f"YAML file over {bounds.max_bytes} bytes")
        _check_events(text, bounds)
        loader = _SafeLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except _Refused as exc:
        message = str(exc)
    except yaml.YAMLError as exc:
        message = f"not valid YAML: {_describe(exc)}"
    except Exception as exc:  # a constructor's ValueError (!!int "x"), MemoryError, ...
        message = f"not valid YAML: {type(exc).__name__}: {_show(str(exc))[1:-1]}"
    raise RuleLoadError([RuleProblem(source, None, None, message)]) from None


class _Refused(Exception):
    """Over a bound (internal: ``load_yaml_bounded`` turns it into ``RuleLoadError``)."""


def _check_events(text: bytes | str, bounds: YamlBounds) -> None:
    """Walk the event stream (the parser keeps no tree and does not recurse) and refuse
    the document as soon as it is over a bound, counting each alias as the nodes and
    characters of what it refers to, so expansion is measured without being done."""
    nodes = chars = aliases = 0
    open_collections: list[tuple[str | None, int, int]] = []  # (anchor, nodes, chars) at start
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, chars) of its whole value
    parser = _SafeLoader(text)
    try:
        while parser.check_event():
            event = parser.get_event()
            if isinstance(event, AliasEvent):
                aliases += 1
                if aliases > bounds.max_aliases:
                    raise _Refused(f"YAML with over {bounds.max_aliases} aliases{_at(event)}")
                size = sizes.get(event.anchor or "")
                if size is None:  # undefined, or still open: a value containing itself
                    raise _Refused(f"YAML alias *{event.anchor} undefined or recursive{_at(event)}")
                nodes, chars = nodes + size[0], chars + size[1]
            elif isinstance(event, ScalarEvent):
                if len(event.value) > bounds.max_scalar:
                    raise _Refused(f"YAML value over {bounds.max_scalar} characters{_at(event)}")
                nodes, chars = nodes + 1, chars + len(event.value)
                if event.anchor is not None:
                    sizes[event.anchor] = (1, len(event.value))
            elif isinstance(event, CollectionStartEvent):
                if len(open_collections) >= bounds.max_depth:
                    raise _Refused(f"YAML nested deeper than {bounds.max_depth} levels{_at(event)}")
                open_collections.append((event.anchor, nodes, chars))
                nodes += 1
            elif isinstance(event, CollectionEndEvent):
                anchor, nodes_before, chars_before = open_collections.pop()
                if anchor is not None:
                    sizes[anchor] = (nodes - nodes_before, chars - chars_before)
            if nodes > bounds.max_nodes:
                raise _Refused(f"YAML over {bounds.max_nodes} nodes, aliases expanded{_at(event)}")
            if chars > bounds.max_chars:
                raise _Refused(
                    f"YAML over {bounds.max_chars} characters in values, aliases expanded"
                    + _at(event)
                )
    finally:
        parser.dispose()


def _at(event: yaml.Event | None) -> str:
    mark = getattr(event, "start_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _describe(exc: yaml.YAMLError) -> str:
    """The problem and where, on one line (the parser's own text names no file)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        what = ", ".join(str(part) for part in (exc.context, exc.problem) if part)
        mark = exc.problem_mark or exc.context_mark
        if mark is not None:
            what += f" (line {mark.line + 1}, column {mark.column + 1})"
        return what
    if isinstance(exc, yaml.reader.ReaderError):  # bad UTF-8 or a control character
        return f"{exc.reason} (position {exc.position})"
    return _show(str(exc))[1:-1]


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
    """Load and validate every rule file; raise ``RuleLoadError`` listing every problem.

    ``regions``: the regions served (``DEFAULT_REGIONS`` are known whatever it says);
    each of them the table sets no limit for is logged as a WARNING (every request there
    would be exempt)."""
    regions = tuple(regions)
    files = rule_files(paths)
    texts: list[tuple[str, bytes]] = []
    for file in files:
        try:
            with file.open("rb") as stream:  # no more than the bound: the file may be endless
                data = stream.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise RuleLoadError([RuleProblem(str(file), None, None, str(exc))]) from exc
        if len(data) > MAX_FILE_BYTES:
            raise RuleLoadError(
                [RuleProblem(str(file), None, None, f"file is over {MAX_FILE_BYTES} bytes")]
            )
        texts.append((str(file), data))
    table = load_rules_from_texts(texts, regions, now)
    for region in table.unlimited_regions(regions):
        log.warning("%s", unlimited_region_message(region, table))
    return table


def unlimited_region_message(region: str, table: RuleTable) -> str:
    """What the start-up log and ``gateway rules check`` say of a region without limits."""
    return (
        f"region {region!r} has no limits: no rule and no ceiling in "
        f"{', '.join(table.sources)} has a limit for it (or 'default'), so every request "
        f"served there is exempt; add {region!r} to the limits of the rules that should "
        f"apply there, or stop serving it"
    )


def load_rules_from_texts(
    texts: Sequence[tuple[str, bytes | str]],
    regions: Iterable[str] = DEFAULT_REGIONS,
    now: Callable[[], float] = time.time,
) -> RuleTable:
    """Validate rule files given as text; raise ``RuleLoadError`` (and nothing else,
    whatever the texts hold) listing the problems."""
    try:
        return _load_texts(texts, regions, now)
    except RuleLoadError:
        raise
    except Exception as exc:  # a bug here must refuse the files, not kill the reloader
        names = ", ".join(str(n) for n, _ in texts)
        message = f"could not be loaded: {type(exc).__name__}: {_show(str(exc))[1:-1]}"
        raise RuleLoadError([RuleProblem(names, None, None, message)]) from exc


def _load_texts(
    texts: Sequence[tuple[str, bytes | str]],
    regions: Iterable[str],
    now: Callable[[], float],
) -> RuleTable:
    known = frozenset(regions) | DEFAULT_REGIONS
    problems: list[RuleProblem] = []
    rules: list[Rule] = []
    ceilings: list[Rule] = []
    seen_ids: dict[str, str] = {}
    digest = hashlib.sha256()
    for name, text in texts:
        # A lone surrogate passes through, for the YAML reader to refuse as not UTF-8.
        raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        digest.update(name.encode() + b"\0" + raw + b"\0")
        file_rules, file_ceilings = _parse_file(name, raw, known, problems)
        # Ceilings share the rules' id space: an id names one set of counters.
        for rule in (*file_rules, *file_ceilings):
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
            (ceilings if rule.ceiling else rules).append(rule)
    everywhere = ", ".join(n for n, _ in texts)
    if not problems and len(rules) > MAX_RULES:
        problems.append(RuleProblem(everywhere, None, None, f"over {MAX_RULES} rules"))
    if not problems and sum(len(r.alternatives) for r in rules) > MAX_ALTERNATIVES:
        message = f"over {MAX_ALTERNATIVES} match alternatives in all"
        problems.append(RuleProblem(everywhere, None, None, message))
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
    if len(problems) > MAX_PROBLEMS:
        rest = len(problems) - MAX_PROBLEMS
        del problems[MAX_PROBLEMS:]
        problems.append(RuleProblem(everywhere, None, None, f"and {rest} more problem(s)"))
    if problems:
        raise RuleLoadError(problems)
    if not rules and not ceilings:
        raise RuleLoadError([RuleProblem(everywhere, None, None, "no rules")])
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
        ceilings=tuple(ceilings),
    )


def _parse_file(
    name: str, raw: bytes, regions: frozenset[str], problems: list[RuleProblem]
) -> tuple[list[Rule], list[Rule]]:
    """The file's rules and ceilings."""
    try:
        doc = load_yaml_bounded(raw, name)
    except RuleLoadError as exc:
        problems.extend(exc.problems)
        return [], []
    if not isinstance(doc, dict):
        problems.append(RuleProblem(name, None, None, "expected a mapping with a 'rules' list"))
        return [], []
    extra = set(doc) - {"rules", "ceilings", "version"}
    if extra:
        problems.append(RuleProblem(name, None, None, f"unknown top-level key(s): {_keys(extra)}"))
    items = doc.get("rules", [] if "ceilings" in doc else None)
    if not isinstance(items, list):
        problems.append(RuleProblem(name, None, "rules", "expected a list of rules"))
        return [], []
    ceiling_items = doc.get("ceilings") or []
    if not isinstance(ceiling_items, list):
        problems.append(RuleProblem(name, None, "ceilings", "expected a list of ceilings"))
        return [], []
    if len(items) + len(ceiling_items) > MAX_RULES:
        problems.append(RuleProblem(name, None, "rules", f"over {MAX_RULES} rules"))
        return [], []
    rules = []
    for index, item in enumerate(items, start=1):
        rule = _parse_rule(name, index, item, regions, problems)
        if rule is not None:
            rules.append(rule)
    ceilings = []
    for index, item in enumerate(ceiling_items, start=1):
        ceiling = _parse_rule(name, index, item, regions, problems, ceiling=True)
        if ceiling is not None:
            ceilings.append(ceiling)
    return rules, ceilings


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
    file: str,
    index: int,
    item: Any,
    regions: frozenset[str],
    problems: list[RuleProblem],
    ceiling: bool = False,
) -> Rule | None:
    ctx = _RuleContext(file, index, problems)
    if ceiling:
        ctx.label = f"ceiling #{index}"
    if not isinstance(item, dict):
        ctx.error(None, "expected a mapping")
        return None
    rule_id = item.get("id")
    if not isinstance(rule_id, str) or not ID_PATTERN.fullmatch(rule_id):
        # "required" only when it is missing: a value given is said to be wrong as such.
        if "id" not in item:
            ctx.error("id", f"required: {ID_RULE}")
        else:
            message = _wrong(rule_id, ID_RULE)
            if isinstance(rule_id, str) and ID_PATTERN.fullmatch(rule_id.lower()):
                message += f" (did you mean {rule_id.lower()!r}?)"
            ctx.error("id", message)
    else:
        ctx.label = f"{'ceiling ' if ceiling else ''}{rule_id!r} (#{index})"
    allowed = CEILING_KEYS if ceiling else RULE_KEYS
    unknown = set(item) - allowed
    if unknown:
        ctx.error(None, f"unknown key(s) {_keys(unknown)}; allowed: {sorted(allowed)}")
    category = item.get("category", "")
    if not isinstance(category, str):
        ctx.error("category", "must be a string")
    shadow = _bool(ctx, item, "shadow")
    unlimited = _bool(ctx, item, "unlimited")
    if shadow and unlimited:
        ctx.error("shadow", "a rule cannot be both shadow and unlimited")
    given = "identity" in item
    identity = _identity(ctx, item.get("identity", "ip" if unlimited else None), given)
    failure_mode = item.get("failure_mode", "open")
    if failure_mode not in ("open", "closed"):
        ctx.error("failure_mode", _wrong(failure_mode, "'open' or 'closed'"))
    alternatives = _alternatives(ctx, item.get("match"))
    limits: dict[str, tuple[LimitSpec, ...]] = {}
    if unlimited:
        if "limits" in item:
            ctx.error("limits", "an unlimited rule takes no limits")
    else:
        limits = _limits(ctx, item.get("limits"), regions, given="limits" in item)
    tier_limits: dict[str, dict[str, tuple[LimitSpec, ...]]] = {}
    raw_tiers = item.get("tiers")
    if raw_tiers is not None:
        if unlimited or not isinstance(raw_tiers, dict) or not raw_tiers:
            ctx.error("tiers", "a mapping of tier name to limits per region (not on unlimited)")
        else:
            for tier, spec in raw_tiers.items():
                if not isinstance(tier, str) or not TIER_PATTERN.fullmatch(tier):
                    ctx.error("tiers", f"bad tier name {_show(tier)}")
                    continue
                tier_limits[tier] = _limits(ctx, spec, regions, field=f"tiers.{tier}")
    refusal_status, refusal_detail = _refusal(ctx, item.get("refusal"), unlimited)
    if unlimited and alternatives is not None:
        for alternative in alternatives:
            exact_pattern = alternative.path.exact_pattern
            if exact_pattern is not None and exact_pattern.flags & re.IGNORECASE:
                ctx.error(
                    "match",
                    "an exemption's regex cannot ignore case ('(?i)'): an unlimited rule "
                    "takes only the path as written, so that /OK is not exempt with /ok",
                )
    if ctx.failed or identity is None or alternatives is None:
        return None
    rule = Rule(
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
        exact=_compile(alternatives, exact=True) if unlimited else None,
        ceiling=ceiling,
        refusal_status=refusal_status,
        refusal_detail=refusal_detail,
    )
    if tier_limits:
        # Each tier: the same rule (id, match, counters) with the tier's limits.
        tiers = {
            tier: dataclasses.replace(rule, limits=spec, policy=f"{rule.id}.{tier}")
            for tier, spec in tier_limits.items()
        }
        rule = dataclasses.replace(rule, tiers=tiers)
    return rule


MAX_REFUSAL_DETAIL = 500


def _refusal(ctx: _RuleContext, raw: Any, unlimited: bool) -> tuple[int, str]:
    """``refusal: {status: 429 | 503, detail: text}``: how this rule's refusals are
    answered (both optional)."""
    if raw is None:
        return 429, ""
    if unlimited or not isinstance(raw, dict) or set(raw) - {"status", "detail"}:
        ctx.error("refusal", "a mapping with 'status' (429 or 503) and/or 'detail' (text)")
        return 429, ""
    status = raw.get("status", 429)
    if status not in (429, 503) or isinstance(status, bool):
        ctx.error("refusal.status", _wrong(status, "429 or 503"))
        status = 429
    detail = raw.get("detail", "")
    if (
        not isinstance(detail, str)
        or len(detail) > MAX_REFUSAL_DETAIL
        or (detail and not detail.isprintable())
    ):
        ctx.error(
            "refusal.detail",
            f"printable text of at most {MAX_REFUSAL_DETAIL} characters "
            "({rule} and {retry_after} are filled in)",
        )
        detail = ""
    return int(status), detail


def _wrong(value: Any, wanted: str) -> str:
    """The message for a key a rule has with a value that will not do: never
    "required" (that is for a key it lacks). YAML's empty value (``id:``) is said as
    empty, not as Python's None."""
    if value is None:
        return f"empty: give {wanted}"
    return f"must be {wanted}, not {_show(value)}"


def _keys(keys: Iterable[Any]) -> str:
    """Unknown keys for a message: keys may be of any type (``1:``, ``null:``) and long."""
    return _show(sorted(keys, key=_show))


def _bool(ctx: _RuleContext, item: Mapping[str, Any], key: str) -> bool:
    value = item.get(key, False)
    if not isinstance(value, bool):
        ctx.error(key, _wrong(value, "true or false"))
        return False
    return value


def _identity(ctx: _RuleContext, value: Any, given: bool) -> IdentityKind | None:
    """The rule's identity kind; ``given``: the rule has the key (a value it holds is
    wrong as such, never "required")."""
    try:
        return IdentityKind(value)
    except ValueError:
        names = [k.value for k in IdentityKind]
        allowed = ", ".join(names)
        if not given:
            ctx.error("identity", f"required: one of {allowed}")
            return None
        message = _wrong(value, f"one of {allowed}")
        if isinstance(value, str) and len(value) <= 64:  # (a close name is short)
            close = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.75)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        ctx.error("identity", message)
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
        ctx.error(field, f"unknown key(s) {_keys(unknown)}; allowed: {sorted(MATCH_KEYS)}")
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
        ctx.error(path_field, f"must start with '/': {_show(value)}")
        return None
    if kind is PathKind.PREFIX and value != "/" and value.endswith("/"):
        ctx.error(path_field, "a prefix is whole segments; drop the trailing '/'")
        return None
    pattern: re.Pattern[str] | None = None
    exact_pattern: re.Pattern[str] | None = None
    if kind is PathKind.REGEX:
        if "(?-i" in value or re.search(r"\(\?[aiLmsux]*-", value):
            ctx.error(
                path_field,
                "a case-sensitive group ('(?-i:...)') cannot be honoured: paths match "
                "whatever their case",
            )
            return None
        try:
            pattern = re.compile(value, re.IGNORECASE)  # paths match whatever their case
            exact_pattern = re.compile(value)  # an exemption's, as written
        except Exception as exc:  # re.error, or RecursionError for deeply nested groups
            ctx.error(path_field, f"bad regular expression: {exc}")
            return None
    elif kind is PathKind.TEMPLATE:
        pattern = _template(ctx, path_field, value)
        if pattern is None:
            return None
        exact_pattern = _template(ctx, path_field, value, fold=False)
    if kind is PathKind.PREFIX and value == "/":
        kind = PathKind.ANY
    return MatchAlternative(methods, PathMatcher(kind, value, pattern, exact_pattern))


def _template(
    ctx: _RuleContext, field: str, value: str, fold: bool = True
) -> re.Pattern[str] | None:
    """``/runs/{uuid}`` or ``/runs/{run_id:uuid}``: a parameter is one typed segment.
    ``fold``: literal text in lower case (paths are matched folded: PathMatcher), else as
    written (an exemption's confirming test)."""
    parts: list[str] = []
    position = 0

    def literal(text: str) -> str:
        return re.escape(text.lower() if fold else text)

    for number, param in enumerate(TEMPLATE_PARAM.finditer(value)):
        parts.append(literal(value[position : param.start()]))
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
    parts.append(literal(rest))
    return re.compile("".join(parts))


def _limits(
    ctx: _RuleContext,
    value: Any,
    regions: frozenset[str],
    given: bool = True,
    field: str = "limits",
) -> dict[str, tuple[LimitSpec, ...]]:
    """The limits per region at ``field`` (a tier's: ``tiers.<name>``); ``given``: the
    rule has the key ("required" only when it does not: a value given is wrong as such)."""
    if not isinstance(value, dict) or not value:
        wanted = "a mapping of region (or 'default') to 'count/seconds'"
        if given:
            ctx.error(field, _wrong(value, f"a non-empty {wanted[2:]}"))
        else:
            ctx.error(field, f"required: {wanted}")
        return {}
    parsed: dict[str, tuple[LimitSpec, ...]] = {}
    where = field
    for region, spec in value.items():
        field = f"{where}.{_show(region)[1:-1] if isinstance(region, str) else _show(region)}"
        if region != "default" and region not in regions:
            known = f"known: {sorted(regions)} or 'default'"
            ctx.error(field, f"unknown region {_show(region)}; {known}")
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
        ctx.error(field, f"bad limit {_show(raw)}: write 'count/seconds', e.g. '100/60'")
        return None
    # int() refuses over 4,300 digits (ValueError); anything over 18 is out of range anyway.
    count, seconds = (int(g) if len(g) <= 18 else 10**18 for g in match.groups())
    if not 1 <= count <= MAX_COUNT:
        ctx.error(field, f"bad limit {_show(raw)}: count must be 1..{MAX_COUNT}")
        return None
    if not 1 <= seconds <= MAX_WINDOW_SECONDS:
        ctx.error(field, f"bad limit {_show(raw)}: seconds must be 1..{MAX_WINDOW_SECONDS}")
        return None
    return LimitSpec(count, seconds)


def _compile(
    alternatives: tuple[MatchAlternative, ...], exact: bool = False
) -> Callable[[str, str], bool]:
    """One closure per rule, built once at load time so matching does no parsing; with
    ``exact``, the test of the path as written (case-sensitive), for exemptions."""
    tests = tuple(a.exact_compiled() if exact else a.compiled() for a in alternatives)
    if len(tests) == 1:
        return tests[0]
    return lambda method, path: any(test(method, path) for test in tests)

"""The limiter: turns a rule selection into counter checks and the result into a decision."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from gateway.policy.matcher import Selection
from gateway.policy.model import IdentityKind, Rule
from gateway.ratelimit.decision import Decision, LimitReport, Outcome
from gateway.ratelimit.ports import CounterBackend, HitResult, HitSettled, LimitCheck, LimitState
from gateway.ratelimit.window import bucket_ms_for

MAX_CACHED_CHECKS: Final = 50_000  # identities whose checks are kept (then the cache starts over)


# The counter's layout in Redis (gateway/counters/lua/sliding_window.lua), in every key:
# gateways of two layouts sharing one Redis during an upgrade count apart, each reading
# only values it wrote, instead of failing on the other's (v1 was a hash of buckets).
LAYOUT: Final = "v2"


def counter_key(region: str, rule_id: str, identity_hash: str, seconds: int) -> str:
    """``rl:{<region>:<rule>:<identity>}:<window>s:v2`` — the hash tag keeps one
    identity's keys for one rule in one Redis Cluster slot; the window in the name means a
    rule whose window changes starts a fresh counter, while a changed count applies to the
    existing one; the layout's version (``LAYOUT``) ends it.
    """
    return f"rl:{{{region}:{rule_id}:{identity_hash}}}:{seconds}s:{LAYOUT}"


def limit_checks(region: str, rule: Rule, identity_hash: str, enforce: bool) -> list[LimitCheck]:
    return [
        LimitCheck(
            key=counter_key(region, rule.id, identity_hash, spec.seconds),
            limit=spec.count,
            window_ms=spec.seconds * 1000,
            bucket_ms=bucket_ms_for(spec.seconds * 1000),
            enforce=enforce,
            fail_open=rule.fail_open,
        )
        for spec in rule.limits_for(region)
    ]


# One counter call: the rules whose limits its checks hold (in order), whether they are
# shadow rules, and the checks.
Group = tuple[tuple[Rule, ...], bool, Sequence[LimitCheck]]


class _Kept:
    """An enforced rule's checks for one identity, and the group of the last pair they
    were counted in with a ceiling: ``partner``, the ceiling (a reloaded one is a new
    object, so a stale pair is never reused), and ``partner_key``, its identity."""

    __slots__ = ("alone", "checks", "pair", "partner", "partner_key", "rule")

    def __init__(self, rule: Rule, checks: list[LimitCheck]) -> None:
        self.rule = rule
        self.checks = checks
        self.partner: Rule | None = None
        self.partner_key = ""
        self.pair: Group | None = None
        # Its checks as a call of their own (a rule and its ceiling in a Redis Cluster).
        self.alone: Group = ((rule,), False, checks)


def _group_reports(
    rules: tuple[Rule, ...], region: str, result: HitResult, shadow: bool
) -> list[LimitReport]:
    if len(rules) == 1:
        return _reports(rules[0], region, result.states, shadow)
    reports: list[LimitReport] = []
    start = 0
    for rule in rules:  # a rule and its ceilings, counted in one call: states in order
        end = start + len(rule.limits_for(region))
        reports.extend(_reports(rule, region, result.states[start:end], shadow))
        start = end
    return reports


def _reports(
    rule: Rule, region: str, states: Sequence[LimitState], shadow: bool
) -> list[LimitReport]:
    specs = rule.limits_for(region)
    several = len(specs) > 1
    return [
        LimitReport(
            name=f"{rule.policy or rule.id}-{spec.seconds}s" if several else rule.policy or rule.id,
            rule_id=rule.id,
            count=spec.count,
            seconds=spec.seconds,
            remaining=state.remaining,
            reset_seconds=-(-state.reset_ms // 1000),
            reset_ms=state.reset_ms,
            exceeded=not state.allowed,
            shadow=shadow,
        )
        for spec, state in zip(specs, states, strict=True)
    ]


def _one_limit(region: str, identity: str | None, rule: Rule, result: HitResult) -> Decision:
    """``_decision`` for one enforced rule with one limit, the shape of nearly every
    request: no report list or generator, the rule's identity kind read once per rule
    (benchmarks/README.md, "Data plane", the proxied rows)."""
    spec = rule.limits_for(region)[0]
    state = result.states[0]
    reset_seconds = -(-state.reset_ms // 1000)
    exceeded = not state.allowed
    report = LimitReport(
        rule.policy or rule.id, rule.id, spec.count, spec.seconds, state.remaining, reset_seconds,
        exceeded, False, state.reset_ms,
    )  # fmt: skip
    if result.admitted:
        outcome, retry_after = Outcome.ALLOWED, 0
    else:
        outcome, retry_after = Outcome.LIMITED, max(reset_seconds, 1) if exceeded else 1
    return Decision(
        outcome, rule.id, _KIND_VALUES[rule.identity], identity, (report,), retry_after,
        result.source, (), result.certain_ms,
    )  # fmt: skip


def _rule_and_ceiling(
    region: str,
    selection: Selection,
    rule: Rule,
    ceiling: Rule,
    states: tuple[LimitState, LimitState],
    result: HitResult,
    admitted: bool,
    certain_ms: int,
) -> Decision | None:
    """``_decision`` for an enforced rule and one enforced ceiling, each with one limit
    (the default table's shape), counted in one call or in two (a Redis Cluster's), without
    the general path's lists and generators. ``states``: the rule's, the ceiling's;
    ``result``: the (first) call's. None: another shape."""
    rule_specs = rule.limits_for(region)
    ceiling_specs = ceiling.limits_for(region)
    if len(rule_specs) != 1 or len(ceiling_specs) != 1:
        return None
    spec, state = rule_specs[0], states[0]
    reset = -(-state.reset_ms // 1000)
    first = LimitReport(
        rule.policy or rule.id, rule.id, spec.count, spec.seconds, state.remaining, reset,
        not state.allowed, False, state.reset_ms,
    )  # fmt: skip
    spec, state = ceiling_specs[0], states[1]
    reset = -(-state.reset_ms // 1000)
    second = LimitReport(
        ceiling.policy or ceiling.id, ceiling.id, spec.count, spec.seconds, state.remaining,
        reset, not state.allowed, False, state.reset_ms,
    )  # fmt: skip
    named, identity = rule, selection.identity
    if admitted:
        outcome, retry_after = Outcome.ALLOWED, 0
    else:
        outcome = Outcome.LIMITED
        if first.exceeded:
            retry_after = max(first.reset_seconds, second.reset_seconds if second.exceeded else 1)
        elif second.exceeded:
            # The refusal is named after the policy that had no room, with its identity.
            retry_after = second.reset_seconds
            named, identity = ceiling, selection.ceilings[0][1]
        else:
            retry_after = 1
        retry_after = max(retry_after, 1)
    return Decision(
        outcome, named.id, _KIND_VALUES[named.identity], identity, (first, second),
        retry_after, result.source, (), certain_ms,
    )  # fmt: skip


# IdentityKind.value through the enum's descriptor costs more than a dict lookup.
_KIND_VALUES: Final = {kind: kind.value for kind in IdentityKind}


class Limiter:
    """Decides about requests; one counter backend per region."""

    def __init__(
        self,
        backends: Mapping[str, CounterBackend],
        separate_calls: frozenset[str] = frozenset(),
    ) -> None:
        """``separate_calls``: regions whose store cannot count keys of several hash tags
        in one call (Redis Cluster): there a rule and its ceilings are separate calls."""
        self._backends = dict(backends)
        self._separate_calls = separate_calls
        # Each region's synchronous ``hit_now``, looked up once (None: it has none).
        self._hit_now = {name: getattr(b, "hit_now", None) for name, b in self._backends.items()}
        # And each region's ``submit`` (the call by callback), where it has one.
        self._submit: dict[str, Callable[[Sequence[LimitCheck], HitSettled], bool] | None] = {
            name: getattr(b, "submit", None) for name, b in self._backends.items()
        }
        self._check_cache: dict[tuple[str, str, str], _Kept] = {}
        # The groups decide_now made for the request it could not answer, with its
        # selection and region (``_groups_of``): made once a request, not twice.
        self._prepared: Selection | None = None
        self._prepared_region = ""
        self._prepared_groups: list[Group] = []

    def backend(self, region: str) -> CounterBackend:
        return self._backends[region]

    def decide_now(self, region: str, selection: Selection) -> Decision | None:
        """The decision when it can be known without waiting: exempt, in-process
        counters, or a refusal the deny cache already knows. None: use ``decide``.

        Saves the data plane a task and an await on its most common answers.
        """
        rule = selection.rule
        if (rule is None or rule.unlimited) and not selection.shadows and not selection.ceilings:
            return Decision(Outcome.EXEMPT, rule_id=None if rule is None else rule.id)
        hit_now = self._hit_now[region]
        if hit_now is None:
            return None
        groups = self._groups(region, selection)
        if len(groups) == 1:
            result: HitResult | None = hit_now(groups[0][2])
            if result is not None:
                return self._decision(region, selection, groups, [result])
        # Kept for the decide_later (or decide) that follows for this request.
        self._prepared, self._prepared_region, self._prepared_groups = selection, region, groups
        return None

    def decide_later(
        self,
        region: str,
        selection: Selection,
        done: Callable[[Decision | Exception], None],
    ) -> bool:
        """``decide`` by callback: ``done`` gets the decision, or the exception ``decide``
        would raise, once, later. False: this request needs ``decide`` (several calls,
        or a backend without ``submit``), and ``done`` is never called.

        The common wait for the store then costs no task and no coroutine chain
        (benchmarks/README.md, "Counter callbacks", the Redis rows)."""
        submit = self._submit[region]
        if submit is None:
            return False
        rule = selection.rule
        if (rule is None or rule.unlimited) and not selection.shadows and not selection.ceilings:
            return False  # decide_now answers these
        groups = self._groups_of(region, selection)
        if len(groups) != 1:
            if not groups:
                return False
            # Several calls (shadow rules; a rule and its ceilings in other Redis Cluster
            # slots): each by callback, the decision once all have answered. A task and
            # an asyncio.gather per request cost about as much as the calls themselves.
            gathered = _Gathered(self, region, selection, groups, done)
            for index, group in enumerate(groups):
                if not submit(group[2], gathered.settler(index)):
                    if index == 0:
                        return False  # nothing sent: ``decide`` does it all
                    # (Not expected: a region's calls all go one way.) The rest awaited.
                    gathered.await_rest(self._backends[region], index)
                    break
            return True

        def settled(outcome: HitResult | Exception) -> None:
            if isinstance(outcome, Exception):
                done(outcome)
                return
            try:
                decision = self._decision(region, selection, groups, [outcome])
            except Exception as exc:  # a bug: the request still gets its answer (500)
                done(exc)
                return
            done(decision)

        return submit(groups[0][2], settled)

    def decide_with(
        self,
        region: str,
        selection: Selection,
        hit_now: Callable[[Sequence[LimitCheck]], HitResult],
    ) -> Decision:
        """``decide`` with a synchronous counter call for every group (shadow rules
        included): replays (``gateway rules simulate``) count on a virtual clock."""
        rule = selection.rule
        if (rule is None or rule.unlimited) and not selection.shadows and not selection.ceilings:
            return Decision(Outcome.EXEMPT, rule_id=None if rule is None else rule.id)
        groups = self._groups(region, selection)
        return self._decision(region, selection, groups, [hit_now(c) for _, _, c in groups])

    async def decide(self, region: str, selection: Selection) -> Decision:
        """Count the request against the selected rule (and shadow rules) in ``region``.

        Raises ``CounterUnavailableError`` when the store is down and the rule fails
        closed; the caller answers 503.
        """
        rule = selection.rule
        if (rule is None or rule.unlimited) and not selection.shadows and not selection.ceilings:
            return Decision(Outcome.EXEMPT, rule_id=None if rule is None else rule.id)
        backend = self._backends[region]
        groups = self._groups_of(region, selection)
        if len(groups) == 1:  # the common case: no task scheduling for one call
            results: Sequence[HitResult] = [await backend.hit(groups[0][2])]
        else:
            results = await asyncio.gather(*(backend.hit(checks) for _, _, checks in groups))
        return self._decision(region, selection, groups, results)

    def _groups_of(self, region: str, selection: Selection) -> list[Group]:
        """``_groups``, as ``decide_now`` made them for this request when it was the last
        one asked (it answered None: the store is asked next), else made now. A request's
        groups depend on its selection and region only, and nothing runs between the
        two calls of one request (benchmarks/README.md, "twenty-second step")."""
        groups = self._prepared_groups
        if self._prepared is selection and self._prepared_region == region:
            self._prepared, self._prepared_groups = None, []
            return groups
        return self._groups(region, selection)

    def _checks(self, region: str, rule: Rule, identity: str) -> list[LimitCheck]:
        """``limit_checks`` for an enforced rule, kept per identity (an identity seen
        again, the common case, skips building keys and checks)."""
        return self._kept(region, rule, identity).checks

    def _kept(self, region: str, rule: Rule, identity: str) -> _Kept:
        key = (region, rule.id, identity)
        found = self._check_cache.get(key)
        if found is not None and found.rule is rule:  # a reloaded rule is a new object
            return found
        if len(self._check_cache) >= MAX_CACHED_CHECKS:
            self._check_cache.clear()
        kept = self._check_cache[key] = _Kept(rule, limit_checks(region, rule, identity, True))
        return kept

    def _groups(self, region: str, selection: Selection) -> list[Group]:
        # The enforced rule's checks share one hash tag and are counted all-or-nothing in
        # one call, together with the enforced ceilings' (so a request one of them refuses
        # uses up none of the others' quota); each shadow rule or shadow ceiling is its own
        # call, sent concurrently (never blocking).
        rule = selection.rule
        groups: list[Group] = []
        ceilings = selection.ceilings
        if not ceilings:  # the common case
            if rule is not None and not rule.unlimited and selection.identity is not None:
                groups.append(((rule,), False, self._checks(region, rule, selection.identity)))
        elif (
            len(ceilings) == 1
            and not selection.shadows
            and rule is not None
            and not rule.unlimited
            and selection.identity is not None
            and not ceilings[0][0].shadow
        ):
            ceiling, ceiling_key = ceilings[0]
            kept = self._kept(region, rule, selection.identity)
            if region in self._separate_calls:
                # Two calls (their keys' slots differ on a Redis Cluster): each one's
                # kept group.
                return [kept.alone, self._kept(region, ceiling, ceiling_key).alone]
            # A rule and one enforced ceiling (the default table): their one group, from
            # each one's kept checks; the rule's identity keeps its last pair only. Pairs
            # of identity and client address are far more than either alone: a cache of
            # them missed for nearly every request under the bench's 10,000 keys over 50
            # addresses and was cleared every 50,000 (benchmarks/README.md, "ninth step"),
            # while one client from one address, the usual case, still meets its pair.
            pair = kept.pair
            if pair is None or kept.partner is not ceiling or kept.partner_key != ceiling_key:
                partner = self._checks(region, ceiling, ceiling_key)
                pair = kept.pair = ((rule, ceiling), False, kept.checks + partner)
                kept.partner, kept.partner_key = ceiling, ceiling_key
            return [pair]
        else:
            enforced: list[tuple[Rule, str]] = []
            if rule is not None and not rule.unlimited and selection.identity is not None:
                enforced.append((rule, selection.identity))
            enforced.extend((c, key) for c, key in ceilings if not c.shadow)
            if len(enforced) == 1 or region in self._separate_calls:
                for r, key in enforced:
                    groups.append(((r,), False, self._checks(region, r, key)))
            elif enforced:
                checks: list[LimitCheck] = []
                for r, key in enforced:
                    checks.extend(self._checks(region, r, key))
                groups.append((tuple(r for r, _ in enforced), False, checks))
        for shadow_rule, key in selection.shadows:
            groups.append(((shadow_rule,), True, limit_checks(region, shadow_rule, key, False)))
        for ceiling, key in ceilings:
            if ceiling.shadow:
                groups.append(((ceiling,), True, limit_checks(region, ceiling, key, False)))
        return groups

    @staticmethod
    def _decision(
        region: str,
        selection: Selection,
        groups: list[Group],
        results: Sequence[HitResult],
    ) -> Decision:
        rule = selection.rule
        if len(groups) == 1 and not groups[0][1] and rule is not None and len(groups[0][0]) == 1:
            # The common case: one enforced rule, no shadow rules, no ceilings.
            result = results[0]
            if len(result.states) == 1:
                return _one_limit(region, selection.identity, rule, result)
            reports = _reports(rule, region, result.states, False)
            limited = not result.admitted
            return Decision(
                Outcome.LIMITED if limited else Outcome.ALLOWED,
                rule_id=rule.id,
                identity_kind=rule.identity.value,
                identity_hash=selection.identity,
                reports=tuple(reports),
                retry_after=max(
                    max((r.reset_seconds for r in reports if r.exceeded), default=1), 1
                ) if limited else 0,
                source=result.source,
                certain_ms=result.certain_ms,
            )  # fmt: skip
        if len(groups) == 1 and not groups[0][1] and rule is not None and len(groups[0][0]) == 2:
            result = results[0]
            if len(result.states) == 2:
                rules, states = groups[0][0], result.states
                pair = _rule_and_ceiling(
                    region, selection, rules[0], rules[1], (states[0], states[1]), result,
                    result.admitted, result.certain_ms,
                )  # fmt: skip
                if pair is not None:
                    return pair
        if (
            len(groups) == 2
            and rule is not None
            and not selection.shadows
            and len(selection.ceilings) == 1
            and not groups[0][1]
            and not groups[1][1]
            and len(groups[0][0]) == 1
            and len(groups[1][0]) == 1
        ):
            # The same in two calls (a Redis Cluster's: the rule's and the ceiling's keys
            # in other slots). As the general path below: admitted when both are, the
            # first call's source, no certain_ms (that is one call's).
            first, second = results[0], results[1]
            if len(first.states) == 1 and len(second.states) == 1:
                pair = _rule_and_ceiling(
                    region, selection, rule, groups[1][0][0], (first.states[0], second.states[0]),
                    first, first.admitted and second.admitted, 0,
                )  # fmt: skip
                if pair is not None:
                    return pair
        return Limiter._general_decision(region, selection, groups, results)

    @staticmethod
    def _general_decision(
        region: str,
        selection: Selection,
        groups: list[Group],
        results: Sequence[HitResult],
    ) -> Decision:
        """``_decision`` for any shape: what its shortcuts above must equal
        (tests/unit/test_decision_shortcuts.py compares them)."""
        rule = selection.rule
        reports = []
        shadow_exceeded: list[tuple[str, str]] = []
        admitted = True
        enforced = False
        source = ""
        for (group_rules, is_shadow, _), result in zip(groups, results, strict=True):
            group_reports = _group_reports(group_rules, region, result, is_shadow)
            reports.extend(group_reports)
            if is_shadow:
                if any(r.exceeded for r in group_reports):
                    shadow_exceeded.append((group_rules[0].id, group_rules[0].identity.value))
            else:
                admitted = admitted and result.admitted
                if not enforced:
                    enforced, source = True, result.source
        named, identity = rule, selection.identity
        if (rule is not None and rule.unlimited) or not enforced:
            outcome = Outcome.EXEMPT
        else:
            outcome = Outcome.ALLOWED if admitted else Outcome.LIMITED
        retry_after = 0
        if outcome is Outcome.LIMITED:
            exceeded = [r for r in reports if r.exceeded and not r.shadow]
            retry_after = max(max((r.reset_seconds for r in exceeded), default=1), 1)
            # The refusal is named after the first policy that had no room (the rule, or
            # else a ceiling), with that policy's identity.
            if exceeded and (rule is None or exceeded[0].rule_id != rule.id):
                for ceiling, key in selection.ceilings:
                    if ceiling.id == exceeded[0].rule_id:
                        named, identity = ceiling, key
                        break
        elif named is None and enforced:
            # No rule matched, a ceiling counted the request: it is what the fields name.
            for ceiling, key in selection.ceilings:
                if not ceiling.shadow:
                    named, identity = ceiling, key
                    break
        return Decision(
            outcome,
            rule_id=None if named is None else named.id,
            identity_kind=None if named is None else named.identity.value,
            identity_hash=identity,
            reports=tuple(reports),
            retry_after=retry_after,
            source=source or (results[0].source if results else ""),
            shadow_exceeded=tuple(shadow_exceeded),
            certain_ms=results[0].certain_ms if len(results) == 1 else 0,
        )


class _Gathered:
    """The counter calls of one ``decide_later`` with several groups: ``done`` gets the
    decision once every call has answered, or the first exception at once (as
    ``asyncio.gather`` raises it in ``decide``); whatever answers after that is dropped."""

    def __init__(
        self,
        limiter: Limiter,
        region: str,
        selection: Selection,
        groups: list[Group],
        done: Callable[[Decision | Exception], None],
    ) -> None:
        self.limiter = limiter
        self.region = region
        self.selection = selection
        self.groups = groups
        self.done = done
        self.results: list[HitResult | None] = [None] * len(groups)
        self.remaining = len(groups)
        self.finished = False
        self.tasks: set[asyncio.Task[None]] = set()

    def settler(self, index: int) -> HitSettled:
        def settled(outcome: HitResult | Exception) -> None:
            self.settle(index, outcome)

        return settled

    def settle(self, index: int, outcome: HitResult | Exception) -> None:
        if self.finished:
            return
        if isinstance(outcome, Exception):
            self.finished = True
            self.done(outcome)
            return
        self.results[index] = outcome
        self.remaining -= 1
        if self.remaining:
            return
        self.finished = True
        results = [r for r in self.results if r is not None]
        try:
            decision = self.limiter._decision(self.region, self.selection, self.groups, results)
        except Exception as exc:  # a bug: the request still gets its answer (500)
            self.done(exc)
            return
        self.done(decision)

    def await_rest(self, backend: CounterBackend, start: int) -> None:
        for index in range(start, len(self.groups)):
            task = asyncio.get_running_loop().create_task(
                self._hit(backend, index, self.groups[index][2])
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _hit(self, backend: CounterBackend, index: int, checks: Sequence[LimitCheck]) -> None:
        outcome: HitResult | Exception
        try:
            outcome = await backend.hit(checks)
        except Exception as exc:
            outcome = exc
        self.settle(index, outcome)

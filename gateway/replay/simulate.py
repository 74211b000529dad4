"""Recorded requests replayed through a rule table on a virtual clock.

The same code as the gateway's request path decides: ``policy.matcher.select`` picks the
rules and ``ratelimit.limiter.Limiter`` counts, on ``counters.memory.MemoryBackend`` whose
clock is the recorded start of the request being replayed. Nothing sleeps and nothing
leaves the process. Identities are the logged hashes (12 hex), so counts per identity are
exactly the gateway's, and the identities reported are the ones its logs show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.counters.memory import MemoryBackend
from gateway.policy.matcher import select
from gateway.policy.model import IdentityKind, Rule, RuleTable
from gateway.ratelimit.decision import Outcome
from gateway.ratelimit.limiter import Limiter
from gateway.replay.records import Request

# Counters are never forgotten for room during a replay (the gateway's shared counters in
# Redis are not either); idle ones still go once their window has passed.
REPLAY_MAX_KEYS = 1 << 62
# Logged decisions a replay can reproduce; "fallback" and "unavailable" depended on the
# counter store's health, which a replay does not model.
COMPARABLE = frozenset({"allowed", "limited", "exempt"})


@dataclass(slots=True)
class RuleCounts:
    """What one rule did during the replay."""

    rule: Rule
    matched: int = 0  # requests it applied to (a shadow rule: that it was evaluated for)
    limited: int = 0  # requests it limited (a shadow rule: would have limited)
    # identity ("<kind>:<hash>") -> [requests limited, first limited at (epoch us)]
    identities: dict[str, list[int]] = field(default_factory=dict)

    def limit(self, identity: str, at_us: int) -> None:
        self.limited += 1
        seen = self.identities.get(identity)
        if seen is None:
            self.identities[identity] = [1, at_us]
        else:
            seen[0] += 1


@dataclass
class Disagreement:
    request_id: str | None
    start_us: int
    method: str
    path: str
    logged: str
    replayed: str


@dataclass
class TableReplay:
    """One table's replay: counts per rule, and how its decisions compare with the log."""

    table: RuleTable
    rules: dict[str, RuleCounts]
    requests: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    unmatched: int = 0  # requests no rule applied to
    compared: int = 0  # requests whose logged decision a replay can reproduce
    agreed: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    disagreed: int = 0
    # per request, whether this table limited it (for the comparison of two tables)
    limited_flags: bytearray = field(default_factory=bytearray)


MAX_EXAMPLES = 20


class Replayer:
    """Replays requests, in order, through one table."""

    def __init__(self, table: RuleTable, regions: Iterable[str]) -> None:
        self.now_ms = 0
        backend = MemoryBackend(
            clock=self._clock, max_keys=REPLAY_MAX_KEYS, sweep_every=100_000, label="replay"
        )
        self.limiter = Limiter({region: backend for region in regions})
        self._hit = backend.hit_now
        self.result = TableReplay(table, {r.id: RuleCounts(r) for r in table.rules})

    def _clock(self) -> int:
        return self.now_ms

    def step(self, request: Request) -> str:
        """Decide ``request`` at its recorded time; the decision as the log writes it."""
        self.now_ms = request.start_us // 1000  # the counters' clock ticks in whole ms
        ids = {IdentityKind.API_KEY: request.key, IdentityKind.USER_IP: request.user,
               IdentityKind.IP: request.ip, IdentityKind.CLIENT_CERT: request.cert}  # fmt: skip
        result = self.result
        selection = select(
            result.table, request.region, request.method, request.path, ids.get, request.tier
        )
        decision = self.limiter.decide_with(request.region, selection, self._hit)
        rules = result.rules
        for shadow_rule, _ in selection.shadows:
            rules[shadow_rule.id].matched += 1
        for shadow_id, kind in decision.shadow_exceeded:
            shadow_key = next(k for r, k in selection.shadows if r.id == shadow_id)
            rules[shadow_id].limit(f"{kind}:{shadow_key}", request.start_us)
        rule = selection.rule
        label = decision.outcome.value
        if rule is None:
            result.unmatched += 1
        else:
            counts = rules[rule.id]
            counts.matched += 1
            if decision.outcome is Outcome.LIMITED:
                counts.limit(decision.logged_identity or "-", request.start_us)
        result.requests += 1
        result.decisions[label] = result.decisions.get(label, 0) + 1
        result.limited_flags.append(decision.outcome is Outcome.LIMITED)
        logged = request.decision
        if logged in COMPARABLE:
            result.compared += 1
            if logged == label:
                result.agreed += 1
            else:
                result.disagreed += 1
                if len(result.disagreements) < MAX_EXAMPLES:
                    result.disagreements.append(
                        Disagreement(
                            request.request_id,
                            request.start_us,
                            request.method,
                            request.path,
                            logged,
                            label,
                        )
                    )
        return label


def replay(
    requests: Sequence[Request],
    tables: Sequence[RuleTable],
    progress: Callable[[int], None] | None = None,
) -> list[TableReplay]:
    """Replay every request through each table (one pass; tables are independent)."""
    regions = {r.region for r in requests}
    replayers = [Replayer(table, regions) for table in tables]
    steps = [r.step for r in replayers]
    for index, request in enumerate(requests):
        for step in steps:
            step(request)
        if progress is not None and index % 20_000 == 0:
            progress(index)
    if progress is not None:
        progress(len(requests))
    return [r.result for r in replayers]

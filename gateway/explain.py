"""``gateway rules explain``: which rule a request hits, and why earlier ones did not."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.policy.loader import DEFAULT_REGIONS, load_rules
from gateway.policy.model import IdentityKind, Rule, RuleTable
from gateway.policy.paths import normalise_path, split_target
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity, valid_identity_header

HEADER_FOR = {IdentityKind.API_KEY: "x-api-key", IdentityKind.USER_IP: "x-user-id"}


@dataclass(frozen=True)
class ResolvedIdentity:
    """What verified identities made of the request's headers (``gateway rules explain
    --config``): the values counted instead of the claimed ones, and why."""

    api_key: str | None
    user_id: str | None
    tier: str | None
    notes: tuple[str, ...]


def _secret() -> tuple[bytes, str]:
    configured = os.environ.get("GATEWAY_IDENTITY_SECRET")
    if configured:
        return configured.encode(), "GATEWAY_IDENTITY_SECRET"
    path = Path(os.environ.get("GATEWAY_DATA_DIR", "data")) / "identity-secret"
    if path.is_file():
        return path.read_bytes().strip(), str(path)
    return secrets.token_hex(32).encode(), "a throwaway secret (no deployment secret found)"


def explain(
    rules: Sequence[str],
    method: str,
    target: str,
    headers: Sequence[str],
    client_ip: str,
    region: str | None = None,
    resolved: ResolvedIdentity | None = None,
) -> str:
    """A human-readable account of how the table treats the described request."""
    table = load_rules(rules, DEFAULT_REGIONS | ({region} if region else set()))
    secret, secret_source = _secret()
    return explain_request(
        table, IdentityHasher(secret), secret_source, method, target, headers, client_ip, region,
        resolved,
    )  # fmt: skip


def explain_request(
    table: RuleTable,
    hasher: IdentityHasher,
    secret_source: str,
    method: str,
    target: str,
    headers: Sequence[str],
    client_ip: str,
    region: str | None = None,
    resolved: ResolvedIdentity | None = None,
) -> str:
    """``explain`` for a loaded table and hasher (the admin console's explain form).
    ``ValueError`` names what is wrong with the described request."""
    method = method.upper()
    if not method.replace("-", "").isalpha() or len(method) > 16:
        raise ValueError(f"{method[:20]!r} is not an HTTP method")
    if region is not None and region not in table.regions:
        raise ValueError(f"unknown region {region!r}")
    raw_path, _ = split_target(target)
    path = normalise_path(raw_path)
    values: dict[str, str] = {}
    for header in headers:
        name, sep, value = header.partition(":")
        if not sep:
            raise ValueError(f"header {header!r} is not 'Name: value'")
        values[name.strip().lower()] = value.strip()
    found: list[str | None] = []
    for name in ("x-api-key", "x-user-id"):
        try:
            found.append(valid_identity_header(values.get(name)))
        except ValueError as exc:  # the gateway answers such a request 400
            raise ValueError(f"the {name} header {exc}: the gateway refuses it (400)") from exc
    tier = None
    if resolved is not None:
        found = [resolved.api_key, resolved.user_id]
        tier = resolved.tier
    identity = RequestIdentity(hasher, client_ip, found[0], found[1])
    regions = [region] if region else sorted(table.regions)
    lines = [
        f"request: {method} {path}"
        + (f"  (normalised from {raw_path})" if path != raw_path else "")
    ]
    lines.append(f"identity hashes keyed with {secret_source}")
    if resolved is not None:
        lines.extend(f"identity: {note}" for note in resolved.notes)
    for name in regions:
        lines.append("")
        lines.append(f"region {name}:")
        region_lines = _explain_region(table, name, method, path, identity, tier)
        lines.extend(region_lines)
        if table.ceilings:
            exempt = any(": MATCHES, exempt" in line for line in region_lines)
            lines.extend(_explain_ceilings(table, name, method, path, identity, exempt))
    return "\n".join(lines)


def _explain_ceilings(
    table: RuleTable,
    region: str,
    method: str,
    path: str,
    identity: RequestIdentity,
    exempt: bool,
) -> list[str]:
    """The ceilings, each applied (counted with the rule, all or nothing) or why not."""
    lines = ["  ceilings (applied besides the rule, counted with it all or nothing):"]
    for ceiling in table.ceilings:
        if exempt:
            lines.append(f"  - {ceiling.id}: not applied, the request is exempt")
            continue
        reason = _why_not(ceiling, region, method, path, identity)
        if reason is not None:
            lines.append(f"  - {ceiling.id}: not applied, {reason}")
            continue
        limits = ", ".join(str(s) for s in ceiling.limits_for(region))
        kind = "shadow ceiling (counted, never refuses)" if ceiling.shadow else "APPLIES"
        lines.append(f"  + {ceiling.id}: {kind}  [{ceiling.source} #{ceiling.index}]")
        lines.append(
            f"      identity: {ceiling.identity.value} -> {identity.key_for(ceiling.identity)}"
        )
        lines.append(f"      limit in {region}: {limits} (count/seconds)")
    return lines


def _explain_region(
    table: RuleTable,
    region: str,
    method: str,
    path: str,
    identity: RequestIdentity,
    tier: str | None = None,
) -> list[str]:
    lines: list[str] = []
    for rule in table.rules:
        reason = _why_not(rule, region, method, path, identity)
        if reason is not None:
            lines.append(f"  - {rule.id}: skipped, {reason}")
            continue
        key = identity.key_for(rule.identity)
        if rule.shadow:
            lines.append(f"  ~ {rule.id}: shadow rule, counted and reported, evaluation goes on")
            continue
        if rule.unlimited:
            lines.append(
                f"  = {rule.id}: MATCHES, exempt (unlimited)  [{rule.source} #{rule.index}]"
            )
            return lines
        tiered = rule.tiers.get(tier) if tier is not None else None
        if tiered is not None and tiered.limits_for(region):
            rule = tiered  # the tier's limits, the rule's counters
        limits = ", ".join(str(s) for s in rule.limits_for(region))
        lines.append(f"  = {rule.id}: MATCHES  [{rule.source} #{rule.index}]")
        if rule.policy:
            lines.append(f"      tier: {tier} (policy {rule.policy})")
        lines.append(f"      category: {rule.category}")
        lines.append(f"      identity: {rule.identity.value} -> {key}")
        lines.append(f"      limit in {region}: {limits} (count/seconds)")
        others = ", ".join(
            f"{r}: {', '.join(str(s) for s in rule.limits_for(r))}"
            for r in sorted(table.regions)
            if r != region
        )
        lines.append(f"      other regions: {others}")
        if not rule.fail_open:
            lines.append("      failure mode: closed (503 while the counter store is down)")
        return lines
    lines.append("  no rule matches: the request is not limited")
    return lines


def _why_not(
    rule: Rule, region: str, method: str, path: str, identity: RequestIdentity
) -> str | None:
    if not rule.unlimited and not rule.limits_for(region):
        return f"no limit for region {region}"
    if not rule.matches(method, path):
        wanted = " or ".join(a.describe() for a in rule.alternatives)
        return f"does not match ({wanted})"
    if identity.key_for(rule.identity) is None:
        if rule.identity is IdentityKind.CLIENT_CERT:
            return "identity client_cert cannot be formed (no verified client certificate)"
        header = HEADER_FOR.get(rule.identity, "")
        return f"identity {rule.identity.value} cannot be formed (no valid {header} header)"
    return None

"""What a replay found, as a JSON-ready document and as text for a terminal."""

from __future__ import annotations

from typing import Any

from gateway.replay.records import Reading, iso_us
from gateway.replay.simulate import RuleCounts, TableReplay

Document = dict[str, Any]


def _rule(counts: RuleCounts, top: int) -> Document:
    rule = counts.rule
    ranked = sorted(counts.identities.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0]))
    return {
        "id": rule.id,
        "source": rule.source,
        "identity": rule.identity.value,
        "shadow": rule.shadow,
        "unlimited": rule.unlimited,
        "matched": counts.matched,
        "limited": counts.limited,
        "identities_limited": len(counts.identities),
        "top_limited": [
            {"identity": ident, "limited": n, "first_limited": iso_us(first)}
            for ident, (n, first) in ranked[:top]
        ],
    }


def _table(result: TableReplay, top: int) -> Document:
    table = result.table
    return {
        "sources": list(table.sources),
        "digest": table.digest,
        "requests": result.requests,
        "decisions": dict(sorted(result.decisions.items())),
        "unmatched": result.unmatched,
        "rules": [_rule(result.rules[r.id], top) for r in table.rules],
        "against_log": {
            "compared": result.compared,
            "agreed": result.agreed,
            "disagreed": result.disagreed,
            "examples": [
                {
                    "request_id": d.request_id,
                    "start": iso_us(d.start_us),
                    "method": d.method,
                    "path": d.path,
                    "logged": d.logged,
                    "replayed": d.replayed,
                }
                for d in result.disagreements
            ],
        },
    }


def _limited_identities(result: TableReplay) -> dict[str, int]:
    found: dict[str, int] = {}
    for counts in result.rules.values():
        if counts.rule.shadow:
            continue
        for ident, (n, _) in counts.identities.items():
            found[ident] = found.get(ident, 0) + n
    return found


def _diff(new: TableReplay, old: TableReplay, top: int) -> Document:
    rules: list[Document] = []
    order = [r.id for r in new.table.rules]
    order += [r.id for r in old.table.rules if r.id not in new.rules]
    for rule_id in order:
        a, b = old.rules.get(rule_id), new.rules.get(rule_id)
        entry: Document = {
            "id": rule_id,
            "in": "both" if a and b else ("new" if b else "baseline"),
            "matched": [a.matched if a else 0, b.matched if b else 0],
            "limited": [a.limited if a else 0, b.limited if b else 0],
            "identities_limited": [len(a.identities) if a else 0, len(b.identities) if b else 0],
        }
        was = set(a.identities) if a else set()
        now = set(b.identities) if b else set()
        if (
            entry["in"] == "both"
            and entry["matched"][0] == entry["matched"][1]
            and (entry["limited"][0] == entry["limited"][1] and was == now)
        ):
            continue
        # most limited first (under the new table; freed: under the baseline)
        new_counts, old_counts = (b.identities if b else {}), (a.identities if a else {})
        entry["newly_limited"] = sorted(now - was, key=lambda i: (-new_counts[i][0], i))[:top]
        entry["newly_freed"] = sorted(was - now, key=lambda i: (-old_counts[i][0], i))[:top]
        rules.append(entry)
    newly_limited = newly_allowed = 0
    for before_flag, after_flag in zip(old.limited_flags, new.limited_flags, strict=True):
        if after_flag and not before_flag:
            newly_limited += 1
        elif before_flag and not after_flag:
            newly_allowed += 1
    before, after = _limited_identities(old), _limited_identities(new)
    gained = sorted((i for i in after if i not in before), key=lambda i: (-after[i], i))
    freed = sorted((i for i in before if i not in after), key=lambda i: (-before[i], i))
    return {
        "rules_changed": rules,
        "requests_newly_limited": newly_limited,
        "requests_newly_allowed": newly_allowed,
        "identities_newly_limited": len(gained),
        "identities_newly_freed": len(freed),
        "top_newly_limited": [{"identity": i, "limited": after[i]} for i in gained[:top]],
        "top_newly_freed": [{"identity": i, "was_limited": before[i]} for i in freed[:top]],
    }


def build_report(
    reading: Reading, new: TableReplay, baseline: TableReplay | None, top: int = 10
) -> Document:
    """The replay as one JSON-ready document (``--json``, ``--save``, the console)."""
    requests = reading.requests
    return {
        "logs": reading.files,
        "lines": reading.lines,
        "replayed": len(requests),
        "skipped": dict(sorted(reading.skipped.items())),
        "from": iso_us(requests[0].start_us) if requests else None,
        "to": iso_us(requests[-1].start_us) if requests else None,
        "new": _table(new, top),
        "baseline": None if baseline is None else _table(baseline, top),
        "diff": None if baseline is None else _diff(new, baseline, top),
    }


def render_text(report: Document) -> str:
    """The report for a terminal."""
    out: list[str] = []
    w = out.append
    w(f"replayed {report['replayed']:,} requests from {report['lines']:,} lines "
      f"({', '.join(report['logs'])})")  # fmt: skip
    if report["replayed"]:
        w(f"  recorded from {report['from']} to {report['to']}")
    for reason, n in report["skipped"].items():
        w(f"  skipped {n:,}: {reason}")
    for name in ("new", "baseline"):
        table = report[name]
        if table is None:
            continue
        w("")
        title = "NEW table" if name == "new" else "BASELINE table"
        w(f"{title} {table['digest'][:12]} ({', '.join(table['sources'])}): "
          f"{table['requests']:,} requests, "
          + ", ".join(f"{k} {v:,}" for k, v in table["decisions"].items()))  # fmt: skip
        w(
            f"  {'rule':<28} {'matched':>10} {'limited':>9} {'identities':>10}  "
            "most limited (first limited at)"
        )
        quiet = [r["id"] for r in table["rules"] if not r["matched"]]
        for rule in table["rules"]:
            if not rule["matched"]:
                continue
            tag = " (shadow)" if rule["shadow"] else (" (exempt)" if rule["unlimited"] else "")
            top = ", ".join(
                f"{t['identity']} x{t['limited']:,} ({t['first_limited']})"
                for t in rule["top_limited"][:3]
            )
            w(f"  {rule['id'] + tag:<28} {rule['matched']:>10,} {rule['limited']:>9,} "
              f"{rule['identities_limited']:>10,}  {top}")  # fmt: skip
        w(f"  {'(no rule)':<28} {table['unmatched']:>10,}")
        if quiet:
            w(f"  matched nothing: {', '.join(quiet)}")
        log = table["against_log"]
        if log["compared"]:
            w(f"  against the logged decisions: {log['agreed']:,} of {log['compared']:,} "
              f"agree, {log['disagreed']:,} differ")  # fmt: skip
    diff = report["diff"]
    if diff is not None:
        w("")
        w("CHANGES from baseline to new:")
        w(f"  requests newly limited {diff['requests_newly_limited']:,}, "
          f"newly allowed {diff['requests_newly_allowed']:,}")  # fmt: skip
        w(f"  identities newly limited {diff['identities_newly_limited']:,}, "
          f"newly freed {diff['identities_newly_freed']:,} (by any rule)")  # fmt: skip
        for entry in diff["rules_changed"]:
            m0, m1 = entry["matched"]
            l0, l1 = entry["limited"]
            i0, i1 = entry["identities_limited"]
            where = "" if entry["in"] == "both" else f" (only in {entry['in']})"
            w(
                f"  {entry['id'] + where:<40} matched {m0:,} -> {m1:,} ({m1 - m0:+,}), "
                f"limited {l0:,} -> {l1:,} ({l1 - l0:+,}), identities {i0:,} -> {i1:,}"
            )
            if entry["newly_limited"]:
                w(f"      newly limited here: {', '.join(entry['newly_limited'])}")
            if entry["newly_freed"]:
                w(f"      no longer limited here: {', '.join(entry['newly_freed'])}")
        for t in diff["top_newly_limited"]:
            w(f"  newly limited: {t['identity']} x{t['limited']:,}")
        for t in diff["top_newly_freed"]:
            w(f"  newly freed:   {t['identity']} (was limited x{t['was_limited']:,})")
    return "\n".join(out)

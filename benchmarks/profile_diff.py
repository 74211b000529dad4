"""Where one data-plane row's CPU a request goes against another's, from the perf
profiles ``dataplane_bench.py --profile DIR --profiler perf`` records.

    .venv/bin/python benchmarks/dataplane_bench.py --seconds 15 --warmup 1 \\
        --counter-warmup 6 --rows gateway-redis,gateway-redis-cluster \\
        --profile /tmp/prof --profiler perf --out /tmp/prof-out
    .venv/bin/python benchmarks/profile_diff.py --profile /tmp/prof \\
        --results /tmp/prof-out/dataplane.json --base gateway-redis \\
        --other gateway-redis-cluster

Why this exists: the instruction counts of ``dataplane_instructions.py`` leave out what
only load brings (system calls to more peers, wake-ups, cache misses over 10,000
identities), and a row's CPU a request says how much, not where. Each sample's CPU time
(its period: nanoseconds of the ``cpu-clock`` event, which the bench records) is divided
by the requests the row completed in its measured window, so both rows are in
microseconds a request, however fast each ran. Three tables follow:

* by the outermost compiled function of the sample's stack (the event-loop callback
  the work was done for: a client's read, a counter store's reply, the turn's writes),
  or the outermost frame when no compiled function is on it (the poll, the kernel);
* by compiled function, inclusive (each counted once a sample), the largest differences;
* by function, self (the sample's leaf frame), the largest differences.

A row of a run with ``--repeat`` or ``--gateway-src`` is named as the bench names its
profile: ``--base gateway-redis --label before --run 2`` reads
``gateway-redis-before-run2.data`` and that pass's row of the JSON. perf's window starts
a little after the load's, so the totals run ~1 % under the row's own CPU a request,
printed beside them; its own sampling slows the gateway alike in both rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def stacks(data: Path) -> Iterator[tuple[int, list[str]]]:
    """(period in ns, frames leaf first) of each sample of a ``perf record`` file:
    ``perf script -F period,ip,sym`` prints a sample as its period on a line of its own,
    one tab-indented ``<address> <symbol>`` line a frame, and a blank line."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "period,ip,sym"],
        capture_output=True,
        check=True,
    ).stdout.decode(errors="replace")
    period = 0
    frames: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            if frames:
                yield period, frames
            period, frames = 0, []
        elif not line.startswith("\t"):  # a sample's header: its period (and, with no
            head = line.split()  # call chain recorded, its one frame)
            period = int(head[0])
            if len(head) > 2:
                frames.append(" ".join(head[2:]))
        else:
            parts = line.strip().split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else parts[0])
    if frames:
        yield period, frames


def clean(frame: str) -> str:
    return frame.removesuffix(" (inlined)")


def root_of(frames: list[str]) -> str:
    compiled = [f for f in frames if f.startswith("CPyDef_")]
    if compiled:
        return compiled[-1]
    outer = [f for f in frames if f != "[unknown]" and not f.startswith("0x")]
    return f"(no compiled frame) {outer[-1] if outer else frames[-1]}"


def profile(data: Path, requests: int) -> tuple[float, Counter[str], Counter[str], Counter[str]]:
    """µs a request: in all, by root, by compiled function inclusive, by leaf function."""
    roots: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for period, frames in stacks(data):
        names = [clean(f) for f in frames]
        total += period
        roots[root_of(names)] += period
        leaves[names[0]] += period
        for name in {f for f in names if f.startswith("CPyDef_")}:
            inclusive[name] += period
    scale = 1 / 1000 / requests  # ns in all -> µs a request

    def per_request(counts: Counter[str]) -> Counter[str]:
        return Counter({k: v * scale for k, v in counts.items()})

    return total * scale, per_request(roots), per_request(inclusive), per_request(leaves)


def tag_of(name: str, label: str | None, run: int | None) -> str:
    """The profile's file name stem, as ``dataplane_bench.py`` makes it."""
    return name + (f"-{label}" if label else "") + (f"-run{run}" if run else "")


def row_of(results: Path, name: str, label: str | None, run: int | None) -> dict[str, Any]:
    rows = [
        r
        for r in json.loads(results.read_text())["rows"]
        if r["name"] == name
        and (label is None or r.get("source") == label)
        and (run is None or r.get("run") == run)
    ]
    if len(rows) != 1:
        raise SystemExit(
            f"{results}: {len(rows)} rows named {name!r} (label {label}, run {run}): "
            "give --label and --run as the bench ran them"
        )
    row = rows[0]
    if row.get("error") or not row.get("requests"):
        raise SystemExit(f"{results}: row {name!r} has no requests ({row.get('error')})")
    return row


def check_event(data: Path) -> None:
    events = subprocess.run(
        ["perf", "evlist", "-i", str(data)], capture_output=True, text=True, check=True
    ).stdout
    if not events.strip().startswith("cpu-clock"):
        raise SystemExit(
            f"{data}: recorded {events.strip()!r}; periods are nanoseconds only for "
            "cpu-clock (dataplane_bench.py records it)"
        )


def table(
    title: str, base: Counter[str], other: Counter[str], labels: tuple[str, str], top: int
) -> str:
    names = sorted(set(base) | set(other), key=lambda k: -abs(other[k] - base[k]))[:top]
    lines = [
        f"{title}\n",
        f"| µs a request | {labels[0]} | {labels[1]} | difference |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        diff = other[name] - base[name]
        lines.append(f"| `{name[:90]}` | {base[name]:.2f} | {other[name]:.2f} | {diff:+.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", type=Path, required=True, help="dataplane_bench --profile DIR")
    parser.add_argument("--results", type=Path, required=True, help="that run's dataplane.json")
    parser.add_argument("--base", required=True, help="row name, e.g. gateway-redis")
    parser.add_argument("--other", required=True, help="row name, e.g. gateway-redis-cluster")
    parser.add_argument("--label", help="the --gateway-src label both rows ran with")
    parser.add_argument("--other-label", help="the other row's label, when it differs")
    parser.add_argument("--run", type=int, help="the pass, when the bench ran with --repeat")
    parser.add_argument("--top", type=int, default=25, help="lines per table")
    args = parser.parse_args()
    wanted = ((args.base, args.label), (args.other, args.other_label or args.label))
    labels = (tag_of(args.base, args.label, None), tag_of(args.other, wanted[1][1], None))
    measured = []
    for name, label in wanted:
        data = args.profile / f"{tag_of(name, label, args.run)}.data"
        if not data.exists():
            raise SystemExit(f"{data} not found: run dataplane_bench.py --profiler perf first")
        check_event(data)
        row = row_of(args.results, name, label, args.run)
        measured.append((row, profile(data, int(row["requests"]))))
    (row_a, (total_a, roots_a, incl_a, self_a)), (row_b, (total_b, roots_b, incl_b, self_b)) = (
        measured
    )
    print(
        f"CPU a request under perf: {labels[0]} {total_a:.1f} µs "
        f"(the row: {row_a['cpu_us_per_request']:.1f}), {labels[1]} {total_b:.1f} µs "
        f"(the row: {row_b['cpu_us_per_request']:.1f}); difference {total_b - total_a:+.1f}\n"
    )
    print(table("By the outermost compiled function:", roots_a, roots_b, labels, args.top))
    print()
    print(table("By compiled function, inclusive:", incl_a, incl_b, labels, args.top))
    print()
    print(table("By function, self:", self_a, self_b, labels, args.top))


if __name__ == "__main__":
    main()

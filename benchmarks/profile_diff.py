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
(perf's period) is divided by the requests the row completed in the same measured window,
so both rows are in microseconds a request, however fast each ran; two tables follow:

* by the outermost compiled function of the sample's stack (the event-loop callback
  the work was done for: a client's read, a counter store's reply, the turn's writes),
  or the outermost frame when no compiled function is on it (the poll, the kernel);
* by compiled function, inclusive (each counted once a sample), the largest differences.

Perf's own sampling slows the profiled gateway (dwarf stacks: a few percent), alike for
both rows. With ``--repeat`` the last pass's profile is the one kept, so give the rows'
requests of that pass (the JSON's last row of each name is used).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


def stacks(data: Path) -> Iterator[tuple[int, list[str]]]:
    """(period in ns, frames leaf first) of each sample of a ``perf record`` file."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "period,ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    period = 0
    frames: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            if frames:
                yield period, frames
            period, frames = 0, []
        elif not line.startswith("\t"):  # a sample's header: its period
            period = int(line.split()[0])
        else:  # "\t<address> <symbol>"
            parts = line.strip().split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else parts[0])
    if frames:
        yield period, frames


def root_of(frames: list[str]) -> str:
    compiled = [f for f in frames if f.startswith("CPyDef_")]
    if compiled:
        return compiled[-1]
    outer = [f for f in frames if f not in ("[unknown]",) and not f.startswith("0x")]
    return f"(no compiled frame) {outer[-1] if outer else frames[-1]}"


def profile(data: Path, requests: int) -> tuple[float, Counter[str], Counter[str]]:
    """(µs a request in all, µs a request by root, µs a request by function inclusive)."""
    roots: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for period, frames in stacks(data):
        total += period
        roots[root_of(frames)] += period
        for name in {f for f in frames if f.startswith("CPyDef_")}:
            inclusive[name] += period
    scale = 1 / 1000 / requests  # ns in all -> µs a request
    as_us = Counter({k: v * scale for k, v in roots.items()})
    return total * scale, as_us, Counter({k: v * scale for k, v in inclusive.items()})


def requests_of(results: Path, name: str) -> int:
    rows = [r for r in json.loads(results.read_text())["rows"] if r["name"] == name]
    if not rows:
        raise SystemExit(f"{results}: no row named {name!r}")
    return int(rows[-1]["requests"])


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
    parser.add_argument("--top", type=int, default=25, help="lines per table")
    args = parser.parse_args()
    labels = (args.base, args.other)
    measured = []
    for name in labels:
        data = args.profile / f"{name}.data"
        if not data.exists():
            raise SystemExit(f"{data} not found: run dataplane_bench.py --profiler perf first")
        measured.append(profile(data, requests_of(args.results, name)))
    (base_total, base_roots, base_incl), (other_total, other_roots, other_incl) = measured
    print(
        f"CPU a request under perf: {args.base} {base_total:.1f} µs, "
        f"{args.other} {other_total:.1f} µs ({other_total - base_total:+.1f})\n"
    )
    print(table("By the outermost compiled function:", base_roots, other_roots, labels, args.top))
    print()
    print(table("By compiled function, inclusive:", base_incl, other_incl, labels, args.top))


if __name__ == "__main__":
    main()

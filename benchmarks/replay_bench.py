"""``gateway rules simulate`` on a generated log: wall time and peak memory.

Generates (once, kept in --dir) a JSON access log of --requests requests over
--identities identities spread over an hour (``benchmarks/replay_log.py``), then runs the
command line as a child process, as an operator would, twice: the new table alone, and
the new table with a baseline (two tables replayed in one pass). The new table is
``rules/default.yaml`` with ``runs-query-api-key`` at 30/10 instead of 15/10. Peak memory
is the child's maximum resident set size (``wait4``). Results go to
``benchmarks/results/replay.{json,md}``.

    .venv/bin/python benchmarks/replay_bench.py [--requests 1000000] [--identities 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.replay_log import generate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _new_table(directory: Path) -> Path:
    text = (ROOT / "rules" / "default.yaml").read_text()
    old = "  - id: runs-query-api-key\n"
    head, tail = text.split(old, 1)
    tail = tail.replace("limits: {us: 15/10, eu: 15/10}", "limits: {us: 30/10, eu: 30/10}", 1)
    target = directory / "rules-new"
    target.mkdir(exist_ok=True)
    (target / "default.yaml").write_text(head + old + tail)
    return target


def _run(args: list[str]) -> dict[str, float]:
    started = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{args} exited with {proc.returncode}")
    report = json.loads(out)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "replayed": report["replayed"],
        "limited_new": report["new"]["decisions"].get("limited", 0),
        "limited_baseline": (report["baseline"] or {}).get("decisions", {}).get("limited", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/replay-bench"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    log = args.dir / f"access-{args.requests}-{args.identities}.log"
    if not log.exists():
        started = time.perf_counter()
        generate(log, args.requests, args.identities, 3600)
        print(f"generated {log} ({log.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    new = _new_table(args.dir)
    base = [sys.executable, "-m", "gateway", "rules", "simulate", "--json", "--no-progress",
            "--rules", str(new)]  # fmt: skip
    rows = {
        "new table only": _run([*base, str(log)]),
        "new table + baseline": _run([*base, "--baseline", str(ROOT / "rules"), str(log)]),
    }
    result = {
        "machine": machine_info(),
        "requests": args.requests,
        "identities": args.identities,
        "log_mib": round(log.stat().st_size / 2**20, 1),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Replay: {args.requests:,} requests over {args.identities:,} identities "
        f"({result['log_mib']} MiB JSON log)",
        "",
        "| run | wall s | CPU s | requests/s | peak RSS MiB | limited (new / baseline) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        rate = row["replayed"] / row["wall_s"]
        lines.append(f"| {name} | {row['wall_s']} | {row['cpu_s']} | {rate:,.0f} | "
                     f"{row['max_rss_mib']} | {row['limited_new']:,} / "
                     f"{row['limited_baseline']:,} |")  # fmt: skip
    lines += ["", "machine: " + ", ".join(f"{k}={v}" for k, v in result["machine"].items())]
    (RESULTS / "replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

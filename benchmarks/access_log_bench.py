"""The access log's cost per request, before and after the identity components (issue 15).

Times ``AccessLogger.emit`` (format one record into the batch; the batch is written once
per loop turn, here when full) for a request whose API key hash rule matching already
computed, on a connection whose memo holds its client address's hash (keep-alive: the
common case), in both line formats. "before" is ``gateway/proxy/access_log.py`` of
``--before`` (git), loaded from ``git show``; "now" is the working tree. The log goes to
a handler that drops records, so the numbers are formatting cost only.

    .venv/bin/python benchmarks/access_log_bench.py [--before d4a85d7] [--n 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.policy.model import IdentityKind  # noqa: E402
from gateway.proxy import access_log as now_module  # noqa: E402
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity  # noqa: E402


def _load_before(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:gateway/proxy/access_log.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "access_log_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("access_log_before", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _record(module, identities):
    fields = dict(
        method="POST", path="/runs/query", status=200, region="us", client="10.1.2.3",
        rule="runs-query-api-key", decision="allowed", identity="api_key:0123456789ab",
        upstream="default", duration_ms=0.84, upstream_ms=0.61,
        request_id="5f0c0ffee0ddba11" + "0000000000000001",
    )  # fmt: skip
    if identities is not None:
        fields["identities"] = identities
    return module.AccessRecord(**fields)


async def _emit_all(logger, records) -> float:
    # inside a loop, as in the gateway: lines are batched, written when 256 are buffered.
    # CPU time of this process: the machine is shared, wall time would count waiting.
    started = time.process_time()
    for record in records:
        logger.emit(record)
    return time.process_time() - started


def _time(module, mode: str, n: int, with_ids: bool) -> float:
    hasher = IdentityHasher(b"b" * 32)
    memo: dict = {}
    # warm the connection's memo as the first request on a connection would
    RequestIdentity(hasher, "10.1.2.3", "sk-bench", None, memo=memo).key_for(IdentityKind.IP)
    logger = module.AccessLogger(mode, max_batch=256)
    best = float("inf")
    for _ in range(5):
        records = []
        for _ in range(n):
            ids = None
            if with_ids:
                ids = RequestIdentity(hasher, "10.1.2.3", "sk-bench", None, memo=memo)
                ids.key_for(IdentityKind.API_KEY)  # what rule matching computed
            records.append(_record(module, ids))
        best = min(best, asyncio.run(_emit_all(logger, records)) / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="d4a85d7")
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    access = logging.getLogger("gateway.access")
    access.handlers[:] = [logging.NullHandler()]
    access.propagate = False
    access.setLevel(logging.INFO)
    before = _load_before(args.before)
    print(f"emit() per record, CPU time, best of 5 x {args.n:,} (microseconds)")
    print(f"| format | before ({args.before}) | now | now - before |")
    print("|---|---:|---:|---:|")
    for mode in ("json", "plain"):
        old = _time(before, mode, args.n, with_ids=False)
        new = _time(now_module, mode, args.n, with_ids=True)
        print(f"| {mode} | {old:.2f} | {new:.2f} | {new - old:+.2f} |")


if __name__ == "__main__":
    main()

"""With --workers, a rule reload is logged once, not once per process (issue 28 item 5):
the supervisor says it; its workers, which read the same files, log it at DEBUG."""

from __future__ import annotations

import shutil
import time

from tests.support.gateway import ROOT, GatewayProcess
from tests.support.redis_servers import RedisServer


def test_a_reload_is_logged_once_with_workers(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    rules = tmp_path / "rules"
    shutil.copytree(ROOT / "rules", rules)
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(
        ["--workers", "2", "--redis-url", redis.url, "--rules", str(rules), "--no-embedded",
         "--data-dir", str(tmp_path / "data"), "--access-log", "off"],
        log_path=log,
    )  # fmt: skip
    try:
        gateway.wait_ready()
        (rules / "00-extra.yaml").write_text(
            "rules:\n  - id: extra\n    match: {prefix: /extra}\n    identity: ip\n"
            "    limits: {us: 5/60, eu: 5/60}\n"
        )
        for _ in range(500):
            if "rules reloaded" in gateway.log_text():
                break
            time.sleep(0.02)
        time.sleep(2)  # every process's watcher has had its turn (the interval is 1 s)
        assert gateway.log_text().count("rules reloaded") == 1, gateway.log_text()
    finally:
        gateway.stop()
        redis.stop()

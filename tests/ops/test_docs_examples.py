"""Examples in the README and docs that quote what the gateway prints must match what it
prints today: the default table's digest, its size, the compiled-module count. Written
by hand, they drifted (issue 28); this test keeps them true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gateway.native import HOT_MODULES
from gateway.policy.loader import load_rules
from gateway.settings import DEFAULT_REGIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _lines(pattern: str) -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            if re.search(pattern, line):
                found.append((doc.name, line))
    return found


def test_the_default_tables_digest_and_size_quoted_in_the_docs_are_todays(monkeypatch):
    monkeypatch.chdir(ROOT)  # as the docs run it: the digest covers the files' names too
    table = load_rules(["rules"], DEFAULT_REGIONS)
    quoted = _lines(r"from rules/default\.yaml \(table [0-9a-f]{12}\)")
    assert len(quoted) >= 3  # README, deployment.md, rules.md
    for doc, line in quoted:
        assert f"{table.size_text} from rules/default.yaml (table {table.digest[:12]})" in line, (
            doc,
            line,
        )
    for doc, line in _lines(r'"hash": "[0-9a-f]{12}\.\.\."'):
        assert f'"hash": "{table.digest[:12]}..."' in line, (doc, line)


def test_rules_check_prints_what_the_docs_show():
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "rules", "check", "rules/"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.strip() in (ROOT / "docs" / "rules.md").read_text()


def test_the_compiled_module_count_quoted_in_the_docs_is_todays():
    quoted = _lines(r"compiled with mypyc \(\d+ of \d+ modules\)")
    assert quoted
    n = len(HOT_MODULES)
    for doc, line in quoted:
        assert f"compiled with mypyc ({n} of {n} modules)" in line, (doc, line)


def test_scripts_gateway_runs_the_projects_gateway_command():
    done = subprocess.run(
        [str(ROOT / "scripts" / "gateway"), "rules", "check", "rules/"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: ")

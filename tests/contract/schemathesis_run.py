"""Run schemathesis, as its command line does, against a server a test started on loopback.

Every check (``--checks all``), a fixed seed, the examples, coverage and fuzzing phases, a
bounded number of cases per operation, no example database: the same command gives the
same run, and a failure prints the command line to replay it by hand.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILE = Path(__file__).with_name("schemathesis.toml")
SEED = 20260613
MAX_EXAMPLES = 100


@dataclass
class ContractRun:
    command: list[str]
    returncode: int
    output: str

    @property
    def operations_tested(self) -> int:
        found = re.search(r"Tested: (\d+)", self.output)
        return int(found.group(1)) if found else 0

    @property
    def cases(self) -> int:
        found = re.search(r"(\d+) generated", self.output)
        return int(found.group(1)) if found else 0

    @property
    def failures(self) -> int:
        """Failing cases: the summary tallies ``N generated, M passed[, K skipped]`` when
        every generated case passed, and names failures otherwise."""
        found = re.search(
            r"(\d+) generated, (\d+) passed(?:, (\d+) skipped)?\s*$", self.output, re.M
        )
        if found is None:
            return -1  # no clean tally: some case failed or errored
        generated, passed, _skipped = (int(g or 0) for g in found.groups())
        return generated - passed

    @property
    def summary(self) -> str:
        return self.output[self.output.find("SUMMARY") :] if "SUMMARY" in self.output else ""


async def run_schemathesis(
    document_url: str,
    work_dir: Path,
    *,
    headers: dict[str, str] | None = None,
    max_examples: int = MAX_EXAMPLES,
) -> ContractRun:
    """``schemathesis run`` against ``document_url`` (which must be on 127.0.0.1)."""
    assert document_url.startswith("http://127.0.0.1:"), document_url
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG_FILE),
        "run",
        document_url,
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing",
        "--seed",
        str(SEED),
        "--max-examples",
        str(max_examples),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--no-color",
        # Show the bodies of failures in full: the credentials here are the tests' own.
        "--output-sanitize",
        "false",
    ]
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=work_dir,  # its .schemathesis/ state lands in the test's temporary directory
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=600)
    assert process.returncode is not None
    return ContractRun(command, process.returncode, output.decode(errors="replace"))

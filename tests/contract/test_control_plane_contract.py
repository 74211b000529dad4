"""schemathesis against the control plane's own port and its generated document (with the
credentials a client sends): zero failures.

The control plane runs as shipped in the embedded default: no integrations configured, so
any ``integration_id`` is accepted (a configured list makes the id a matter of stored state,
checked by ``rules.py`` and by tests/control_plane).
"""

from __future__ import annotations

from pathlib import Path

from tests.control_plane.support import headers as credentials
from tests.control_plane.support import make_config, running_control_plane

from .schemathesis_run import run_schemathesis

# Every documented operation but GET /openapi.json (schemathesis leaves out the URL it
# loaded the document from).
CONTROL_PLANE_OPERATIONS = 24


async def test_control_plane_conforms_to_its_openapi_document(tmp_path: Path) -> None:
    # The default body limit (1 MiB): the test helpers' 64 KiB would refuse (413) some bodies
    # the document allows, such as a secret value of the longest length.
    # A short longest wait: GET /v2/auth/wait holds each request up to its timeout.
    config = make_config(
        tmp_path / "control-plane",
        integrations={},
        max_body_bytes=1 << 20,
        auth_wait_max_seconds=0.2,
    )
    async with running_control_plane(config) as control_plane:
        run = await run_schemathesis(
            control_plane.url + "/openapi.json",
            tmp_path,
            headers=credentials(),
        )
    print(run.summary)
    assert run.returncode == 0, run.output[-20000:]
    assert run.failures == 0, run.output[-20000:]
    assert run.operations_tested == CONTROL_PLANE_OPERATIONS, run.summary
    assert run.cases >= 20 * CONTROL_PLANE_OPERATIONS, run.summary

"""schemathesis against the Store's own port and its generated document: zero failures.

Checks every response against the document (status, content type, schema) and that the
Store rejects schema-violating requests and accepts schema-valid ones, so the models, the
document and the handlers cannot drift apart unnoticed.
"""

from __future__ import annotations

from pathlib import Path

from gateway.upstreams.store import StoreConfig
from tests.store.store_support import start_store

from .schemathesis_run import run_schemathesis

# put, get, delete, search, list namespaces (schemathesis leaves out the URL it loaded the
# document from, GET /store/openapi.json)
STORE_OPERATIONS = 5


async def test_store_api_conforms_to_its_openapi_document(tmp_path: Path) -> None:
    store = await start_store(StoreConfig(data_dir=tmp_path / "store"))
    try:
        run = await run_schemathesis(store.url + "/store/openapi.json", tmp_path)
    finally:
        await store.runner.cleanup()
    print(run.summary)
    assert run.returncode == 0, run.output[-20000:]
    assert run.failures == 0, run.output[-20000:]
    assert run.operations_tested == STORE_OPERATIONS, run.summary
    assert run.cases >= 20 * STORE_OPERATIONS, run.summary

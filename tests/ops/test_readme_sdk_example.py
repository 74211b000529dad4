"""The README's langgraph-sdk example runs as written against `gateway serve` with the
shipped rules and the built-in Store, and a client written like it is not limited after
its 100th call (user review: without an API key the example's client was counted per
address under catch-all, 100 per 60 s)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from langgraph_sdk import get_client

from tests.support.gateway import ROOT, GatewayProcess


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "get_client" in b]
    return example


def test_the_readme_example_runs_and_a_client_like_it_is_counted_per_key(tmp_path: Path) -> None:
    gw = GatewayProcess(["--data-dir", str(tmp_path / "data")], log_path=tmp_path / "gw.log")
    try:
        gw.wait_ready(60)
        code = _example().replace("http://127.0.0.1:8080", gw.url)
        assert gw.url in code, "the example names the default address"
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102

        key = re.search(r'api_key="([^"]+)"', code)
        assert key, "the example passes an API key"

        async def many() -> None:
            store = get_client(url=gw.url, api_key=key[1]).store
            for n in range(150):  # past catch-all's 100 per 60 s
                await store.put_item(["readme"], key=f"k{n}", value={"n": n})

        asyncio.run(many())
    finally:
        gw.stop()

"""Store processes on one data dir: acknowledged writes survive kill -9, and two processes
writing at once lose nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from langgraph_sdk import get_client

from .store_support import StoreProcess, spawn_store_process


async def _all_items(sdk: Any, namespace: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    offset = 0
    while True:
        page = (await sdk.search_items(namespace, limit=1000, offset=offset))["items"]
        found.update({item["key"]: item["value"] for item in page})
        if len(page) < 1000:
            return found
        offset += 1000


async def test_acknowledged_writes_survive_kill_9(
    tmp_path: Path, store_processes: list[StoreProcess], store_database_url: str | None
) -> None:
    data_dir = tmp_path / "data"
    database = ("--database-url", store_database_url) if store_database_url else ()
    first = await spawn_store_process(data_dir, *database)
    store_processes.append(first)
    acknowledged: dict[str, int] = {}
    deleted: set[str] = set()
    async with get_client(url=first.url, api_key=None) as client:
        for index in range(100):
            await client.store.put_item(["durable"], key=f"seq{index}", value={"i": index})
            acknowledged[f"seq{index}"] = index
        for index in range(0, 100, 10):
            await client.store.delete_item(["durable"], key=f"seq{index}")
            deleted.add(f"seq{index}")

        # Then a burst of concurrent writes, killed while requests are in flight.
        enough = asyncio.Event()

        async def writer(worker: int) -> None:
            for index in range(10_000):
                key = f"burst{worker}-{index}"
                try:
                    await client.store.put_item(["durable"], key=key, value={"i": index})
                except Exception:
                    return  # the server died mid-request: not acknowledged
                acknowledged[key] = index
                if len(acknowledged) >= 400:
                    enough.set()

        writers = [asyncio.create_task(writer(worker)) for worker in range(8)]
        async with asyncio.timeout(120):
            await enough.wait()
        first.kill_hard()
        # Requests still open can no longer be acknowledged; stop them rather than wait for
        # the client's connection retries to give up.
        for task in writers:
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)

    assert first.process.returncode == -9
    second = await spawn_store_process(data_dir, *database)
    store_processes.append(second)
    async with get_client(url=second.url, api_key=None) as client:
        stored = await _all_items(client.store, ["durable"])
    for key, index in acknowledged.items():
        if key in deleted:
            assert key not in stored
        else:
            assert stored.get(key) == {"i": index}, key


async def test_two_processes_writing_one_data_dir_lose_nothing(
    tmp_path: Path, store_processes: list[StoreProcess], store_database_url: str | None
) -> None:
    database = ("--database-url", store_database_url) if store_database_url else ()
    data_dir = tmp_path / "shared"
    # Started together, so they also race to create the schema.
    processes = await asyncio.gather(
        spawn_store_process(data_dir, *database), spawn_store_process(data_dir, *database)
    )
    store_processes.extend(processes)
    clients = [get_client(url=p.url, api_key=None) for p in processes]
    per_process = 250
    try:

        async def write_all(name: str, sdk: Any) -> None:
            gate = asyncio.Semaphore(8)

            async def one(index: int) -> None:
                async with gate:
                    await sdk.put_item(
                        ["shared", name], key=f"{name}-{index}", value={"text": f"{name} {index}"}
                    )
                    # Both processes also rewrite one common item over and over.
                    await sdk.put_item(["shared"], key="common", value={"by": name, "i": index})

            await asyncio.gather(*(one(index) for index in range(per_process)))

        await asyncio.gather(
            write_all("alpha", clients[0].store), write_all("beta", clients[1].store)
        )

        expected = {
            f"{name}-{index}": {"text": f"{name} {index}"}
            for name in ("alpha", "beta")
            for index in range(per_process)
        }
        for client in clients:  # each process sees every write, its own and the other's
            stored = await _all_items(client.store, ["shared"])
            common = stored.pop("common")
            assert common["by"] in ("alpha", "beta")
            assert stored == expected
            namespaces = await client.store.list_namespaces(prefix=["shared"])
            assert namespaces["namespaces"] == [["shared"], ["shared", "alpha"], ["shared", "beta"]]
            found = await client.store.search_items(["shared"], query="beta 17")
            assert found["items"][0]["key"] == "beta-17"
    finally:
        for client in clients:
            await client.aclose()

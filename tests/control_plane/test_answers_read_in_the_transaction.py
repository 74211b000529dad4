"""A write's answer is read in the write's own transaction: with several gateways on one
database, another one may delete the row the moment this one commits (review,
seventeenth session: a PATCH racing a DELETE on a shared PostgreSQL answered 500,
``AssertionError`` where the row was read again after the commit).

Made certain here, not left to timing: this store's transactions end by committing and
then, at once, deleting the row through a second store on the same file (a second
gateway), before the caller sees the answer."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from gateway.upstreams.control_plane.storage import ControlPlaneStore
from gateway.upstreams.control_plane.tables import Transaction

TENANT = str(uuid.uuid4())


class _DeletedOnCommit(Transaction):
    def __init__(self, store: RacedStore) -> None:
        super().__init__(store._conn)
        self._store = store

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        owner = self._owner
        super().__exit__(exc_type, exc, tb)
        if owner and exc_type is None and self._store.on_commit is not None:
            self._store.on_commit()


class RacedStore(ControlPlaneStore):
    on_commit: Any = None

    def _tx(self) -> Transaction:
        return _DeletedOnCommit(self)


class _Clock(float):
    def __call__(self) -> float:
        return float(self)


def _deployment() -> dict[str, Any]:
    return {
        "name": "agent",
        "source": "github",
        "source_config": {"integration_id": "i", "repo_url": "https://example.com/r"},
        "source_revision_config": {"repo_ref": "main", "langgraph_config_path": "l.json"},
        "secrets": [],
    }


def test_a_row_deleted_the_moment_its_write_commits_is_still_answered(tmp_path: Path) -> None:
    path = tmp_path / "cp.sqlite3"
    mine, other = RacedStore(path), ControlPlaneStore(path)
    try:
        # create: the deployment is deleted by the other gateway right after the commit.
        def delete_deployments() -> None:
            for (found,) in other._conn.execute("SELECT id FROM deployments").fetchall():
                assert other.delete_deployment(TENANT, found)

        mine.on_commit = delete_deployments
        deployment = mine.create_deployment(TENANT, _deployment(), _Clock(1000.0))
        assert deployment["name"] == "agent"
        assert other.get_deployment(TENANT, deployment["id"]) is None  # (it was deleted)

        # patch: the same, with the deployment there before.
        mine.on_commit = None
        kept = mine.create_deployment(TENANT, _deployment(), _Clock(1001.0))
        mine.on_commit = lambda: other.delete_deployment(TENANT, kept["id"])
        patched = mine.patch_deployment(
            TENANT, kept["id"], {"source_revision_config": {"repo_ref": "next"}}, _Clock(1002.0)
        )
        assert patched is not None and patched[1] is True
        assert other.get_deployment(TENANT, kept["id"]) is None  # (it was deleted)

        # a listener (every insert of the shared tables).
        listener_ids: list[str] = []

        def delete_listeners() -> None:
            for row in other._conn.execute("SELECT id FROM listeners").fetchall():
                listener_ids.append(row[0])
                other._conn.execute("DELETE FROM listeners WHERE id = ?", (row[0],))

        mine.on_commit = delete_listeners
        listener = mine.create_listener(
            TENANT,
            {"compute_type": "k8s", "compute_id": "c1", "compute_config": {}, "version": "1"},
            1003.0,
        )
        assert listener["compute_id"] == "c1" and listener_ids == [listener["id"]]
    finally:
        mine.close()
        other.close()

"""`gateway keys add|revoke` as an operator runs them, and the key file's hot reload."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway.identity.key_edit import add_key, revoke
from gateway.identity.keys import Consumer, KeyFileError, KeySource, load_key_file
from tests.support.gateway import ROOT


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=60,
    )


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def added(path: Path, consumer: str, *tier: str) -> str:
    result = gateway("keys", "add", "--file", str(path), "--consumer", consumer, *tier)
    assert result.returncode == 0, result.stderr
    key, *notes = result.stdout.splitlines()
    assert "cannot be shown again" in notes[0]
    assert f"sha256 {sha(key)[:12]}" in notes[1]
    return key


def test_add_prints_the_key_once_and_stores_only_its_hash(tmp_path):
    path = tmp_path / "keys.yaml"
    key = added(path, "acme", "--tier", "gold")
    assert key.startswith("gk_") and len(key) == 46
    text = path.read_text()
    assert key not in text and key[3:] not in text
    assert sha(key) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = load_key_file(path)
    assert ring.lookup(key.encode()) == Consumer("acme", "gold")
    # A second key of acme inherits its tier; both count as acme.
    second = added(path, "acme")
    other = added(path, "beta")
    ring = load_key_file(path)
    assert len(ring) == 3 and second != key
    assert ring.lookup(second.encode()) is ring.lookup(key.encode())
    assert ring.lookup(other.encode()) == Consumer("beta", None)
    assert not [n for n in os.listdir(tmp_path) if n != "keys.yaml"]  # no temp file left


def test_add_refuses_another_tier_for_a_consumer_and_bad_names(tmp_path):
    path = tmp_path / "keys.yaml"
    added(path, "acme", "--tier", "gold")
    before = path.read_bytes()
    result = gateway("keys", "add", "--file", str(path), "--consumer", "acme", "--tier", "free")
    assert result.returncode == 1 and "has tier 'gold'" in result.stderr
    assert result.stdout == ""  # no key printed for a key never stored
    result = gateway("keys", "add", "--file", str(path), "--consumer", "a b")
    assert result.returncode == 1 and "is not a name" in result.stderr
    assert path.read_bytes() == before


def test_a_bad_file_is_never_edited(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {sha256: nothex, consumer: acme}\n")
    before = path.read_bytes()
    for args in (
        ("add", "--consumer", "acme"),
        ("revoke", "--consumer", "acme"),
        ("revoke", "--hash", "0123456789"),
    ):
        result = gateway("keys", args[0], "--file", str(path), *args[1:])
        assert result.returncode == 1
        assert "entry #1, field 'sha256'" in result.stderr and "nothex" not in result.stderr
        assert result.stdout == ""
    assert path.read_bytes() == before
    missing = gateway("keys", "revoke", "--file", str(tmp_path / "none.yaml"), "--consumer", "a")
    assert missing.returncode == 1 and "no such file" in missing.stderr


def test_revoke_by_consumer_keeps_the_others_and_their_comments(tmp_path):
    path = tmp_path / "keys.yaml"
    acme = [added(path, "acme", "--tier", "gold"), added(path, "acme")]
    beta = added(path, "beta")
    # The operator annotates the file by hand; edits keep the notes of the keys kept.
    text = path.read_text().replace(
        f"  - {{sha256: {sha(beta)}", f"  # beta's CI key\n  - {{sha256: {sha(beta)}"
    )
    path.write_text(text + "# end of the list\n")
    result = gateway("keys", "revoke", "--file", str(path), "--consumer", "acme")
    assert result.returncode == 0 and "revoked 2 key(s)" in result.stdout
    ring = load_key_file(path)
    assert [ring.lookup(k.encode()) for k in acme] == [None, None]
    assert ring.lookup(beta.encode()) == Consumer("beta", None)
    text = path.read_text()
    assert "# beta's CI key" in text and "# end of the list" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = gateway("keys", "revoke", "--file", str(path), "--consumer", "acme")
    assert again.returncode == 1 and "has no key" in again.stderr
    # The last key gone leaves an explicit empty list, which still loads.
    assert gateway("keys", "revoke", "--file", str(path), "--consumer", "beta").returncode == 0
    assert len(load_key_file(path)) == 0


def test_revoke_one_key_by_a_prefix_of_its_hash(tmp_path):
    path = tmp_path / "keys.yaml"
    first, second = added(path, "acme"), added(path, "acme")
    result = gateway("keys", "revoke", "--file", str(path), "--hash", sha(second)[:10].upper())
    assert result.returncode == 0 and "revoked 1 key(s)" in result.stdout
    ring = load_key_file(path)
    assert ring.lookup(second.encode()) is None and ring.lookup(first.encode()) is not None
    short = gateway("keys", "revoke", "--file", str(path), "--hash", sha(first)[:7])
    assert short.returncode == 1 and "8 to 64 hex digits" in short.stderr
    unknown = gateway("keys", "revoke", "--file", str(path), "--hash", "0" * 12)
    # (a 1-in-2^48 chance that the random key's hash starts so)
    assert unknown.returncode == 1 and "0 keys" in unknown.stderr
    neither = gateway("keys", "revoke", "--file", str(path))
    assert neither.returncode == 2 and "--consumer" in neither.stderr
    assert len(load_key_file(path)) == 1


def test_an_ambiguous_prefix_is_refused(tmp_path):
    path = tmp_path / "keys.yaml"
    one, two = "deadbeef" + "0" * 56, "deadbeef" + "1" * 56
    path.write_text(
        f"keys:\n  - {{sha256: {one}, consumer: a}}\n  - {{sha256: {two}, consumer: b}}\n"
    )
    with pytest.raises(ValueError, match=r"2 keys .* starting with deadbeef; give more digits"):
        revoke(path, hash_prefix="deadbeef")
    assert revoke(path, hash_prefix="deadbeef1") == 1
    assert [e.consumer for e in load_key_file(path)] == ["a"]
    with pytest.raises(ValueError, match="either a consumer or a hash prefix"):
        revoke(path, consumer="a", hash_prefix="deadbeef")


def test_a_list_the_edit_does_not_understand_is_rewritten_whole(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys: [{{sha256: {'a' * 64}, consumer: a}}]  # flow style\n")
    key = add_key(path, "b", "gold")
    ring = load_key_file(path)
    assert [e.consumer for e in ring] == ["a", "b"] and ring.lookup(key.encode()) is not None


def test_concurrent_adds_lose_no_key(tmp_path):
    path = tmp_path / "keys.yaml"
    keys: list[str] = []

    def one(n: int) -> None:
        keys.append(add_key(path, f"c{n}"))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ring = load_key_file(path)
    assert len(ring) == 8
    assert all(ring.lookup(k.encode()) is not None for k in keys)


def test_through_a_symlink_the_link_stays(tmp_path):
    real = tmp_path / "real.yaml"
    link = tmp_path / "keys.yaml"
    add_key(real, "a")
    link.symlink_to(real)
    key = add_key(link, "b")
    assert link.is_symlink()
    assert load_key_file(real).lookup(key.encode()) == Consumer("b", None)


async def wait_for(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_hot_reload_keeps_the_old_ring_on_a_bad_edit_and_applies_a_good_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gateway.identity")
    path = tmp_path / "keys.yaml"
    old_key = add_key(path, "acme", "gold")
    outcomes: list[str] = []
    source = KeySource(path, on_reload=outcomes.append)
    assert source.ring.lookup(old_key.encode()) == Consumer("acme", "gold")
    watch = asyncio.create_task(source.watch(0.05))
    try:
        good = path.read_text()
        # A bad edit, with a key pasted in clear where its hash belongs.
        pasted = "gk_pasted-in-clear-by-mistake"
        path.write_text(good + f"  - {{sha256: {pasted}, consumer: beta}}\n")
        await wait_for(lambda: source.last_error is not None)
        assert "entry #2, field 'sha256'" in source.last_error
        assert source.ring.lookup(old_key.encode()) == Consumer("acme", "gold")
        assert outcomes == ["error"]
        # Fixed by the CLI: the bad entry removed, a new key added.
        path.write_text(good)
        new_key = add_key(path, "beta")
        await wait_for(lambda: source.ring.lookup(new_key.encode()) is not None)
        assert source.last_error is None
        assert source.ring.lookup(old_key.encode()) == Consumer("acme", "gold")
        # Revoked: gone at the next poll.
        revoke(path, consumer="acme")
        await wait_for(lambda: source.ring.lookup(old_key.encode()) is None)
        assert source.ring.lookup(new_key.encode()) == Consumer("beta", None)
        # The file removed: the last ring stays.
        ring = source.ring
        path.unlink()
        await wait_for(lambda: source.last_error is not None)
        assert source.ring is ring and not watch.done()
        assert "ok" in outcomes and outcomes.count("error") == 2
    finally:
        watch.cancel()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "keeping the previous 1 keys" in logged and "api keys reloaded" in logged
    for secret in (old_key, new_key, pasted):
        assert secret not in logged


def test_reload_reports_unchanged_and_start_refuses_a_bad_file(tmp_path):
    path = tmp_path / "keys.yaml"
    add_key(path, "acme")
    source = KeySource(path)
    assert source.reload() is False and source.last_error is None  # same bytes
    add_key(path, "beta")
    assert source.changed_on_disk()
    assert source.reload() is True and len(source.ring) == 2
    assert not source.changed_on_disk()
    path.write_text("keys: nope\n")
    with pytest.raises(KeyFileError, match="'keys' must be a list"):
        KeySource(path)


def test_a_fix_back_to_the_ring_in_force_is_logged(tmp_path, caplog):
    """A bad edit is refused (ERROR); restoring the file gives the same ring, so nothing
    is reloaded, but the operator reads that the file is valid again (not the ERROR as
    the last word). A plain unchanged reload says nothing."""
    caplog.set_level(logging.INFO, logger="gateway.identity")
    path = tmp_path / "keys.yaml"
    add_key(path, "acme")
    source = KeySource(path)
    good = path.read_text()
    assert source.reload("poll") is False
    assert "valid again" not in caplog.text
    path.write_text(good + "  - {sha256: not-a-hash, consumer: beta}\n")
    assert source.reload("poll") is False and source.last_error is not None
    path.write_text(good)
    assert source.reload("poll") is False and source.last_error is None
    assert "api keys valid again (poll): unchanged, still 1 keys of 1 consumers" in caplog.text

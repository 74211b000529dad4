"""gateway.proxy.request_id: cheap ids that never repeat, and which client ids are kept."""

from __future__ import annotations

import os
import re

import pytest

from gateway.proxy.request_id import accept_request_id, new_request_id

ID = re.compile(r"[0-9a-f]{32}")


def test_ids_are_32_lowercase_hex_digits():
    for _ in range(1000):
        rid = new_request_id()
        assert len(rid) == 32 and ID.fullmatch(rid), rid


def test_ids_do_not_repeat_within_a_process():
    ids = [new_request_id() for _ in range(200_000)]
    assert len(set(ids)) == len(ids)


def _ids_from_a_forked_child(count: int) -> list[str]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its ids and leave without running pytest's cleanup
        try:
            os.close(read_end)
            with os.fdopen(write_end, "w") as out:
                out.write("\n".join(new_request_id() for _ in range(count)))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as data:
        ids = data.read().split("\n")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return ids


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_never_repeats_its_parents_ids():
    before = [new_request_id() for _ in range(1000)]
    first, second = _ids_from_a_forked_child(1000), _ids_from_a_forked_child(1000)
    after = [new_request_id() for _ in range(1000)]
    everything = before + first + second + after
    assert all(ID.fullmatch(rid) for rid in everything)
    assert len(set(everything)) == len(everything)
    # Each child draws its own prefix, so their counters may overlap harmlessly.
    prefixes = {rid[:16] for rid in before} | {first[0][:16]} | {second[0][:16]}
    assert len(prefixes) == 3
    assert {rid[:16] for rid in after} == {before[0][:16]}


@pytest.mark.parametrize(
    "given",
    [b"a", b"abc-123", b"0123456789abcdef0123456789abcdef", b"with space", b"~!@#$%^&*()",
     b'"quoted"\\', b"x" * 128],
)  # fmt: skip
def test_printable_ascii_ids_up_to_128_bytes_are_kept(given):
    assert accept_request_id(given) == given.decode("ascii")


@pytest.mark.parametrize(
    "given",
    [b"", b"x" * 129, b"new\nline", b"tab\there", b"nul\x00", b"del\x7f", b"\x1b[31m",
     "caf\u00e9".encode(), b"\xff\xfe", b"\x80"],
)  # fmt: skip
def test_other_ids_are_replaced(given):
    assert accept_request_id(given) is None


def test_the_rule_is_the_one_the_handler_used_before():
    # Before: ``given and len(given) <= 128 and given.isascii() and given.isprintable()``
    # on the decoded header value.
    for code in range(256):
        raw = bytes([code]) * 3
        text = raw.decode("latin-1")
        before = bool(text) and len(text) <= 128 and text.isascii() and text.isprintable()
        assert (accept_request_id(raw) is not None) == before, code


def test_ids_count_up_one_by_one_across_the_formatted_runs():
    # The first 30 digits are formatted once per 256 ids: across several such runs each
    # id is the previous counter plus one, under the same prefix.
    ids = [new_request_id() for _ in range(1000)]
    assert {rid[:16] for rid in ids} == {ids[0][:16]}
    counters = [int(rid[16:], 16) for rid in ids]
    assert counters == list(range(counters[0], counters[0] + 1000))

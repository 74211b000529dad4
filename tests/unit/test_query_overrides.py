"""The '_method' query check: the same answers as reading every parameter, at a cost the
query's size bounds, not its number of parameters (review, seventeenth session: a query
of 30,000 '%;' pieces held the event loop ~90 ms a request when every piece was decoded).

Differential: ``query_overrides`` against ``every_parameter`` (the check as it was: every
parameter split, decoded and read as PHP reads ``$_GET``'s keys) over queries built from
the spellings frameworks read as '_method', near misses, escapes of every letter of
"method" in both cases, separators and junk."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.handler import MAX_METHOD_SPELLINGS, query_overrides


def every_parameter(query: bytes) -> list[bytes]:
    """The reference: every parameter looked at, as the check did before."""
    found: list[bytes] = []
    for part in query[1:].replace(b";", b"&").split(b"&"):
        key, _, value = part.partition(b"=")
        if b"%" in key or b"+" in key:
            key = unquote_to_bytes(key.replace(b"+", b" "))
        if b"method" not in key:
            continue
        key = key.split(b"\0", 1)[0].lstrip(b" ").replace(b".", b"_").replace(b" ", b"_")
        if key == b"_method" or key.startswith(b"_method["):
            found.append(unquote_to_bytes(value.replace(b"+", b" ")))
    return found


# Pieces of keys and values: every letter of "method" bare and escaped (both hex cases),
# the PHP spellings of '_', separators inside escapes, and junk.
PIECES = [
    b"_", b"%5F", b"%5f", b".", b"%2E", b"+", b"%20", b" ", b"%00", b"[", b"%5B", b"]",
    b"m", b"%6D", b"%6d", b"e", b"%65", b"t", b"%74", b"h", b"%68", b"o", b"%6F", b"%6f",
    b"d", b"%64", b"method", b"_method", b"METHOD", b"x", b"%", b"%%", b"%4", b"%G1",
    b"=", b"==", b"DELETE", b"get", b"%26", b"%3B",
]  # fmt: skip
# "method" spelled letter by letter, each bare or escaped in either hex case.
LETTERS = [[b"m", b"%6D", b"%6d"], [b"e", b"%65"], [b"t", b"%74"], [b"h", b"%68"],
           [b"o", b"%6F", b"%6f"], [b"d", b"%64"]]  # fmt: skip
SPELLED = st.tuples(*(st.sampled_from(variants) for variants in LETTERS)).map(b"".join)
KEYS = st.lists(st.one_of(st.sampled_from(PIECES), SPELLED), max_size=8).map(b"".join)
PARAMETER = st.tuples(KEYS, st.sampled_from([b"", b"="]), KEYS).map(b"".join)
SEPARATED = st.tuples(PARAMETER, st.sampled_from([b"&", b";", b"&&", b""])).map(b"".join)
QUERY = st.lists(SEPARATED, max_size=12).map(lambda parts: b"?" + b"".join(parts))


@settings(max_examples=1000, deadline=None)
@given(QUERY)
def test_the_same_overrides_as_reading_every_parameter(query: bytes) -> None:
    found = query_overrides(query)
    if found is None:  # refused: only for more spellings than the bound
        assert len(query) >= 6 * MAX_METHOD_SPELLINGS
        return
    assert found == every_parameter(query)


def test_known_spellings_are_found_among_many_other_parameters() -> None:
    junk = b"&".join(b"%41=%42" for _ in range(5000))
    for key in [b"_method", b"%5Fmethod", b"_%6Dethod", b"_method%5B0%5D", b".method",
                b"+_method", b"_method%00x", b"_%6D%65%74%68%6F%64"]:  # fmt: skip
        query = b"?" + junk + b"&" + key + b"=DELETE;" + junk
        assert query_overrides(query) == [b"DELETE"] == every_parameter(query)
    assert query_overrides(b"?" + junk) == []
    assert query_overrides(b"?x_method=1&method=2&_METHOD=3&q=_method") == []


def test_more_spellings_than_the_bound_are_refused_and_up_to_it_read() -> None:
    at_bound = b"?" + b"&".join([b"payment_method=card"] * MAX_METHOD_SPELLINGS)
    assert query_overrides(at_bound) == []
    for over in [
        b"?" + b"&".join([b"payment_method=card"] * (MAX_METHOD_SPELLINGS + 1)),
        b"?q=" + b"method" * (MAX_METHOD_SPELLINGS + 1),  # in values, in one parameter
        b"?" + b"%6Dethod;" * 9000,  # escaped spellings, the other separator
    ]:
        assert query_overrides(over) is None


def test_a_query_of_many_escaped_parameters_holds_no_override() -> None:
    # The review's query: every piece was decoded; none can spell 'method'.
    for piece in [b"%;", b"%&", b"%41=1&", b"%6D=%65&"]:
        query = b"?" + piece * 30000
        assert query_overrides(query) == [] == every_parameter(query)

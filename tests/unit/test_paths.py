from __future__ import annotations

import pytest

from gateway.policy.paths import PathError, normalise_path

SAME_AS_RUNS_QUERY = [
    "/runs/query",
    "//runs/query",
    "/runs//query",
    "/runs/./query",
    "/runs/x/../query",
    "/runs/%71uery",
    "/runs/%71%75%65%72%79",
    "/%72uns/query",
    "/runs/query/",
    "/runs/query//",
    "/./runs/query",
    "/runs/%2e/query",
    "/runs/x/%2e%2e/query",
]


@pytest.mark.parametrize("raw", SAME_AS_RUNS_QUERY)
def test_spellings_normalise_to_one_path(raw):
    assert normalise_path(raw) == "/runs/query"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("/runs/query;x=1", "path parameters"),
        ("/runs;/query", "path parameters"),
        ("/runs/query%3Bx", "path parameters"),
        ("/runs%2Fquery", "encoded '/'"),
        ("/runs%2fquery", "encoded '/'"),
        ("/runs%5Cquery", "encoded '\\'"),
        ("/runs\\query", "'\\'"),
        ("/runs/%00", "control character"),
        ("/../runs/query", "above the root"),
        ("/runs/%zz", "malformed percent"),
        ("/runs/%4", "malformed percent"),
        ("http://evil.example/runs", "starting with '/'"),
        ("*", "starting with '/'"),
        ("/runs/qu ery", "must be percent-encoded"),
        ("/" + "a" * 5000, "longer than"),
    ],
)
def test_ambiguous_spellings_are_refused(raw, words):
    with pytest.raises(PathError, match=None) as info:
        normalise_path(raw)
    assert words in str(info.value)


def test_reserved_characters_stay_encoded_and_hex_is_upper_cased():
    assert normalise_path("/a/b%3fc") == "/a/b%3Fc"
    assert normalise_path("/a/%25") == "/a/%25"
    assert normalise_path("/") == "/"
    assert normalise_path("/a/b:c@d") == "/a/b:c@d"

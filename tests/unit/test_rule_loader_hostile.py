"""Hostile rule files (issue 24 finding 4): whatever a file holds, loading it gives a table
or ``RuleLoadError``, within bounded depth, alias expansion, size and memory.

Regressions (each failed before the loader was bounded): a deeply nested file raised
``RecursionError``; a 400-byte alias bomb in a rule field made the problem message walk
billions of nodes; keys of mixed types raised ``TypeError``; a huge integer raised
``ValueError`` from its repr; a regex with deeply nested groups raised ``RecursionError``.
"""

from __future__ import annotations

import json
import string
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.policy import loader
from gateway.policy.loader import (
    MAX_ALTERNATIVES,
    MAX_FILE_BYTES,
    MAX_PROBLEMS,
    MAX_RULES,
    RuleLoadError,
    YamlBounds,
    load_rules,
    load_rules_from_texts,
    load_yaml_bounded,
)
from tests.support.fuzz import fuzz

ROOT = Path(__file__).resolve().parents[2]
MEMORY_BOUND = 64 * 1024 * 1024  # the loader's worst accepted document peaks near 40 MB
BOMB_MEMORY_BOUND = 16 * 1024 * 1024

VALID_RULE = "  - {id: ok, identity: ip, limits: {default: 10/60}}\n"


def alias_bomb(levels: int = 9, fan_out: int = 9) -> str:
    """Billion laughs (under 400 bytes): each anchor a list of ``fan_out`` aliases to the
    one before, and a rule field holding the last, which the old loader repr'd into its
    error message (9**9 strings: gigabytes)."""
    names = string.ascii_lowercase
    lines = [f"a: &a [{','.join(['lol'] * fan_out)}]"]
    for level in range(1, levels):
        name, previous = names[level], names[level - 1]
        lines.append(f"{name}: &{name} [{','.join([f'*{previous}'] * fan_out)}]")
    lines.append(f"rules: [{{id: bomb, identity: *{names[levels - 1]}, limits: {{default: 1/1}}}}]")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int = 9, fan_out: int = 9) -> str:
    """The same with merge keys. A PyYAML that copies the merged pairs at every level
    expands it (the one installed skips repeated keys); the bound refuses it either way."""
    lines = [f"a: &a {{{', '.join(f'k{n}: lol' for n in range(fan_out))}}}"]
    for level in range(1, levels):
        name, previous = string.ascii_lowercase[level], string.ascii_lowercase[level - 1]
        lines.append(f"{name}: &{name} {{<<: [{','.join([f'*{previous}'] * fan_out)}]}}")
    return "\n".join(lines) + "\n"


def refusal(text: str | bytes, name: str = "hostile.yaml") -> RuleLoadError:
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts([(name, text)])
    assert info.value.problems and all(p.file == name for p in info.value.problems)
    return info.value


def peak_memory(call: Callable[[], object]) -> int:
    """Peak bytes allocated by Python while ``call`` runs (exceptions propagate)."""
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# --- the regressions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "rules:\n" + "- " * 3000 + "x\n",  # block sequences, one line
        "rules: " + "[" * 3000 + "]" * 3000 + "\n",  # flow sequences
        "rules: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",  # flow mappings
        "rules: " + "[" * 65 + "]" * 65 + "\n",  # just over the bound
    ],
    ids=["block", "flow-seq", "flow-map", "65-levels"],
)
def test_deep_nesting_is_refused_with_the_loaders_error(tmp_path, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(RuleLoadError) as info:
        load_rules([path])
    (problem,) = info.value.problems
    assert problem.file == str(path)
    assert "nest" in problem.message  # ours, or libyaml's own "maximum nesting depth"


def test_nesting_up_to_the_bound_loads():
    depth = YamlBounds().max_depth
    assert load_yaml_bounded("[" * depth + "]" * depth, "x") is not None


def test_alias_bomb_is_refused_with_bounded_memory(tmp_path):
    text = alias_bomb()
    assert len(text) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    errors: list[RuleLoadError] = []

    def load() -> None:
        try:
            load_rules([path])
        except RuleLoadError as exc:
            errors.append(exc)

    assert peak_memory(load) < BOMB_MEMORY_BOUND
    (error,) = errors
    (problem,) = error.problems
    assert problem.file == str(path)
    assert "aliases expanded" in problem.message
    assert "aliases expanded" in str(refusal(merge_bomb()))


def test_recursive_and_undefined_aliases_are_refused():
    assert "recursive" in str(refusal("rules: &r [*r]\n"))
    assert "undefined" in str(refusal("rules: [*nowhere]\n"))


def test_aliases_within_bounds_still_load():
    text = (
        "rules:\n"
        "  - {id: a, match: {prefix: /a}, identity: ip, limits: &std {default: 10/60}}\n"
        "  - {id: b, match: {prefix: /b}, identity: ip, limits: *std}\n"
    )
    table = load_rules_from_texts([("anchors.yaml", text)])
    assert [str(s) for s in table.rules[1].limits_for("eu")] == ["10/60"]


def test_each_yaml_bound_is_enforced():
    small = YamlBounds(max_depth=3, max_nodes=20, max_chars=50, max_scalar=10, max_aliases=2)
    cases = {
        "[[[[1]]]]": "nested deeper than 3",
        "[" + ",".join("1" * 21) + "]": "over 20 nodes",
        "[" + ",".join(["123456789"] * 6) + "]": "over 50 characters",
        "a: " + "x" * 11: "value over 10 characters",
        "a: &a 1\nb: [*a, *a, *a]": "over 2 aliases",
    }
    for text, words in cases.items():
        with pytest.raises(RuleLoadError) as info:
            load_yaml_bounded(text, "bounded.yaml", small)
        assert words in str(info.value), text
    with pytest.raises(RuleLoadError, match="over 7 bytes"):
        load_yaml_bounded("a: 12345", "x", YamlBounds(max_bytes=7))


def test_a_file_over_the_size_bound_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(RuleLoadError, match=f"over {MAX_FILE_BYTES} bytes"):
        load_rules([path])
    # Not through the file reader either.
    refusal("#" * (MAX_FILE_BYTES + 1))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # keys of several types: sorting them for the message raised TypeError
        ("rules:\n  - {1: a, b: c, null: d, id: x, identity: ip}\n", "unknown key(s)"),
        ("{1: a, rules: [], null: b}\n", "unknown top-level key(s)"),
        ("rules:\n  - {id: x, identity: ip, match: {1: a, b: c}}\n", "unknown key(s)"),
        # an integer of ~77,000 digits: its repr raised ValueError
        ("rules:\n  - {id: x, identity: 0x" + "f" * 64_000 + "}\n", "not <int>"),
        ("rules:\n  - {id: x, identity: ip, limits: {? 0x" + "f" * 64_000 + " : 1/1}}\n", "<int>"),
        (
            "rules:\n  - {id: x, identity: ip, limits: {default: " + "9" * 5000 + "/60}}\n",
            "1..1000000000",
        ),
        # sre recurses per group: RecursionError
        (
            "rules:\n  - {id: x, identity: ip, match: {regex: '" + "(" * 5000 + ")" * 5000 + "'}}",
            "bad regular expression",
        ),
        # constructors that raise something else than a YAMLError
        ("rules: !!int nope\n", "ValueError"),
        ("rules: !!timestamp nope\n", "AttributeError"),
        ("rules: !!float nope\n", "ValueError"),
        ("rules: 1" + ":00" * 20_000 + "\n", "expected a list of rules"),  # sexagesimal int
        ("rules: !!python/object/apply:os.system [true]\n", "could not determine a constructor"),
        (b"rules: \xff\xfe\x00\x00", "not valid YAML"),
        ("rules: \ud800\n", "not valid YAML"),  # a lone surrogate: encode() raised
    ],
)
def test_odd_content_is_a_refusal_not_a_crash(text, words):
    error = refusal(text)
    assert words in str(error)
    assert len(str(error)) < 2000  # values are quoted short, whatever their size


def test_table_sized_bounds(tmp_path):
    many = "".join(
        f"  - {{id: r{i}, match: {{path: /p{i}}}, identity: ip, limits: {{default: 1/1}}}}\n"
        for i in range(MAX_RULES + 1)
    )
    assert f"over {MAX_RULES} rules" in str(refusal("rules:\n" + many))
    # Split over two files: the bound is on the table.
    half = (MAX_RULES + 1) // 2
    lines = many.splitlines(keepends=True)
    texts = [
        ("a.yaml", "rules:\n" + "".join(lines[:half])),
        ("b.yaml", "rules:\n" + "".join(lines[half:])),
    ]
    with pytest.raises(RuleLoadError, match=f"over {MAX_RULES} rules"):
        load_rules_from_texts(texts)
    alternatives = ", ".join(f"{{path: /p{i}}}" for i in range(MAX_ALTERNATIVES + 1))
    text = (
        f"rules:\n  - {{id: a, match: [{alternatives}], identity: ip, limits: {{default: 1/1}}}}\n"
    )
    assert f"over {MAX_ALTERNATIVES} match alternatives" in str(refusal(text))
    error = refusal("rules: [" + ", ".join(["1"] * (MAX_PROBLEMS * 3)) + "]\n")
    assert len(error.problems) == MAX_PROBLEMS + 1
    assert f"and {MAX_PROBLEMS * 2} more problem(s)" in error.problems[-1].message


def test_the_pure_python_parser_has_the_same_bounds(monkeypatch):
    """PyYAML without libyaml: the same refusals (its composer is the one that recursed)."""
    monkeypatch.setattr(loader, "_SafeLoader", yaml.SafeLoader)
    assert "nested deeper" in str(refusal("rules:\n" + "- " * 3000 + "x\n"))
    assert "nested deeper" in str(refusal("rules: " + "[" * 3000 + "]" * 3000 + "\n"))
    assert "aliases expanded" in str(refusal(alias_bomb()))
    table = load_rules([ROOT / "rules"])
    assert len(table.rules) == 30


def test_bounded_load_builds_what_safe_load_builds():
    good = ROOT / "tests" / "fixtures" / "rules" / "good"
    for path in [*sorted((ROOT / "rules").glob("*.yaml")), *sorted(good.glob("*.yaml"))]:
        text = path.read_text()
        assert load_yaml_bounded(text, str(path)) == yaml.safe_load(text)
    for text in ["", "a: 1", "- [1, 2.5, null, true, '2024-01-01']", "a: &x {b: 1}\nc: *x"]:
        assert load_yaml_bounded(text, "x") == yaml.safe_load(text)


# --- fuzzing ----------------------------------------------------------------------------

TAGS = [
    "!!str", "!!int", "!!float", "!!bool", "!!null", "!!binary", "!!timestamp", "!!set",
    "!!omap", "!!pairs", "!!seq", "!!map", "!!merge", "!!value", "!!python/object:os.system",
    "!!python/name:os.system", "!custom", "!<tag:yaml.org,2002:str>", "!<!>",
]  # fmt: skip
PLAIN = [
    "a", "ip", "api_key", "user_ip", "default", "us", "10/60", "0/0", "/runs", "GET", "true",
    "1:00:00", "0x1f", "0o17", "017", "1e400", "-.inf", ".nan", "2024-02-30", "2024-01-01",
    "~", "null", "yes", "<<", "=", "1_000", "0b101",
]  # fmt: skip
KEYS = ["rules", "id", "identity", "limits", "match", "regex", "template", "methods", "<<", "1"]


def _scalar() -> st.SearchStrategy[str]:
    plain = st.sampled_from(PLAIN)
    # a double-quoted YAML scalar (JSON's \u escapes; no surrogates, which YAML refuses)
    quoted = st.text(st.characters(max_codepoint=0xD7FF), max_size=30).map(json.dumps)
    # huge: around the value bound, long digits (int conversions), sexagesimal integers
    huge = st.one_of(
        st.builds(lambda c, n: c * n, st.sampled_from(["x", "9", "f"]), st.integers(4_000, 70_000)),
        st.integers(1, 30_000).map(lambda n: "1" + ":00" * n),
    )
    # One in ten huge: more, and every document is refused for its size before anything else.
    return st.integers(0, 9).flatmap(lambda n: huge if n == 0 else quoted if n < 4 else plain)


def _node(depth: int, anchors: list[str]) -> st.SearchStrategy[str]:
    """One flow-style YAML node, sometimes tagged, with aliases to earlier anchors."""
    leaf = _scalar()
    if anchors:
        leaf = st.one_of(leaf, st.sampled_from(anchors).map(lambda a: f"*{a}"))
    if depth <= 0:
        return leaf
    child = _node(depth - 1, anchors)
    seq = st.lists(child, max_size=6).map(lambda xs: "[" + ", ".join(xs) + "]")
    key = st.one_of(st.sampled_from(KEYS), leaf, child)  # a collection key is refused
    pairs = st.lists(st.tuples(key, child), max_size=5)
    mapping = pairs.map(lambda kv: "{" + ", ".join(f"? {k} : {v}" for k, v in kv) + "}")
    tag = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(TAGS))
    return st.builds(lambda t, n: f"{t} {n}" if t else n, tag, st.one_of(leaf, seq, mapping))


@st.composite
def _anchored(draw: st.DrawFn, rules: bool) -> str:
    """A chain of anchors, each repeating earlier ones (as lists or merge keys): an alias
    bomb when the chain is long and the fan-out large; then a document using them."""
    anchors: list[str] = []
    lines = ["x-anchors:"]
    for level in range(draw(st.integers(1, 12))):
        if anchors and draw(st.integers(0, 3)):
            fan_out = draw(st.integers(1, 12))
            refs = draw(st.one_of(
                st.just([anchors[-1]] * fan_out),  # the classic bomb
                st.lists(st.sampled_from(anchors), min_size=1, max_size=fan_out),
            ))  # fmt: skip
            aliases = ", ".join(f"*{r}" for r in refs)
            body = f"{{<<: [{aliases}], k{level}: v}}" if draw(st.booleans()) else f"[{aliases}]"
        else:
            body = draw(_node(2, anchors))
        lines.append(f"  - &a{level} {body}")
        anchors.append(f"a{level}")
    body = draw(_node(3, anchors))
    if rules:
        lines[0] = "rules:"
        identity = draw(_node(1, anchors))
        lines.append(f"  - {{id: r, identity: {identity}, match: {body}, limits: {body}}}")
        lines.append(f"  - {body}")
    else:
        lines.append(f"doc: {body}")
    return "\n".join(lines) + "\n"


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    """A well-formed hostile document with a few characters inserted or removed."""
    text = draw(_anchored(rules=True))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(st.sampled_from(list("[]{}:,-?&*!|>'\"#%@` \t\n"))) + text[at:]
        else:
            text = text[:at] + text[at + 1 :]
    return text


def _nested(opener: str, closer: str) -> st.SearchStrategy[str]:
    return st.builds(
        lambda n, leaf: opener * n + leaf + closer * n, st.integers(1, 5000), _scalar()
    )


HOSTILE_YAML = st.one_of(
    st.binary(max_size=2000),
    st.text(max_size=2000),
    _nested("[", "]"),
    _nested("{a: ", "}"),
    _nested("- ", ""),
    _nested("? ", ""),
    _anchored(rules=False),
    _anchored(rules=True),
    _mutated(),
)


def _outcome(call: Callable[[], Any]) -> None:
    try:
        call()
    except RuleLoadError as exc:
        # Not the loader's last resort either (an exception it did not expect, caught).
        assert not any(p.message.startswith("could not be loaded") for p in exc.problems)


@fuzz(200)
@given(HOSTILE_YAML)
@example(alias_bomb())
@example(merge_bomb())
@example("rules: " + "[" * 5000 + "]" * 5000)
@example(b"\x00\xff" * 100)
def test_fuzz_only_the_loaders_error_within_a_memory_bound(text):
    # Anything but RuleLoadError escapes _outcome and fails the test.
    assert (
        peak_memory(lambda: _outcome(lambda: load_yaml_bounded(text, "fuzz.yaml"))) < MEMORY_BOUND
    )
    rules = lambda: _outcome(lambda: load_rules_from_texts([("fuzz.yaml", text)]))  # noqa: E731
    assert peak_memory(rules) < MEMORY_BOUND

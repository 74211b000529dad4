"""What the start-up log says about the compiled data plane (gateway/native.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from gateway import native

ROOT = Path(__file__).resolve().parents[2]


def test_setup_reads_the_list_and_every_listed_module_exists() -> None:
    setup_py = (ROOT / "setup.py").read_text()
    assert 'runpy.run_path("gateway/native.py")["HOT_MODULES"]' in setup_py
    for name in native.HOT_MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_the_start_up_line_says_what_runs_and_flags_a_stale_build() -> None:
    compiled = native.compiled_modules()
    text = native.describe()
    # The install compiles every hot module unless told not to (setup.py): a build that
    # fell back to interpreted code without being asked to fails here.
    if os.environ.get("GATEWAY_COMPILE", "1") != "0":
        assert compiled == list(native.HOT_MODULES), text
        assert f"compiled with mypyc ({len(compiled)} of {len(native.HOT_MODULES)}" in text
        # A source edited after its build: the line says the old code runs.
        source = Path(native.module_file(compiled[0])).with_name(
            compiled[0].rsplit(".", 1)[1] + ".py"
        )
        built = os.path.getmtime(native.module_file(compiled[0]))
        before = os.path.getmtime(source)
        os.utime(source, (before, built + 10))
        try:
            assert native.stale_modules() == [compiled[0]]
            assert "changed since it was compiled" in native.describe()
        finally:
            os.utime(source, (before, before))
    else:
        assert text.startswith("data plane: interpreted")
        assert native.stale_modules() == []


def test_compiled_modules_never_await_inside_except_or_finally() -> None:
    """Compiled (mypyc) coroutines that await inside an ``except`` or ``finally`` block
    can raise the exception being handled again after the await: a NOSCRIPT reply once
    failed its own retry that way. The compiled modules keep such awaits out."""
    found = []
    for name in native.HOT_MODULES:
        path = ROOT / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            blocks = []
            if isinstance(node, ast.ExceptHandler):
                blocks.append(node.body)
            if isinstance(node, ast.Try):
                blocks.append(node.finalbody)
            for block in blocks:
                for statement in block:
                    for inner in ast.walk(statement):
                        if isinstance(inner, ast.Await | ast.AsyncWith | ast.AsyncFor):
                            found.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    assert found == []


def test_compiled_f_strings_have_no_conversions_or_format_specs() -> None:
    """mypyc builds an f-string in one step only when every piece is a plain value; one
    ``!r`` or format spec (``:g``, ``:03d``) turns every piece of it into a
    ``str.format`` call, and the access log's JSON line took 1.9 us instead of 0.8
    (benchmarks/README.md, "Compiled f-strings"). Compiled modules spell those as
    ``repr(x)``, ``format(x, spec)`` or a lookup instead."""
    found = []
    for name in native.HOT_MODULES:
        path = ROOT / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                for piece in node.values:
                    if isinstance(piece, ast.FormattedValue) and (
                        piece.conversion != -1 or piece.format_spec is not None
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(piece)}")
    assert found == []

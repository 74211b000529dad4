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
        # The identity HMAC is built with them (setup.py), and said so.
        assert native.c_hmac(), text
        assert ", identity HMAC in C" in text
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
        assert not native.c_hmac() and text.endswith(", identity HMAC on hashlib")
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


# Built once per process: the dataclass's own __init__ is fine there.
BUILT_ONCE = {"Gateway"}


def test_compiled_dataclasses_made_per_request_write_out_their_init() -> None:
    """mypyc keeps a dataclass's generated ``__init__`` as Python code, ~3x the cost of a
    compiled one (190 vs 64 ns for three fields); the per-request dataclasses of the
    compiled modules define their own, which must take exactly the fields, in order,
    with the same defaults, and set each (the dataclass then keeps it)."""
    problems = []
    for name in native.HOT_MODULES:
        path = ROOT / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name in BUILT_ONCE:
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            if not any(d.startswith("dataclass") for d in decorators):
                continue
            if any("frozen=True" in d for d in decorators):
                continue  # made when rules or settings load, not per request
            where = f"{path.relative_to(ROOT)}:{node.name}"
            fields = [
                (item.target.id, None if item.value is None else item.value)
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            ]
            inits = [
                i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"
            ]
            if not inits:
                problems.append(f"{where}: no __init__ of its own")
                continue
            args = inits[0].args
            names = [a.arg for a in args.args[1:]]
            if names != [f for f, _ in fields]:
                problems.append(f"{where}: __init__ takes {names}, the fields are {fields}")
                continue
            defaults = [ast.unparse(d) for d in args.defaults]
            wanted = []
            for _, value in fields:
                if value is None:
                    continue
                if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
                    value = next(k.value for k in value.keywords if k.arg == "default")
                wanted.append(ast.unparse(value))
            if defaults != wanted:
                problems.append(f"{where}: defaults {defaults}, the fields' {wanted}")
            assigned = [ast.unparse(s) for s in inits[0].body if isinstance(s, ast.Assign)]
            if assigned != [f"self.{f} = {f}" for f, _ in fields]:
                problems.append(f"{where}: __init__ does not set each field from its argument")
    assert problems == []

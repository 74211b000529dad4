"""Build: the data plane's hot modules compiled to C with mypyc; everything else as is.

Why: after three rounds of profile-led trimming the per-request cost was spread over
parsing callbacks, header checks, rule selection, decision objects and head rebuilding,
none above a few percent; compiling the modules a request runs through cuts the CPU per
request where trimming could not (benchmarks/README.md, "Compiled data plane").

The modules stay ordinary, typed Python (``mypy --strict`` is what lets mypyc compile
them): change the .py, install again (``pip install -e .`` or ``scripts/test``) and the
change is compiled. ``GATEWAY_COMPILE=0`` builds without compiling (no C compiler needed);
so does any failure to compile, with a warning: the gateway then runs the same code
interpreted, only slower. ``gateway serve`` logs which of the two it runs.

One module is written in C by hand: the identity HMAC (``_identity_hmac.c``), whose
Python form was the largest single cost of a proxied request that mypyc could not cut
(hashlib's objects, not Python code: benchmarks/README.md, "Third round, eighth step").
It needs only Python's headers; if it fails to build, identities are hashed with
hashlib, to the same digests.
"""

from __future__ import annotations

import glob
import os
import runpy
import sys
from importlib.machinery import EXTENSION_SUFFIXES

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules every proxied or refused request runs through, as gateway/native.py lists
# them for the start-up log (read from there: one list).
HOT_MODULES = [
    name.replace(".", "/") + ".py" for name in runpy.run_path("gateway/native.py")["HOT_MODULES"]
]


# The identity HMAC in plain C (no library but Python's headers): the largest single cost
# of a proxied request in Python (gateway/ratelimit/_identity_hmac.c says why). Built
# whenever the data plane is compiled; identity.py uses hashlib without it.
# optional=True: setuptools then skips copying it into the tree (editable installs) when
# it was not built, where copying a missing file would fail the whole build_ext run, and
# run() below would drop the mypyc modules with it.
C_HMAC = Extension(
    "gateway.ratelimit._identity_hmac",
    ["gateway/ratelimit/_identity_hmac.c"],
    extra_compile_args=["-O3"],
    optional=True,
)


class OptionalBuildExt(build_ext):
    """Compile if possible. On any failure every compiled output is removed, so that no
    module is left compiled beside a missing shared library: all interpreted, or all
    compiled. The C HMAC stands alone: if it fails, only it is left out."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name != C_HMAC.name:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(
                f"WARNING: the identity HMAC could not be compiled ({type(exc).__name__}: "
                f"{exc}); the gateway hashes identities with hashlib instead (slower).",
                file=sys.stderr,
            )

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any compiler failure: fall back
            _fallback_warning(exc)
            for ext in self.extensions:
                for path in (
                    self.get_ext_fullpath(ext.name),
                    os.path.join(self.build_lib, self.get_ext_filename(ext.name)),
                ):
                    if os.path.exists(path):
                        os.remove(path)


def _fallback_warning(exc: BaseException) -> None:
    print(
        f"WARNING: the data plane could not be compiled ({type(exc).__name__}: {exc}); "
        "installing it interpreted (slower). Install a C compiler and the Python headers "
        "to compile it, or set GATEWAY_COMPILE=0 to skip this attempt.",
        file=sys.stderr,
    )


def _remove_old_builds() -> None:
    """An editable install leaves compiled modules beside their sources; they are removed
    first, so a build that falls back to interpreted code never runs an older compile."""
    for suffix in EXTENSION_SUFFIXES:
        for old in glob.glob(f"gateway/**/*{suffix}", recursive=True):
            os.remove(old)
        for old in glob.glob(f"*__mypyc{suffix}"):
            os.remove(old)


# setup.py also runs for metadata only (pip asks for it first): no compiling then.
_METADATA_ONLY = {"egg_info", "dist_info", "sdist", "--version", "--name"}


def _ext_modules() -> list[object]:
    if set(sys.argv[1:2]) <= _METADATA_ONLY and len(sys.argv) > 1:
        return []
    _remove_old_builds()
    if os.environ.get("GATEWAY_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        _fallback_warning(exc)
        return [C_HMAC]  # (it needs only Python's headers)
    # The build environment has mypy but not the project's dependencies: their types are
    # not needed to compile these modules (they are called through the Python API). No
    # mypy cache either: a checkout's .mypy_cache (from mypy runs with the dependencies
    # installed) would make a local build succeed where a clean one fails.
    # Not --allow-subclassing-any: a compiled class whose base is such an unknown type
    # is miscompiled (it crashed at run time), so that must fail the build instead.
    # And --no-site-packages: mypy would otherwise look for them in the site-packages of
    # the interpreter running the build, which holds them on a reinstall but not on a
    # first install from a clean clone (a build that passed locally once fell back there).
    options = [
        "--ignore-missing-imports",
        "--allow-untyped-calls",
        "--no-site-packages",
        "--cache-dir",
        os.devnull,
    ]
    try:
        compiled = list(mypycify([*options, *HOT_MODULES], opt_level="3", debug_level="1"))
    except BaseException as exc:  # mypyc exits (SystemExit) on type errors
        _fallback_warning(exc)
        compiled = []
    return [*compiled, C_HMAC]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})

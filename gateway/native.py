"""Which of the data plane's hot modules run compiled (mypyc, see setup.py), and whether
any compiled one is older than its source (edited since the last install: the old code
would run). ``gateway serve`` logs both at start-up."""

from __future__ import annotations

import importlib
import os
from importlib.machinery import EXTENSION_SUFFIXES

# setup.py compiles these (it reads this list; this module imports nothing but the
# standard library so that it can).
HOT_MODULES = (
    "gateway.proxy.server",
    "gateway.proxy.forwarding",
    "gateway.proxy.framing",
    "gateway.proxy.handler",
    "gateway.proxy.relay",
    "gateway.proxy.request",
    "gateway.proxy.wire",
    "gateway.proxy.batched_writes",
    "gateway.proxy.access_log",
    "gateway.proxy.upstream_pool",
    "gateway.proxy.request_id",
    "gateway.proxy.routing",
    "gateway.ratelimit.decision",
    "gateway.ratelimit.limiter",
    "gateway.ratelimit.identity",
    "gateway.ratelimit.window",
    "gateway.counters.memory",
    "gateway.policy.matcher",
    "gateway.policy.paths",
    "gateway.policy.model",
    "gateway.policy.uuid_readings",
    "gateway.counters.base",
    "gateway.ratelimit.ports",
    "gateway.counters.deny_cache",
    "gateway.counters.resilient",
    "gateway.counters.coalesce",
    "gateway.counters.redis_backend",
    "gateway.counters.cluster",
    "gateway.counters.resp",
    "gateway.proxy.plane",
    "gateway.metrics",
)


def module_file(name: str) -> str:
    return str(getattr(importlib.import_module(name), "__file__", "") or "")


def is_compiled(name: str) -> bool:
    return module_file(name).endswith(tuple(EXTENSION_SUFFIXES))


def compiled_modules() -> list[str]:
    return [name for name in HOT_MODULES if is_compiled(name)]


def stale_modules() -> list[str]:
    """Compiled modules whose .py beside them changed after they were built. Only in a
    source checkout (an editable install: setup.py beside the package), where the .py is
    what a developer edits; an installed wheel writes its files in no particular order."""
    package = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(os.path.dirname(package), "setup.py")):
        return []
    stale = []
    built_from = [(name, ".py") for name in compiled_modules()]
    if c_hmac():
        built_from.append((C_HMAC_MODULE, ".c"))
    for name, extension in built_from:
        built = module_file(name)
        source = os.path.join(os.path.dirname(built), name.rsplit(".", 1)[1] + extension)
        if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(built):
            stale.append(name)
    return stale


# The identity HMAC in C (setup.py builds it beside the compiled modules).
C_HMAC_MODULE = "gateway.ratelimit._identity_hmac"


def c_hmac() -> bool:
    """Whether the identity HMAC runs in C (else on hashlib, the same digests)."""
    try:
        importlib.import_module(C_HMAC_MODULE)
    except ImportError:
        return False
    return True


def _hmac_text() -> str:
    if not c_hmac():
        return "identity HMAC on hashlib"
    # Its SHA-256 blocks on the CPU's SHA extensions when it has them (_identity_hmac.c).
    sha_ni = getattr(importlib.import_module(C_HMAC_MODULE), "SHA_NI", 0)
    return "identity HMAC in C" + (" (SHA-NI)" if sha_ni else "")


def describe() -> str:
    """One line for the start-up log."""
    compiled = compiled_modules()
    hmac = _hmac_text()
    if not compiled:
        return f"data plane: interpreted (not compiled; see setup.py to compile it), {hmac}"
    text = (
        f"data plane: compiled with mypyc ({len(compiled)} of {len(HOT_MODULES)} modules), {hmac}"
    )
    stale = stale_modules()
    if stale:
        text += (
            f"; WARNING: {', '.join(stale)} changed since it was compiled and runs the old "
            "code: install again (pip install -e .)"
        )
    return text

"""Logging an exception without its message.

An exception's message may quote what a request carried: aiohttp's parser errors quote the
offending header line (an ``X-Api-Key`` with a control character logs the raw key), and a
database error may quote a value. Logs of the built-in APIs name the exception's type and
where it was raised, never its message (SECURITY.md: raw keys are never logged).
"""

from __future__ import annotations

import traceback


def exception_summary(exc: BaseException | None) -> str:
    """``exc``'s type and the frames it was raised through (file, line, function; no
    message, no values), innermost last, and the same for the exceptions it was raised from
    or during."""
    if exc is None:
        return "no exception"
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 5:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)
        where = " <- ".join(
            f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in reversed(frames)
        )
        kind = type(current)
        parts.append(f"{kind.__module__}.{kind.__qualname__}" + (f" at {where}" if where else ""))
        current = current.__cause__ or current.__context__
    return "; caused by ".join(parts)

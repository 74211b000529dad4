"""One fixed hypothesis profile for the fuzzing properties (``tests/unit/test_*_property.py``)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz(max_examples: int) -> settings:
    """Derandomized (the same examples on every run), no deadline, no example database,
    and a bounded number of examples, so every property runs in a few seconds."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )

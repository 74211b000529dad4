"""The two event loops the gateway runs on (asyncio's own and uvloop's, which ``gateway
serve`` uses; its transports are not ``asyncio.Transport`` subclasses), as a fixture:
a test taking ``run`` runs its scenario once on each."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

Runner = Callable[[Awaitable[Any]], Any]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]

"""A deterministic OpenAI-compatible embedding server on loopback, for tests and benchmarks.

``POST /v1/embeddings`` ``{"model", "input": [texts]}`` answers ``{"data": [{"index",
"embedding"}], ...}`` like the real API. A text's vector counts its words in hashed buckets
after mapping each word to its synonym group (``espresso``, ``coffee`` and ``latte`` share a
bucket), so meaning-level matches are exact and predictable: "espresso" is close to "dark
roast coffee" and far from "car repair".

Faults are injected through attributes: ``fail_next`` (answer 503 that many times),
``status_override`` (answer that status every time), ``delay_seconds`` (sleep before each
answer), and every request is recorded (``requests``: the list of input batches).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# Synonym groups: each word maps to its group's first word.
SYNONYM_GROUPS: tuple[tuple[str, ...], ...] = (
    ("coffee", "espresso", "latte", "cappuccino", "roast", "barista", "caffeine", "brew"),
    ("tea", "chai", "matcha", "oolong", "earl"),
    ("car", "vehicle", "automobile", "sedan", "engine", "mechanic", "tyre", "tire"),
    ("dog", "puppy", "canine", "hound", "terrier"),
    ("cat", "kitten", "feline", "tabby"),
    ("run", "running", "jog", "jogging", "marathon", "sprint"),
    ("swim", "swimming", "pool", "freestyle"),
    ("sad", "unhappy", "depressed", "gloomy", "down"),
    ("happy", "cheerful", "joyful", "glad"),
    ("money", "cash", "budget", "salary", "finance", "savings", "invest"),
    ("doctor", "physician", "clinic", "medical", "nurse", "hospital"),
    ("music", "song", "guitar", "piano", "concert", "melody"),
    ("travel", "trip", "flight", "vacation", "holiday", "journey"),
    ("cook", "cooking", "recipe", "bake", "baking", "kitchen"),
    ("code", "programming", "python", "software", "developer", "bug"),
    ("sleep", "insomnia", "nap", "bedtime", "tired"),
    ("book", "novel", "reading", "author", "library"),
    ("weather", "rain", "sunny", "forecast", "storm"),
)
_CANONICAL = {word: group[0] for group in SYNONYM_GROUPS for word in group}
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    [
        "a",
        "an",
        "and",
        "the",
        "of",
        "to",
        "in",
        "is",
        "it",
        "for",
        "on",
        "with",
        "my",
        "me",
        "i",
        "what",
        "does",
        "do",
        "like",
    ]
)


def _bucket(word: str, dims: int) -> int:
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % dims


def embed_text(text: str, dims: int) -> list[float]:
    """The deterministic vector of ``text`` (not normalised; the Store normalises)."""
    vector = [0.0] * dims
    for word in _WORD.findall(text.lower()):
        if word in _STOP:
            continue
        # Words outside every group count a little, so exact words still tell texts apart.
        canonical = _CANONICAL.get(word)
        if canonical is not None:
            vector[_bucket("group:" + canonical, dims)] += 1.0
        else:
            vector[_bucket("word:" + word, dims)] += 0.3
    if not any(vector):
        vector[0] = 1e-3  # never the zero vector
    return vector


@dataclass
class EmbeddingServer:
    """The server's state and its fault switches."""

    dims: int = 64
    fail_next: int = 0
    status_override: int | None = None
    delay_seconds: float = 0.0
    requests: list[list[str]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        texts = body["input"]
        if isinstance(texts, str):
            texts = [texts]
        self.requests.append(list(texts))
        self.authorizations.append(request.headers.get("Authorization"))
        if self.delay_seconds:
            await asyncio.sleep(self.delay_seconds)
        if self.status_override is not None:
            return web.json_response({"error": "forced"}, status=self.status_override)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"error": "temporarily down"}, status=503)
        data = [
            {"object": "embedding", "index": i, "embedding": embed_text(t, self.dims)}
            for i, t in enumerate(texts)
        ]
        # Answered in reverse order: clients must order by "index", not by position.
        return web.json_response(
            {"object": "list", "data": data[::-1], "model": body.get("model", "")}
        )

    @property
    def texts_embedded(self) -> int:
        return sum(len(batch) for batch in self.requests)

    async def start(self) -> EmbeddingServer:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

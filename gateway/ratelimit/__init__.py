"""Pure rate-limit decision logic: no aiohttp, no Redis, time is always injected."""

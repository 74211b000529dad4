"""The aiohttp side: request handling, forwarding, admin endpoints, hot reload."""

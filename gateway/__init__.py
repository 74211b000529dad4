"""Rate-limiting gateway: sliding-window limits in front of an API, plus built-in upstreams."""

__version__ = "0.1.0"

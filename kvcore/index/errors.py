"""Errors an index backend raises at its edge."""
from __future__ import annotations


class IndexUnavailable(RuntimeError):
    """The index cannot be reached right now (e.g. Redis down or timing out).

    Raised by every method of a networked backend (:class:`kvcore.index.redis.RedisIndex`) instead
    of the client library's own errors, so callers handle one type: the gateway catches it around
    ``match()`` and routes on load alone for that request; the agent keeps its own state and
    republishes it once the index answers again. The backend recovers by itself (the next call
    after ``retry_after_s`` tries the server again); the in-memory backend never raises it.
    """

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


class IndexEncodingMismatch(IndexUnavailable):
    """The shared index holds block keys of another encoding version than this process computes
    (:data:`kvcore.block_keys.ENCODING_VERSION`), so none of its keys could ever match ours.

    ``key``: the Redis key holding the index's version; ``stored``: the version found there (as
    text); ``expected``: this process's version. Raised by :meth:`kvcore.index.redis.RedisIndex.open`
    (called at start-up: the gateway and the agent refuse to start on it) and, if the index first
    answered later, by every call, as a subclass of :class:`IndexUnavailable`, so that a running
    process treats the index as unusable (routes on load alone, writes nothing) instead of
    mixing encodings. The message says what to do.
    """

    def __init__(self, url: str, key: str, stored: str, expected: int) -> None:
        self.url = url
        self.key = key
        self.stored = stored
        self.expected = expected
        namespace = key.rsplit(":meta:", 1)[0]
        super().__init__(
            f"redis index {url}: block-key encoding mismatch: the index holds keys of encoding version "
            f"{stored} (key {key!r}), this kvroute computes version {expected}, so no key would ever "
            f"match. Run the same kvroute release on every gateway and agent sharing this index; to "
            f"move the index to version {expected}, stop them all, delete its keys "
            f"(redis-cli -u {url} --scan --pattern '{namespace}:*' | xargs redis-cli -u {url} del) "
            f"and start them on the new release (agents republish their state by themselves).")

    def again(self) -> IndexEncodingMismatch:
        """A new error saying the same (raised again by each call until the next check)."""
        return IndexEncodingMismatch(self.url, self.key, self.stored, self.expected)


class IndexLayoutMismatch(IndexEncodingMismatch):
    """The shared index is laid out otherwise than this process is configured for: a cluster
    index's partition count differs (``key``: the Redis key holding it; ``stored``/``expected``:
    the two counts), or cluster mode does not match the server (a standalone index on a Redis
    Cluster node, ``cluster: true`` on a standalone server). Handled as an encoding mismatch (the
    gateway and the agent refuse to start on it); ``message`` says what to change."""

    def __init__(self, url: str, key: str, stored: str, expected: object, message: str) -> None:
        IndexUnavailable.__init__(self, message)
        self.url = url
        self.key = key
        self.stored = stored
        self.expected = expected  # type: ignore[assignment]
        self.message = message

    def again(self) -> IndexLayoutMismatch:
        return IndexLayoutMismatch(self.url, self.key, self.stored, self.expected, self.message)

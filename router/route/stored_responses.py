"""Which worker holds each stored Responses API response, so a request continuing one
(``previous_response_id``) goes there.

vLLM keeps a stored response (and the messages it came from) in the memory of the server that
made it (``VLLM_ENABLE_RESPONSES_API_STORE=1``; ``responses/serving.py``'s ``response_store`` and
``msg_store``): any other worker answers 404 for it. The gateway reads each 200 answer's response
id from its first bytes (a non-streamed body's top-level ``id``; a stream's ``response.created``
event, whose ``response.id`` comes first) and keeps the latest ``capacity`` ids, least recently
used dropped first. Per gateway process: a continuation reaching another process is routed as
any other request. Pure: no I/O.
"""
from __future__ import annotations

import re
from collections import OrderedDict

DEFAULT_CAPACITY = 65536
# vLLM's ids: "resp_" and a hex uuid (or the request's own request_id); the first "id" of the answer
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_.:-]{1,200})"')


class StoredResponses:
    """``response id -> worker id`` for the latest ``capacity`` answers."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._workers: OrderedDict[str, str] = OrderedDict()

    def learn(self, worker_id: str, answer: bytes) -> str | None:
        """Record the response id in ``answer`` (the first bytes of a worker's 200 answer) as held
        by ``worker_id``; returns the id, None when there is none."""
        found = _RESPONSE_ID.search(answer)
        if found is None:
            return None
        response_id = found.group(1).decode()
        self._workers[response_id] = worker_id
        self._workers.move_to_end(response_id)
        while len(self._workers) > self.capacity:
            self._workers.popitem(last=False)
        return response_id

    def worker_of(self, response_id: str) -> str | None:
        """The worker that made ``response_id``, None when unknown."""
        worker = self._workers.get(response_id)
        if worker is not None:
            self._workers.move_to_end(response_id)
        return worker

    def __len__(self) -> int:
        return len(self._workers)

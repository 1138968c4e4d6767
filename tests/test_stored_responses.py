"""router.route.stored_responses: response ids read from a worker's first answer bytes, bounded."""
from __future__ import annotations

import pytest

from router.route.stored_responses import StoredResponses


def test_ids_from_a_body_and_a_stream_first_event_and_the_oldest_dropped():
    store = StoredResponses(capacity=2)
    assert store.learn("w0", b'{"id":"resp_a1","object":"response","output":[{"id":"msg_x"}]}') == "resp_a1"
    event = (b'event: response.created\ndata: {"response":{"id":"resp_b2","status":"in_progress"},'
             b'"type":"response.created","sequence_number":0}\n\n')
    assert store.learn("w1", event) == "resp_b2"
    assert store.learn("w1", b'{"error":{"message":"x"}}') is None
    assert (store.worker_of("resp_a1"), store.worker_of("resp_b2")) == ("w0", "w1")
    assert store.worker_of("resp_a1") == "w0"  # used after resp_b2 now
    store.learn("w0", b'{"id": "resp_c3"}')  # so resp_b2, the least recently used, goes
    assert (store.worker_of("resp_b2"), store.worker_of("resp_a1"), store.worker_of("resp_c3"), len(store)) == (
        None, "w0", "w0", 2)
    with pytest.raises(ValueError):
        StoredResponses(capacity=0)

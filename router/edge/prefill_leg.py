"""The prefill leg of a split request (I/O; the choice and the bodies are :mod:`router.route.pd`).

The gateway sends :func:`router.route.pd.prefill_body` to the prefill worker (same path, the client's
headers, ``x-request-id: <client's>-prefill``) and waits for its whole answer, within
``policy.pd.prefill_timeout_s`` (:mod:`router.policies.pd`; null: ``timeouts.first_byte_s``).
Then:

- 200 with a ``kv_transfer_params`` object: :attr:`PrefillResult.params` carries it to the decode
  leg (the caller relays the client's body with it to the decode worker);
- a 4xx: the worker refused the client's input (vLLM's decode worker would give the same
  error): relayed to the client as it is (``x-kvroute-worker`` names the prefill worker);
- a connect error (counted against the worker's health as a failed probe), no answer within the
  timeout (the connection is closed: vLLM aborts the request), a broken connection, a 5xx, a 200 without the params: :attr:`PrefillResult.params` is None and the
  caller serves the request whole on the decode worker.

While the leg runs the prefill worker counts the request in flight with its predicted uncached
tokens (released in every path); the prompt's keys are recorded there as speculative index
entries (its KV events confirm them), the new ones withdrawn when it refuses the connection or
the request (:func:`router.relay.upstream.refused_status`, :meth:`router.route.planner.Router.withdraw`).
Cancelling the task (the client went away) closes the connection, which makes vLLM abort the
request and free the blocks it holds for the decode side.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.relay.stream_usage import cached_tokens_of_body
from router.relay.upstream import ClientState, client_headers, for_rank, refused_status, upstream_headers
from router.route.context import RequestContext
from router.route.pd import prefill_body, transfer_params
from router.upstream_http import UpstreamConnectError, UpstreamError, UpstreamResponse
from router.workers.registry import InFlight

if TYPE_CHECKING:
    from router.gateway import Gateway

log = logging.getLogger("kvroute.pd")


@dataclass
class PrefillResult:
    """``params``: the prefill worker's ``kv_transfer_params`` (None: serve the request whole);
    ``answered``: the worker's 4xx went to the client (nothing more to do); ``detail``: why the
    leg failed, for the log; ``cached_tokens``: the prefill worker's reported prefix hit (tokens;
    None when its answer carried none)."""

    params: dict[str, Any] | None = None
    answered: bool = False
    detail: str = ""
    cached_tokens: int | None = None


async def prefill_leg(gw: Gateway, send, state: ClientState, ctx: RequestContext,
                      on_answer: Callable[[InFlight], None] | None = None,
                      on_usage: Callable[[InFlight, int], None] | None = None,
                      on_begin: Callable[[], None] | None = None) -> PrefillResult:
    """Run the prefill leg of ``ctx.plan`` (split: ``plan.pd.prefill`` set) for the client's body
    (a ``chat`` or ``completion`` request); see the module docstring. ``on_answer(handle)``: the
    200 answer with params arrived
    (its time from dispatch is the prefill worker's TTFT, ``handle.ttft_ms``);
    ``on_usage(handle, n)``: that answer reported ``n`` cached prompt tokens; ``on_begin()``: the
    leg is counted in flight on the prefill worker (the dispatch queue's reservation may go)."""
    pplan = ctx.plan.pd.prefill
    reg = pplan.workers[pplan.decision.worker_id]
    payload = prefill_body(ctx.body, ctx.kind)
    request_id = ctx.request_id
    timeout_s = gw.router.policy.policy.pd.prefill_timeout_s or gw.upstream.timeouts.first_byte_s
    await gw.router.commit(pplan, reg, count_use=False)
    handle = reg.begin(pplan.uncached_tokens(reg.id), pplan.predicted_ttft_ms(reg.id))
    if on_begin is not None:
        on_begin()
    resp: UpstreamResponse | None = None
    done = False
    try:
        try:
            async with asyncio.timeout(timeout_s):
                leg_headers = for_rank(upstream_headers(ctx.headers, f"{request_id}-prefill"), reg)
                resp = await gw.upstream.http.request(ctx.method, reg.url + ctx.path, leg_headers, payload)
                answer = await resp.read()
        except TimeoutError:  # a connect timeout too (as aiohttp's ConnectionTimeoutError was)
            # the leg's connection is closed; its transport lets the worker know on the loop's next
            # turn: let it, so the worker sees the cancel before the decode leg goes out
            await asyncio.sleep(0)
            return _failed(request_id, reg.id, f"no answer in {timeout_s:g} s")
        except UpstreamConnectError as exc:  # refused or unreachable (a connect timeout is above)
            health = gw.upstream.health
            reg.record_probe(False, health.fail_threshold, health.rise_threshold, str(exc))
            await gw.router.withdraw(pplan, reg)
            return _failed(request_id, reg.id, f"{type(exc).__name__}: {exc}")
        except UpstreamError as exc:
            return _failed(request_id, reg.id, f"{type(exc).__name__}: {exc}")
        done = True
        handle.first_byte()
        status = resp.status
        gw.metrics.record_response(reg.id, status, time.perf_counter() - ctx.t0)
        if refused_status(status):  # it computed none of the prompt
            await gw.router.withdraw(pplan, reg)
        if 400 <= status < 500:
            state.response_started = True
            await send({"type": "http.response.start", "status": status,
                        "headers": client_headers(resp.raw_headers, reg.id, request_id, len(answer))})
            state.response_done = True
            await send({"type": "http.response.body", "body": answer, "more_body": False})
            return PrefillResult(answered=True)
        if status != 200:
            return _failed(request_id, reg.id, f"HTTP {status}")
        params = transfer_params(answer)
        if params is None:
            return _failed(request_id, reg.id, "answer without a kv_transfer_params object")
        if on_answer is not None:
            on_answer(handle)
        cached = cached_tokens_of_body(answer)
        if cached is not None and on_usage is not None:
            on_usage(handle, cached)
        return PrefillResult(params, cached_tokens=cached)
    finally:
        handle.finish()
        if resp is not None:
            resp.release() if done else resp.close()


def _failed(request_id: str, worker_id: str, detail: str) -> PrefillResult:
    log.warning("request %s: prefill leg on %s failed (%s); serving it whole on the decode worker",
                request_id, worker_id, detail)
    return PrefillResult(detail=detail)

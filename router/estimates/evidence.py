"""Whether a worker's prefix evidence (its index entries) can be trusted, judged by what the
worker itself reports.

For every completed request the gateway knows the cached tokens it predicted from the index and
the ``usage.prompt_tokens_details.cached_tokens`` vLLM reported. Over the last :data:`WINDOW`
requests for which something was predicted::

    agreement = sum(min(reported, predicted)) / sum(predicted)

Below ``distrust_below`` (0.25) the worker's evidence is *distrusted*: policies stop crediting its
matches (its requests are still predicted and compared, so agreement is watched all the time);
at ``trust_at`` (0.5) or above it is trusted again. The two thresholds are apart so that a worker
near one of them does not flap. They are low on purpose: under heavy KV pressure a real worker
evicts part of a matched prefix between the routing decision and its prefill, so a healthy
worker's agreement can sit near one half, and a half-realised hit is still worth crediting; the
failures this is for leave almost nothing (figures: docs/tuning/evidence_trust.md). At least
:data:`MIN_PREDICTED_REQUESTS` requests and :data:`MIN_PREDICTED_TOKENS` predicted tokens are
needed before a judgement: a single eviction race must not cost a worker its credit. Reports
above the prediction (vLLM found more than the index knew) count as agreement: the index lagging
is not a reason to distrust it.

Causes this catches: an event endpoint nobody publishes on while speculative entries live,
events lost or stale, a wrong worker URL for an events endpoint, a block-hash mismatch (a
tokenizer or chat template that differs from the worker's). Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 32
MIN_PREDICTED_REQUESTS = 8
MIN_PREDICTED_TOKENS = 256


class EvidenceTrust:
    """Predicted-vs-reported agreement of one worker, with hysteresis (module docstring)."""

    def __init__(self, distrust_below: float = 0.25, trust_at: float = 0.5, window: int = WINDOW) -> None:
        if not 0.0 <= distrust_below <= trust_at <= 1.0:
            raise ValueError("need 0 <= distrust_below <= trust_at <= 1")
        self.distrust_below = distrust_below
        self.trust_at = trust_at
        self._pairs: deque[tuple[int, int]] = deque(maxlen=window)
        self._agreement: float | None = None  # of the window as it stands (it changes in observe only)
        self.trusted = True
        self.changes = 0

    def observe(self, predicted_tokens: int, reported_tokens: int) -> bool | None:
        """Book one request; returns the new ``trusted`` value when it changed, else None.
        Requests with nothing predicted are ignored (they say nothing about the index)."""
        if predicted_tokens <= 0:
            return None
        self._pairs.append((predicted_tokens, max(0, reported_tokens)))
        predicted = sum(p for p, _ in self._pairs)
        if len(self._pairs) < MIN_PREDICTED_REQUESTS or predicted < MIN_PREDICTED_TOKENS:
            self._agreement = None
        else:
            self._agreement = sum(min(p, r) for p, r in self._pairs) / predicted
        ratio = self._agreement
        if ratio is None:
            return None
        if self.trusted and ratio < self.distrust_below:
            self.trusted = False
        elif not self.trusted and ratio >= self.trust_at:
            self.trusted = True
        else:
            return None
        self.changes += 1
        return self.trusted

    @property
    def agreement(self) -> float | None:
        """``sum(min(reported, predicted)) / sum(predicted)`` over the window, None until enough
        has been predicted to judge."""
        return self._agreement

    @property
    def credit_weight(self) -> float:
        """The share of a predicted prefix hit this worker is expected to realise: 0 while
        distrusted, the agreement once judged (a worker under KV pressure evicts part of a
        matched prefix before its prefill), 1 before a judgement."""
        if not self.trusted:
            return 0.0
        agreement = self.agreement
        return 1.0 if agreement is None else min(1.0, agreement)

    def state(self) -> dict[str, Any]:
        """For ``GET /admin/workers``: trusted, agreement (None before a judgement), window size,
        how many times trust changed."""
        agreement = self.agreement
        return {"trusted": self.trusted,
                "agreement": None if agreement is None else round(agreement, 3),
                "credit_weight": round(self.credit_weight, 3),
                "requests": len(self._pairs), "changes": self.changes}

"""What a routed request teaches the gateway once its worker answers: the first token's TTFT
against the policy's prediction (metrics) and against the work the request met, which teaches
the worker's prefill rate (:mod:`router.estimates.prefill_rate`); the reported cached tokens
against the index's prediction, which teaches the worker's evidence trust
(:mod:`router.estimates.evidence`). Both also go to the request's decision log entry."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from router.estimates.prefill_rate import work_tokens
from router.route.decision_log import DecisionEntry, DecisionLog

if TYPE_CHECKING:
    from router.route.plan import RoutePlan
    from router.telemetry.metrics import GatewayMetrics
    from router.workers.registry import InFlight, WorkerRegistry

log = logging.getLogger("kvroute.endpoints")


class Feedback:
    """Learns from answers into the workers of ``registry`` and the ``metrics``. Its methods
    never raise (a bookkeeping bug must never break a response: logged)."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    def first_token(self, plan: RoutePlan, handle: InFlight, logged: DecisionEntry | None = None) -> None:
        """A streamed request's first token (``handle.ttft_ms``). The work it met is the figure
        the policy predicted with for that worker (the same terms, so the learned rate is the one
        the prediction needs); a policy that predicts no TTFT leaves the gateway's own figures
        (queue at dispatch, predicted uncached prompt, decodes). Learned at the first token rather
        than at the end, so a decode's length never delays it; a lasting change of speed shows in
        the fit once it holds about half of its window (some 30 requests). Skipped while the
        worker's evidence is distrusted (the own-prefill figure would be wrong)."""
        try:
            reg = handle.reg
            DecisionLog.first_token(logged, handle.ttft_ms)
            if handle.ttft_ms is None or plan.blocks is None or plan.blocks.token_ids is None:
                return
            predicted_ms = plan.predicted_ttft_ms(reg.id)
            if predicted_ms is not None:
                self.metrics.record_ttft_prediction(reg.id, predicted_ms, handle.ttft_ms)
            if not reg.evidence.trusted:
                return
            work = plan.predicted_work_tokens(reg.id)
            if work is None:
                work = work_tokens(handle.queued_tokens, plan.uncached_tokens(reg.id), handle.decoding)
            reg.prefill_rate.observe(work, handle.ttft_ms)
            self.registry.model_rate(reg.model).observe(work, handle.ttft_ms)
        except Exception:
            log.exception("TTFT bookkeeping failed for worker %s", handle.reg.id)

    def usage(self, plan: RoutePlan, handle: InFlight, actual: int, logged: DecisionEntry | None = None) -> None:
        """The worker reported ``actual`` cached prompt tokens. For single-prompt requests (a
        completions body with several prompts reports their sum, while the prediction covers the
        first): predicted vs reported (metrics, and the worker's evidence trust, with a warning
        when it changes)."""
        try:
            DecisionLog.usage(logged, actual)
            self._usage(plan, handle, actual)
        except Exception:
            log.exception("usage bookkeeping failed for worker %s", handle.reg.id)

    def _usage(self, plan: RoutePlan, handle: InFlight, actual: int) -> None:
        reg = handle.reg
        predicted = plan.predicted_cached_tokens(reg.id)
        if predicted is None or len(plan.blocks.token_ids) != 1:
            return
        self.metrics.record_cached_tokens(reg.id, predicted, actual)
        changed = reg.evidence.observe(predicted, actual)
        if changed is False:
            self.metrics.evidence_distrust.labels(reg.id).inc()
            log.warning("worker %s: reported cached tokens run far below the index's predictions "
                        "(agreement %s); its prefix evidence is no longer credited", reg.id,
                        reg.evidence.state()["agreement"])
        elif changed is True:
            log.info("worker %s: reported cached tokens agree with the index again; its prefix "
                     "evidence is credited", reg.id)

"""When each request of a workload is sent: the arrival process (pure; no I/O).

- ``trace``: at the workload's own ``arrival_s`` (trace timestamps / time scale);
- ``rate``: a Poisson process of ``rate`` requests/s (exponential gaps, seeded), in workload order;
- ``concurrency``: closed loop, ``concurrency`` requests in flight, the next sent as one ends.

Under every process a request with ``after`` set is also held until that request has finished
(a conversation's next turn follows its previous one).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvbench.workload import Workload


@dataclass(frozen=True)
class Arrivals:
    """The arrival process: ``kind`` is ``"trace"``, ``"rate"`` or ``"concurrency"``; ``rate`` in
    requests/s; ``concurrency`` requests in flight; ``seed`` for the Poisson gaps."""

    kind: str
    rate: float = 0.0
    concurrency: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("trace", "rate", "concurrency"):
            raise ValueError(f"unknown arrival process {self.kind!r}")
        if self.kind == "rate" and self.rate <= 0:
            raise ValueError("--rate must be > 0")
        if self.kind == "concurrency" and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")

    def describe(self) -> str:
        return {"trace": "trace timestamps", "rate": f"Poisson {self.rate:g} req/s",
                "concurrency": f"closed loop, concurrency {self.concurrency}"}[self.kind]

    def send_times_s(self, workload: Workload) -> list[float] | None:
        """Scheduled send time of each request from the start (s), or None for the closed loop.
        Raises ValueError for ``trace`` timing on a workload without arrival times."""
        if self.kind == "concurrency":
            return None
        if self.kind == "trace":
            times = [r.arrival_s for r in workload.requests]
            if any(t is None for t in times):
                raise ValueError(f"the {workload.name} workload has no timestamps: use --rate or --concurrency")
            return [float(t) for t in times]
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in workload.requests:
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

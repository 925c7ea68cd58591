"""Whose fault a worker's death is: the batch in its engine's (a poison batch) or its surroundings'.

A worker that dies with a request in its engine may have been killed by that request (a row that exhausts memory,
an input that crashes a kernel), and a poison batch must not kill every worker in turn: so its death counts against
the request, and a request charged ``--max-attempts`` times is failed. But the broker cannot tell a crash from an
operator's SIGKILL, a lost node, a preemption or the OOM killer acting for another process: all look like a worker
falling silent. So a death is taken for the batch's own only while nothing says otherwise. Three things say so:

- a worker died holding no request: workers are dying for a reason of their own;
- a request charged with a death was then served: that death was not its fault;
- a worker forgotten as dead registered again: it was frozen, not dead.

Each is evidence of churn for the service. For ``--churn-window`` after it, deaths charge no request: a batch is
failed as poison only by deaths that nothing explains. What stays unexplained, and so charged, is a run of deaths each
with the same request in its engine and none of the three between: that is what a poison batch looks like, and an
outside killer that picked that request's worker ``--max-attempts`` times in a row looks the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("draftfeed.broker")


class DeathJudge:
    """Per service, the last evidence that its workers die for reasons not their batches' own."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.clock = clock
        self._churn_seen: dict[str, float] = {}

    def churn(self, service: str, evidence: str) -> None:
        """Evidence that the service's workers die for reasons of their own: deaths charge nothing for a while."""
        now = self.clock()
        if not self.churning(service):
            log.info("broker: service %r: %s; workers' deaths charge no request for %.0f s (--churn-window)", service, evidence, self.window_s)
        self._churn_seen[service] = now

    def churning(self, service: str) -> bool:
        """Whether deaths in the service are explained by churn now (and so are no request's fault)."""
        seen = self._churn_seen.get(service)
        return seen is not None and self.clock() - seen <= self.window_s

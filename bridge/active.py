"""How many of the bridge's jobs are in the scheduler, against ``HPC_MAX_ACTIVE_JOBS``.

A job is active from its submission until reconciliation sees it end (ledger state ``submitted``,
``job_ended`` false); a request that continues itself in a successor stays one active job. At the
cap a new request is not submitted: it waits in the request queue (:class:`Intake` defers it without
running the ``HPC_DEFER_LIMIT`` clock) until a job ends, so a site's submit limit is never met and
nothing is answered with an error for it.

Counting reads the whole ledger, so the count is kept for the rest of the pass (``new_pass``, called
by the runner at the start of each) or at most ``refresh_s``; each submission of this process adds
one at once. A count that is stale can only be too high (a job ended since): a request then waits
one more pass, never goes over the cap.
"""

from __future__ import annotations

import time

import structlog

from bridge.ledger import Ledger, RequestState

log = structlog.get_logger(__name__)


class ActiveJobs:
    def __init__(self, ledger: Ledger, cap: int, *, refresh_s: float = 10.0) -> None:
        self.ledger = ledger
        self.cap = cap
        self.refresh_s = refresh_s
        self._count: int | None = None
        self._counted_at = 0.0
        self._logged = False

    def new_pass(self) -> None:
        """Count afresh when next asked, and log the cap again (once per pass)."""
        self._count = None
        self._logged = False

    def count(self) -> int:
        """Jobs of the bridge's requests that the scheduler holds (pending, running, held for a successor)."""
        if self._count is None or time.monotonic() - self._counted_at > self.refresh_s:
            self._count = sum(
                1 for r in self.ledger.all() if r.state is RequestState.SUBMITTED and r.job_id and not r.job_ended
            )
            self._counted_at = time.monotonic()
        return self._count

    def full(self) -> bool:
        """Whether no more job may be submitted now (never with ``cap`` 0: no cap). Logs
        ``max_active_jobs_reached`` the first time in a pass that it says so."""
        if self.cap <= 0:
            return False
        active = self.count()
        if active < self.cap:
            return False
        if not self._logged:
            self._logged = True
            log.info("max_active_jobs_reached", active=active, cap=self.cap)
        return True

    def submitted(self) -> None:
        """One more job (this process just submitted it)."""
        if self._count is not None:
            self._count += 1

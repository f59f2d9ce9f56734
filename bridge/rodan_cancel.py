"""Rodan 3: a run cancelled, deleted or retried in Rodan ends its cluster jobs (docs/design-rodan3.md,
"Cancel and Retry").

Rodan 3.1.0 runs no code of ours on Cancel: it sets the RunJob to CANCELLED and revokes its Celery
task. So the bridge, which holds a Rodan token, asks Rodan about each generation-3 request it
watches (``GET /api/runjob/<uuid>/``, at most every ``HPC_RODAN_CHECK_INTERVAL`` per request, from the
reconciliation pass). A RunJob that is CANCELLED, FAILED, FINISHED or gone will never read a reply,
so the request is *cancelled by Rodan*:

- its jobs are cancelled (``scancel`` / ``qdel``: the watched job, every earlier one, and any job of
  its name, which finds a successor that a continuation has just submitted);
- the ledger records the state ``cancelled_by_rodan`` with the reason; no reply is ever published
  (one already staged is dropped, one the worker stages later is dropped by the outbox's flush);
- the run directory's ``inputs/`` and ``checkpoints/`` and the parameter file go once the job has
  ended (the log, any models and the TensorBoard events stay for the operator).

Rodan's Retry dispatches the same RunJob again; the job package then publishes a new attempt
(``<RunJob uuid>.<n>``, header ``x-rodan-runjob``). Its arrival supersedes every earlier attempt of the
RunJob still open here (:meth:`RodanCancels.supersede`), whose reply the job package no longer reads.

Older generations carry no RunJob and are never asked about. The run's reply queue and Rodan-side
state are the job package's to remove (rodan_job/README.md).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path
from uuid import UUID

import structlog

from bridge.config import BridgeConfig
from bridge.errors import BridgeError, SchedulerUnavailable, TransientError
from bridge.handoff import TRANSIENT_RUN_FOLDERS
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import Scheduler
from bridge.spool import Spool, read_json

log = structlog.get_logger("bridge.rodan_cancel")

#: The AMQP header of a generation-3 request that names its RunJob (docs/protocol.md §2.5).
RUNJOB_HEADER = "x-rodan-runjob"
#: How many earlier attempts of one RunJob a new attempt looks for in the ledger.
MAX_ATTEMPTS_LOOKED_AT = 100


class RunJobStatus(IntEnum):
    """Rodan 3.1.0's RunJob status codes (``rodan.constants.task_status``)."""

    FAILED = -1
    SCHEDULED = 0
    PROCESSING = 1
    WAITING_FOR_INPUT = 2
    FINISHED = 4
    CANCELLED = 9


#: The RunJob statuses of a run that waits for its reply (any other status: nobody will read it).
WAITING = frozenset({RunJobStatus.SCHEDULED, RunJobStatus.PROCESSING, RunJobStatus.WAITING_FOR_INPUT})


def runjob_of(correlation_id: str, header: str | None = None) -> str:
    """The RunJob uuid of a generation-3 request: its ``x-rodan-runjob`` header, else the correlation
    id's (``<uuid>`` for a first attempt, ``<uuid>.<n>`` for a Retry's); "" when neither is one."""
    for text in (header or "", correlation_id.split(".", 1)[0]):
        try:
            return str(UUID(text))
        except ValueError:
            continue
    return ""


def attempt_of(correlation_id: str) -> int:
    """1 for ``<uuid>``, n for ``<uuid>.<n>``; 0 when the correlation id is not of that form."""
    head, _, tail = correlation_id.partition(".")
    try:
        UUID(head)
    except ValueError:
        return 0
    if not tail:
        return 1
    return int(tail) if tail.isdigit() and int(tail) >= 2 else 0


class RodanCancels:
    """Ends the cluster side of generation-3 requests whose run Rodan no longer runs."""

    def __init__(
        self,
        config: BridgeConfig,
        spool: Spool,
        ledger: Ledger,
        scheduler: Scheduler,
        replies: ReplyBox,
        rodan: RodanClient,
    ) -> None:
        self.config = config
        self.spool = spool
        self.ledger = ledger
        self.scheduler = scheduler
        self.replies = replies
        self.rodan = rodan

    # --- asking Rodan ----------------------------------------------------------------------------
    def check(self, records: Iterable[RequestRecord], now: float | None = None) -> int:
        """Ask Rodan about each open generation-3 request whose last question is older than
        HPC_RODAN_CHECK_INTERVAL; cancel those whose RunJob will never read a reply. Returns how many
        were cancelled. Rodan unreachable: nothing changes (asked again next pass)."""
        interval = self.config.rodan_check_interval_s
        if interval <= 0:
            return 0
        now = time.time() if now is None else now
        cancelled = 0
        for record in records:
            if not record.rodan_runjob or record.state.is_final or now - record.rodan_checked_at < interval:
                continue
            with structlog.contextvars.bound_contextvars(correlation_id=record.correlation_id):
                try:
                    status = self.rodan.runjob_status(record.rodan_runjob)
                except TransientError as exc:
                    log.warning("rodan_check_failed", runjob=record.rodan_runjob, error=str(exc))
                    return cancelled  # Rodan is down or busy: every other question waits too
                except BridgeError as exc:
                    log.error("rodan_check_refused", runjob=record.rodan_runjob, error=str(exc))
                    record.rodan_checked_at = now
                    self.ledger.save(record)
                    continue
                record.rodan_checked_at = now
                why = self._why_over(record, status)
                if why is None:
                    self.ledger.save(record)
                    continue
                cancelled += self.cancel(record, why, rodan_status=_status_word(status))
        return cancelled

    def _why_over(self, record: RequestRecord, status: int | None) -> str | None:
        """Why the run will never read a reply, or None while it waits (or cannot be told)."""
        if status is None:
            if not record.rodan_seen:
                # Rodan answers 404 to an account that may not view the RunJob as well as for one
                # that is gone: only a RunJob seen before is known to be deleted.
                log.warning(
                    "rodan_runjob_unseen",
                    runjob=record.rodan_runjob,
                    note="Rodan shows no such RunJob to the bridge's account: cancels in Rodan cannot reach "
                    "this run's jobs (give the account view rights on the projects' runs)",
                )
                return None
            return "the run was deleted in Rodan"
        record.rodan_seen = True
        try:
            known = RunJobStatus(status)
        except ValueError:
            return None  # a status this bridge does not know: not a reason to cancel anything
        if known in WAITING:
            return None
        return {
            RunJobStatus.CANCELLED: "the run was cancelled in Rodan",
            RunJobStatus.FAILED: "the run failed in Rodan (it reads no reply any more)",
            RunJobStatus.FINISHED: "the run finished in Rodan without this reply",
        }[known]

    # --- a Retry's new attempt -------------------------------------------------------------------
    def supersede(self, record: RequestRecord) -> int:
        """A new attempt of a RunJob arrived (Rodan's Retry): cancel the earlier attempts still open."""
        attempt = attempt_of(record.correlation_id)
        if not record.rodan_runjob or attempt < 2:
            return 0
        cancelled = 0
        for n in range(max(1, attempt - MAX_ATTEMPTS_LOOKED_AT), attempt):
            earlier_id = record.rodan_runjob if n == 1 else f"{record.rodan_runjob}.{n}"
            earlier = self.ledger.get(earlier_id)
            if earlier is None or earlier.state.is_final:
                continue
            with structlog.contextvars.bound_contextvars(correlation_id=earlier.correlation_id):
                cancelled += self.cancel(
                    earlier,
                    f"Rodan retried the run: attempt {attempt} ({record.correlation_id}) replaces this one",
                    rodan_status="retried",
                )
        return cancelled

    # --- the cancel itself -----------------------------------------------------------------------
    def cancel(self, record: RequestRecord, why: str, *, rodan_status: str) -> int:
        """Cancel every job of ``record``, record ``cancelled_by_rodan``, drop any staged reply and,
        once its jobs have ended, the run's transient files. Returns 1, or 0 when the scheduler could
        not be reached (the next pass tries again; nothing was recorded)."""
        if self.replies.already_replied(record.correlation_id):
            return 0  # answered already: nothing runs any more
        try:
            live = self._cancel_jobs(record)
        except SchedulerUnavailable as exc:
            log.warning("rodan_cancel_deferred", error=str(exc), note="the scheduler did not answer; next pass")
            return 0
        record.state = RequestState.CANCELLED_BY_RODAN
        record.reason = why
        record.outcome = "cancelled_by_rodan"
        record.job_ended = not live
        self.ledger.save(record)
        self._drop_staged(record)
        if not live:
            self._clean(record)
        log.warning(
            "request_cancelled_by_rodan",
            runjob=record.rodan_runjob,
            rodan_status=rodan_status,
            job_ids=record.job_ids or ([record.job_id] if record.job_id else []),
            reason=why,
        )
        return 1

    def settle(self, records: Iterable[RequestRecord]) -> int:
        """Of ``records`` (the ledger's cancelled by Rodan), those whose jobs had not ended yet: cancel
        what still runs (a successor submitted meanwhile), and clean up once nothing does. Returns how
        many were settled."""
        settled = 0
        for record in records:
            if record.job_ended:
                continue
            with structlog.contextvars.bound_contextvars(correlation_id=record.correlation_id):
                try:
                    live = self._cancel_jobs(record)
                except SchedulerUnavailable as exc:
                    log.warning("rodan_cancel_deferred", error=str(exc))
                    continue
                self._drop_staged(record)
                if live:
                    continue
                record.job_ended = True
                self.ledger.save(record)
                self._clean(record)
                log.info("cancelled_request_settled", job_ids=record.job_ids or [record.job_id])
                settled += 1
        return settled

    def _cancel_jobs(self, record: RequestRecord) -> bool:
        """Cancel every job of the request (known ids and any of its name); whether one still runs."""
        ids = [j for j in dict.fromkeys([*record.job_ids, record.job_id]) if j]
        if record.job_name:
            ids += [j for j in self.scheduler.find_by_name(record.job_name) if j not in ids]
        for job_id in ids:
            self.scheduler.cancel(job_id)
        if not ids:
            return False
        infos = self.scheduler.query(ids)
        return any(not info.state.is_terminal for info in infos.values())

    def _drop_staged(self, record: RequestRecord) -> None:
        if self.replies.discard(record.correlation_id):
            log.info("reply_discarded", reason="the run is cancelled in Rodan: nobody reads this reply")

    def _clean(self, record: RequestRecord) -> None:
        """The run directory's transient folders, the inputs fetched into the spool and the parameter
        file (it holds the broker password)."""
        params_path = self.spool.params_path(record.key)
        try:
            params = read_json(params_path)
        except (OSError, ValueError):
            params = {}
        params = params if isinstance(params, dict) else {}
        params_path.unlink(missing_ok=True)
        self.spool.drop_inputs(record.key)  # HPC_INPUTS_FETCH=login: the inputs the bridge fetched
        for run_dir in self._run_dirs(record, params):
            for name in TRANSIENT_RUN_FOLDERS:
                shutil.rmtree(run_dir / name, ignore_errors=True)

    def _run_dirs(self, record: RequestRecord, params: dict[str, object]) -> list[Path]:
        """The request's run directory: the parameter file names it once a job continued; before,
        the first job made ``RUNS/<UTC time>-<key>`` (``-2``, ``-3`` ... for a second in the same
        second), found by name."""
        if params.get("run_dir"):
            return [Path(str(params["run_dir"]))]
        runs = Path(str(params.get("runs_dir") or self.config.runs_dir or self.spool.root / "runs"))
        try:
            names = [entry.name for entry in os.scandir(runs) if entry.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        pattern = re.compile(r"\d{8}-\d{6}-" + re.escape(record.key) + r"(-\d+)?")
        return [runs / name for name in names if pattern.fullmatch(name)]


def _status_word(status: int | None) -> str:
    if status is None:
        return "deleted"
    try:
        return RunJobStatus(status).name.lower()
    except ValueError:
        return str(status)

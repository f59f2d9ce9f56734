"""Watch every submitted job until its request has had its one reply.

The worker replies itself. For a job that ended any other way (time limit,
cancellation, crash, out of memory, node failure ...) this stages an error
reply that names the scheduler's state and what to change. A job the scheduler
no longer knows is looked up in accounting; one that stays unknown is only
judged after ``missing_timeout_s``. "Missing" is never read as done.

A training job that continued itself past its time limit is still the same
request: a Slurm requeue keeps the job id (REQUEUED/PENDING are not outcomes),
and a successor (Grid Engine; Slurm with ``HPC_SLURM_CONTINUE=successor``) is followed
through the job's continuation record (``bridge/continuation_record.py``) or, if that was never
written, by the job name. Only the last job of the chain can end the request.
"""

from __future__ import annotations

import time

import structlog

from bridge.config import BridgeConfig
from bridge.continuation_record import read_continuation
from bridge.errors import SchedulerUnavailable
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.protocol import error_reply
from bridge.replies import ReplyBox, StagedReply, part_bytes_for
from bridge.rodan_cancel import RodanCancels
from bridge.schedulers import JobInfo, JobState, Scheduler
from bridge.spool import Spool

log = structlog.get_logger(__name__)


def explain(record: RequestRecord, info: JobInfo, scheduler: str) -> str:
    """A human-readable error reply for a job that ended without replying (``scheduler``: "Slurm")."""
    job = f"{scheduler} job {record.job_id}"
    state = info.state.value
    if info.native_state and info.native_state.split()[0] != state:
        state += f" ({info.native_state})"  # the scheduler's own words, e.g. Grid Engine's "failed 37 ..."
    code = f", exit code {info.exit_code}" if info.exit_code else ""
    hints = {
        JobState.TIMEOUT: f"{state} after {record.time_limit or '?'}: the job hit its time limit "
        "before it could checkpoint and continue; raise 'Maximum time (D-HH:MM)' (or the bridge's "
        "HPC_WARN_SECONDS), or lower the epochs or samples per label",
        JobState.OUT_OF_MEMORY: f"{state} with {record.memory_mb} MB: the job ran out of memory; "
        "raise 'Maximum memory (MB)' or lower the patch size or samples per label",
        JobState.CANCELLED: f"{state}: the job was cancelled (by an operator or the scheduler); resubmit it",
        JobState.FAILED: f"{state}{code}: the training job crashed without replying; "
        f"see its log in the bridge's spool (jobs/{record.key}/)",
        JobState.COMPLETED: f"{state}{code}: the job finished without sending its models; "
        f"see its log in the bridge's spool (jobs/{record.key}/)",
        JobState.NODE_FAIL: f"{state}: the compute node failed; resubmit the job",
        JobState.PREEMPTED: f"{state}: the job was preempted by the scheduler; resubmit the job",
        JobState.BOOT_FAIL: f"{state}: the compute node failed to boot; resubmit the job",
        JobState.DEADLINE: f"{state}: the job missed its scheduling deadline; resubmit the job",
        JobState.ERROR: f"{state}: the scheduler put the job in an error state and would never have run it; "
        f"the bridge deleted it. See the job's log in the bridge's spool (jobs/{record.key}/)",
    }
    return f"{job} ended without a result: {hints.get(info.state, state)}"


class Reconciler:
    def __init__(
        self,
        config: BridgeConfig,
        spool: Spool,
        ledger: Ledger,
        scheduler: Scheduler,
        replies: ReplyBox,
        cancels: RodanCancels | None = None,
    ) -> None:
        self.config = config
        self.spool = spool
        self.ledger = ledger
        self.scheduler = scheduler
        self.replies = replies
        self.cancels = cancels  # Rodan 3: runs cancelled, deleted or retried in Rodan (bridge/rodan_cancel.py)

    def _stage(self, record: RequestRecord, body: bytes) -> None:
        """Stage the bridge's error reply to ``record`` (in parts for generation 3: docs/protocol.md §3.5)."""
        part_bytes = part_bytes_for(record.generation, self.config.reply_part_bytes)
        self.replies.stage(record.correlation_id, record.reply_to, body, origin="reconcile", part_bytes=part_bytes)

    def mark_replied(self) -> int:
        """Mark requests whose reply marker exists as replied. Cheap: files only."""
        replied = 0
        for record in self.ledger.in_state(RequestState.SUBMITTED, RequestState.SUBMITTING, RequestState.RECEIVED):
            marker = self.replies.marker(record.correlation_id)
            if marker is None:
                continue
            record.state = RequestState.REPLIED
            record.outcome = str(marker.get("outcome", ""))
            record.replied_at = float(marker.get("published_at", time.time()))
            self.ledger.save(record)
            # A job that died never deleted its parameter file (it holds the broker password).
            self.spool.params_path(record.key).unlink(missing_ok=True)
            replied += 1
            log.info(
                "request_replied",
                correlation_id=record.correlation_id,
                job_id=record.job_id,
                outcome=record.outcome,
                latency_s=round(record.replied_at - record.created_at, 3),
            )
        return replied

    def reconcile(self) -> int:
        """Query the scheduler about every watched job; stage error replies for dead ones."""
        self.mark_replied()
        if self.cancels is not None:  # one read of the ledger for both
            records = self.ledger.in_state(
                RequestState.SUBMITTED, RequestState.RECEIVED, RequestState.CANCELLED_BY_RODAN
            )
            self.cancels.settle([r for r in records if r.state is RequestState.CANCELLED_BY_RODAN])
            self.cancels.check([r for r in records if r.state is not RequestState.CANCELLED_BY_RODAN])
        watched = [r for r in self.ledger.in_state(RequestState.SUBMITTED) if r.job_id]
        if not watched:
            return 0
        for record in watched:
            self._follow_continuation(record)
        try:
            infos = self.scheduler.query([r.job_id for r in watched])
        except SchedulerUnavailable as exc:
            log.warning("reconcile_scheduler_unavailable", error=str(exc), watched=len(watched))
            return 0
        staged = {entry.key for entry in self.replies.staged()}
        judged = 0
        now = time.time()
        for record in watched:
            with structlog.contextvars.bound_contextvars(correlation_id=record.correlation_id, job_id=record.job_id):
                # The marker is checked after the query: a job that replied and then
                # ended is seen as replied, never as "ended without reply".
                if self.replies.already_replied(record.correlation_id):
                    continue
                info = infos.get(record.job_id)
                if info is None or info.state is JobState.MISSING:
                    judged += self._missing(record, now, has_reply=record.key in staged)
                    continue
                if record.job_state != info.state.value:  # the ledger keeps the JobState, not the scheduler's word
                    log.info("job_state", state=info.state.value, native=info.native_state, source=info.source)
                record.job_state = info.state.value
                record.missing_since = 0.0
                record.job_ended = info.state.is_terminal
                if info.state is not JobState.PENDING:
                    record.pending_since = 0.0
                elif record.key not in staged:
                    record.pending_since = record.pending_since or now
                    if now - record.pending_since >= self.config.max_pending_s:
                        judged += self._pending_too_long(record, info, now)
                if info.state.is_terminal and record.key in staged:
                    log.info("job_ended_reply_waiting", note="its staged reply goes out with the next flush")
                elif info.state.is_terminal and self._adopt_successor(record):
                    record.job_ended = False
                elif info.state.is_terminal:
                    if info.state is JobState.ERROR:
                        self._delete(record)
                    reason = self.config.public(explain(record, info, self.scheduler.display_name))
                    log.error("job_ended_without_reply", state=info.state.value, reason=reason)
                    record.reason = reason
                    self._stage(record, error_reply(reason))
                    judged += 1
                self.ledger.save(record)
        log.info("reconcile_done", watched=len(watched), judged=judged)
        return judged

    def _pending_too_long(self, record: RequestRecord, info: JobInfo, now: float) -> int:
        """A job that has waited HPC_MAX_PENDING without starting is cancelled and answered: Rodan
        must not wait for ever on a request the cluster will not run (or not for days)."""
        try:
            self.scheduler.cancel(record.job_id)
        except SchedulerUnavailable as exc:
            log.warning("job_delete_failed", error=str(exc))
            return 0  # not answered while the job may still start; tried again next time
        waited = now - record.pending_since
        said = info.reason or "none given"
        reason = self.config.public(
            f"{self.scheduler.display_name} job {record.job_id} waited {_duration(waited)} in the queue without "
            f"starting (the scheduler's reason: {said}); the bridge cancelled it after HPC_MAX_PENDING "
            f"({_duration(self.config.max_pending_s)}). Ask for less memory, fewer CPUs or a shorter "
            "'Maximum time (D-HH:MM)', or ask the operator why the cluster does not start it"
        )
        log.error("job_pending_too_long", waited_s=int(waited), scheduler_reason=said, reason=reason)
        record.reason = reason
        self._stage(record, error_reply(reason))
        return 1

    def _follow_continuation(self, record: RequestRecord) -> None:
        """Take in what the job wrote when it continued itself (count, successor id)."""
        found = read_continuation(self.spool, record.key)
        if found is None or found.count < record.continuations:
            return
        changed = found.count > record.continuations
        record.continuations = found.count
        if found.job_id and found.job_id != record.job_id and found.job_id not in record.job_ids[:-1]:
            self._switch_job(record, found.job_id, how="continuation record")
            changed = True
        if changed:
            log.info(
                "job_continued",
                correlation_id=record.correlation_id,
                job_id=record.job_id,
                continuations=record.continuations,
                stopped_at=found.stopped_at,
            )
            self.ledger.save(record)

    def _adopt_successor(self, record: RequestRecord) -> bool:
        """A job that ended without a reply may have continued in a newer job of the same name."""
        if not record.job_name or not record.job_id.isdigit():
            return False
        try:
            ids = self.scheduler.find_by_name(record.job_name)
        except SchedulerUnavailable as exc:
            log.warning("successor_lookup_failed", error=str(exc))
            return False
        newer = [i for i in ids if i.isdigit() and int(i) > int(record.job_id)]
        if not newer:
            return False
        self._switch_job(record, max(newer, key=int), how="job name")
        record.continuations = max(record.continuations, len(record.job_ids) - 1)
        log.warning("job_continued", job_id=record.job_id, continuations=record.continuations, found_by="job name")
        return True

    def _switch_job(self, record: RequestRecord, job_id: str, *, how: str) -> None:
        if not record.job_ids:
            record.job_ids = [record.job_id]
        record.job_ids.append(job_id)
        log.info("job_followed", previous_job_id=record.job_id, job_id=job_id, found_by=how)
        record.job_id = job_id
        record.job_state = ""
        record.missing_since = 0.0

    def _delete(self, record: RequestRecord) -> None:
        try:
            self.scheduler.cancel(record.job_id)
        except SchedulerUnavailable as exc:
            log.warning("job_delete_failed", error=str(exc))

    def may_publish(self, entry: StagedReply) -> bool:
        """A reply the worker staged is the worker's to publish until its job has ended. A request
        cancelled in Rodan gets no reply: one staged after the cancel (the worker's, as its job
        stopped) is dropped here."""
        record = self.ledger.get(entry.correlation_id)
        if record is not None and record.state is RequestState.CANCELLED_BY_RODAN:
            self.replies.discard(entry.correlation_id)
            log.info("reply_discarded", correlation_id=entry.correlation_id, reason="the run is cancelled in Rodan")
            return False
        if entry.origin != "worker":
            return True
        return record is None or record.state is not RequestState.SUBMITTED or record.job_ended

    def judge_lost(self, seen: set[str], now: float | None = None) -> int:
        """Answer requests whose message the broker no longer holds (call right after a full drain).

        A request the bridge took but could not submit yet (Rodan or the scheduler was down) waits
        in the request queue and comes back on every pass, which refreshes its ledger record. One
        that has not come back for ``missing_timeout_s`` and was not in the queue just drained
        (``seen``) is gone: Rodan's queues are not durable, so a broker restart drops it. Without
        this its Rodan task would wait for ever; it gets one error reply instead. A job submitted
        for it before the loss is adopted, not answered.
        """
        now = time.time() if now is None else now
        judged = 0
        for record in self.ledger.in_state(RequestState.RECEIVED, RequestState.SUBMITTING):
            if record.correlation_id in seen or now - record.updated_at < self.config.missing_timeout_s:
                continue
            if self.replies.already_replied(record.correlation_id):
                continue
            with structlog.contextvars.bound_contextvars(correlation_id=record.correlation_id):
                if record.state is RequestState.SUBMITTING and record.job_name:
                    try:
                        ids = self.scheduler.find_by_name(record.job_name)
                    except SchedulerUnavailable as exc:
                        log.warning("request_lost_check_deferred", error=str(exc))
                        continue
                    if ids:
                        self.ledger.adopt_job(record, ids)
                        log.warning("request_adopted_job", job_id=ids[0], jobs_with_name=ids)
                        continue
                reason = (
                    f"the request was lost from the broker's queue before it could be submitted (its message "
                    f"has not come back for {int(now - record.updated_at)} s: a broker restart drops Rodan's "
                    f"queues); run the job again"
                )
                log.error("request_lost", reason=reason, attempts=record.attempts)
                record.state = RequestState.REJECTED
                record.reason = reason
                record.outcome = "error"
                self.ledger.save(record)
                self.spool.params_path(record.key).unlink(missing_ok=True)  # it may hold a token
                self._stage(record, error_reply(reason))
                judged += 1
        return judged

    def _missing(self, record: RequestRecord, now: float, *, has_reply: bool = False) -> int:
        if not record.missing_since:
            record.missing_since = now
            self.ledger.save(record)
            log.warning("job_missing", note="not in the queue nor in accounting; waiting before judging")
            return 0
        if now - record.missing_since < self.config.missing_timeout_s:
            return 0
        record.job_ended = True
        if has_reply:
            self.ledger.save(record)
            return 0
        reason = self.config.public(
            f"{self.scheduler.display_name} job {record.job_id} vanished: neither the queue nor accounting "
            f"has known it for {int(now - record.missing_since)} s; resubmit the job"
        )
        log.error("job_vanished", reason=reason)
        record.reason = reason
        self.ledger.save(record)
        self._stage(record, error_reply(reason))
        return 1


def _duration(seconds: float) -> str:
    """``93784`` -> ``1 d 2 h 3 min``."""
    minutes = int(seconds // 60)
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    parts = [f"{days} d"] if days else []
    parts += [f"{hours} h"] if hours else []
    return " ".join([*parts, f"{mins} min"]) if mins or not parts else " ".join(parts)

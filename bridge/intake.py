"""One request in, one job out (or one error reply): the per-request pipeline.

``Intake.process`` runs OFF the pika connection's thread (it may wait on Rodan
or the scheduler for a while) and never touches the broker: it only decides,
writes files and submits. The runner then acks, defers or dead-letters on the
connection's own thread.

Order of durable steps (a crash between any two is harmless):
ledger RECEIVED -> parameter file + batch script -> ledger SUBMITTING -> submit
-> ledger SUBMITTED -> (runner) ack. A redelivered message whose record says
SUBMITTING is first looked up at the scheduler by its job name.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import structlog

from bridge.config import BridgeConfig
from bridge.errors import PermanentError, SchedulerRejected, TransientError
from bridge.faults import fault_point
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.protocol import JobRequest, error_reply, parse_request
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import JobSpec, Scheduler
from bridge.spool import Spool, atomic_write, atomic_write_json

log = structlog.get_logger(__name__)

TOKEN_CACHE_S = 600.0

#: What to change when the scheduler refuses a job for good (after its own words, in the reply).
REFUSED_HINT = (
    "Change 'Maximum memory (MB)', 'CPUs' or 'Maximum time (D-HH:MM)' to what the cluster allows; "
    "if it names an account, partition, queue or GPU, the operator's scheduler settings are wrong"
)


@dataclass(frozen=True)
class Message:
    """A request as taken from the queue."""

    body: bytes
    correlation_id: str | None
    reply_to: str | None
    redelivered: bool
    delivery_tag: int


class Outcome(str, Enum):
    SUBMITTED = "submitted"  # ack
    DUPLICATE = "duplicate"  # already handled: ack, do nothing else
    REJECTED = "rejected"  # error reply staged: publish it, dead-letter a copy, ack
    UNANSWERABLE = "unanswerable"  # no reply_to/correlation_id: dead-letter a copy, ack
    DEFERRED = "deferred"  # transient failure: give the message back later


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str = ""
    record: RequestRecord | None = None


class Intake:
    def __init__(
        self,
        config: BridgeConfig,
        spool: Spool,
        ledger: Ledger,
        scheduler: Scheduler,
        rodan: RodanClient,
        replies: ReplyBox,
    ) -> None:
        self.config = config
        self.spool = spool
        self.ledger = ledger
        self.scheduler = scheduler
        self.rodan = rodan
        self.replies = replies
        self._token = ""
        self._token_at = 0.0

    def process(self, msg: Message) -> Decision:
        if not msg.correlation_id or not msg.reply_to:
            missing = "correlation_id" if not msg.correlation_id else "reply_to"
            log.error("request_unanswerable", missing=missing, bytes=len(msg.body))
            return Decision(Outcome.UNANSWERABLE, f"message has no {missing}: cannot reply")
        record = self.ledger.open(msg.correlation_id, msg.reply_to)
        with structlog.contextvars.bound_contextvars(
            correlation_id=msg.correlation_id, attempt=record.attempts + 1, redelivered=msg.redelivered
        ):
            return self._process(msg, record)

    def _process(self, msg: Message, record: RequestRecord) -> Decision:
        if record.state in (RequestState.SUBMITTED, RequestState.REPLIED):
            log.info("request_duplicate", state=record.state.value, job_id=record.job_id)
            return Decision(Outcome.DUPLICATE, record=record)
        if record.state is RequestState.REJECTED:
            log.info("request_duplicate", state=record.state.value)
            return Decision(Outcome.REJECTED if not record.dead_lettered else Outcome.DUPLICATE, record.reason, record)
        log.info("request_received", bytes=len(msg.body))
        try:
            # A pass that died (or was deferred) after sbatch may have left a job: find it by name
            # rather than submit twice. The scheduler may be down for this lookup too: defer then.
            if record.state is RequestState.SUBMITTING and self._adopt_existing_job(record):
                return Decision(Outcome.SUBMITTED, record=record)
            request = parse_request(msg.body, correlation_id=msg.correlation_id or "", reply_to=msg.reply_to or "")
            record.generation = request.generation.value
            log.info("request_valid", generation=request.generation.value, layers=len(request.layers))
            token = self._get_token()
            job_id = self._submit(request, record, token)
        except SchedulerRejected as exc:
            return self._reject(record, f"{self.scheduler.display_name} refused the job: {exc}. {REFUSED_HINT}")
        except PermanentError as exc:
            return self._reject(record, str(exc))
        except TransientError as exc:
            record.attempts += 1
            record.reason = str(exc)
            if record.attempts >= self.config.max_attempts:
                return self._reject(record, f"gave up after {record.attempts} attempts over several passes: {exc}")
            if record.state is not RequestState.SUBMITTING:
                record.state = RequestState.RECEIVED
            self.ledger.save(record)
            log.warning("request_deferred", error=str(exc), attempts=record.attempts)
            return Decision(Outcome.DEFERRED, str(exc), record)
        log.info("request_submitted", job_id=job_id, scheduler=self.scheduler.name)
        return Decision(Outcome.SUBMITTED, record=record)

    # --- steps -----------------------------------------------------------------
    def _get_token(self) -> str:
        if self._token and time.monotonic() - self._token_at < TOKEN_CACHE_S:
            return self._token
        self._token = self.rodan.get_token()
        self._token_at = time.monotonic()
        log.info("rodan_token_obtained", rodan=self.config.rodan_base_url)
        return self._token

    def _submit(self, request: JobRequest, record: RequestRecord, token: str) -> str:
        key = record.key
        job_dir = self.spool.job_dir(key)
        job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        params_path = self.spool.params_path(key)
        spec = self.job_spec(request, key)
        script = job_dir / "job.sh"
        atomic_write_json(params_path, self._parameters(request, token, spec, script), mode=0o600)
        try:
            atomic_write(script, self.scheduler.render(spec).encode("utf-8"), mode=0o700)
        except ValueError as exc:  # a value that must never reach a script
            params_path.unlink(missing_ok=True)
            raise PermanentError(str(exc)) from exc
        record.state = RequestState.SUBMITTING
        record.scheduler = self.scheduler.name
        record.job_name = spec.name
        record.time_limit = request.settings.max_time
        record.memory_mb = request.settings.max_memory_mb
        self.ledger.save(record)
        fault_point("before_submit")
        try:
            job_id = self.scheduler.submit(script, spec)
        except PermanentError:
            params_path.unlink(missing_ok=True)
            raise
        fault_point("after_submit")
        record.state = RequestState.SUBMITTED
        record.job_id = job_id
        record.job_ids = [job_id]
        record.submitted_at = time.time()
        record.reason = ""
        self.ledger.save(record)
        fault_point("after_record")
        structlog.contextvars.bind_contextvars(job_id=job_id)
        return job_id

    def job_spec(self, request: JobRequest, key: str) -> JobSpec:
        s = request.settings
        job_dir = self.spool.job_dir(key)
        return JobSpec(
            name=f"rodan-{key}",
            comment=key,
            time_minutes=s.max_time_minutes,
            memory_mb=s.max_memory_mb,
            cpus=s.cpus,
            gres=self.config.gres_for(s.max_memory_mb),
            email=s.notification_email,
            account=self.config.account,
            partition=self.config.partition,
            warn_seconds=self.config.warn_seconds_for(s.max_time_minutes),
            extra_args=self.config.scheduler_args,
            log_dir=job_dir,
            workdir=job_dir,
            command=(self.config.worker_python, "-m", "worker", "run", str(self.spool.params_path(key))),
        )

    def _parameters(self, request: JobRequest, token: str, spec: JobSpec, script: Path) -> dict[str, object]:
        return {
            "correlation_id": request.correlation_id,
            "reply_to": request.reply_to,
            "generation": request.generation.value,
            "inputs": request.inputs,
            "layers": [[layer.input_name, layer.reply_key] for layer in request.layers],
            "settings": asdict(request.settings),
            "rodan": {
                "base_url": self.config.rodan_base_url,
                "token": token,
                "timeout_s": self.config.rodan_timeout_s,
                "retries": self.config.rodan_retries,
            },
            "broker": {"url": self.config.broker_url, "ca_file": self.config.broker_ca_file},
            "spool": str(self.spool.root),
            "runs_dir": str(self.config.runs_dir or self.spool.root / "runs"),
            "save_optimizer": self.config.save_optimizer,
            "mixed_precision": self.config.mixed_precision,
            "seed": self.config.training_seed,
            "max_reply_bytes": self.config.max_reply_bytes,
            # How the job continues itself after a time-limit warning (worker/continuation.py).
            "job": {
                "scheduler": self.scheduler.name,
                "options": self.config.scheduler_options,
                "timeout_s": self.config.scheduler_timeout_s,
                "script": str(script),
                "spec": spec.to_json(),
            },
            "continuation": {
                "count": 0,
                "max": self.config.max_continuations,
                "node_local_dir": str(self.config.node_local_dir) if self.config.node_local_dir else None,
                "sync_s": self.config.checkpoint_sync_s,
            },
            "created_at": time.time(),
            "bridge_pid": os.getpid(),
        }

    def _adopt_existing_job(self, record: RequestRecord) -> bool:
        """After a crash between submit and record: is the job already at the scheduler?"""
        ids = self.scheduler.find_by_name(record.job_name) if record.job_name else []
        if not ids:
            return False
        self.ledger.adopt_job(record, ids)
        log.warning("request_adopted_job", job_id=ids[0], jobs_with_name=ids)
        return True

    def _reject(self, record: RequestRecord, reason: str) -> Decision:
        log.error("request_rejected", reason=reason)
        record.state = RequestState.REJECTED
        record.reason = reason
        record.outcome = "error"
        self.ledger.save(record)
        # A request given up on after its parameter file was written: the token must not stay on disk.
        self.spool.params_path(record.key).unlink(missing_ok=True)
        self.replies.stage(record.correlation_id, record.reply_to, error_reply(reason), origin="bridge")
        return Decision(Outcome.REJECTED, reason, record)

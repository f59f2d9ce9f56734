"""One request in, one job out (or one error reply): the per-request pipeline.

``Intake.process`` runs OFF the pika connection's thread (it may wait on Rodan
or the scheduler for a while) and never touches the broker: it only decides,
writes files and submits. The runner then acks, defers or dead-letters on the
connection's own thread.

Order of durable steps (a crash between any two is harmless):
ledger RECEIVED -> parameter file + batch script -> ledger SUBMITTING -> submit
-> ledger SUBMITTED -> (runner) ack. A redelivered message whose record says
SUBMITTING is first looked up at the scheduler by its job name.

Nothing a message holds can make ``process`` raise: the message's properties are
taken apart defensively (``Message.from_delivery``), parsing raises only
``InvalidRequest``, and any other exception becomes an error reply naming an
internal error. A message whose handling killed the process (``deliveries``, counted
in the ledger before the work and cleared after) is quarantined after
``HPC_POISON_LIMIT`` such deliveries: error reply and dead letter, never processed again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pika
import structlog
from pika.spec import Basic

from bridge.active import ActiveJobs
from bridge.config import BridgeConfig
from bridge.errors import PermanentError, RodanAuthError, SchedulerRejected, SubmitLimitReached, TransientError
from bridge.faults import fault_point
from bridge.handoff import (
    BrokerAccess,
    ContinuationState,
    InputLimits,
    JobParameters,
    RodanAccess,
    SchedulerAccess,
    input_files,
)
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.protocol import (
    Generation,
    InputRole,
    JobRequest,
    RequestSettings,
    bounded,
    error_reply,
    generation_hint,
    parse_request,
)
from bridge.replies import ReplyBox, part_bytes_for
from bridge.rodan import IMAGE_KINDS, SNIFF_BYTES, InputKind, RodanClient, sniff, wrong_kind
from bridge.rodan_cancel import RUNJOB_HEADER, RodanCancels, runjob_of
from bridge.schedulers import JobSpec, Scheduler
from bridge.spool import Spool, atomic_write, atomic_write_json, safe_key
from bridge.version import package_version, pinned_worker_python

log = structlog.get_logger(__name__)

TOKEN_CACHE_S = 600.0

#: The file types (first bytes) an input of each role must have (docs/protocol.md §2.2, §2.5).
ROLE_KINDS: dict[InputRole, tuple[InputKind, ...]] = {
    InputRole.IMAGE: IMAGE_KINDS,
    InputRole.SAMPLE: ("zip",),
    InputRole.MULTI_SAMPLE: ("zip",),
    InputRole.MODEL: ("hdf5",),
}

#: What to change when the scheduler refuses a job for good (after its own words, in the reply).
REFUSED_HINT = (
    "Change 'Maximum memory (MB)', 'CPUs' or 'Maximum time (D-HH:MM)' to what the cluster allows; "
    "if it names an account, partition, queue or GPU, the operator's scheduler settings are wrong"
)


#: AMQP short strings are at most 255 bytes; pika hands over one that is not UTF-8 as ``bytes``.
MAX_PROPERTY_BYTES = 255


def text_property(value: object) -> str | None:
    """A message property as a usable string, or None (missing, empty, not UTF-8, not a string)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not value or len(value.encode("utf-8")) > MAX_PROPERTY_BYTES:
        return None
    return value


@dataclass(frozen=True)
class Message:
    """A request as taken from the queue."""

    body: bytes
    correlation_id: str | None
    reply_to: str | None
    redelivered: bool
    delivery_tag: int
    runjob: str | None = None  # generation 3: the x-rodan-runjob header (the RunJob's uuid)

    @classmethod
    def from_delivery(cls, method: Basic.GetOk, properties: pika.BasicProperties, body: bytes) -> Message:
        """What ``basic_get`` returned, with every property checked: nothing here trusts the sender."""
        return cls(
            body=bytes(body) if isinstance(body, (bytes, bytearray)) else b"",
            correlation_id=text_property(properties.correlation_id),
            reply_to=text_property(properties.reply_to),
            redelivered=bool(method.redelivered),
            delivery_tag=int(method.delivery_tag),
            runjob=text_property((properties.headers or {}).get(RUNJOB_HEADER)),
        )


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
    retry_in_s: float = 0.0  # DEFERRED: give the message back after this long (0: the runner's backoff)


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
        self.active = ActiveJobs(ledger, config.max_active_jobs)  # HPC_MAX_ACTIVE_JOBS
        self.cancels: RodanCancels | None = None  # Rodan 3: a Retry's attempt supersedes the earlier ones

    def process(self, msg: Message) -> Decision:
        """Decide one message. Raises only when the spool cannot be written (the runner defers it)."""
        if not msg.correlation_id or not msg.reply_to:
            missing = "correlation_id" if not msg.correlation_id else "reply_to"
            log.error("request_unanswerable", missing=missing, bytes=len(msg.body))
            return Decision(Outcome.UNANSWERABLE, f"message has no usable {missing}: cannot reply")
        if not self.config.accepts_reply_to(msg.reply_to):
            # Replies go only to Rodan's queue: not to our own request or dead-letter queue, nor to
            # another application's, nor to a queue nobody will ever declare.
            log.error("request_foreign_reply_to", correlation_id=msg.correlation_id, reply_to=msg.reply_to)
            return Decision(
                Outcome.UNANSWERABLE,
                f"reply_to {msg.reply_to!r} is not Rodan's reply queue (HPC_REPLY_QUEUE): no reply is sent",
            )
        with structlog.contextvars.bound_contextvars(correlation_id=msg.correlation_id, redelivered=msg.redelivered):
            record = self.ledger.open(msg.correlation_id, msg.reply_to)
            counted = not record.state.is_final and record.state is not RequestState.SUBMITTED
            if counted:
                if record.deliveries >= self.config.poison_limit:
                    return self._quarantine(record)
                record.deliveries += 1
                self.ledger.save(record)  # if this delivery kills the process, the next one knows
            with structlog.contextvars.bound_contextvars(attempt=record.attempts + 1):
                try:
                    decision = self._process(msg, record)
                except Exception as exc:  # a defect, not the request's fault: answer it, keep going
                    log.error("request_crashed", error=f"{type(exc).__name__}: {bounded(str(exc), 300)}", exc_info=True)
                    decision = self._reject(
                        record,
                        f"internal error in the HPC bridge while handling this request ({type(exc).__name__}); "
                        "the operator's log has the details (event request_crashed)",
                    )
            if counted and record.deliveries:  # a path that saved nothing (a duplicate): clear it here
                record.deliveries = 0
                self.ledger.save(record)
            return decision

    def _quarantine(self, record: RequestRecord) -> Decision:
        """A request whose handling stopped the process ``deliveries`` times: never handled again."""
        log.error("request_quarantined", deliveries=record.deliveries, state=record.state.value)
        if record.state is RequestState.SUBMITTING:
            # Stopped after its submit, perhaps: a job found by name is the answer, not an error reply.
            # Only this lookup runs; while the scheduler cannot say, the message waits (still counted).
            try:
                adopted = self._adopt_existing_job(record)
            except TransientError as exc:
                log.warning("request_quarantine_lookup_failed", error=str(exc))
                return Decision(Outcome.DEFERRED, str(exc), record)
            if adopted:
                return Decision(Outcome.SUBMITTED, record=record)
        return self._reject(
            record,
            f"the HPC bridge stopped {self.config.poison_limit} times while handling this request (a crash "
            "or a kill); it was set aside in the dead-letter queue without being processed again",
        )

    def _process(self, msg: Message, record: RequestRecord) -> Decision:
        if record.state in (RequestState.SUBMITTED, RequestState.REPLIED, RequestState.CANCELLED_BY_RODAN):
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
            if generation_hint(msg.body) is Generation.RODAN3:  # its error reply, if any, goes in parts
                record.generation = Generation.RODAN3.value
            request = parse_request(
                msg.body,
                correlation_id=msg.correlation_id or "",
                reply_to=msg.reply_to or "",
                rodan_origin=self.config.rodan_base_url,
            )
            record.generation = request.generation.value
            if request.generation is Generation.RODAN3:
                self._note_attempt(record, msg)
            log.info("request_valid", generation=request.generation.value, **request.log_fields())
            if self.active.full():
                return self._wait_for_room(record)
            token = self._get_token()
            self._check_inputs(request.inputs, request.roles)
            self._fetch_inputs(request)  # HPC_INPUTS_FETCH=login only
            job_id = self._submit(request, record, token)
        except SchedulerRejected as exc:
            return self._reject(record, f"{self.scheduler.display_name} refused the job: {exc}. {REFUSED_HINT}")
        except PermanentError as exc:
            return self._reject(record, str(exc))
        except TransientError as exc:
            now = time.time()
            record.attempts += 1
            record.reason = bounded(str(exc))
            # A submit limit that the bridge's own jobs hold is waited out, without the HPC_DEFER_LIMIT
            # clock: they end and make room. Held by other jobs of the account (or a limit of 0), bounded.
            at_limit = isinstance(exc, SubmitLimitReached)
            own_limit = at_limit and self.active.count() > 0
            record.deferred_since = 0.0 if own_limit else (record.deferred_since or now)
            waited = now - record.deferred_since if record.deferred_since else 0.0
            if waited >= self.config.defer_limit_s:
                return self._reject(
                    record,
                    f"gave up after retrying for {_minutes(waited)} ({record.attempts} attempts, "
                    f"HPC_DEFER_LIMIT): {exc}",
                )
            if record.state is not RequestState.SUBMITTING or at_limit:
                record.state = RequestState.RECEIVED  # a submit limit's refusal made no job: nothing to look up
            record.deliveries = 0  # this delivery is accounted for: the save that ends it clears the count
            self.ledger.save(record)
            limit = {"submit_limit": True, "active_jobs": self.active.count()} if at_limit else {}
            log.warning(
                "request_deferred", error=record.reason, attempts=record.attempts, waited_s=round(waited, 1), **limit
            )
            return Decision(Outcome.DEFERRED, record.reason, record)
        log.info("request_submitted", job_id=job_id, scheduler=self.scheduler.name)
        return Decision(Outcome.SUBMITTED, record=record)

    # --- steps -----------------------------------------------------------------
    def _note_attempt(self, record: RequestRecord, msg: Message) -> None:
        """Rodan 3: the request's RunJob; a Retry's new attempt supersedes the earlier ones."""
        record.rodan_runjob = runjob_of(record.correlation_id, msg.runjob)
        if self.cancels is not None and record.rodan_runjob:
            self.cancels.supersede(record)

    def _get_token(self) -> str:
        if self._token and time.monotonic() - self._token_at < TOKEN_CACHE_S:
            return self._token
        self._token = self.rodan.get_token()
        self._token_at = time.monotonic()
        log.info("rodan_token_obtained", rodan=self.config.rodan_base_url)
        return self._token

    def _check_inputs(self, inputs: Mapping[str, str], roles: Mapping[str, InputRole]) -> None:
        """Every input exists at Rodan, is under HPC_MAX_INPUT_BYTES and is of its role's type (a PNG
        or JPEG; generation 3: a sample is a zip, a starting model HDF5): a request that would fail
        in its download is refused now, not after hours in the scheduler's queue."""
        checked: set[tuple[str, tuple[InputKind, ...]]] = set()
        for name, resource in inputs.items():
            kinds = ROLE_KINDS[roles.get(name, InputRole.IMAGE)]
            if (resource, kinds) in checked:
                continue
            max_bytes = self.config.max_input_bytes
            try:
                info = self.rodan.check_input(resource, name=name, max_bytes=max_bytes, kinds=kinds)
            except RodanAuthError:
                if not checked and self._token:  # a cached token Rodan no longer takes: once more, fresh
                    self._token = ""
                    self._get_token()
                    info = self.rodan.check_input(resource, name=name, max_bytes=max_bytes, kinds=kinds)
                else:
                    raise
            checked.add((resource, kinds))
            log.debug("input_checked", input=name, bytes=info.bytes, kind=info.kind)

    def _inputs_dir(self, request: JobRequest) -> Path | None:
        """HPC_INPUTS_FETCH=login: the request's folder of inputs in the spool; None: the job downloads them."""
        return self.spool.inputs_dir(safe_key(request.correlation_id)) if self.config.inputs_fetch == "login" else None

    def _fetch_inputs(self, request: JobRequest) -> None:
        """HPC_INPUTS_FETCH=login: download every input now, on the login node, into the spool, where the
        job reads them (compute nodes without a route to Rodan). The limits of a job's download apply
        (:meth:`RodanClient.download`: Rodan's files only, HPC_MAX_INPUT_BYTES on the wire, no compressed
        body), and each file's first bytes must be of its role's kind again: the check above read a range
        of 16 bytes, the job opens the whole file. A TransientError defers the request (complete files stay
        for the next attempt); a PermanentError (4xx, too large, another kind) answers it at once."""
        folder = self._inputs_dir(request)
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        started, total = time.monotonic(), 0
        for name, dest in input_files(request.inputs, folder).items():
            if dest.exists():  # downloads are atomic and checked on arrival: an earlier attempt's, whole
                log.info("input_present", input=name, bytes=dest.stat().st_size)
                continue
            result = self.rodan.download(request.inputs[name], dest, max_bytes=self.config.max_input_bytes)
            with dest.open("rb") as handle:
                head = handle.read(SNIFF_BYTES)
            kinds = ROLE_KINDS[request.roles.get(name, InputRole.IMAGE)]
            if sniff(head) not in kinds:
                dest.unlink(missing_ok=True)
                raise PermanentError(wrong_kind(name, head, kinds))
            total += result.bytes
            log.info("input_fetched", input=name, bytes=result.bytes, seconds=round(result.seconds, 3))
        seconds = round(time.monotonic() - started, 3)
        log.info("inputs_fetched", inputs=len(request.inputs), bytes=total, seconds=seconds)

    def _submit(self, request: JobRequest, record: RequestRecord, token: str) -> str:
        key = record.key
        job_dir = self.spool.job_dir(key)
        job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        params_path = self.spool.params_path(key)
        spec = self.job_spec(request, key)
        script = job_dir / "job.sh"
        atomic_write_json(params_path, self._parameters(request, token, spec, script).to_json(), mode=0o600)
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
        record.deferred_since = 0.0
        record.deliveries = 0
        self.ledger.save(record)
        self.active.submitted()
        fault_point("after_record")
        structlog.contextvars.bind_contextvars(job_id=job_id)
        return job_id

    def job_spec(self, request: JobRequest, key: str) -> JobSpec:
        return rodan_job_spec(self.config, self.spool, request.settings, key)

    def _parameters(self, request: JobRequest, token: str, spec: JobSpec, script: Path) -> JobParameters:
        config = self.config
        return JobParameters(
            correlation_id=request.correlation_id,
            reply_to=request.reply_to,
            generation=request.generation,
            inputs=request.inputs,
            layers=tuple((layer.input_name, layer.reply_key) for layer in request.layers),
            roles=request.roles,
            settings=request.settings,
            rodan=RodanAccess(
                base_url=config.rodan_base_url,
                token="" if self._inputs_dir(request) else token,  # HPC_INPUTS_FETCH=login: the job needs none
                timeout_s=config.rodan_timeout_s,
                retries=config.rodan_retries,
            ),
            broker=BrokerAccess(url=config.broker_url, ca_file=config.broker_ca_file),
            spool=self.spool.root,
            runs_dir=config.runs_dir or self.spool.root / "runs",
            runs_shared=config.runs_shared == "group",  # run directories 0750/0640 (worker/trainer/rundir.py)
            save_optimizer=config.save_optimizer,
            mixed_precision=config.mixed_precision,
            seed=config.training_seed,
            max_reply_bytes=config.max_reply_bytes,
            reply_part_bytes=part_bytes_for(request.generation, config.reply_part_bytes),  # generation 3
            # What the worker may download and open (HPC_MAX_INPUT_BYTES, HPC_MAX_INPUT_PIXELS).
            limits=InputLimits(max_input_bytes=config.max_input_bytes, max_input_pixels=config.max_input_pixels),
            # How the job continues itself after a time-limit warning (worker/continuation.py).
            job=SchedulerAccess(
                scheduler=self.scheduler.name,
                options=config.scheduler_options,
                timeout_s=config.scheduler_timeout_s,
                script=script,
                spec=spec,
            ),
            continuation=ContinuationState(
                count=0,
                max=config.max_continuations,
                node_local_dir=config.node_local_dir,
                sync_s=config.checkpoint_sync_s,
            ),
            inputs_dir=self._inputs_dir(request),  # HPC_INPUTS_FETCH=login: where the job reads its inputs
            created_at=time.time(),
            bridge_pid=os.getpid(),
            bridge_version=package_version(),  # the worker warns when its own differs
        )

    def _wait_for_room(self, record: RequestRecord) -> Decision:
        """``HPC_MAX_ACTIVE_JOBS`` jobs are active: the request waits in the queue until one ends. Not a
        failure: no attempt is counted and the ``HPC_DEFER_LIMIT`` clock does not run."""
        record.state = RequestState.RECEIVED  # no job of its own exists (looked up above when SUBMITTING)
        record.reason = (
            f"waiting for a job to end: {self.active.count()} of HPC_MAX_ACTIVE_JOBS={self.active.cap} active"
        )
        record.deferred_since = 0.0
        record.deliveries = 0
        self.ledger.save(record)
        return Decision(Outcome.DEFERRED, record.reason, record, retry_in_s=self.config.reconcile_interval_s)

    def _adopt_existing_job(self, record: RequestRecord) -> bool:
        """After a crash between submit and record: is the job already at the scheduler?"""
        ids = self.scheduler.find_by_name(record.job_name) if record.job_name else []
        if not ids:
            return False
        record.deliveries = 0
        self.ledger.adopt_job(record, ids)
        log.warning("request_adopted_job", job_id=ids[0], jobs_with_name=ids)
        return True

    def _reject(self, record: RequestRecord, reason: str) -> Decision:
        reason = bounded(self.config.public(reason))
        log.error("request_rejected", reason=reason)
        record.state = RequestState.REJECTED
        record.reason = reason
        record.outcome = "error"
        record.deliveries = 0
        self.ledger.save(record)
        # A request given up on after its parameter file was written: the token must not stay on disk.
        self.spool.params_path(record.key).unlink(missing_ok=True)
        self.spool.drop_inputs(record.key)  # HPC_INPUTS_FETCH=login's copies: no job will read them
        self.replies.stage(
            record.correlation_id,
            record.reply_to,
            error_reply(reason),
            origin="bridge",
            part_bytes=part_bytes_for(record.generation, self.config.reply_part_bytes),
        )
        return Decision(Outcome.REJECTED, reason, record)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s" if seconds >= 60 else f"{int(seconds)} s"


def rodan_job_spec(config: BridgeConfig, spool: Spool, s: RequestSettings, key: str) -> JobSpec:
    """The batch job of a Rodan request with settings ``s``: the one place the site's settings meet
    the request's (``doctor``'s sample script and ``doctor --job``'s probe use it too)."""
    job_dir = spool.job_dir(key)
    return JobSpec(
        name=f"rodan-{key}",
        comment=key,
        time_minutes=s.max_time_minutes,
        memory_mb=s.max_memory_mb,
        cpus=s.cpus,
        gres=config.gres_for(s.max_memory_mb),
        email=s.notification_email,
        account=config.account,
        partition=config.partition,
        warn_seconds=config.warn_seconds_for(s.max_time_minutes),
        continue_by=config.continue_by,  # the backend's setting (HPC_SLURM_CONTINUE), if it has one
        extra_args=config.scheduler_args,
        directives=config.job_directives,  # HPC_JOB_DIRECTIVES
        prologue=config.job_prologue,  # HPC_JOB_PROLOGUE
        log_dir=job_dir,
        workdir=job_dir,
        # The environment's directories resolved now: an upgrade that switches a symlink later
        # leaves this job, and the jobs it continues in, on the environment it was submitted with.
        command=(pinned_worker_python(config.worker_python), "-m", "worker", "run", str(spool.params_path(key))),
    )

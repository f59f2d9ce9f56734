"""``hpc-bridge enqueue``: publish a request exactly as Rodan's task does, and wait like it.

Rodan declares both queues with default arguments, publishes the JSON body to
``hpc-jobs`` with ``reply_to`` and a uuid4 ``correlation_id`` (no content type,
transient), then consumes ``hpc-results``, nacking (requeueing) every reply
that is not its own. Operators use this to test a deployment end to end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import structlog

from bridge.amqp import connect, declare_rodan_queue
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.progress import Progress, read_new_events
from bridge.protocol import build_request_body
from bridge.schedulers import short_name
from bridge.spool import Spool, atomic_write, read_json, safe_key

log = structlog.get_logger(__name__)


@dataclass
class ReplyResult:
    correlation_id: str
    body: bytes
    seconds: float
    foreign_nacked: int

    @property
    def data(self) -> dict[str, Any]:
        parsed = json.loads(self.body)
        return parsed if isinstance(parsed, dict) else {"error": f"unexpected reply: {parsed!r}"}

    @property
    def is_error(self) -> bool:
        return "error" in self.data


def publish_request(
    broker_url: str,
    inputs: Mapping[str, str],
    settings: Mapping[str, Any],
    *,
    request_queue: str = "hpc-jobs",
    reply_queue: str = "hpc-results",
    correlation_id: str | None = None,
) -> str:
    correlation_id = correlation_id or str(uuid.uuid4())
    connection = connect(broker_url, name="hpc-bridge-enqueue")
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        declare_rodan_queue(channel, request_queue)
        declare_rodan_queue(channel, reply_queue)
        channel.basic_publish(
            exchange="",
            routing_key=request_queue,
            body=build_request_body(inputs, settings),
            properties=pika.BasicProperties(reply_to=reply_queue, correlation_id=correlation_id),
        )
    finally:
        connection.close()
    log.info("request_enqueued", correlation_id=correlation_id, queue=request_queue)
    return correlation_id


def wait_for_reply(
    broker_url: str,
    correlation_id: str,
    *,
    reply_queue: str = "hpc-results",
    timeout_s: float | None = None,
    progress_every_s: float | None = 15.0,
    on_poll: Callable[[float], None] | None = None,
) -> ReplyResult | None:
    """Consume the reply queue like Rodan: ack our reply, nack (requeue) the others.

    ``on_poll(waited_s)`` is called on this thread (which owns the connection) at least every
    half second while waiting, e.g. to show progress; keep it short. ``progress_every_s=None``
    logs no ``waiting_for_reply`` events (a status line drawn on the log's stream shows it).
    """
    started = time.monotonic()
    connection = connect(broker_url, heartbeat=60, name="hpc-bridge-enqueue")
    foreign = 0
    next_progress = started + progress_every_s if progress_every_s is not None else None
    try:
        channel = connection.channel()
        declare_rodan_queue(channel, reply_queue)
        for method, properties, body in channel.consume(reply_queue, inactivity_timeout=0.5):
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                return None
            if next_progress is not None and progress_every_s is not None and now >= next_progress:
                log.info("waiting_for_reply", correlation_id=correlation_id, waited_s=round(now - started))
                next_progress = now + progress_every_s
            if on_poll is not None:
                on_poll(now - started)
            if method is None:
                continue
            if properties.correlation_id == correlation_id:
                channel.basic_ack(method.delivery_tag)
                return ReplyResult(correlation_id, body, now - started, foreign)
            channel.basic_nack(method.delivery_tag, requeue=True)
            foreign += 1
            time.sleep(0.05)  # kinder than Rodan, which spins on a foreign reply
        return None
    finally:
        if connection.is_open:
            connection.close()


#: The longest file name written, in UTF-8 bytes (most filesystems allow 255).
MAX_NAME_BYTES = 200
_UNSAFE_IN_NAME = re.compile(r"[\x00-\x1f\x7f/\\]")


def model_file_name(key: str) -> str:
    """The file name a reply key is saved under: one name, never a path.

    ``Background Model`` -> ``Background_Model.hdf5``, as ever. Path separators (``/``, ``\\``),
    NUL and other control characters become ``_``, leading dots become ``_`` (no hidden file,
    no ``..``), an empty key is ``model``, and a name too long for a filesystem is cut and
    given a short hash of the key.
    """
    stem = _UNSAFE_IN_NAME.sub("_", key.replace(" ", "_"))
    stem = re.sub(r"^\.+", lambda dots: "_" * len(dots.group()), stem) or "model"
    if len(stem.encode("utf-8")) > MAX_NAME_BYTES:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        stem = stem.encode("utf-8")[: MAX_NAME_BYTES - 13].decode("utf-8", "ignore") + "-" + digest
    return f"{stem}.hdf5"


def save_models(reply: ReplyResult, out_dir: Path) -> dict[str, Path]:
    """Decode the reply's models into ``out_dir``, one file per key (:func:`model_file_name`).

    Nothing is written outside ``out_dir``: every name is a plain file name in it, two keys
    that would share a name get ``-2``, ``-3``, ... and each file is written atomically
    (a temporary file renamed over the name), so a symbolic link already there is replaced,
    never followed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    saved: dict[str, Path] = {}
    taken: set[str] = set()
    for key, value in reply.data.items():
        name = model_file_name(str(key))
        stem, n = name[: -len(".hdf5")], 1
        while name in taken:
            n += 1
            name = f"{stem}-{n}.hdf5"
        taken.add(name)
        path = out_dir / name
        if path.parent != out_dir or path.name != name:  # model_file_name never allows this
            raise ValueError(f"reply key {key!r} does not map to a file name in {out_dir}")
        atomic_write(path, base64.decodebytes(str(value).encode("ascii")), mode=0o644)
        saved[key] = path
    return saved


# --- progress while waiting: what the login node can see of the request ---------------------------


@dataclass
class RequestView:
    """One look at a request from the login node: its ledger record and its run's ``job.log``.

    ``state``: ``waiting`` (no ledger record visible: the request is still in the broker, or the
    spool is not readable from here), ``queued``, ``submitting``, ``submitted``, ``pending``,
    ``running``, ``continuing`` (stopped at the time limit; a new job carries on), ``replying``
    (training ended, the reply is on its way), ``replied``, ``rejected``.
    """

    correlation_id: str
    state: str = "waiting"
    scheduler: str = ""
    job_id: str = ""
    job_state: str = ""
    continuations: int = 0
    layer: int = 0  # 1-based index of the layer of the last finished epoch
    layers: int = 0
    label: str = ""
    epoch: int = 0
    epochs: int = 0  # the most epochs a layer trains (early stopping may end it sooner)
    outcome: str = ""  # "ok" or "error" once replied

    @property
    def fraction(self) -> float | None:
        """Epochs done over epochs planned (every layer at its maximum), when both are known."""
        if not (self.layer and self.layers and self.epochs):
            return None
        return ((self.layer - 1) * self.epochs + min(self.epoch, self.epochs)) / (self.layers * self.epochs)

    @property
    def label_text(self) -> str:
        return "waiting for the reply" if self.state == "waiting" else self.state

    def detail(self) -> str:
        """``slurm job 61  continued 1x  layer 1/2 epoch 3/10``."""
        parts = []
        if self.job_id:
            parts.append(f"{short_name(self.scheduler) or 'job'} job {self.job_id}".strip())
        if self.continuations:
            parts.append(f"continued {self.continuations}x")
        if self.epoch:
            layer = f"layer {self.layer}/{self.layers}" if self.layers else f"layer {self.label!r}"
            parts.append(f"{layer} epoch {self.epoch}" + (f"/{self.epochs}" if self.epochs else ""))
        if self.outcome:
            parts.append(self.outcome)
        return "  ".join(parts)

    def fields(self) -> dict[str, Any]:
        """The JSON progress event's fields (empty ones left out)."""
        data: dict[str, Any] = {"correlation_id": self.correlation_id}
        for name in ("scheduler", "job_id", "job_state", "continuations", "label", "layer", "layers", "epoch"):
            value = getattr(self, name)
            if value:
                data[name] = value
        if self.epochs:
            data["epochs"] = self.epochs
        if self.outcome:
            data["outcome"] = self.outcome
        return data

    def report(self, progress: Progress) -> bool:
        return progress.update(
            self.state, self.detail(), fraction=self.fraction, state_text=self.label_text, **self.fields()
        )


@dataclass
class RequestWatcher:
    """Looks (read-only, cheaply) at what the login node can see of one request: the ledger
    record ``SPOOL/ledger/ID.json`` and the newest run directory's ``job.log`` and
    ``settings.json``. Nothing needs to exist: without the spool the view stays ``waiting``."""

    spool_dir: Path
    runs_dir: Path
    correlation_id: str
    _run: Path | None = None
    _offset: int = 0
    _layers: list[str] = field(default_factory=list)
    _labels: list[str] = field(default_factory=list)
    _epochs: int = 0
    _label: str = ""
    _epoch: int = 0
    _phase: str = ""  # from job.log: started, training, stopped, trained, failed
    _job_id: str = ""  # of the last job.log event that had one

    def poll(self) -> RequestView:
        view = RequestView(self.correlation_id)
        try:
            record = Ledger(Spool(self.spool_dir)).get(self.correlation_id)
        except (OSError, ValueError, TypeError, KeyError):  # unreadable from here, or not a record
            record = None
        if record is not None:
            self._read_job_log(record)
            view.scheduler, view.job_id, view.job_state = record.scheduler, record.job_id, record.job_state
            view.continuations = record.continuations
            view.state = self._state(record)
            if record.state is RequestState.REPLIED:
                view.outcome = record.outcome
        view.epochs, view.label, view.epoch = self._epochs, self._label, self._epoch
        if self._label:  # the layers in job_start's order, else in the order their epochs came
            listed = self._label in self._layers
            view.layer = (self._layers if listed else self._labels).index(self._label) + 1
            view.layers = len(self._layers) if listed else 0
        return view

    def _state(self, record: RequestRecord) -> str:
        if record.state is RequestState.RECEIVED:
            return "queued"
        if record.state is RequestState.SUBMITTING:
            return "submitting"
        if record.state is RequestState.REPLIED:
            return "replied"
        if record.state is RequestState.REJECTED:
            return "rejected"
        this_job = not self._job_id or not record.job_id or self._job_id == record.job_id
        if self._phase in ("started", "training") and this_job:
            return "running"
        if self._phase in ("trained", "failed"):
            return "replying"
        if self._phase == "stopped":
            return "continuing"
        seen = record.job_state.upper()
        if seen == "RUNNING":
            return "running"
        if seen in ("PENDING", "REQUEUED", "SUSPENDED", "HELD"):
            return "pending"
        return "submitted"

    def _read_job_log(self, record: RequestRecord) -> None:
        if self._run is None:
            candidates = sorted(self.runs_dir.glob(f"*-{safe_key(self.correlation_id)}")) if self._runs_ok() else []
            if not candidates:
                return
            self._run = candidates[-1]
        if not self._epochs:
            try:
                settings = read_json(self._run / "settings.json")
                self._epochs = int(settings.get("epochs", 0)) if isinstance(settings, dict) else 0
            except (OSError, ValueError, TypeError):
                pass
        self._offset, events = read_new_events(self._run / "job.log", self._offset)
        for event in events:
            name = event.get("event")
            if event.get("job_id"):
                self._job_id = str(event["job_id"])
            if name in ("job_start", "job_resume"):
                self._phase = "started"
                if isinstance(event.get("layers"), list):
                    self._layers = [str(x) for x in event["layers"]]
            elif name == "epoch":
                self._phase = "training"
                self._label = str(event.get("label", ""))
                if self._label not in self._labels:
                    self._labels.append(self._label)
                self._epoch = int(event.get("epoch") or 0)
            elif name in ("training_stopped", "job_continuing", "job_continued"):
                self._phase = "stopped"
            elif name == "job_trained":
                self._phase = "trained"
            elif name in ("job_failed", "job_not_continued"):
                self._phase = "failed"

    def _runs_ok(self) -> bool:
        try:
            return self.runs_dir.is_dir()
        except OSError:
            return False


def progress_poller(watcher: RequestWatcher, progress: Progress, *, every_s: float = 1.0) -> Callable[[float], None]:
    """An ``on_poll`` for :func:`wait_for_reply`: look at the request every ``every_s`` seconds and
    report it (the elapsed time ticks in between)."""
    next_look = 0.0

    def poll(waited_s: float) -> None:
        nonlocal next_look
        if waited_s >= next_look:
            next_look = waited_s + every_s
            watcher.poll().report(progress)
        else:
            progress.tick()

    return poll

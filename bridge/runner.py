"""The bridge process: ``check`` (one cron pass) and ``run`` (the daemon).

One thread owns the pika connection and does every broker operation. Slow work
(Rodan, the scheduler) runs on a helper thread while the owner keeps servicing
the connection (heartbeats), so a long submit never drops the connection.

A pass: publish staged replies -> take at most ``HPC_DRAIN_BATCH`` requests ->
give deferred requests back -> reconcile submitted jobs -> publish staged replies
(-> prune settled requests: hourly, or every quarter of a shorter HPC_RETENTION_DAYS). Work that
reads the whole ledger runs on the helper thread too, one record at a time. No message, and no
defect met in a pass, ends the daemon: a failed pass is logged with its traceback and the next one
starts after a backoff.

How requests come in. ``check`` (one cron pass, then exit) reads the queue with ``basic_get``
until it is empty. The daemon (``run``) is a consumer: ``basic_consume`` with prefetch 1, so
RabbitMQ's management page shows a consumer on the request queue while it runs, and a request is
pushed the moment it is published (no polling). The delivery callback only appends to an inbox;
the pass takes requests from it and handles each exactly as ``check`` does (the same durable
steps, then the ack), so prefetch 1 means one request in hand at a time, as before.

Deferred requests (Rodan or the scheduler down for now, a submit limit, HPC_MAX_ACTIVE_JOBS)
are held unacked until their retry time and then given back (``basic_nack(requeue=True)``), as
before. A held delivery would fill the consumer's prefetch of 1 and stop every later request, so
after a deferral the consumer is restarted (``basic_cancel`` + ``basic_consume``): RabbitMQ counts
prefetch per consumer, and the held deliveries belong to the cancelled one (they stay unacked on
the channel, and go back to the queue if the connection drops). At most ``HELD_LIMIT`` requests are
held that way; beyond it the consumer is left full, so intake pauses until a held one is given
back (a broker-wide deferral reason, such as the scheduler's submit limit, then costs nothing).
Nacking a deferred request at once instead would hand it straight back: a busy loop.

Supervision (``bridge/sdnotify.py``, ``Type=notify`` units): ``READY=1`` after the first broker
connection, ``WATCHDOG=1`` from this thread's loops (the idle wait, the reconnect backoff, the wait
for the helper thread, between replies published), so a hung loop stops the pings and systemd
restarts the daemon. While the helper thread works the pings go on for at most ``HUNG_WORK_S``; a
call that runs longer is taken as hung. ``STOPPING=1`` once SIGTERM is seen.

A status message (``bridge/ops/heartbeat.py``) goes to HPC_STATUS_QUEUE every HPC_STATUS_INTERVAL
seconds (daemon) or at the end of the pass (``check``), on a channel of its own: a failure there is
logged and never touches the requests.
"""

from __future__ import annotations

import contextvars
import ctypes
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import pika
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from bridge.amqp import (
    CONNECTION_ERRORS,
    connect,
    declare_own_queue,
    declare_rodan_queue,
    describe_url,
    publish,
    queue_counts,
)
from bridge.config import BridgeConfig
from bridge.errors import BrokerUnavailable, NoRoute
from bridge.faults import fault_point
from bridge.intake import Decision, Intake, Message, Outcome
from bridge.ledger import Ledger
from bridge.ops.heartbeat import MESSAGE_TYPE, QueueCounts, build_status, encode, status_line
from bridge.ops.heartbeat import status_queue_arguments as status_arguments
from bridge.protocol import bounded
from bridge.reconcile import Reconciler
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.rodan_cancel import RodanCancels
from bridge.schedulers import Scheduler, get_scheduler
from bridge.sdnotify import Notifier
from bridge.spool import Spool

log = structlog.get_logger(__name__)
T = TypeVar("T")
PRUNE_INTERVAL_S = 3600.0
#: ... or more often: at least this many prunes per HPC_RETENTION_DAYS, so that a short retention is
#: kept to (a settled record lives at most 1.25 times it), and with it what a pass over the ledger reads.
PRUNES_PER_RETENTION = 4
#: Deferred requests held unacked at once (each after a consumer restart); beyond: intake pauses.
HELD_LIMIT = 100
#: A call on the helper thread running longer than this is taken as hung: no more watchdog pings.
HUNG_WORK_S = 1800.0
#: The daemon's per-consumer prefetch: one request in hand at a time.
PREFETCH = 1
RECOVERABLE: tuple[type[BaseException], ...] = (BrokerUnavailable, *CONNECTION_ERRORS)
#: What may go wrong with the status message (NoRoute: its queue was deleted meanwhile): logged only.
STATUS_ERRORS: tuple[type[BaseException], ...] = (NoRoute, *RECOVERABLE)
#: glibc's mallopt parameter M_MMAP_THRESHOLD, and what the daemon pins it at (glibc's default).
M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES = -3, 128 * 1024


def pin_mmap_threshold() -> bool:
    """Keep the daemon's memory from ratcheting up in glibc's heap (benchmarks/README.md, "Months of
    running"); True when pinned.

    glibc gives a block of M_MMAP_THRESHOLD (128 KiB) or more a mapping of its own, unmapped when
    freed; but the first time such a block is freed it raises the threshold to that size, and from
    then on blocks that large come from the heap, where smaller ones soon split the space each one
    leaves, so the next needs new pages. The daemon reallocates one such block for ever: CPython
    3.11's table of interned strings (about 1.9 MiB; pathlib interns every path component, so each
    temporary file name written and each ledger file name read is a new entry, and the table is
    rebuilt whenever deleted entries fill it). Each rebuild left about 1.9 MiB more resident. Set
    explicitly, the threshold no longer moves. MALLOC_MMAP_THRESHOLD_ in the environment wins; not
    glibc: nothing to do.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


@dataclass
class _Deferred:
    delivery_tag: int
    due: float
    correlation_id: str = ""


@dataclass
class PassStats:
    received: int = 0
    submitted: int = 0
    rejected: int = 0
    deferred: int = 0
    duplicates: int = 0
    replies_sent: int = 0
    judged: int = 0


def _wake(connection: pika.BlockingConnection) -> None:
    try:
        connection.add_callback_threadsafe(lambda: None)
    except CONNECTION_ERRORS:
        pass  # closed meanwhile: the owner notices on its own


class Bridge:
    def __init__(
        self,
        config: BridgeConfig,
        *,
        scheduler: Scheduler | None = None,
        notifier: Notifier | None = None,
        hung_work_s: float = HUNG_WORK_S,
    ) -> None:
        self.config = config
        self.spool = Spool(config.spool_dir).ensure().claim(config.instance)
        self.ledger = Ledger(self.spool)
        self.scheduler = scheduler or get_scheduler(
            config.scheduler,
            timeout_s=config.scheduler_timeout_s,
            options=config.scheduler_options,
            scheduler_args=config.scheduler_args,
        )
        self.replies = ReplyBox(self.spool, max_bytes=config.max_reply_bytes, wait_s=config.reply_wait_s)
        self.rodan = RodanClient(
            config.rodan_base_url,
            user=config.rodan_user,
            email=config.rodan_email,
            password=config.rodan_password,
            timeout_s=config.rodan_timeout_s,
            retries=config.rodan_retries,
        )
        self.intake = Intake(config, self.spool, self.ledger, self.scheduler, self.rodan, self.replies)
        self.cancels = RodanCancels(config, self.spool, self.ledger, self.scheduler, self.replies, self.rodan)
        self.intake.cancels = self.cancels
        self.reconciler = Reconciler(config, self.spool, self.ledger, self.scheduler, self.replies, self.cancels)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-work")
        self._stop = threading.Event()
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._deferred: list[_Deferred] = []
        self.reconciliations = 0  # counted for the metrics file (HPC_METRICS_FILE)
        self.broker_reconnects = 0
        self._next_prune = 0.0
        self.notifier = notifier if notifier is not None else Notifier()
        self.hung_work_s = hung_work_s
        self.mode = "check"
        self.started_at = time.time()
        self.passes = 0
        self.last_pass_at: float | None = None
        self.last_pass_ok: bool | None = None
        self._consumer_tag: str | None = None
        self._consumer_cancelled = False
        self._inbox: deque[tuple[Any, pika.BasicProperties, bytes]] = deque()
        self._status_channel: BlockingChannel | None = None
        self._status_problem = ""
        self._next_status = 0.0
        self._work_stalled = False

    # --- signals: the handler only sets a flag --------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            self._stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- entry points ----------------------------------------------------------
    def check(self) -> int:
        """One pass, then exit. Exit status 0 when the pass completed, 1 otherwise."""
        with self.spool.lock() as held:
            if not held:
                log.info("bridge_lock_busy", note="another hpc-bridge is working on this spool")
                return 0
            log.info("check_start", broker=describe_url(self.config.broker_url), scheduler=self.scheduler.name)
            try:
                self._open()
                stats = self._pass(drain_all=True, reconcile=True)
                self._pass_done(ok=True)
                self._publish_status()
            except BrokerUnavailable as exc:
                log.error("broker_unavailable", error=str(exc))
                self._run_offline_reconcile()
                return 1
            except CONNECTION_ERRORS as exc:
                log.error("broker_lost", error=f"{type(exc).__name__}: {exc}")
                return 1
            except Exception as exc:  # a defect: logged with its traceback; the next pass starts afresh
                log.error("pass_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                return 1
            finally:
                self._close()
            log.info("check_done", **stats.__dict__)
            return 0

    def run(self) -> int:
        """The daemon: consume requests, reconcile periodically, reconnect with backoff."""
        with self.spool.lock() as held:
            if not held:
                log.error("bridge_lock_busy", note="another hpc-bridge is working on this spool")
                return 1
            self.mode = "daemon"
            pin_mmap_threshold()
            log.info(
                "daemon_start",
                broker=describe_url(self.config.broker_url),
                scheduler=self.scheduler.name,
                systemd_notify=self.notifier.enabled,
                watchdog_s=self.notifier.watchdog_s,
            )
            self.notifier.status(f"connecting to the broker at {describe_url(self.config.broker_url)}")
            backoff = 1.0
            next_reconcile = 0.0
            while not self.stopping:
                try:
                    self._open()
                    self._start_consuming()
                    log.info("broker_connected")
                    self.notifier.ready(f"connected; consuming {self.config.request_queue}")
                    while not self.stopping:
                        due = time.monotonic() >= next_reconcile
                        self._pass(drain_all=False, reconcile=due)
                        self._pass_done(ok=True)
                        backoff = 1.0
                        if due:
                            next_reconcile = time.monotonic() + self.config.reconcile_interval_s
                        if time.monotonic() >= self._next_status:
                            self._publish_status()
                            self._next_status = time.monotonic() + self.config.status_interval_s
                        self._sleep(self.config.poll_interval_s)
                except RECOVERABLE as exc:
                    self.broker_reconnects += 1
                    log.warning("broker_lost", error=f"{type(exc).__name__}: {exc}", retry_in_s=backoff)
                    self.notifier.status(f"waiting for the broker (retry in {backoff:.0f} s): {exc}")
                except Exception as exc:  # a defect: the daemon must outlive it (the unacked message goes back)
                    log.error("pass_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=backoff, exc_info=True)
                    self._pass_done(ok=False)
                    self.notifier.status(f"pass failed (retry in {backoff:.0f} s): {type(exc).__name__}")
                else:
                    continue
                self._close()
                self._deferred.clear()  # unacked deliveries went back to the queue with the channel
                self._wait(backoff)
                backoff = min(backoff * 2, 60.0)
            self._tick()  # STOPPING=1
            self._close()
            log.info("daemon_stop")
            return 0

    # --- one pass ----------------------------------------------------------------
    def _pass(self, *, drain_all: bool, reconcile: bool) -> PassStats:
        stats = PassStats()
        self._tick()
        if self._consumer_cancelled:
            raise BrokerUnavailable(f"the broker cancelled the consumer on {self.config.request_queue!r}")
        self.intake.active.new_pass()  # HPC_MAX_ACTIVE_JOBS: count afresh, log the cap once per pass
        stats.replies_sent += self._flush()
        seen: set[str] = set()
        # Read to its end (not stopped, not cut at HPC_DRAIN_BATCH): what is not in the queue is gone.
        drained = self._drain(stats, seen, need_end=reconcile)
        self._release_deferred(force=drain_all)
        if reconcile:
            stats.judged = self._off_connection_thread(self.reconciler.reconcile)
            if drained:
                stats.judged += self._off_connection_thread(self.reconciler.judge_lost, seen | self._held_ids())
            self.reconciliations += 1
        stats.replies_sent += self._flush()
        if stats.replies_sent:
            # Only our own publications need marking as replied now; replies the workers sent are
            # marked by reconcile() on its interval (mark_replied reads the whole ledger).
            self._off_connection_thread(self.reconciler.mark_replied)
        if reconcile:
            self._off_connection_thread(self.write_metrics)
            if time.monotonic() >= self._next_prune:
                self._off_connection_thread(self.prune)
                self._next_prune = time.monotonic() + self.prune_interval_s
        return stats

    @property
    def prune_interval_s(self) -> float:
        """Hourly, or a quarter of HPC_RETENTION_DAYS where that is shorter (at least a minute)."""
        return max(60.0, min(PRUNE_INTERVAL_S, self.config.retention_days * 86400.0 / PRUNES_PER_RETENTION))

    def prune(self) -> None:
        """Forget requests settled longer than HPC_RETENTION_DAYS ago (a failure is logged, never fatal)."""
        from bridge.ops.prune import prune

        try:
            prune(self.config, self.spool, self.ledger)
        except OSError as exc:
            log.warning("prune_failed", error=str(exc))

    def write_metrics(self) -> None:
        """Rewrite HPC_METRICS_FILE, when set (a failure is logged, never fatal)."""
        if self.config.metrics_file is None:
            return
        from bridge.ops.metrics import outbox_size, write_metrics

        try:
            write_metrics(
                self.config.metrics_file,
                self.ledger.all(),
                outbox=outbox_size(self.spool),
                reconciliations=self.reconciliations,
                broker_reconnects=self.broker_reconnects,
                instance=self.config.instance,
            )
        except OSError as exc:
            log.warning("metrics_write_failed", path=str(self.config.metrics_file), error=str(exc))

    def _drain(self, stats: PassStats, seen: set[str], *, need_end: bool = True) -> bool:
        """Take up to HPC_DRAIN_BATCH requests; True when the queue was read to its end (the
        daemon asks the broker only when ``need_end``: reconciliation's judge_lost needs it)."""
        channel = self._require_channel()
        for _ in range(self.config.drain_batch):
            if self.stopping:
                return False
            self._tick()
            if self._consumer_tag is None:  # check: read the queue until it is empty
                method, properties, body = channel.basic_get(self.config.request_queue, auto_ack=False)
                if method is None:
                    return True
            elif self._inbox or self._dispatch():
                method, properties, body = self._inbox.popleft()
            else:
                return need_end and self._read_to_end(channel)
            fault_point("after_get")
            msg = Message.from_delivery(method, properties, body)
            stats.received += 1
            seen.add(msg.correlation_id or "")
            decision = self._decide(msg)
            self._apply_decision(channel, msg, decision)
            if decision.outcome is Outcome.SUBMITTED:
                stats.submitted += 1
            elif decision.outcome in (Outcome.REJECTED, Outcome.UNANSWERABLE):
                stats.rejected += 1
            elif decision.outcome is Outcome.DEFERRED:
                stats.deferred += 1
            else:
                stats.duplicates += 1
        return False

    def _decide(self, msg: Message) -> Decision:
        """``Intake.process`` on the helper thread. It raises only when the spool cannot be written
        (a full disk): the message is then given back later, as for any transient failure."""
        try:
            return self._off_connection_thread(self.intake.process, msg)
        except RECOVERABLE:
            raise
        except Exception as exc:
            log.error(
                "request_deferred",
                correlation_id=msg.correlation_id,
                error=f"{type(exc).__name__}: {exc}",
                attempts=1,
                exc_info=True,
            )
            return Decision(Outcome.DEFERRED, f"{type(exc).__name__}: {exc}")

    def _apply_decision(self, channel: BlockingChannel, msg: Message, decision: Decision) -> None:
        """Everything that touches the broker for one message, on the owner thread."""
        if decision.outcome is Outcome.DEFERRED:
            attempts = decision.record.attempts if decision.record else 1
            due = time.monotonic() + (decision.retry_in_s or min(5.0 * 2 ** min(attempts - 1, 8), 300.0))
            self._deferred.append(_Deferred(msg.delivery_tag, due, msg.correlation_id or ""))
            if self._consumer_tag is not None and len(self._deferred) <= HELD_LIMIT:
                self._restart_consumer(channel)  # the held delivery must not fill the prefetch
            return
        if decision.outcome is Outcome.REJECTED and msg.correlation_id:
            # The staged error reply goes out before the message is dropped: this one only, not the
            # whole outbox (that is flushed once per pass).
            entry = self.replies.staged_entry(msg.correlation_id)
            if entry is not None:
                self.replies.flush(channel, self.reconciler.may_publish, entries=[entry])
        if decision.outcome in (Outcome.REJECTED, Outcome.UNANSWERABLE):
            self._dead_letter(channel, msg, decision.reason)
            if decision.record is not None:
                decision.record.dead_lettered = True
                self.ledger.save(decision.record)
        fault_point("before_ack")
        channel.basic_ack(msg.delivery_tag)
        log.info("request_acked", correlation_id=msg.correlation_id, outcome=decision.outcome.value)

    def _dead_letter(self, channel: BlockingChannel, msg: Message, reason: str) -> None:
        headers = {
            "x-hpc-bridge-reason": bounded(reason),
            "x-hpc-bridge-rejected-at": int(time.time()),
            "x-original-queue": self.config.request_queue,
        }
        publish(
            channel,
            self.config.dead_letter_queue,
            msg.body,
            correlation_id=msg.correlation_id,
            reply_to=msg.reply_to,
            headers=headers,
            persistent=True,
        )
        log.info("request_dead_lettered", correlation_id=msg.correlation_id, queue=self.config.dead_letter_queue)

    def _held_ids(self) -> set[str]:
        """Correlation ids of the deferred requests this daemon holds (unacked, so not in the queue)."""
        return {item.correlation_id for item in self._deferred}

    def _release_deferred(self, *, force: bool) -> None:
        """Give deferred requests back to the queue (their retry time came, or the pass ends)."""
        if not self._deferred or self._channel is None:
            return
        now = time.monotonic()
        keep: list[_Deferred] = []
        for item in self._deferred:
            if force or item.due <= now:
                self._channel.basic_nack(item.delivery_tag, requeue=True)
            else:
                keep.append(item)
        self._deferred = keep

    def _flush(self) -> int:
        def may_publish(entry: Any) -> bool:
            self._tick()  # a large outbox is published on this thread: keep systemd's watchdog fed
            return self.reconciler.may_publish(entry)

        return self.replies.flush(self._require_channel(), may_publish)

    # --- connection ownership ------------------------------------------------------
    def _open(self) -> None:
        self._connection = connect(
            self.config.broker_url,
            heartbeat=self.config.broker_heartbeat_s,
            ca_file=self.config.broker_ca_file,
            name="hpc-bridge",
        )
        channel = self._connection.channel()
        channel.confirm_delivery()
        declare_rodan_queue(channel, self.config.request_queue)
        declare_own_queue(channel, self.config.dead_letter_queue)
        self._channel = channel

    def _close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._status_channel, self._consumer_tag, self._consumer_cancelled = None, None, False
        self._inbox.clear()  # undelivered: back in the queue once the connection is closed
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except CONNECTION_ERRORS:
                pass

    def _require_channel(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            raise BrokerUnavailable("no open channel")
        return self._channel

    def _off_connection_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` on the helper thread while this thread services the connection."""
        context = contextvars.copy_context()  # keeps the bound log context on the helper thread
        future: Future[T] = self._executor.submit(context.run, fn, *args)
        connection = self._connection
        if connection is not None and connection.is_open:
            # Wake process_data_events the moment the work is done, instead of at its next timeout.
            future.add_done_callback(lambda _f: _wake(connection))
        started = time.monotonic()
        while not future.done():
            if time.monotonic() - started < self.hung_work_s:
                self._tick()
            elif not self._work_stalled:
                self._work_stalled = True
                log.error(
                    "work_stalled",
                    work=getattr(fn, "__qualname__", repr(fn)),
                    seconds=round(time.monotonic() - started),
                    note="taken as hung: the systemd watchdog is no longer fed",
                )
            if connection is not None and connection.is_open:
                connection.process_data_events(time_limit=1.0)
            else:
                wait([future], timeout=0.1)
        self._work_stalled = False
        return future.result()

    def _sleep(self, seconds: float) -> None:
        """Idle between passes, servicing the connection; a delivery ends the wait at once."""
        deadline = time.monotonic() + seconds
        while not self.stopping and not self._inbox and (remaining := deadline - time.monotonic()) > 0:
            self._tick()
            if self._connection is not None:
                # Returns as soon as a delivery has been dispatched to the inbox.
                self._connection.process_data_events(time_limit=min(remaining, 0.1))
            else:
                time.sleep(min(remaining, 0.1))
        self._release_deferred(force=False)

    def _wait(self, seconds: float) -> None:
        """The reconnect backoff: the daemon is healthy while the broker is away, so keep pinging."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (remaining := deadline - time.monotonic()) > 0:
            self._tick()
            self._stop.wait(min(remaining, 0.5))

    def _tick(self) -> None:
        """From this thread's loops only (never a signal handler, never a side thread)."""
        if self.stopping:
            self.notifier.stopping("stopping: finishing the request in hand")
        self.notifier.watchdog()

    # --- the consumer (daemon) -------------------------------------------------------
    def _start_consuming(self) -> None:
        channel = self._require_channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        channel.add_on_cancel_callback(self._on_cancelled)
        self._consumer_tag = channel.basic_consume(self.config.request_queue, self._on_delivery, auto_ack=False)

    def _restart_consumer(self, channel: BlockingChannel) -> None:
        if self._consumer_tag is not None:
            channel.basic_cancel(self._consumer_tag)
        self._consumer_tag = channel.basic_consume(self.config.request_queue, self._on_delivery, auto_ack=False)

    def _on_delivery(
        self, _channel: BlockingChannel, method: Any, properties: pika.BasicProperties, body: bytes
    ) -> None:
        self._inbox.append((method, properties, body))  # taken by the next pass, on this same thread

    def _on_cancelled(self, _frame: Any) -> None:
        self._consumer_cancelled = True  # the queue was deleted: reconnect and declare it again

    def _dispatch(self) -> bool:
        """Hand deliveries that have already arrived to the inbox; True when it holds one."""
        if self._connection is not None and self._connection.is_open:
            self._connection.process_data_events(time_limit=0)
        return bool(self._inbox)

    def _read_to_end(self, channel: BlockingChannel) -> bool:
        """Whether the request queue holds nothing we have not seen (judge_lost relies on it).

        The broker's count leaves out deliveries on their way to us; a second round trip on the
        same channel brings any delivery the queue made before answering the first one in ahead
        of its own answer, so an empty inbox after it is a complete picture."""
        if self._inbox:
            return False
        ready, _consumers = queue_counts(channel, self.config.request_queue)
        if ready:
            return False
        queue_counts(channel, self.config.request_queue)
        return not self._dispatch()

    # --- the status message ---------------------------------------------------------------
    def _pass_done(self, *, ok: bool) -> None:
        self.passes += 1
        self.last_pass_at = time.time()
        self.last_pass_ok = ok

    def _publish_status(self) -> None:
        """Publish the status message (and update systemd's STATUS= line); never raises for the broker."""
        if not self.config.status_queue and not self.notifier.enabled:
            return
        from bridge.ops.metrics import outbox_size

        outbox = self._off_connection_thread(outbox_size, self.spool)
        queues = QueueCounts()
        channel = None
        try:
            channel = self._open_status_channel()
            queues.waiting, queues.consumers = queue_counts(channel, self.config.request_queue)
            queues.dead_letters, _ = queue_counts(channel, self.config.dead_letter_queue)
        except STATUS_ERRORS as exc:
            self._status_failed(exc)
            channel = None  # the STATUS= line still says what is known; nothing is published
        # Counted on the helper thread as the ledger is read, one record at a time (never a list of them).
        status = self._off_connection_thread(
            partial(
                build_status,
                self.ledger.all(),
                mode=self.mode,
                scheduler=self.scheduler.name,
                request_queue=self.config.request_queue,
                interval_s=self.config.status_interval_s if self.mode == "daemon" else None,
                started_at=self.started_at,
                last_pass_at=self.last_pass_at,
                last_pass_ok=self.last_pass_ok,
                passes=self.passes,
                held=len(self._deferred),
                outbox=outbox,
                queues=queues,
                broker_connected=self._connection is not None and self._connection.is_open,
            )
        )
        if self.mode == "daemon":
            self.notifier.status(status_line(status))
        if channel is None or not self.config.status_queue:
            return
        try:
            publish(
                channel,
                self.config.status_queue,
                encode(status),
                content_type="application/json",
                message_type=MESSAGE_TYPE,
            )
        except STATUS_ERRORS as exc:
            self._status_failed(exc)
            return
        if self._status_problem:
            log.info("status_publish_recovered", queue=self.config.status_queue)
            self._status_problem = ""

    def _open_status_channel(self) -> BlockingChannel:
        """A channel of its own: a refused declaration (406) or a missing queue (404) closes only it."""
        if self._status_channel is not None and self._status_channel.is_open:
            return self._status_channel
        if self._connection is None or not self._connection.is_open:
            raise BrokerUnavailable("not connected")
        channel = self._connection.channel()
        channel.confirm_delivery()
        if self.config.status_queue:
            declare_own_queue(channel, self.config.status_queue, status_arguments())
        self._status_channel = channel
        return channel

    def _status_failed(self, exc: BaseException) -> None:
        self._status_channel = None
        problem = f"{type(exc).__name__}: {exc}"
        if problem != self._status_problem:  # once per distinct problem, not every interval
            self._status_problem = problem
            log.warning("status_publish_failed", queue=self.config.status_queue, error=problem)

    def _run_offline_reconcile(self) -> None:
        """Broker down: still watch jobs so error replies are staged for the next pass."""
        try:
            judged = self.reconciler.reconcile()
            self.reconciliations += 1
            self.write_metrics()
            log.info("offline_reconcile", judged=judged, staged=len(self.replies.staged()))
        except Exception as exc:
            log.warning("offline_reconcile_failed", error=str(exc))

"""The bridge process: ``check`` (one cron pass) and ``run`` (the daemon).

One thread owns the pika connection and does every broker operation. Slow work
(Rodan, the scheduler) runs on a helper thread while the owner keeps servicing
the connection (heartbeats), so a long submit never drops the connection.

A pass: publish staged replies -> take at most ``HPC_DRAIN_BATCH`` requests ->
give deferred requests back -> reconcile submitted jobs -> publish staged replies
(-> prune settled requests, at most hourly). Work that reads the whole ledger runs on
the helper thread too. No message, and no defect met in a pass, ends the daemon: a
failed pass is logged with its traceback and the next one starts after a backoff.
"""

from __future__ import annotations

import contextvars
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

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
)
from bridge.config import BridgeConfig
from bridge.errors import BrokerUnavailable
from bridge.faults import fault_point
from bridge.intake import Decision, Intake, Message, Outcome
from bridge.ledger import Ledger
from bridge.protocol import bounded
from bridge.reconcile import Reconciler
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import Scheduler, get_scheduler
from bridge.spool import Spool

log = structlog.get_logger(__name__)
T = TypeVar("T")
PRUNE_INTERVAL_S = 3600.0
RECOVERABLE: tuple[type[BaseException], ...] = (BrokerUnavailable, *CONNECTION_ERRORS)


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
    def __init__(self, config: BridgeConfig, *, scheduler: Scheduler | None = None) -> None:
        self.config = config
        self.spool = Spool(config.spool_dir).ensure()
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
        self.reconciler = Reconciler(config, self.spool, self.ledger, self.scheduler, self.replies)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-work")
        self._stop = threading.Event()
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._deferred: list[_Deferred] = []
        self.reconciliations = 0  # counted for the metrics file (HPC_METRICS_FILE)
        self.broker_reconnects = 0
        self._next_prune = 0.0

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
        """The daemon: poll for requests, reconcile periodically, reconnect with backoff."""
        with self.spool.lock() as held:
            if not held:
                log.error("bridge_lock_busy", note="another hpc-bridge is working on this spool")
                return 1
            log.info("daemon_start", broker=describe_url(self.config.broker_url), scheduler=self.scheduler.name)
            backoff = 1.0
            next_reconcile = 0.0
            while not self.stopping:
                try:
                    self._open()
                    log.info("broker_connected")
                    while not self.stopping:
                        due = time.monotonic() >= next_reconcile
                        self._pass(drain_all=False, reconcile=due)
                        backoff = 1.0
                        if due:
                            next_reconcile = time.monotonic() + self.config.reconcile_interval_s
                        self._sleep(self.config.poll_interval_s)
                except RECOVERABLE as exc:
                    self.broker_reconnects += 1
                    log.warning("broker_lost", error=f"{type(exc).__name__}: {exc}", retry_in_s=backoff)
                except Exception as exc:  # a defect: the daemon must outlive it (the unacked message goes back)
                    log.error("pass_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=backoff, exc_info=True)
                else:
                    continue
                self._close()
                self._deferred.clear()  # unacked deliveries went back to the queue with the channel
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
            self._close()
            log.info("daemon_stop")
            return 0

    # --- one pass ----------------------------------------------------------------
    def _pass(self, *, drain_all: bool, reconcile: bool) -> PassStats:
        stats = PassStats()
        stats.replies_sent += self._flush()
        seen: set[str] = set()
        # Read to its end (not stopped, not cut at HPC_DRAIN_BATCH): what is not in the queue is gone.
        drained = self._drain(stats, seen)
        self._release_deferred(force=drain_all)
        if reconcile:
            stats.judged = self._blocking(self.reconciler.reconcile)
            if drained:
                stats.judged += self._blocking(self.reconciler.judge_lost, seen | self._held_ids())
            self.reconciliations += 1
        stats.replies_sent += self._flush()
        if stats.replies_sent:
            # Only our own publications need settling now; replies the workers sent are
            # settled by reconcile() on its interval (settle reads the whole ledger).
            self._blocking(self.reconciler.settle)
        if reconcile:
            self._blocking(self.write_metrics)
            if time.monotonic() >= self._next_prune:
                self._blocking(self.prune)
                self._next_prune = time.monotonic() + PRUNE_INTERVAL_S
        return stats

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
            )
        except OSError as exc:
            log.warning("metrics_write_failed", path=str(self.config.metrics_file), error=str(exc))

    def _drain(self, stats: PassStats, seen: set[str]) -> bool:
        """Take up to HPC_DRAIN_BATCH requests; True when the queue was read to its end."""
        channel = self._require_channel()
        for _ in range(self.config.drain_batch):
            if self.stopping:
                return False
            method, properties, body = channel.basic_get(self.config.request_queue, auto_ack=False)
            if method is None:
                return True
            fault_point("after_get")
            msg = Message.from_delivery(method, properties, body)
            stats.received += 1
            seen.add(msg.correlation_id or "")
            decision = self._decide(msg)
            self._settle_message(channel, msg, decision)
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
            return self._blocking(self.intake.process, msg)
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

    def _settle_message(self, channel: BlockingChannel, msg: Message, decision: Decision) -> None:
        """Everything that touches the broker for one message, on the owner thread."""
        if decision.outcome is Outcome.DEFERRED:
            attempts = decision.record.attempts if decision.record else 1
            due = time.monotonic() + min(5.0 * 2 ** min(attempts - 1, 8), 300.0)
            self._deferred.append(_Deferred(msg.delivery_tag, due, msg.correlation_id or ""))
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
        return self.replies.flush(self._require_channel(), self.reconciler.may_publish)

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
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except CONNECTION_ERRORS:
                pass

    def _require_channel(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            raise BrokerUnavailable("no open channel")
        return self._channel

    def _blocking(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` on the helper thread while this thread services the connection."""
        context = contextvars.copy_context()  # keeps the bound log context on the helper thread
        future: Future[T] = self._executor.submit(context.run, fn, *args)
        connection = self._connection
        if connection is not None and connection.is_open:
            # Wake process_data_events the moment the work is done, instead of at its next timeout.
            future.add_done_callback(lambda _f: _wake(connection))
        while not future.done():
            if connection is not None and connection.is_open:
                connection.process_data_events(time_limit=1.0)
            else:
                wait([future], timeout=0.1)
        return future.result()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and (remaining := deadline - time.monotonic()) > 0:
            if self._connection is not None:
                self._connection.process_data_events(time_limit=min(remaining, 0.1))
            else:
                time.sleep(min(remaining, 0.1))
        self._release_deferred(force=False)

    def _run_offline_reconcile(self) -> None:
        """Broker down: still watch jobs so error replies are staged for the next pass."""
        try:
            judged = self.reconciler.reconcile()
            self.reconciliations += 1
            self.write_metrics()
            log.info("offline_reconcile", judged=judged, staged=len(self.replies.staged()))
        except Exception as exc:
            log.warning("offline_reconcile_failed", error=str(exc))

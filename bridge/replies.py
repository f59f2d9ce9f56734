"""Replies to Rodan: staged on disk first, published with confirms, marked once sent.

Exactly one final reply per request is the contract. The protocol here:

1. ``stage``: write the reply body, then its metadata, into ``SPOOL/outbox``
   (the metadata file's presence means the entry is complete).
2. ``publish_staged``: publish with publisher confirms; on the confirm, write
   ``SPOOL/replies/KEY.json`` (the "replied" marker), then drop the outbox entry.
   ``SPOOL/replies/KEY.sending``, written just before the publish, says one was under way: a
   process killed between the broker's confirm and the marker cannot know whether the reply
   arrived, so the next publish of that entry carries an expiry (``UNCERTAIN_REPLY_TTL_MS``).
3. Whoever finds a staged entry later (the bridge on every pass) publishes it,
   unless the marker already exists. A reply the WORKER staged belongs to the
   worker while its job may still run (it is publishing it right now, or will):
   the bridge only takes it over once reconciliation has seen the job end
   (``may_publish``), so the two never publish the same reply.

So a reply that could not be published (broker down) is never lost, and a
request with a marker is never answered again.

A reply staged with ``part_bytes`` (generation 3: docs/protocol.md §3.5) is staged whole, once, and
published as consecutive parts of at most that many bytes, each its own persistent message with the
headers ``x-hpc-part`` (1-based) and ``x-hpc-parts``; the marker is written only once every part was
confirmed. A republish sends every part again (the receiver keeps parts by index, so a part that
comes twice is harmless) and never with an expiry: its queue is the run's own, where no other task
nacks it. The part size is the staged entry's (its metadata), so every publish cuts the same parts.

One exception bounds the outbox: a reply
whose queue does not exist (Rodan's task that declared it is gone) waits ``wait_s``
(``HPC_REPLY_WAIT``) from its staging, then expires: its marker says ``expired``. The worker and the bridge both
use this class; it needs the spool to be on storage both can reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pika.adapters.blocking_connection import BlockingChannel

from bridge.amqp import CONNECTION_ERRORS, publish
from bridge.errors import BrokerUnavailable, NoRoute, PermanentError
from bridge.faults import fault_point
from bridge.handoff import DEFAULT_MAX_REPLY_BYTES
from bridge.protocol import Generation, error_reply, reply_is_error
from bridge.spool import Spool, atomic_write, atomic_write_json, read_json, safe_key

log = structlog.get_logger(__name__)

#: The headers of a reply published in parts (docs/protocol.md §3.5): 1-based index, and count.
PART_HEADER = "x-hpc-part"
PARTS_HEADER = "x-hpc-parts"

#: The expiry of a reply published again after a publish whose outcome is unknown (its process
#: died between publishing and writing the marker): long enough for a waiting Rodan task to take
#: it if the first one never arrived, short enough to bound a duplicate's nack loop at Rodan.
UNCERTAIN_REPLY_TTL_MS = 15 * 60 * 1000


def split_parts(body: bytes, part_bytes: int) -> list[bytes]:
    """``body`` cut into consecutive parts of at most ``part_bytes`` (one empty part for an empty body)."""
    return [body[start : start + part_bytes] for start in range(0, len(body), part_bytes)] or [body]


def part_bytes_for(generation: str | Generation, part_bytes: int) -> int | None:
    """``part_bytes`` when a request of ``generation`` (a ``Generation`` or the ledger's text; "" when
    unknown) is answered in parts, else None (one message)."""
    try:
        in_parts = Generation(generation).replies_in_parts
    except ValueError:
        in_parts = False
    return part_bytes if in_parts else None


@contextmanager
def _spare_channel(channel: BlockingChannel) -> Iterator[BlockingChannel]:
    """A new confirm-mode channel on ``channel``'s connection, closed on leaving the block."""
    try:
        spare = channel.connection.channel()
        spare.confirm_delivery()
    except CONNECTION_ERRORS as exc:
        raise BrokerUnavailable(f"no channel after the broker refused a reply: {type(exc).__name__}") from exc
    try:
        yield spare
    finally:
        if spare.is_open:
            try:
                spare.close()
            except CONNECTION_ERRORS:
                pass


@dataclass(frozen=True)
class StagedReply:
    key: str
    correlation_id: str
    reply_to: str
    body_path: Path
    meta_path: Path
    origin: str
    staged_at: float = 0.0
    part_bytes: int | None = None  # published in parts of at most this many bytes; None: one message


class ReplyBox:
    def __init__(self, spool: Spool, *, max_bytes: int = DEFAULT_MAX_REPLY_BYTES, wait_s: float = 86400.0) -> None:
        self.spool = spool
        self.max_bytes = max_bytes
        self.wait_s = wait_s

    def already_replied(self, correlation_id: str) -> bool:
        return self.spool.reply_marker(safe_key(correlation_id)).exists()

    def marker(self, correlation_id: str) -> dict[str, Any] | None:
        path = self.spool.reply_marker(safe_key(correlation_id))
        if not path.exists():
            return None
        data = read_json(path)
        return data if isinstance(data, dict) else None

    def stage(
        self, correlation_id: str, reply_to: str, body: bytes, *, origin: str, part_bytes: int | None = None
    ) -> StagedReply:
        """Keep the reply on disk until it is confirmed. An oversized reply becomes an error reply.

        ``part_bytes``: publish it in parts of at most this many bytes (a request whose generation
        wants parts: ``JobParameters.reply_part_bytes``, or :func:`part_bytes_for` from the ledger's
        generation); None: one message, as Rodan's own jobs expect."""
        if part_bytes is not None and part_bytes < 1:
            raise ValueError(f"part_bytes must be positive, got {part_bytes}")
        if len(body) > self.max_bytes:
            reason = (
                f"the reply is {len(body)} bytes, larger than the broker's message limit of "
                f"{self.max_bytes} bytes (HPC_MAX_REPLY_BYTES / RabbitMQ max_message_size); "
                "train fewer layers per request or raise the broker's limit"
            )
            log.error("reply_too_large", bytes=len(body), limit=self.max_bytes)
            body = error_reply(reason)
        key = safe_key(correlation_id)
        body_path = self.spool.outbox_dir / f"{key}.body"
        meta_path = self.spool.outbox_dir / f"{key}.json"
        staged_at = time.time()
        atomic_write(body_path, body)
        meta = {
            "correlation_id": correlation_id,
            "reply_to": reply_to,
            "origin": origin,
            "bytes": len(body),
            "outcome": "error" if reply_is_error(body) else "ok",
            "staged_at": staged_at,
            "part_bytes": part_bytes,
        }
        atomic_write_json(meta_path, meta)
        log.info("reply_staged", bytes=len(body), origin=origin, outcome=meta["outcome"], part_bytes=part_bytes)
        return StagedReply(key, correlation_id, reply_to, body_path, meta_path, origin, staged_at, part_bytes)

    def staged(self) -> list[StagedReply]:
        entries = []
        for meta_path in sorted(self.spool.outbox_dir.glob("*.json")):
            entry = self._read_entry(meta_path)
            if entry is not None:
                entries.append(entry)
        return entries

    def staged_entry(self, correlation_id: str) -> StagedReply | None:
        """The staged reply of one request, if there is one (without listing the outbox)."""
        return self._read_entry(self.spool.outbox_dir / f"{safe_key(correlation_id)}.json")

    def discard(self, correlation_id: str) -> bool:
        """Drop the staged reply of a request nobody will read (cancelled in Rodan); whether there was one."""
        entry = self.staged_entry(correlation_id)
        if entry is None:
            return False
        self._drop(entry)
        return True

    @staticmethod
    def _read_entry(meta_path: Path) -> StagedReply | None:
        try:
            meta = read_json(meta_path)
            part_bytes = meta.get("part_bytes")  # absent in an entry staged before replies had parts
            if part_bytes is not None and (not isinstance(part_bytes, int) or part_bytes < 1):
                raise ValueError(f"part_bytes {part_bytes!r}")
            return StagedReply(
                meta_path.stem,
                str(meta["correlation_id"]),
                str(meta["reply_to"]),
                meta_path.with_suffix(".body"),
                meta_path,
                str(meta.get("origin", "")),
                float(meta.get("staged_at", 0.0)),
                part_bytes,
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def publish_staged(self, channel: BlockingChannel, entry: StagedReply, body: bytes | None = None) -> bool:
        """Publish one staged reply (confirm mode channel). False if it had been sent already.

        ``body``: the staged bytes, when the caller still holds them (saves reading a copy back).
        """
        marker = self.spool.reply_marker(entry.key)
        if marker.exists():
            self._drop(entry)
            return False
        if body is None:
            body = entry.body_path.read_bytes()
        outcome = "error" if reply_is_error(body) else "ok"
        fault_point("before_publish")
        # A publish under way when its process died may have reached the broker before the marker
        # was written: it goes out again (Rodan must not wait forever), but with an expiry, so that
        # if it is a duplicate it leaves the reply queue after UNCERTAIN_REPLY_TTL_MS.
        # Parts go to a queue of the run's own, where no other task nacks them: never an expiry.
        sending = marker.with_suffix(".sending")
        expiration = UNCERTAIN_REPLY_TTL_MS if sending.exists() and entry.part_bytes is None else None
        atomic_write(sending, b"")
        parts = 1

        def send(on: BlockingChannel, data: bytes) -> None:
            nonlocal parts
            if entry.part_bytes is None:
                publish(
                    on,
                    entry.reply_to,
                    data,
                    correlation_id=entry.correlation_id,
                    persistent=True,
                    expiration_ms=expiration,
                )
                return
            # Every part is at most the first's size: a broker that refuses one for its size
            # refuses the first, before any other went out.
            pieces = split_parts(data, entry.part_bytes)
            parts = len(pieces)
            for index, piece in enumerate(pieces, start=1):
                publish(
                    on,
                    entry.reply_to,
                    piece,
                    correlation_id=entry.correlation_id,
                    headers={PART_HEADER: index, PARTS_HEADER: parts},
                    persistent=True,
                )

        try:
            try:
                send(channel, body)
            except NoRoute:
                # The reply queue is gone (a broker's restart drops Rodan's non-durable queue until
                # Rodan declares it again): the reply waits in the outbox, unchanged, for a later pass.
                raise
            except PermanentError as exc:
                # The broker refused the message itself (larger than its max_message_size) and
                # closed the channel: these models can never go. The error reply replaces them on
                # disk first, so that no later pass tries them again, then goes on a fresh channel.
                if reply_is_error(body):
                    raise
                log.error("reply_refused", error=str(exc), bytes=len(body))
                body = error_reply(f"the models could not be delivered: {exc}")
                outcome = "error"
                self.stage(entry.correlation_id, entry.reply_to, body, origin=entry.origin, part_bytes=entry.part_bytes)
                with _spare_channel(channel) as spare:
                    send(spare, body)
        except PermanentError:
            sending.unlink(missing_ok=True)  # refused by the broker: certainly not delivered
            raise
        fault_point("after_publish")
        atomic_write_json(
            marker,
            {
                "correlation_id": entry.correlation_id,
                "outcome": outcome,
                "bytes": len(body),
                "origin": entry.origin,
                "published_at": time.time(),
                "parts": parts if entry.part_bytes is not None else None,
            },
        )
        fault_point("after_marker")
        self._drop(entry)
        in_parts = {"parts": parts} if entry.part_bytes is not None else {}
        log.info(
            "reply_published",
            outcome=outcome,
            bytes=len(body),
            origin=entry.origin,
            expiration_ms=expiration,
            **in_parts,
        )
        return True

    def flush(
        self,
        channel: BlockingChannel,
        may_publish: Callable[[StagedReply], bool] = lambda _e: True,
        *,
        entries: list[StagedReply] | None = None,
    ) -> int:
        """Publish every staged reply (or each of ``entries``) ``may_publish`` allows; returns how many went out."""
        sent = 0
        for entry in self.staged() if entries is None else entries:
            if not may_publish(entry):
                continue
            if not channel.is_open:
                # Closed by the broker after it refused a reply for its size (the error reply went
                # on a channel of its own): the channel's owner reconnects; the rest wait for it.
                raise BrokerUnavailable("the broker closed the channel after refusing a reply")
            try:
                published = self.publish_staged(channel, entry)
            except PermanentError as exc:
                # Not even the error reply could be routed: the reply queue is gone (a broker's full
                # restart drops Rodan's non-durable queues until Rodan declares them again). Keep the
                # reply for a later pass instead of failing the pass, and go on with the others;
                # after wait_s nobody is waiting for it any more: it expires.
                self._left_unrouted(entry, str(exc))
                continue
            if published:
                sent += 1
        return sent

    def _left_unrouted(self, entry: StagedReply, error: str) -> None:
        waited = time.time() - entry.staged_at if entry.staged_at else 0.0
        if waited < self.wait_s:
            log.error(
                "reply_left_in_outbox",
                correlation_id=entry.correlation_id,
                error=error,
                note="published on a later pass, once the reply queue exists",
            )
            return
        log.error(
            "reply_expired",
            correlation_id=entry.correlation_id,
            reply_to=entry.reply_to,
            waited_s=int(waited),
            note="its reply queue has not existed for HPC_REPLY_WAIT: nobody is waiting for it",
        )
        atomic_write_json(
            self.spool.reply_marker(entry.key),
            {
                "correlation_id": entry.correlation_id,
                "outcome": "expired",
                "bytes": 0,
                "origin": entry.origin,
                "published_at": time.time(),
            },
        )
        self._drop(entry)

    def _drop(self, entry: StagedReply) -> None:
        self.spool.reply_marker(entry.key).with_suffix(".sending").unlink(missing_ok=True)
        entry.meta_path.unlink(missing_ok=True)
        entry.body_path.unlink(missing_ok=True)

"""``hpc-bridge requeue-dead`` and ``hpc-bridge purge``: the dead-letter queue, by hand.

Every request the bridge could not turn into a job (invalid, Rodan refused the HPC account, the
scheduler refused it for good) was answered with one error reply and copied to our durable
``HPC_DEAD_LETTER_QUEUE`` with the reason in header ``x-hpc-bridge-reason``.

``requeue-dead`` moves selected copies back to the request queue (same body, ``correlation_id`` and
``reply_to``; our ``x-hpc-bridge-*`` headers dropped), published with confirms; the dead-letter copy
is acked only after the confirm, so a crash leaves it where it was. ``purge`` drops selected copies.
Copies not selected are given back to the queue untouched (``basic_nack`` with requeue).

The ledger: ``Intake`` answers a REJECTED, dead-lettered record with DUPLICATE, so a requeued
request would just be dropped again. Before publishing, requeue-dead therefore moves the record
back to RECEIVED with its attempts reset (``bridge.ledger.reopen_for_requeue``), the state a
request is processed afresh from. Order per message: reopen the ledger record -> publish with
confirm -> ack the dead-letter copy. This is safe beside a running bridge (cron or daemon): the
bridge only sees the request once its record is already fresh, and a crash at any point leaves
the dead-letter copy in place to requeue again.

Replies: Rodan must get exactly one reply per request, and a reply for a task that no longer
waits is nacked and redelivered by every waiting Rodan task in a tight loop for as long as it
stays queued (docs/protocol.md §1.4). A dead-lettered request has nearly always had its error
reply published (``SPOOL/replies/KEY.json`` exists), and Rodan's task has then failed with it.
Processing it again would publish a second reply, so requeue-dead refuses such a request unless
``--force``: use it only when the requester is known to wait for this correlation id again
(e.g. a test harness, ``hpc-bridge enqueue --wait`` re-run by hand, a Rodan task reset to wait).
With ``--force`` the reply marker is moved aside to ``replies/KEY.json.superseded-<unix time>``
(kept for the record) so that the new outcome is published; without the move the bridge and the
worker would see "already replied" and the new job would answer nobody. A request that was
never answered (no marker) is requeued without ``--force``; an error reply still staged in the
outbox from the rejection is dropped first, so Rodan gets only the new outcome. A request whose
record shows a job (SUBMITTING, SUBMITTED) is skipped: it was requeued already.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from bridge.amqp import CONNECTION_ERRORS, connect, declare_own_queue, declare_rodan_queue, publish
from bridge.config import BridgeConfig
from bridge.errors import BridgeError
from bridge.ledger import Ledger, RequestRecord, RequestState, reopen_for_requeue
from bridge.logs import redact
from bridge.spool import Spool, read_json, safe_key

log = structlog.get_logger(__name__)

OUR_HEADER_PREFIX = "x-hpc-bridge-"
_FAILURES: tuple[type[BaseException], ...] = (BridgeError, *CONNECTION_ERRORS)

REQUEUE_EPILOG = """examples:
  hpc-bridge requeue-dead                       # list what is dead-lettered (moves nothing)
  hpc-bridge requeue-dead --id 5f0c2a9e         # ask, then move that request back (id or unique prefix)
  hpc-bridge requeue-dead --id 5f0c2a9e --force --yes   # it was answered already: Rodan gets a 2nd reply
"""
PURGE_EPILOG = """examples:
  hpc-bridge purge --id 5f0c2a9e                # ask, then drop that dead letter
  hpc-bridge purge --all --yes                  # drop every dead letter without asking
"""


@dataclass
class DeadLetter:
    delivery_tag: int
    correlation_id: str | None
    reply_to: str | None
    body: bytes
    headers: dict[str, Any]

    @property
    def reason(self) -> str:
        return str(self.headers.get("x-hpc-bridge-reason", ""))

    @property
    def age_s(self) -> float | None:
        rejected_at = self.headers.get("x-hpc-bridge-rejected-at")
        return time.time() - float(rejected_at) if isinstance(rejected_at, (int, float)) else None


def add_parser(sub: Any) -> None:
    for name, help_text, epilog, run_fn in (
        ("requeue-dead", "move dead-lettered requests back to the request queue", REQUEUE_EPILOG, run_requeue),
        ("purge", "drop dead-lettered requests", PURGE_EPILOG, run_purge),
    ):
        parser = sub.add_parser(
            name, help=help_text, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        parser.add_argument(
            "--id", action="append", default=[], metavar="CORRELATION_ID", dest="ids",
            help="a dead letter's correlation id or a unique prefix of it (repeatable)",
        )  # fmt: skip
        parser.add_argument("--all", action="store_true", help="every dead letter")
        parser.add_argument("--yes", action="store_true", help="do it without asking")
        if name == "requeue-dead":
            parser.add_argument(
                "--force", action="store_true",
                help="also requeue requests whose reply was already published (Rodan gets a second reply)",
            )  # fmt: skip
        parser.set_defaults(operator=run_fn)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    return run_purge(config, args) if args.command == "purge" else run_requeue(config, args)


def run_requeue(config: BridgeConfig, args: argparse.Namespace) -> int:
    return _command(config, args, requeue=True)


def run_purge(config: BridgeConfig, args: argparse.Namespace) -> int:
    return _command(config, args, requeue=False)


# --- the broker ---------------------------------------------------------------------------------


def _open(config: BridgeConfig) -> tuple[pika.BlockingConnection, BlockingChannel]:
    connection = connect(config.broker_url, ca_file=config.broker_ca_file, name="hpc-bridge-deadletter")
    channel = connection.channel()
    channel.confirm_delivery()
    declare_own_queue(channel, config.dead_letter_queue)
    declare_rodan_queue(channel, config.request_queue)
    return connection, channel


def _fetch_all(channel: BlockingChannel, queue: str) -> list[DeadLetter]:
    """Every message in the queue, held unacked by this channel."""
    letters: list[DeadLetter] = []
    while True:
        method, properties, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            return letters
        letters.append(
            DeadLetter(
                delivery_tag=int(method.delivery_tag),
                correlation_id=properties.correlation_id,
                reply_to=properties.reply_to,
                body=body,
                headers=dict(properties.headers or {}),
            )
        )


def _select(letters: list[DeadLetter], ids: list[str], take_all: bool) -> tuple[list[DeadLetter], list[str]]:
    """The letters chosen, and the problems with ``ids`` (matching nothing, or ambiguous)."""
    if take_all:
        return list(letters), []
    chosen: dict[int, DeadLetter] = {}
    problems: list[str] = []
    for wanted in ids:
        exact = [x for x in letters if x.correlation_id == wanted]
        matches = exact or [x for x in letters if x.correlation_id and x.correlation_id.startswith(wanted)]
        if not matches:
            problems.append(f"{wanted}: no dead letter with this correlation id")
        elif len({x.correlation_id for x in matches}) > 1:
            names = ", ".join(sorted({str(x.correlation_id) for x in matches}))
            problems.append(f"{wanted}: ambiguous, matches {names}")
        else:
            chosen.update((x.delivery_tag, x) for x in matches)
    return [x for x in letters if x.delivery_tag in chosen], problems


def _describe(letter: DeadLetter) -> str:
    age = letter.age_s
    age_text = "?" if age is None else (f"{age / 3600:.1f}h" if age >= 3600 else f"{age / 60:.0f}m")
    reason = letter.reason.replace("\n", " ")
    reason = reason if len(reason) <= 100 else reason[:97] + "..."
    return redact(f"  {letter.correlation_id or '(no correlation id)'}  age {age_text}  {reason}")


def _confirm(prompt: str) -> bool:
    if not sys.stdin.isatty():
        print("hpc-bridge: not a terminal, nothing done: pass --yes to do it without asking", file=sys.stderr)
        return False
    try:
        return input(prompt).strip().lower() in ("y", "yes")
    except EOFError:
        return False


# --- the command ------------------------------------------------------------------------------


def verb_of(requeue: bool) -> str:
    return "requeue" if requeue else "drop"


def _command(config: BridgeConfig, args: argparse.Namespace, *, requeue: bool) -> int:
    spool = Spool(config.spool_dir).ensure()
    try:
        connection, channel = _open(config)
    except BridgeError as exc:
        print(f"hpc-bridge: {exc}", file=sys.stderr)
        return 1
    try:
        return _work(config, args, spool, connection, channel, requeue=requeue)
    except _FAILURES as exc:
        print(redact(f"hpc-bridge: {verb_of(requeue)} failed: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1


def _work(
    config: BridgeConfig,
    args: argparse.Namespace,
    spool: Spool,
    connection: pika.BlockingConnection,
    channel: BlockingChannel,
    *,
    requeue: bool,
) -> int:
    verb = verb_of(requeue)
    try:
        letters = _fetch_all(channel, config.dead_letter_queue)
        if not args.ids and not args.all:  # nothing chosen: list, touch nothing
            for letter in letters:
                print(_describe(letter))
            print(f"{len(letters)} dead-lettered in {config.dead_letter_queue}; choose with --id or --all")
            return 0
        chosen, problems = _select(letters, args.ids, args.all)
        for problem in problems:
            print(f"hpc-bridge: {redact(problem)}", file=sys.stderr)
        if problems:
            return 1
        if not chosen:
            print(f"nothing to {verb}: {config.dead_letter_queue} is empty")
            return 0
        if not args.yes:
            print(f"would {verb} {len(chosen)} of {len(letters)} dead letters:")
            for letter in chosen:
                print(_describe(letter))
            # Give everything back while the person thinks (heartbeats are not serviced meanwhile).
            channel.basic_nack(0, multiple=True, requeue=True)
            connection.close()
            if not _confirm(f"{verb} these {len(chosen)}? [y/N] "):
                return 1
            connection, channel = _open(config)
            wanted = {x.correlation_id for x in chosen}
            letters = _fetch_all(channel, config.dead_letter_queue)
            chosen = [x for x in letters if x.correlation_id in wanted]
        failed = 0
        for letter in chosen:
            if requeue:
                failed += 0 if _requeue_one(config, spool, channel, letter, force=args.force) else 1
            else:
                channel.basic_ack(letter.delivery_tag)
                log.info("dead_letter_purged", correlation_id=letter.correlation_id, reason=letter.reason[:200])
                print(redact(f"dropped {letter.correlation_id}"))
        return 1 if failed else 0
    finally:
        if connection.is_open:
            channel.basic_nack(0, multiple=True, requeue=True)  # whatever is still held goes back untouched
            connection.close()


def _requeue_one(
    config: BridgeConfig, spool: Spool, channel: BlockingChannel, letter: DeadLetter, *, force: bool
) -> bool:
    corr = letter.correlation_id
    if not corr or not letter.reply_to:
        print(f"skipped {corr or '(no correlation id)'}: no correlation id or reply_to, cannot be answered; purge it")
        return False
    ledger = Ledger(spool)
    record = ledger.get(corr)
    if record is not None and record.state in (RequestState.SUBMITTING, RequestState.SUBMITTED):
        print(redact(f"skipped {corr}: its ledger record is {record.state.value} (job {record.job_id or '?'})"))
        return False
    key = safe_key(corr)
    marker = spool.reply_marker(key)
    if marker.exists() and not force:
        try:
            published = read_json(marker)
            outcome = str(published.get("outcome", "?")) if isinstance(published, dict) else "?"
        except (OSError, ValueError):
            outcome = "?"
        print(
            redact(
                f"skipped {corr}: Rodan already got its reply ({outcome}); requeueing publishes a second one, "
                "which a Rodan task that no longer waits nacks forever: add --force only if one waits for it"
            )
        )
        return False
    previous = record.state.value if record is not None else "none"
    original = record.to_json() if record is not None else None
    if record is not None:
        ledger.save(reopen_for_requeue(record))
    # The reply marker (only with --force) and an unpublished staged rejection are moved aside, not
    # deleted: the new outcome must get through, and a failed publish puts them back.
    stamp = int(time.time())
    moved: list[tuple[Path, Path]] = []
    for path in (marker, spool.outbox_dir / f"{key}.json", spool.outbox_dir / f"{key}.body"):
        if path.exists():
            target = path.with_name(f"{path.name}.superseded-{stamp}")
            path.replace(target)
            moved.append((path, target))
    superseded = marker.name if any(path == marker for path, _ in moved) else ""
    headers = {k: v for k, v in letter.headers.items() if not k.startswith(OUR_HEADER_PREFIX)}
    headers.pop("x-original-queue", None)
    try:
        publish(
            channel, config.request_queue, letter.body,
            correlation_id=corr, reply_to=letter.reply_to, headers=headers or None,
        )  # fmt: skip
    except BridgeError as exc:
        for path, target in moved:
            target.replace(path)
        if original is not None:
            ledger.save(RequestRecord.from_json(original))
        print(redact(f"not requeued {corr}: {exc}; its dead letter and ledger record are unchanged"), file=sys.stderr)
        return False
    channel.basic_ack(letter.delivery_tag)
    log.info(
        "dead_letter_requeued", correlation_id=corr, queue=config.request_queue,
        previous_state=previous, reason=letter.reason[:200], reply_superseded=superseded or None,
    )  # fmt: skip
    print(redact(f"requeued {corr} (ledger {previous} -> received{', reply marker superseded' if superseded else ''})"))
    return True

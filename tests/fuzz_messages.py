"""Whole AMQP messages as anything on Rodan's side of the queue might publish them, and the contract
a pass must keep for each. Used by tests/test_fuzz_pass.py.

A message is generated as a :class:`MessageSpec` (a body, and how to build each property) before the
queue names of its batch exist; :func:`publish_batch` resolves it against a :class:`FuzzQueues`,
publishes it with raw ``pika.BasicProperties`` and records what the bridge will receive
(:class:`Sent`). After the pass, :func:`observe` drains every queue and :func:`contract_violations`
says, message by message, what broke the contract:

* a message with a *usable* correlation id (a non-empty ``str``, i.e. valid UTF-8 on the wire) and
  ``reply_to`` equal to the configured reply queue ends (a) submitted: its ledger record says
  ``submitted`` and the job exists, no reply; or (b) with exactly one ``{"error": "..."}`` reply
  carrying its correlation id, and a dead-letter copy;
* any other message ends (c) with a dead-letter copy and no reply anywhere;
* nothing is left in the request queue, nothing reaches another queue, nothing else is dead-lettered.

Copies of one correlation id (duplicates) count as one request: one outcome for the group.

What pika lets through (pika 1.3, RabbitMQ 3.10): short-string properties are ``str`` or ``bytes``
of at most 255 bytes once encoded (``ShortStringTooLong`` above); ``bytes`` that are not UTF-8
arrive at the consumer as ``bytes``, valid UTF-8 arrives as ``str``; any other type is an
``AssertionError`` in pika, and ``str`` with lone surrogates a ``UnicodeEncodeError``. Header
tables take ``str``/``bytes`` keys up to 255 bytes and ``None``, ``bool``, 64-bit ``int``,
``Decimal``, ``datetime``, ``str``, ``bytes``, lists and tables as values (not ``float``).
``priority`` and ``delivery_mode`` are octets, ``timestamp`` an unsigned 64-bit integer. The broker
itself refuses (406, channel closed) an ``expiration`` that is not a non-negative integer and a
``user_id`` other than the connection's user; such messages are never delivered and count as
"refused by the broker", as do those pika cannot encode.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
from hypothesis import strategies as st
from pika.adapters.blocking_connection import BlockingChannel

from tests.support.bridge import FAST_SETTINGS

MIB = 1 << 20
REASON_HEADER = "x-hpc-bridge-reason"  # what marks a dead-letter copy (docs/operator-guide.md)

# --- what a request looks like (docs/protocol.md §2) -----------------------------------------------

OLD_NAMES = ["Image", "Background", "Selected Regions", "Music Layer", "Staff Layer", "Text"]
NEW_PREFIX = "rgba PNG - Layer "
# Generation 3 (Rodan 3.x, docs/protocol.md §2.5): every input optional, at least one sample.
RODAN3_NAMES = [
    *(f"Sample {i}" for i in range(1, 21)),
    "Multi-Sample Zip",
    "Background Model",
    *(f"Model {i}" for i in range(1, 10)),
]
SETTINGS_OK: dict[str, Any] = FAST_SETTINGS  # valid, and accepted by the dev clusters (every generation)
SETTING_NAMES = [
    *SETTINGS_OK,
    "Slurm Notification Email",
    "Batch size",
    "Batch Size",  # generation 3's (capital S)
    "Patience",
]


def new_names(n: int) -> list[str]:
    return ["Image", "Background", "Selected Regions", *(f"{NEW_PREFIX}{i}" for i in range(n))]


def plausible_path(seed: int) -> str:
    """A resource path as Rodan writes them, of a file the stand-in does not have."""
    return f"/uploads/projects/{seed:032x}/resources/{seed * 7919 % 16**32:032x}/original_file"


# Characters that normalise (NFKC) to '/', '@', ':', '.', '?', '#', or that are digits int() rejects
# (str.isdigit() is True for them), or that int() accepts though they are not ASCII, or that render
# invisibly or reversed; plus the ASCII delimiters themselves.
NASTY_CHARS = (
    "\uff0f\uff20\uff1a\ufe55\ufe6b\uff0e\uff1f\uff03\u2100\u2101\u2488\u2474\u2044\u2215\uff3c\ufe68"
    "\u00b2\u00b3\u00b9\u2070\u2460\u2776\u24ea"  # isdigit() and not int()-able
    "\U0001d7ce\u0663\u0966\uff10\uff11"  # int()-able, not ASCII
    "\u200b\u200d\u202e\u2066\ufeff\u00ad\u0130\u0131\u017f\u212a\u00df\ufb00"  # invisible, bidi, case traps
    "\x00\n\r\t\x0b\x1b\x7f\x85\u2028\u2029 %@:/\\[]?#.&=+;,'\"`$|<>~^{}"
)
any_char = st.characters()  # all of Unicode but surrogates
text_chars = st.one_of(any_char, st.sampled_from(NASTY_CHARS))
unicode_text = st.text(text_chars, max_size=40)
# JSON strings may also hold lone surrogates ("\ud800"): valid JSON, not encodable as UTF-8.
json_text = st.one_of(unicode_text, st.text(st.one_of(text_chars, st.characters(categories=["Cs"])), max_size=12))

NASTY_NAMES = [
    f"{NEW_PREFIX}\u00b2",  # isdigit() is True, int() raises
    f"{NEW_PREFIX}\u2460",
    f"{NEW_PREFIX}\u00b9\u2070",
    f"{NEW_PREFIX}\uff10",  # int() gives 0, str(0) differs
    f"{NEW_PREFIX}\u0663",
    f"{NEW_PREFIX}\U0001d7ce",
    f"{NEW_PREFIX}01",
    f"{NEW_PREFIX}-1",
    f"{NEW_PREFIX} 0",
    f"{NEW_PREFIX}0 ",
    f"{NEW_PREFIX}0\n",
    f"{NEW_PREFIX}1_0",
    f"{NEW_PREFIX}10",
    f"{NEW_PREFIX}99999999999999999999",
    f"{NEW_PREFIX}{'9' * 5000}",  # more digits than int() converts
    f"{NEW_PREFIX}",
    "rgba PNG - Layer\u00a00",
    "RGBA PNG - LAYER 0",
    "Image\x00",
    "Image ",
    "\uff29mage",
    "I\u0307mage",
    "Background\u200b",
    "",
    "\ud800",
    "Text/../Text",
    "Music Layer\n#SBATCH --uid=0",
    "x" * 300,
    # Generation 3's names, and what looks like them.
    "Sample 0",
    "Sample 21",
    "Sample 01",
    "Sample -1",
    "Sample \u0661",  # isdigit(), an Arabic-Indic one
    "Sample \uff11",  # int() gives 1, not ASCII
    "Sample \u00b9",
    "Sample 1\n",
    "Sample 1 ",
    "Sample ",
    f"Sample {'9' * 5000}",
    "sample 1",
    "SAMPLE 1",
    "Sample\u00a01",
    "Model 0",
    "Model 10",
    "Model 01",
    "Multi-Sample Zip\u200b",
    "Multi-sample Zip",
    "Background Model ",
    "Log File",
]


def nasty_urls(rodan: str) -> list[str]:
    """Resource values: malformed hosts, ports, NFKC traps, IDNA junk, other schemes, traversal."""
    good = "/uploads/projects/p/resources/r/original_file"
    return [
        "http://[::1",
        "http://[::1/x",
        "http://[zz]/x",
        "http://[::1]]/x",
        "http://[v1.fe]/x",
        "http://[::ffff:127.0.0.1]/x",
        "http://[fe80::1%25eth0]/x",
        "http://]/x",
        "http://host:99999/",
        "http://host:port/",
        "http://host:-1/",
        "http://host:0/x",
        "http://host:80:80/x",
        "http://host:+80/x",
        "http://host:\uff18\uff10/x",
        f"http://{rodan}:80/x",
        f"http://evil\uff0f{rodan}/x",
        f"http://evil\uff20{rodan}/x",
        f"http://{rodan}\uff1a80/x",
        f"http://evil\ufe6b{rodan}{good}",
        "http://a\u2100b/x",
        "http://\u2488example.org/x",
        "http://xn--/x",
        "http://xn--zz--/x",
        "http://xn--ls8h.la/x",
        "http://xn--a.xn--b/x",
        "http://\u2603.net/x",
        "http://\u00df.de/x",
        "http://\ufb00.com/x",
        "http://\uff41\uff42\uff43.com/x",
        "http://" + "a" * 64 + ".example/x",
        "http://" + "a." * 130 + "/x",
        "http://a..b/x",
        "http://./x",
        "http://-/x",
        "http://0x7f.1/x",
        "http://2130706433/x",
        "http://localhost./x",
        "http://LOCALHOST/x",
        "http://user@/x",
        f"http://user:pw@{rodan}{good}",
        f"http://{rodan}@evil.example/x",
        f"http://evil.example\\@{rodan}{good}",
        "http:",
        "http://",
        "http:///x",
        "https:/x",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "ftp://example.org/x",
        "HTTP://EXAMPLE.ORG/x",
        "\\\\host\\share\\x",
        f"//{rodan}{good}",
        f"http://{rodan}{good}",
        f"HTTP://{rodan}{good}",
        f"http://{rodan}/uploads/%2e%2e/%2e%2e/etc/passwd",
        f"http://{rodan}/uploads/\uff0e\uff0e/x",
        "/uploads/\uff0e\uff0e/\uff0e\uff0e/etc/passwd",
        "/uploads/%ff%fe/x",
        "/uploads/%00/x",
        "/uploads/\u202ex",
        "/uploads/x?y=1#z",
        "/",
        "",
        "\ud800",
        "/uploads/" + "a" * 4090,
        "/uploads/" + "a" * 4100,
    ]


# --- specs: a message before the queue names of its batch exist ------------------------------------


@dataclass(frozen=True)
class FuzzQueues:
    """One batch's queues. ``foreign`` exists and must stay empty; ``absent`` is never declared."""

    request: str
    reply: str
    dead: str
    foreign: str

    @property
    def absent(self) -> str:
        return f"{self.request}-nobody"

    def all(self) -> list[str]:
        return [self.request, self.reply, self.dead, self.foreign, self.absent]


TARGETS: dict[str, Callable[[FuzzQueues], str | bytes]] = {
    "reply": lambda q: q.reply,
    "reply-as-bytes": lambda q: q.reply.encode(),  # valid UTF-8: arrives as the same str (usable)
    "request": lambda q: q.request,
    "dead": lambda q: q.dead,
    "foreign": lambda q: q.foreign,
    "absent": lambda q: q.absent,
    "reply+newline": lambda q: q.reply + "\n",
    "reply+nul": lambda q: q.reply + "\x00",
    "space+reply": lambda q: " " + q.reply,
    "reply-upper": lambda q: q.reply.upper(),
    "reply-fullwidth": lambda q: q.reply.replace("-", "\uff0d"),  # NFKC gives the reply queue back
    "reply-glob": lambda q: q.reply[:-3] + "*",
    "reply-utf16": lambda q: q.reply.encode("utf-16"),  # not UTF-8: arrives as bytes
    "reply-latin1-e": lambda q: q.reply.encode() + b"\xe9",
}


@dataclass(frozen=True)
class Prop:
    """How to build a property: a queue of the batch (``target``) or a literal (``None`` = absent)."""

    target: str = ""
    literal: str | bytes | None = None

    def resolve(self, queues: FuzzQueues) -> str | bytes | None:
        return TARGETS[self.target](queues) if self.target else self.literal


@dataclass(frozen=True)
class Corr:
    """A correlation id: ``fresh`` (a new uuid4 string, as Rodan sends), ``literal``, or ``dup``
    (the same as message ``of`` of the batch)."""

    kind: str = "fresh"
    literal: str | bytes | None = None
    of: int = 0


@dataclass(frozen=True, repr=False)
class MessageSpec:
    kind: str  # what made it (statistics and reports)
    body: bytes
    corr: Corr = Corr()
    reply_to: Prop = Prop("reply")
    extra: Mapping[str, Any] = field(default_factory=dict)  # other BasicProperties
    bare: bool = False  # no properties at all

    def __repr__(self) -> str:
        """Short, for hypothesis' report of a failing batch (bodies reach megabytes)."""
        body = self.body if len(self.body) <= 160 else self.body[:120] + b"...(%d bytes)" % len(self.body)
        extra = {k: _short(v) for k, v in self.extra.items()}
        return (
            f"MessageSpec({self.kind!r}, {body!r}, {self.corr!r}, {self.reply_to!r}"
            f"{f', extra={extra}' if extra else ''}{', bare=True' if self.bare else ''})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def properties(self, cid: str | bytes | None, queues: FuzzQueues) -> pika.BasicProperties | None:
        """The AMQP properties this message is sent with, ``cid`` as its correlation id (None: bare)."""
        if self.bare:
            return None
        kwargs: dict[str, Any] = {k: v for k, v in self.extra.items() if v is not None}
        if cid is not None:
            kwargs["correlation_id"] = cid
        reply_to = self.reply_to.resolve(queues)
        if reply_to is not None:
            kwargs["reply_to"] = reply_to
        return pika.BasicProperties(**kwargs)


def on_the_wire(value: str | bytes | None) -> str | bytes | None:
    """A short-string property as a consumer's pika hands it over."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


@dataclass
class Sent:
    """A message the broker accepted, and the properties the bridge receives."""

    spec: MessageSpec
    correlation_id: str | bytes | None
    reply_to: str | bytes | None

    @property
    def body(self) -> bytes:
        return self.spec.body

    def usable(self, reply_queue: str) -> bool:
        cid = self.correlation_id
        return isinstance(cid, str) and cid != "" and self.reply_to == reply_queue

    def describe(self) -> str:
        body = self.body if len(self.body) <= 160 else self.body[:120] + b"...(%d bytes)" % len(self.body)
        extra = {k: _short(v) for k, v in self.spec.extra.items()}
        return (
            f"[{self.spec.kind}] correlation_id={_short(self.correlation_id)} reply_to={_short(self.reply_to)}"
            f"{' bare' if self.spec.bare else ''}{f' {extra}' if extra else ''} body={body!r}"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 90 else f"{text[:80]}...({len(text)} chars)"


# --- publishing --------------------------------------------------------------------------------------


@dataclass
class Published:
    sent: list[Sent]
    refused: list[tuple[MessageSpec, str]]  # by pika's encoder or by the broker


def publish_batch(connection: pika.BlockingConnection, queues: FuzzQueues, specs: Iterable[MessageSpec]) -> Published:
    """Publish each spec to ``queues.request`` (default exchange, publisher confirms)."""
    out = Published([], [])
    ids: list[str | bytes | None] = []
    channel = _confirm_channel(connection)
    for spec in specs:
        if spec.corr.kind == "fresh":
            cid: str | bytes | None = str(uuid.uuid4())
        elif spec.corr.kind == "dup" and spec.corr.of < len(ids):
            cid = ids[spec.corr.of]
        else:
            cid = spec.corr.literal
        ids.append(cid)
        properties = spec.properties(cid, queues)
        try:
            if properties is not None:
                properties.encode()  # what pika refuses never reaches the broker
        except Exception as exc:
            out.refused.append((spec, f"pika: {type(exc).__name__}"))
            continue
        try:
            channel.basic_publish("", queues.request, spec.body, properties, mandatory=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            out.refused.append((spec, f"broker: {exc.reply_code} {exc.reply_text}"))
            channel = _confirm_channel(connection)
            continue
        if spec.bare:
            out.sent.append(Sent(spec, None, None))
        else:
            out.sent.append(Sent(spec, on_the_wire(cid), on_the_wire(spec.reply_to.resolve(queues))))
    if channel.is_open:
        channel.close()
    return out


def _confirm_channel(connection: pika.BlockingConnection) -> BlockingChannel:
    channel = connection.channel()
    channel.confirm_delivery()
    return channel


# --- observing and judging ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    correlation_id: str | bytes | None
    reply_to: str | bytes | None
    body: bytes
    headers: dict[Any, Any]


def drain(connection: pika.BlockingConnection, queue: str) -> list[Delivery]:
    """Every message now in ``queue`` (none when it does not exist)."""
    channel = connection.channel()
    out = []
    try:
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            out.append(Delivery(props.correlation_id, props.reply_to, body, dict(props.headers or {})))
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
    if channel.is_open:
        channel.close()
    return out


@dataclass
class Observed:
    replies: list[Delivery]
    dead: list[Delivery]
    elsewhere: dict[str, list[Delivery]]  # the request, foreign and absent queues: all must be empty
    records: dict[str, dict[str, Any]]  # ledger records by correlation id
    jobs: set[str]  # job ids the scheduler has (live)


def observe(
    connection: pika.BlockingConnection,
    queues: FuzzQueues,
    records: Iterable[dict[str, Any]],
    jobs: set[str],
    replies: list[Delivery] | None = None,
) -> Observed:
    got = list(replies or []) + drain(connection, queues.reply)
    others = {q: drain(connection, q) for q in (queues.request, queues.foreign, queues.absent)}
    by_id = {r["correlation_id"]: r for r in records if isinstance(r, dict) and "correlation_id" in r}
    return Observed(got, drain(connection, queues.dead), others, by_id, jobs)


def error_text(body: bytes) -> str | None:
    """The reason of an ``{"error": "..."}`` reply, else None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict) and set(data) == {"error"} and isinstance(data["error"], str) and data["error"]:
        return data["error"]
    return None


@dataclass
class Verdict:
    violations: list[str]
    outcomes: Counter[str]


def contract_violations(sent: list[Sent], seen: Observed, reply_queue: str) -> Verdict:
    """Judge every sent message against the contract (see the module's docstring).

    Dead-letter copies are matched to messages on (correlation id, body): first one for each request
    answered with an error, then one for each message without a usable id/reply_to, then any extra
    ones to the requests' duplicates; copies left over are matched on the body alone (the bridge may
    drop or replace an id it cannot use), and what is still left over is a violation."""
    problems: list[str] = []
    outcomes: Counter[str] = Counter()
    copies: Counter[tuple[Any, bytes]] = Counter()
    for d in seen.dead:
        if REASON_HEADER not in d.headers:
            problems.append(f"a message in the dead-letter queue is no dead-letter copy: {_delivery(d)}")
        else:
            copies[(d.correlation_id, d.body)] += 1

    def take(keys: Iterable[tuple[Any, bytes]], most: int) -> int:
        taken = 0
        for key in keys:
            while taken < most and copies[key] > 0:
                copies[key] -= 1
                taken += 1
        return taken

    groups: dict[str, list[Sent]] = defaultdict(list)
    unusable: list[Sent] = []
    for s in sent:
        if s.usable(reply_queue):
            assert isinstance(s.correlation_id, str)
            groups[s.correlation_id].append(s)
        else:
            unusable.append(s)
    replies: dict[Any, list[Delivery]] = defaultdict(list)
    for r in seen.replies:
        replies[r.correlation_id].append(r)
    answered = {cid: replies.pop(cid, []) for cid in groups}
    keys = {cid: [(cid, body) for body in dict.fromkeys(m.body for m in members)] for cid, members in groups.items()}
    dead = {cid: take(keys[cid], 1) if answered[cid] else 0 for cid in groups}
    uncopied = [s for s in unusable if not take([(s.correlation_id, s.body)], 1)]
    outcomes["dead-lettered only"] += len(unusable) - len(uncopied)
    for cid, members in groups.items():
        n = len(members)
        dead[cid] += take(keys[cid], n)
        got = answered[cid]
        record = seen.records.get(cid) or {}
        state = record.get("state", "")
        job = str(record.get("job_id") or "")
        what = f"{n} message(s) with correlation id {cid!r}, first: {members[0].describe()}"
        if not got:
            if state != "submitted" or not job:
                problems.append(f"no reply and not submitted (ledger state {state!r}): {what}")
            elif job not in seen.jobs:
                problems.append(f"ledger says submitted as job {job}, which the scheduler does not have: {what}")
            elif dead[cid] > n - 1:
                problems.append(f"submitted, yet {dead[cid]} dead-letter copies: {what}")
            else:
                outcomes["submitted"] += 1
            continue
        if len(got) > 1:
            problems.append(f"{len(got)} replies for one request: {what}")
            continue
        reason = error_text(got[0].body)
        if reason is None:
            problems.append(f"the reply is not an error reply ({got[0].body[:200]!r}): {what}")
        elif state == "submitted":
            problems.append(f"an error reply ({reason[:200]!r}) and a submitted job: {what}")
        elif dead[cid] < 1:
            problems.append(f"an error reply ({reason[:200]!r}) but no dead-letter copy: {what}")
        else:
            outcomes["error reply"] += 1
    for cid, got in replies.items():
        owners = [s.describe() for s in sent if s.correlation_id == cid][:2]
        problems.append(
            f"{len(got)} reply(ies) with correlation id {cid!r} that no usable message carried "
            f"(body {got[0].body[:120]!r}); sent with that id: {owners or 'none'}"
        )
    by_body: Counter[bytes] = Counter()
    for (_cid, body), count in copies.items():
        by_body[body] += count
    for s in uncopied:
        if by_body[s.body] > 0:
            by_body[s.body] -= 1
            outcomes["dead-lettered only"] += 1
        else:
            problems.append(f"no usable correlation id/reply_to, and no dead-letter copy: {s.describe()}")
    for body, count in by_body.items():
        if count > 0:
            problems.append(f"{count} dead-letter cop(ies) of no message sent (body {body[:120]!r})")
    for queue, left in seen.elsewhere.items():
        if left:
            problems.append(f"{len(left)} message(s) left in {queue!r}, first: {_delivery(left[0])}")
    return Verdict(problems, outcomes)


def _delivery(d: Delivery) -> str:
    return f"correlation_id={_short(d.correlation_id)} headers={_short(d.headers)} body={d.body[:160]!r}"


# --- strategies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What the generators need from the test: the Rodan host (``host:port``) and the inputs of
    sample pages the stand-in serves, per generation."""

    rodan: str
    pages: Mapping[str, Mapping[str, str]]  # "old" / "new" / "rodan3" -> inputs
    odd_files: tuple[str, ...] = ()  # paths of files the stand-in serves that are no PNG or JPEG


#: Files that are not what an input must be (written by :func:`write_odd_files`): empty, text, a GIF,
#: an EPS (Pillow would hand it to Ghostscript), a PNG signature with nothing after it, a directory.
ODD_FILES: dict[str, bytes | None] = {
    "projects/odd/resources/empty/original_file": b"",
    "projects/odd/resources/text/original_file": b"just text, no image\n" * 50,
    "projects/odd/resources/gif/original_file": b"GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00!"
    b"\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;",
    "projects/odd/resources/eps/original_file": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\nshowpage\n",
    "projects/odd/resources/png-head/original_file": b"\x89PNG\r\n\x1a\n",
    "projects/odd/resources/dir/original_file": None,  # a directory
    # For generation 3: an empty zip, a zip's first header with nothing after it, an HDF5 signature alone.
    "projects/odd/resources/empty-zip/original_file": b"PK\x05\x06" + bytes(18),
    "projects/odd/resources/zip-head/original_file": b"PK\x03\x04",
    "projects/odd/resources/hdf5-head/original_file": b"\x89HDF\r\n\x1a\n",
}


def write_rodan3_page(uploads: Path, page: Mapping[str, str]) -> dict[str, str]:
    """A generation-3 request's inputs the stand-in serves: ``Sample 1`` (a sample zip as Pixel.js
    writes it, from ``page``, a newer-generation page of 2 layers already under ``uploads``), the
    ``Multi-Sample Zip`` (that sample in a folder) and a ``Background Model`` (HDF5)."""
    import io
    import zipfile

    import h5py
    import numpy as np

    members = {  # member name -> the page's input that holds it
        "Image.png": "Image",
        "rgba PNG - Selected regions.png": "Selected Regions",
        "rgba PNG - Layer 0 (Background).png": "Background",
        "rgba PNG - Layer 1.png": f"{NEW_PREFIX}0",
        "rgba PNG - Layer 2.png": f"{NEW_PREFIX}1",
    }

    def file_of(name: str) -> Path:
        return uploads / page[name].removeprefix("/uploads/")

    def zipped(folder: str) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as archive:
            for member, source in members.items():
                archive.write(file_of(source), folder + member)
        return out.getvalue()

    files = {
        "Sample 1": ("sample", zipped("")),
        "Multi-Sample Zip": ("multi", zipped("page-1/")),
    }
    inputs: dict[str, str] = {}
    for name, (resource, data) in files.items():
        relative = f"projects/rodan3/resources/{resource}/original_file"
        (uploads / relative).parent.mkdir(parents=True, exist_ok=True)
        (uploads / relative).write_bytes(data)
        inputs[name] = f"/uploads/{relative}"
    relative = "projects/rodan3/resources/model/original_file"
    (uploads / relative).parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(uploads / relative, "w") as handle:
        handle.create_dataset("model_weights/conv/kernel", data=np.zeros((3, 3, 3, 4), dtype="float32"))
    inputs["Background Model"] = f"/uploads/{relative}"
    return inputs


def write_odd_files(uploads: Path) -> tuple[str, ...]:
    """Write :data:`ODD_FILES` under the stand-in's uploads folder; their resource paths."""
    for relative, data in ODD_FILES.items():
        path = uploads / relative
        if data is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return tuple(f"/uploads/{relative}" for relative in ODD_FILES)


RAW = "\x00raw\x00"  # placeholder for a JSON fragment json.dumps cannot write (a 5,000-digit number)


def dumps(data: Any, raw: str = "") -> bytes:
    text = json.dumps(data)
    if raw:
        text = text.replace(json.dumps(RAW), raw, 1)
    return text.encode("utf-8")


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**53, max_value=10**40),
    st.floats(),
    json_text,
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(json_text, kids, max_size=4),
    max_leaves=12,
)
junk_setting = st.one_of(
    json_values,
    st.sampled_from(
        [
            "\u00b2",
            "\uff16\uff14",
            "\u0666\u0664",
            "64",
            "0x40",
            "1e3",
            " 64",
            "64\n",
            "\u0660-\u0660\u0666:\u0660\u0660",
            "0-06:00\n",
            "0-6:00",
            "1-24:00",
            "0-00:00",
            "999-23:59",
            "-x@example.org",
            "a@b.org\n",
            "\u00e9@b.org",
            "a@xn--b.org",
            "a@b@c.org",
            "x" * 100_000,
            2**63,
            2**64,
            -(2**63) - 1,
            10**30,
            -(10**30),
            1e308,
            -1e308,
            5e-324,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            0.5,
            64.0,
            [],
            {},
            [64],
            {"value": 64},
            True,
            None,
        ]
    ),
)
RAW_NUMBERS = ["1" * 5000, "-" + "9" * 4400, "1" * 4000, "1e999", "-1e999", "1E+2", "-0", "0.0000001e9", "1" * 300]


@st.composite
def valid_requests(draw: st.DrawFn, ctx: Context) -> dict[str, Any]:
    """A request as Rodan sends it: any generation, the stand-in's real files (submittable) or
    plausible paths (no such file), sometimes the Rodan host's absolute URL; valid settings."""
    generation = draw(st.sampled_from([g for g in ("old", "new", "rodan3") if g in ctx.pages]))
    source = draw(st.sampled_from(["real", "real", "plausible", "absolute"]))
    if source != "plausible":
        inputs = dict(ctx.pages[generation])
    else:
        seed = draw(st.integers(1, 2**64))
        if generation == "rodan3":  # any of its inputs, at least one sample
            names = [draw(st.sampled_from(RODAN3_NAMES[:21]))]
            names += draw(st.lists(st.sampled_from(RODAN3_NAMES), max_size=8, unique=True))
        else:
            names = OLD_NAMES if generation == "old" else new_names(draw(st.integers(1, 10)))
        inputs = {name: plausible_path(seed + i) for i, name in enumerate(names)}
    if source == "absolute":
        inputs = {k: f"http://{ctx.rodan}{v}" for k, v in inputs.items()}
    settings = dict(SETTINGS_OK)
    for name in draw(st.lists(st.sampled_from(list(SETTINGS_OK)), max_size=3, unique=True)):
        del settings[name]  # the default applies (and may be too big for the dev cluster: then (b))
    if draw(st.integers(0, 4)) == 0:
        settings["Slurm Notification Email"] = draw(st.sampled_from(["", "a@b.org", "x.y+z@mail.example.org"]))
    if draw(st.integers(0, 4)) == 0:
        settings["Patch height"] = settings["Patch width"] = draw(st.sampled_from([64, 128, 256]))
    request: dict[str, Any] = {"inputs": inputs, "settings": settings}
    if draw(st.integers(0, 9)) == 0:
        del request["settings"]
    return request


MUTATIONS = [
    "input-name",
    "input-value",
    "input-added",
    "input-dropped",
    "setting-value",
    "setting-raw-number",
    "setting-added",
    "settings-replaced",
    "inputs-replaced",
    "top-level-added",
]


@st.composite
def mutated_requests(draw: st.DrawFn, ctx: Context) -> tuple[str, bytes]:
    """A valid request with ONE field mutated, as a body."""
    request = draw(valid_requests(ctx))
    what = draw(st.sampled_from(MUTATIONS))
    inputs: dict[str, Any] = request["inputs"]
    settings: dict[str, Any] = request.setdefault("settings", {})
    names = list(inputs)
    raw = ""
    name_strategy = st.one_of(st.sampled_from(NASTY_NAMES), json_text)
    url_strategy = st.one_of(
        st.sampled_from(nasty_urls(ctx.rodan)),
        st.sampled_from([*ctx.odd_files, "/uploads/", "/uploads/projects/odd/resources/"]),
        st.tuples(st.sampled_from(["http://", "https://", "/uploads/", f"http://{ctx.rodan}/", ""]), json_text).map(
            "".join
        ),
        st.tuples(st.sampled_from(["http://", "https://"]), json_text, st.sampled_from(["", "/x", ":80/x"])).map(
            "".join
        ),
    )
    if what == "input-name":
        old = draw(st.sampled_from(names))
        inputs[draw(name_strategy)] = inputs.pop(old)
    elif what == "input-value":
        inputs[draw(st.sampled_from(names))] = draw(st.one_of(url_strategy, json_values))
    elif what == "input-added":
        inputs[draw(name_strategy)] = draw(st.one_of(url_strategy, st.sampled_from(list(inputs.values()))))
    elif what == "input-dropped":
        del inputs[draw(st.sampled_from(names))]
    elif what == "setting-value":
        settings[draw(st.sampled_from(SETTING_NAMES))] = draw(junk_setting)
    elif what == "setting-raw-number":
        settings[draw(st.sampled_from(SETTING_NAMES))] = RAW
        raw = draw(st.sampled_from(RAW_NUMBERS))
    elif what == "setting-added":
        settings[draw(st.one_of(json_text, st.sampled_from([n.upper() for n in SETTING_NAMES])))] = draw(junk_setting)
    elif what == "settings-replaced":
        request["settings"] = draw(json_values)
    elif what == "inputs-replaced":
        request["inputs"] = draw(json_values)
    else:
        request[draw(json_text)] = draw(json_values)
    return what, dumps(request, raw)


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


@st.composite
def nested_bodies(draw: st.DrawFn, ctx: Context) -> bytes:
    """JSON nested up to 100,000 deep, at the top or in a field of an otherwise valid request."""
    depth = draw(st.sampled_from([2, 50, 400, 900, 990, 1000, 1100, 5000, 100_000]))
    fragment = nested(depth, draw(st.sampled_from(["list", "object"])))
    request = draw(valid_requests(ctx))
    where = draw(st.sampled_from(["top", "input", "setting", "extra", "inputs", "settings", "name"]))
    if where == "top":
        return fragment.encode()
    if where == "input":
        request["inputs"][next(iter(request["inputs"]))] = RAW
    elif where == "setting":
        request.setdefault("settings", {})["CPUs"] = RAW
    elif where == "extra":
        request["extra"] = RAW
    elif where == "inputs":
        request["inputs"] = RAW
    elif where == "settings":
        request["settings"] = RAW
    else:  # a 1,000-deep JSON text as an input name: a long name, nested only as text
        request["inputs"][fragment[:2000]] = "/uploads/x"
    return dumps(request, fragment)


HUGE_SIZES = [MIB - 4096, MIB - 1, MIB, MIB + 1, MIB + 4096, 2 * MIB]


@st.composite
def huge_bodies(draw: st.DrawFn, ctx: Context) -> bytes:
    """About 1 MiB either side of the limit, some built to provoke an error reason as big as the body."""
    size = draw(st.sampled_from(HUGE_SIZES))
    request = draw(valid_requests(ctx))
    how = draw(st.sampled_from(["padding", "input-name", "input-value", "time", "setting-name", "many-inputs", "junk"]))
    base = len(dumps(request))
    fill = max(size - base - 64, 16)
    if how == "padding":
        request["padding"] = "x" * fill
    elif how == "input-name":
        request["inputs"]["#SBATCH " + "n" * fill] = "/uploads/x"
    elif how == "input-value":
        request["inputs"]["Image"] = "/uploads/" + "v" * fill
    elif how == "time":
        request.setdefault("settings", {})["Maximum time (D-HH:MM)"] = "0" * fill
    elif how == "setting-name":
        request.setdefault("settings", {})["s" * fill] = 1
    elif how == "many-inputs":
        for i in range(fill // 24):
            request["inputs"][f"unknown input {i:08d}"] = "/u"
    else:
        return (b"\xff\xfe" * (size // 2))[:size]
    return dumps(request)


@st.composite
def bodies(draw: st.DrawFn, ctx: Context) -> tuple[str, bytes]:
    roll = draw(st.integers(0, 99))
    if roll < 10:
        return "bytes", draw(st.binary(max_size=300))
    if roll < 20:
        return "json", json.dumps(draw(json_values)).encode()
    if roll < 25:
        encoding = draw(st.sampled_from(["utf-16", "latin-1", "utf-8-sig", "surrogatepass", "trailing"]))
        text = json.dumps(draw(valid_requests(ctx)), ensure_ascii=False)
        if encoding == "surrogatepass":
            return "encoding", (text[:-1] + ', "x": "\ud800"}').encode("utf-8", "surrogatepass")
        if encoding == "trailing":
            return "encoding", text.encode() + draw(st.sampled_from([b"\x00", b" junk", b"}", b"\n{}"]))
        return "encoding", text.encode(encoding)
    if roll < 45:
        return "valid", dumps(draw(valid_requests(ctx)))
    if roll < 85:
        what, body = draw(mutated_requests(ctx))
        return f"mutated:{what}", body
    if roll < 93:
        return "nested", draw(nested_bodies(ctx))
    return "huge", draw(huge_bodies(ctx))


# Short strings (<= 255 bytes once encoded) that pika sends: text, non-UTF-8 bytes, at the limit.
prop_text = st.text(st.one_of(st.characters(codec="utf-8"), st.sampled_from(NASTY_CHARS)), max_size=40)
non_utf8: st.SearchStrategy[bytes] = st.binary(max_size=40).map(lambda b: b"\xff" + b)
prop_values: st.SearchStrategy[str | bytes] = st.one_of(
    st.just(""),
    prop_text,
    non_utf8,
    prop_text.map(lambda t: t.encode()),
    st.sampled_from(
        [
            "x" * 255,
            "\u00e9" * 127,
            "\U0001f600" * 63,
            "#SBATCH --uid=0",
            "../../etc/passwd",
            "\x00",
            "\n",
            "abc\n",
            "sha256-" + "0" * 64,
            ".",
            "..",
            "-rf",
            "\ud7ff\ue000",
            b"\xed\xa0\x80",  # a UTF-8-encoded surrogate: not valid UTF-8
            b"\xc0\xaf",  # an overlong '/'
            b"\xff" * 255,
        ]
    ),
)
header_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.decimals(min_value=-(10**6), max_value=10**6, places=2, allow_nan=False, allow_infinity=False),
        st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(9999, 1, 1)),
        prop_text,
        non_utf8,
        st.sampled_from(["x" * 20_000, b"\xff" * 20_000]),
    ),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(prop_text, kids, max_size=3),
    max_leaves=8,
)
header_keys = st.one_of(
    st.sampled_from(
        [
            "x-death",
            "x-delivery-count",
            REASON_HEADER,
            "x-original-queue",
            "x-hpc-bridge-rejected-at",
            "x-first-death-queue",
        ]
    ),
    prop_text,
    non_utf8,
    st.just("k" * 255),
)
EXTRA_PROPS: dict[str, st.SearchStrategy[Any]] = {
    "content_type": st.one_of(prop_values, st.sampled_from(["application/json", "text/plain; charset=latin-1"])),
    "content_encoding": st.one_of(prop_values, st.sampled_from(["gzip", "utf-16", "base64"])),
    "headers": st.one_of(st.just({}), st.dictionaries(header_keys, header_values, max_size=4)),
    "delivery_mode": st.integers(1, 2),
    "priority": st.integers(0, 255),
    "expiration": st.sampled_from(["86400000", "abc", "-1", "1.5", "\uff11"]),  # junk: the broker refuses
    "message_id": prop_values,
    "timestamp": st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])),
    "type": prop_values,
    "user_id": st.sampled_from(["guest", "someone-else"]),  # another user: the broker refuses
    "app_id": prop_values,
    "cluster_id": prop_values,
}


@st.composite
def corrs(draw: st.DrawFn) -> Corr:
    if draw(st.integers(0, 2)):
        return Corr("fresh")
    value = draw(st.one_of(st.none(), prop_values))
    return Corr("literal", value)


@st.composite
def reply_tos(draw: st.DrawFn) -> Prop:
    roll = draw(st.integers(0, 9))
    if roll < 3:
        return Prop("reply")
    if roll < 7:
        return Prop(draw(st.sampled_from(list(TARGETS))))
    return Prop(literal=draw(st.one_of(st.none(), prop_values)))


@st.composite
def message_specs(draw: st.DrawFn, ctx: Context) -> MessageSpec:
    """One message: a body (any of :func:`bodies`) and, in about 4 of 10, fuzzed properties (the
    others carry exactly what Rodan sends: a fresh uuid4 and the reply queue)."""
    kind, body = draw(bodies(ctx))
    if draw(st.integers(0, 9)) >= 4:
        return MessageSpec(kind, body)
    if draw(st.integers(0, 19)) == 0:
        return MessageSpec(f"{kind}+bare", body, bare=True)
    fuzz = draw(st.sampled_from(["correlation_id", "reply_to", "both", "extra", "all"]))
    corr = draw(corrs()) if fuzz in ("correlation_id", "both", "all") else Corr("fresh")
    reply_to = draw(reply_tos()) if fuzz in ("reply_to", "both", "all") else Prop("reply")
    extra: dict[str, Any] = {}
    if fuzz in ("extra", "all"):
        for name in draw(st.lists(st.sampled_from(list(EXTRA_PROPS)), min_size=1, max_size=4, unique=True)):
            extra[name] = draw(EXTRA_PROPS[name])
    return MessageSpec(f"{kind}+props:{fuzz}", body, corr, reply_to, extra)


@st.composite
def batches(draw: st.DrawFn, ctx: Context, max_size: int = 6) -> list[MessageSpec]:
    """A few messages for one pass; about one in eight repeats an earlier one's correlation id
    (sometimes its body too, sometimes with another reply_to)."""
    specs = draw(st.lists(message_specs(ctx), min_size=1, max_size=max_size))
    out: list[MessageSpec] = []
    for i, spec in enumerate(specs):
        if i and draw(st.integers(0, 7)) == 0:
            of = draw(st.integers(0, i - 1))
            body = out[of].body if draw(st.booleans()) else spec.body
            reply_to = spec.reply_to if draw(st.booleans()) else Prop("reply")
            spec = MessageSpec(f"{spec.kind}+dup", body, Corr("dup", of=of), reply_to, spec.extra, False)
        out.append(spec)
    return out


# --- a fixed burst covering every kind (the daemon test) ----------------------------------------------


def hostile_burst(ctx: Context) -> list[MessageSpec]:
    """About 200 hostile messages, each kind above at least once, without randomness."""
    page = dict(ctx.pages["new"])
    valid = {"inputs": page, "settings": SETTINGS_OK}
    specs: list[MessageSpec] = []

    def add(kind: str, body: bytes, **kw: Any) -> None:
        specs.append(MessageSpec(kind, body, **kw))

    for name in NASTY_NAMES:
        inputs = dict(page)
        inputs[name] = inputs.pop(f"{NEW_PREFIX}0") if name.startswith(NEW_PREFIX) else "/uploads/x"
        add("input-name", dumps({"inputs": inputs, "settings": SETTINGS_OK}))
    if "rodan3" in ctx.pages:  # generation 3: its nasty names, files of the wrong kind, odd settings
        rodan3 = dict(ctx.pages["rodan3"])
        for name in NASTY_NAMES:
            add("rodan3-input-name", dumps({"inputs": {**rodan3, name: rodan3["Sample 1"]}, "settings": SETTINGS_OK}))
        for older in ("Image", "Background", f"{NEW_PREFIX}0"):
            add("rodan3-mixed", dumps({"inputs": {**rodan3, older: page[older]}, "settings": SETTINGS_OK}))
        add("rodan3-models-only", dumps({"inputs": {"Background Model": rodan3["Background Model"]}}))
        for url in [*ctx.odd_files, page["Image"], rodan3["Background Model"]]:
            add("rodan3-input-value", dumps({"inputs": {**rodan3, "Sample 2": url}, "settings": SETTINGS_OK}))
            add("rodan3-input-value", dumps({"inputs": {**rodan3, "Model 1": url}, "settings": SETTINGS_OK}))
        for name, value in [
            ("Batch Size", 65),
            ("Batch Size", 0),
            ("Batch Size", "8"),
            ("Batch Size", None),
            ("Batch Size", 8.0),  # valid: JSON's 8.0 is the integer 8
            ("Batch Size", 2**64),
            ("Patch width", 28),
            ("Patch height", 34),
            ("Maximum number of samples per label", 99),
        ]:
            add("rodan3-setting-value", dumps({"inputs": rodan3, "settings": {**SETTINGS_OK, name: value}}))
        add("rodan3-valid", dumps({"inputs": rodan3, "settings": {**SETTINGS_OK, "Batch Size": 2}}))
    for url in [*nasty_urls(ctx.rodan), *ctx.odd_files]:
        add("input-value", dumps({"inputs": {**page, "Image": url}, "settings": SETTINGS_OK}))
    for i, value in enumerate(
        ["\u00b2", "\uff16\uff14", 2**64, -(10**30), 1e308, float("nan"), [64], {"v": 1}, True, "x" * 100_000]
    ):
        name = SETTING_NAMES[i % len(SETTING_NAMES)]
        add("setting-value", dumps({"inputs": page, "settings": {**SETTINGS_OK, name: value}}))
    for raw in RAW_NUMBERS:
        add("setting-raw-number", dumps({"inputs": page, "settings": {**SETTINGS_OK, "CPUs": RAW}}, raw))
    for depth in (1000, 5000, 100_000):
        add("nested", nested(depth, "list").encode())
        add("nested", dumps({**valid, "extra": RAW}, nested(depth - 2, "object")))
    for size in (MIB - 1, MIB + 1):
        add("huge", dumps({**valid, "padding": "x" * (size - len(dumps(valid)) - 16)}))
    add("huge", dumps({"inputs": {**page, "#SBATCH " + "n" * 900_000: "/uploads/x"}, "settings": SETTINGS_OK}))
    add("huge", b"\xff" * (20 * MIB))  # above 16 MiB (RabbitMQ 4's default limit), below 3.x's 128 MiB
    for raw_body in (b"", b"\x00", b"\xff\xfe{}", b"null", b"[]", b'"x"', b"{", b"{}", b'{"inputs": {}}', b"1" * 5000):
        add("bytes", raw_body)
    body = dumps(valid)
    for target in TARGETS:
        add(f"reply_to:{target}", body, reply_to=Prop(target))
    for value in [None, "", b"\xff\xfe", "x" * 255, "\u00e9" * 127, "abc\n", b"\xed\xa0\x80"]:
        add("reply_to:literal", body, reply_to=Prop(literal=value))
        add("correlation_id", body, corr=Corr("literal", value))
        add("both", b"not json", corr=Corr("literal", value), reply_to=Prop("foreign"))
    add("bare", body, bare=True)
    for name, value in [
        ("content_type", b"\xff" * 255),
        ("content_encoding", "gzip"),
        ("headers", {"x-death": [{"count": "many"}], b"\xff": b"\xff" * 1000, "n": None, "d": Decimal("1.5")}),
        ("headers", {REASON_HEADER: "forged", "x-original-queue": b"\x00", "deep": [[[[{"a": [1]}]]]]}),
        ("headers", {"t": dt.datetime(9999, 1, 1), "big": 2**63 - 1, "s": "x" * 20_000}),
        ("priority", 255),
        ("delivery_mode", 2),
        ("timestamp", 2**64 - 1),
        ("message_id", b"\xff"),
        ("type", "x" * 255),
        ("app_id", "\x00"),
        ("cluster_id", ""),
        ("user_id", "guest"),
        ("expiration", "86400000"),
    ]:
        add(f"property:{name}", body, extra={name: value})
        add(f"property:{name}+not-json", b"\xff not json", extra={name: value})
    # Duplicates: a valid request twice; an invalid one twice; the same id with another reply_to.
    add("dup", body, corr=Corr("literal", "fixed-duplicate-valid"))
    add("dup", body, corr=Corr("literal", "fixed-duplicate-valid"))
    add("dup", b"{", corr=Corr("literal", "fixed-duplicate-invalid"))
    add("dup", b"{", corr=Corr("literal", "fixed-duplicate-invalid"))
    add("dup", body, corr=Corr("literal", "fixed-duplicate-foreign"), reply_to=Prop("foreign"))
    add("dup", b"{", corr=Corr("literal", "fixed-duplicate-foreign"))
    return specs

"""Months of running, measured: the daemon (`hpc-bridge run`, a separate process, real RabbitMQ, real
Slurm, the Rodan stand-in) under a steady, mixed stream of requests, with its RSS, open file
descriptors and threads sampled from /proc/PID/status and /proc/PID/fd.

The stream mixes malformed bodies, invalid settings, requests naming inputs Rodan does not have,
the hostile messages of tests/fuzz_messages.py (`hostile_burst`: nasty names, URLs, settings,
properties, duplicates, replies to the wrong queue), and, rarely, a small valid training: a real
Slurm job whose worker is tests/stub_worker.py (the real parameter file and reply path, no
TensorFlow). Every message with a usable correlation id and reply_to must be answered exactly
once (replies are counted per correlation id, and per part for replies in parts); any other
message only dead-lettered.

Retention is short (`--retention-minutes`, as HPC_RETENTION_DAYS) so that the daemon prunes its
settled records during the run: RSS should level off at what retention and a pass's work hold,
not grow with the requests served.

    .venv/bin/python benchmarks/bench_soak.py                  # 20,000 requests at up to 6/s; about an hour
    .venv/bin/python benchmarks/bench_soak.py --quick          # smoke test: 150 requests, ~20 s
    .venv/bin/python benchmarks/bench_soak.py --out soak.csv   # every sample as CSV (or .json)
    .venv/bin/python benchmarks/bench_soak.py --tree DIR       # the daemon from another tree: before/after
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
from benchlib import BROKER, REPO, Deployment, deployment, load
from tables import print_table

from bridge.errors import InvalidRequest
from bridge.intake import ROLE_KINDS, text_property
from bridge.protocol import InputRole, parse_request
from bridge.replies import PART_HEADER, PARTS_HEADER
from bridge.rodan import sniff
from bridge.testing.samples import make_sample_page
from tests import stub_worker
from tests.fuzz_messages import (
    Context,
    Corr,
    FuzzQueues,
    MessageSpec,
    hostile_burst,
    on_the_wire,
    plausible_path,
    write_odd_files,
    write_rodan3_page,
)

#: A valid training's settings: accepted by the dev cluster, the stub worker answers in seconds.
TRAINING = {"Maximum time (D-HH:MM)": "0-00:05", "Maximum memory (MB)": 1024, "CPUs": 1}
#: Shares of the stream besides the valid trainings (one every --valid-every).
MIX = {"malformed": 0.25, "settings": 0.25, "missing": 0.2, "hostile": 0.3}
#: Left out of the hostile messages: 1-20 MiB bodies (they would measure the broker's disk, not the daemon).
HOSTILE_MAX_BYTES = 256 * 1024
KIB = 1024


@dataclass
class Sample:
    elapsed_s: float
    published: int
    answered: int  # usable requests with their reply, plus messages only dead-lettered
    backlog: int  # ready in the request queue
    ledger: int  # records in SPOOL/ledger (pruned after the retention)
    rss_kib: int
    anon_kib: int  # RssAnon: the heap, without the mapped files
    hwm_kib: int
    fds: int
    threads: int
    cpu_s: float
    load: str


def proc_sample(pid: int) -> tuple[int, int, int, int, int, float]:
    """(VmRSS KiB, RssAnon KiB, VmHWM KiB, open fds, threads, own CPU s) of a live process."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return (
        int(fields["VmRSS"].split()[0]),
        int(fields["RssAnon"].split()[0]),
        int(fields["VmHWM"].split()[0]),
        fds,
        int(fields["Threads"]),
        cpu,
    )


def count_files(folder: Path) -> int:
    """The ``*.json`` files in ``folder`` (0 while it does not exist)."""
    try:
        with os.scandir(folder) as entries:
            return sum(1 for entry in entries if entry.name.endswith(".json"))
    except OSError:
        return 0


# --- the stream ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    kind: str
    body: bytes
    properties: pika.BasicProperties | None
    correlation_id: str | bytes | None  # as the bridge receives it
    usable: bool  # must get exactly one reply


class Stream:
    """The mixed requests, one at a time, deterministic for a seed."""

    def __init__(self, dep: Deployment, queues: FuzzQueues, *, seed: int, valid_every: int) -> None:
        self.rng = random.Random(seed)
        self.queues = queues
        self.valid_every = valid_every
        uploads = dep.rodan.uploads_dir
        self.pages = {
            "old": make_sample_page(uploads, generation="old", height=96, width=96, seed=11),
            "new": make_sample_page(uploads, generation="new", n_layers=2, height=96, width=96, seed=12),
        }
        self.pages["rodan3"] = write_rodan3_page(uploads, self.pages["new"])
        self.uploads = uploads
        self.origin = dep.env["RODAN_SCHEME"] + "://" + dep.env["RODAN_HOST"]
        context = Context(dep.rodan.host_port, self.pages, write_odd_files(uploads))
        # Each of the fuzz's hostile messages once per pass over the list; one that would be a valid
        # training (odd properties around a valid body) gets invalid settings instead.
        self.hostile = [self._not_a_training(s) for s in hostile_burst(context) if len(s.body) <= HOSTILE_MAX_BYTES]
        self.rng.shuffle(self.hostile)  # every part of the stream has each sort of hostility
        self.malformed = [
            b"",
            b"{",
            b"not json at all",
            b"\xff\xfe{}",
            b"null",
            b"[]",
            b'"inputs"',
            b'{"inputs": {}}',
            b'{"inputs": [], "settings": []}',
            json.dumps({"settings": TRAINING}).encode(),
            json.dumps({"inputs": self.pages["new"], "settings": TRAINING}).encode()[:-7],  # truncated
        ]
        bad_settings: list[dict[str, Any]] = [
            {"CPUs": -1},
            {"CPUs": 0},
            {"CPUs": "two"},
            {"Maximum memory (MB)": 10**12},
            {"Maximum memory (MB)": -5},
            {"Maximum time (D-HH:MM)": "99-99:99"},
            {"Maximum time (D-HH:MM)": "soon"},
            {"Patch width": 3},
            {"Maximum number of training epochs": -1},
            {"Maximum number of samples per label": "many"},
        ]
        self.bad_settings = [
            body
            for change in bad_settings
            for page in ("old", "new")
            if not self._valid(
                body := json.dumps({"inputs": self.pages[page], "settings": {**TRAINING, **change}}).encode()
            )
        ]
        self.count = 0
        self.kinds: Counter[str] = Counter()
        self._hostile_at = 0
        self._cycle = 0
        self._burst_ids: list[str | bytes | None] = []

    def _valid(self, body: bytes) -> bool:
        """Whether ``body`` is a request the bridge would submit (so that no training hides among the
        hostile messages): it parses, and every input is a file of its role's type that Rodan has."""
        try:
            request = parse_request(body, correlation_id="probe", reply_to=self.queues.reply, rodan_origin=self.origin)
        except InvalidRequest:
            return False
        for name, resource in request.inputs.items():
            path = self.uploads / resource.removeprefix(self.origin).removeprefix("/uploads/")
            try:
                head = path.read_bytes()[:16] if path.is_file() else b""
            except OSError:
                return False
            if sniff(head) not in ROLE_KINDS[request.roles.get(name, InputRole.IMAGE)]:
                return False
        return True

    def _not_a_training(self, spec: MessageSpec) -> MessageSpec:
        if not self._valid(spec.body):
            return spec
        data = json.loads(spec.body)
        data["settings"] = {**data.get("settings", {}), "CPUs": -1}
        return replace(spec, body=json.dumps(data).encode())

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        self.count += 1
        if self.valid_every and self.count % self.valid_every == 0:
            page = self.pages["new" if self.count % (2 * self.valid_every) else "old"]
            return self._plain("valid", json.dumps({"inputs": page, "settings": TRAINING}).encode())
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind == "malformed":
            return self._plain(kind, self.rng.choice(self.malformed))
        if kind == "settings":
            return self._plain(kind, self.rng.choice(self.bad_settings))
        if kind == "missing":
            inputs = dict(self.pages["new"])
            names = list(inputs) if self.rng.random() < 0.5 else [self.rng.choice(list(inputs))]
            for name in names:
                inputs[name] = plausible_path(self.rng.getrandbits(64))
            return self._plain(kind, json.dumps({"inputs": inputs, "settings": TRAINING}).encode())
        return self._next_hostile()

    def _plain(self, kind: str, body: bytes) -> Message:
        self.kinds[kind] += 1
        corr = str(uuid.uuid4())
        props = pika.BasicProperties(reply_to=self.queues.reply, correlation_id=corr)
        return Message(kind, body, props, corr, True)

    def _next_hostile(self) -> Message:
        if self._hostile_at >= len(self.hostile):
            self._hostile_at, self._burst_ids = 0, []
            self._cycle += 1
        spec = self.hostile[self._hostile_at]
        self._hostile_at += 1
        self.kinds["hostile"] += 1
        cid = self._correlation_id(spec.corr)
        self._burst_ids.append(cid)
        props = spec.properties(cid, self.queues)
        wire_cid = None if spec.bare else on_the_wire(cid)
        wire_reply_to = None if spec.bare else on_the_wire(spec.reply_to.resolve(self.queues))
        usable = isinstance(wire_cid, str) and wire_cid != "" and wire_reply_to == self.queues.reply
        # The bridge takes only what text_property accepts (it is what `usable` means to it too).
        usable = usable and text_property(wire_cid) is not None
        return Message(f"hostile:{spec.kind}", spec.body, props, wire_cid, usable)

    def _correlation_id(self, corr: Corr) -> str | bytes | None:
        """As tests/fuzz_messages.py builds them, but unique per pass over the hostile list: a literal
        text id gets the pass's number (its copies in one pass stay copies), so that every request
        of the soak is a new one (a repeated id is a duplicate, answered once in all)."""
        if corr.kind == "fresh":
            return str(uuid.uuid4())
        if corr.kind == "dup":
            return self._burst_ids[corr.of] if corr.of < len(self._burst_ids) else None
        value = corr.literal
        if isinstance(value, str) and value:
            suffix = f"~soak{self._cycle}"
            room = 255 - len(suffix.encode())
            head = value.encode("utf-8")[:room].decode("utf-8", "ignore")
            return head + suffix
        return value


# --- Rodan's side: replies and dead letters ------------------------------------------------------


class Receiver:
    """Counts every reply (per correlation id and part) and every dead-letter copy."""

    def __init__(self, channel: pika.adapters.blocking_connection.BlockingChannel, queues: FuzzQueues) -> None:
        self.parts: Counter[tuple[str, int]] = Counter()  # (correlation id, part) -> copies
        self.part_counts: dict[str, int] = {}
        self.dead = 0
        self.foreign = 0
        channel.basic_consume(queues.reply, self._on_reply, auto_ack=True)
        channel.basic_consume(queues.dead, self._on_dead, auto_ack=True)
        channel.basic_consume(queues.foreign, self._on_foreign, auto_ack=True)

    def _on_reply(self, _ch: Any, _method: Any, props: pika.BasicProperties, _body: bytes) -> None:
        cid = props.correlation_id
        headers = props.headers or {}
        part = int(headers.get(PART_HEADER, 1))
        if PARTS_HEADER in headers:
            self.part_counts[str(cid)] = int(headers[PARTS_HEADER])
        self.parts[(str(cid), part)] += 1

    def _on_dead(self, *_args: Any) -> None:
        self.dead += 1

    def _on_foreign(self, *_args: Any) -> None:
        self.foreign += 1

    def replied(self) -> set[str]:
        return {cid for cid, _part in self.parts}


@dataclass
class Verdict:
    usable: int
    once: int
    missing: int
    duplicated: int
    stray: int


def judge(expected: set[str], receiver: Receiver) -> Verdict:
    """Each expected id: every part of its reply exactly once (missing: no reply, or a part short)."""
    by_id: dict[str, list[int]] = {}
    for (cid, _part), copies in receiver.parts.items():
        by_id.setdefault(cid, []).append(copies)
    once = missing = duplicated = 0
    for cid in expected:
        per_part = by_id.get(cid, [])
        if any(n > 1 for n in per_part):
            duplicated += 1
        elif len(per_part) < receiver.part_counts.get(cid, 1):
            missing += 1
        else:
            once += 1
    stray = sum(1 for cid in by_id if cid not in expected)
    return Verdict(len(expected), once, missing, duplicated, stray)


# --- the run -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="messages published (default 20,000)")
    parser.add_argument("--rate", type=float, default=6.0, help="at most this many per second (default 6)")
    parser.add_argument("--backlog", type=int, default=30, help="pause publishing while more wait (default 30)")
    parser.add_argument("--valid-every", type=int, default=100, help="every Nth is a valid training (default 100)")
    parser.add_argument(
        "--retention-minutes",
        type=float,
        default=10.0,
        help="HPC_RETENTION_DAYS, in minutes, so that prune runs during the soak (default 10)",
    )
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--rows", type=int, default=16, help="samples shown in the curve's table (default 16)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write every sample to this .csv or .json file")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="a daemon setting")
    parser.add_argument(
        "--tree",
        type=Path,
        help="run the daemon from this source tree (e.g. `git archive` of an older commit): before and after",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 150 requests at up to 30/s, ~20 s")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rate, args.valid_every, args.interval = 150, 30.0, 50, 2.0
        args.retention_minutes = 0.25
    extra = dict(item.split("=", 1) for item in args.env)

    with deployment(hold=False) as dep:
        tag = dep.request_q.removesuffix("-jobs")
        queues = FuzzQueues(dep.request_q, dep.reply_q, dep.dead_q, f"{tag}-foreign")
        wrapper = stub_worker.install(dep.tmp / "stub")
        dep.env.update(
            HPC_WORKER_PYTHON=str(wrapper),
            HPC_RETENTION_DAYS=f"{args.retention_minutes / 1440:.8f}",
            HPC_RECONCILE_INTERVAL="5" if args.quick else "30",
            HPC_METRICS_FILE=str(dep.tmp / "metrics" / "hpc_bridge.prom"),  # rewritten at every reconciliation
        )
        dep.env.update(extra)
        stream = Stream(dep, queues, seed=args.seed, valid_every=args.valid_every)
        connection = pika.BlockingConnection(pika.URLParameters(BROKER))
        publish_channel = connection.channel()
        publish_channel.confirm_delivery()
        for name in (queues.request, queues.reply, queues.foreign):
            publish_channel.queue_declare(name)
        publish_channel.queue_declare(queues.dead, durable=True)
        receiver = Receiver(connection.channel(), queues)
        log_out = (dep.tmp / "daemon.out").open("wb")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "bridge", "run"],
            env=dep.env,
            cwd=args.tree or REPO,
            stdout=log_out,
            stderr=subprocess.STDOUT,
        )
        samples: list[Sample] = []
        expected: set[str] = set()
        unusable = refused = 0
        try:
            deadline = time.monotonic() + 60
            while (
                not (dep.tmp / "bridge.log").exists()
                or b"broker_connected" not in (dep.tmp / "bridge.log").read_bytes()
            ):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("the daemon did not connect")
                time.sleep(0.2)
            started = time.monotonic()

            def answered() -> int:
                return len(receiver.replied() & expected) + min(receiver.dead, unusable)

            def sample(backlog: int) -> None:
                rss, anon, hwm, fds, threads, cpu = proc_sample(daemon.pid)
                dep.rodan.clear_requests()  # the stand-in's log of requests, in this process
                samples.append(
                    Sample(
                        round(time.monotonic() - started, 1),
                        stream.count,
                        answered(),
                        backlog,
                        count_files(dep.spool / "ledger"),
                        rss,
                        anon,
                        hwm,
                        fds,
                        threads,
                        cpu,
                        load(),
                    )
                )
                last = samples[-1]
                print(
                    f"{last.elapsed_s:7.0f} s  published {last.published:6d}  answered {last.answered:6d}  "
                    f"backlog {backlog:3d}  ledger {last.ledger:5d}  RSS {rss / KIB:5.1f} MiB "
                    f"(anon {anon / KIB:5.1f})  fds {fds}  threads {threads}  load {last.load}",
                    file=sys.stderr,
                    flush=True,
                )

            def backlog() -> int:
                return int(publish_channel.queue_declare(queues.request, passive=True).method.message_count)

            sample(backlog())
            next_publish = next_sample = time.monotonic()
            next_sample += args.interval
            while stream.count < args.requests:
                if daemon.poll() is not None:
                    raise SystemExit(f"the daemon exited ({daemon.returncode})")
                now = time.monotonic()
                if now >= next_sample:
                    sample(backlog())
                    next_sample += args.interval
                if now < next_publish:
                    connection.process_data_events(time_limit=min(next_publish - now, 0.2))
                    continue
                if stream.count % 10 == 0 and backlog() > args.backlog:
                    connection.process_data_events(time_limit=0.5)
                    continue
                message = next(stream)
                next_publish = max(next_publish + 1 / args.rate, time.monotonic() - 1.0)
                try:
                    if message.properties is not None:
                        message.properties.encode()  # what pika refuses (any exception) never reaches the broker
                    publish_channel.basic_publish("", queues.request, message.body, message.properties, mandatory=True)
                except pika.exceptions.ChannelClosedByBroker:  # the broker refused it (and closed the channel)
                    refused += 1
                    publish_channel = connection.channel()
                    publish_channel.confirm_delivery()
                    continue
                except Exception:
                    refused += 1
                    continue
                if message.usable:
                    expected.add(str(message.correlation_id))
                else:
                    unusable += 1
            # The rest: every usable request answered (valid trainings wait for their job), queues empty.
            settle = time.monotonic() + (120 if args.quick else 900)
            while time.monotonic() < settle:
                connection.process_data_events(time_limit=1.0)
                if time.monotonic() >= next_sample:
                    sample(backlog())
                    next_sample += args.interval
                if expected <= receiver.replied() and backlog() == 0 and receiver.dead >= unusable:
                    break
            connection.process_data_events(time_limit=2.0)  # a late duplicate would show now
            sample(backlog())
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                status = daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                status = daemon.wait(10)
            log_out.close()
            try:
                connection.channel().queue_delete(queues.foreign)
                connection.close()
            except pika.exceptions.AMQPError:
                pass
        verdict = judge(expected, receiver)
        events = Counter(
            json.loads(line).get("event")
            for line in (dep.tmp / "bridge.log").read_text(errors="replace").splitlines()
            if line.startswith("{")
        )

    report(args, samples, verdict, receiver, stream, unusable, refused, status, events)
    if args.out:
        write_samples(args.out, samples)
    ok = verdict.missing == verdict.duplicated == verdict.stray == 0 and receiver.foreign == 0 and status == 0
    return 0 if ok else 1


def report(
    args: argparse.Namespace,
    samples: list[Sample],
    verdict: Verdict,
    receiver: Receiver,
    stream: Stream,
    unusable: int,
    refused: int,
    status: int,
    events: Counter[str],
) -> None:
    first, last = samples[0], samples[-1]
    warm = next((s for s in samples if s.published >= min(1000, args.requests // 10)), last)
    fds = [s.fds for s in samples]
    threads = [s.threads for s in samples]
    after = [s for s in samples if s.published >= warm.published]
    # growth after warm-up: the least-squares slope of RSS over the requests answered
    slope = _slope([s.answered for s in after], [s.rss_kib for s in after])
    print("Soak: the daemon (`hpc-bridge run`) under a mixed stream, from /proc/PID/status and /proc/PID/fd\n")
    rows = [
        ["requests published (refused by pika or the broker)", f"{stream.count} ({refused})"],
        ["mix", ", ".join(f"{k} {v}" for k, v in sorted(stream.kinds.items()))],
        ["usable requests: answered exactly once", f"{verdict.once} / {verdict.usable}"],
        ["missing / duplicated / stray replies", f"{verdict.missing} / {verdict.duplicated} / {verdict.stray}"],
        ["unusable messages / dead-letter copies", f"{unusable} / {receiver.dead}"],
        ["messages in a foreign queue", str(receiver.foreign)],
        ["valid trainings submitted (request_submitted)", str(events.get("request_submitted", 0))],
        ["prune passes (requests_pruned events)", str(events.get("requests_pruned", 0))],
        ["wall s / requests per s", f"{last.elapsed_s:.0f} / {stream.count / max(last.elapsed_s, 1):.2f}"],
        ["daemon CPU s", f"{last.cpu_s - first.cpu_s:.1f}"],
        ["fds min / max", f"{min(fds)} / {max(fds)}"],
        ["threads min / max", f"{min(threads)} / {max(threads)}"],
        ["RSS MiB at start", f"{first.rss_kib / KIB:.1f}"],
        [f"RSS MiB after warm-up ({warm.published} requests)", f"{warm.rss_kib / KIB:.1f}"],
        ["RSS MiB at the end / peak (VmHWM)", f"{last.rss_kib / KIB:.1f} / {last.hwm_kib / KIB:.1f}"],
        ["RSS MiB max after warm-up", f"{max(s.rss_kib for s in after) / KIB:.1f}"],
        ["RSS growth after warm-up, B per request (least squares)", f"{slope * KIB:.0f}"],
        ["ledger records at the end (max)", f"{last.ledger} ({max(s.ledger for s in samples)})"],
        ["daemon exit status on SIGTERM", str(status)],
        ["load", f"{first.load}/{last.load}"],
    ]
    print_table(["metric", "value"], rows)
    print("\nThe curve (samples over requests published):\n")
    shown = _spread(samples, args.rows)
    print_table(
        ["elapsed s", "published", "answered", "ledger records", "RSS MiB", "fds", "threads", "load"],
        [
            [
                f"{s.elapsed_s:.0f}",
                str(s.published),
                str(s.answered),
                str(s.ledger),
                f"{s.rss_kib / KIB:.1f}",
                str(s.fds),
                str(s.threads),
                s.load,
            ]
            for s in shown
        ],
    )


def _spread(samples: list[Sample], rows: int) -> list[Sample]:
    """``rows`` samples evenly spread from the first to the last."""
    if len(samples) <= rows:
        return samples
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def _slope(xs: list[int], ys: list[int]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (0 when it cannot be told)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def write_samples(path: Path, samples: list[Sample]) -> None:
    rows = [asdict(s) for s in samples]
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1) + "\n")
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    raise SystemExit(main())

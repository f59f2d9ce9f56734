"""The RabbitMQ rights the guides give, proven on the real broker (issue #27, item 1).

``docs/rodan-guide.md`` and ``rodan_job/README.md`` each give the bridge's account and the Rodan 3.x
job's account as ``rabbitmqctl set_permissions`` lines; these tests read the patterns from the guides
(tests/support/broker_rights.py), make those accounts on a vhost of the test's own, and run each
side's real broker operations under its own account: the job's ``hpc_relay.step`` (declare the run's
queue and the request queue, publish with confirms and ``mandatory``, ``basic_get`` + ack, delete its
queue) and a real ``hpc-bridge check`` pass (declare the request and dead-letter queues, take the
request, publish the error reply to the run's queue, copy the request to the dead-letter queue,
declare the status queue and publish to it) and ``hpc-bridge purge`` (read the dead-letter queue).
The request is one the bridge refuses at intake (no sample), so neither Rodan nor a scheduler is
needed: every broker operation of a request's round trip still happens.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from tests.support.bridge import run_bridge
from tests.support.broker_rights import (
    BRIDGE_USER,
    GUIDES,
    JOB_USER,
    REPO,
    Rights,
    RightsVhost,
    documented_rights,
    load_relay,
    rights_vhost,
)

pytestmark = [pytest.mark.broker]


@pytest.fixture(autouse=True)
def _rabbitmqctl() -> None:
    """The accounts are made with rabbitmqctl, which deploy/dev/setup.sh installs with RabbitMQ: a machine
    without it fails here, loudly, rather than skipping the proof that the guides' rights work."""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("the broker-rights tests make RabbitMQ accounts with rabbitmqctl: run deploy/dev/setup.sh as root")


REQUEST_QUEUE = "hpc-jobs"  # the guides' names: the vhost is the test's own
DEAD_LETTER_QUEUE = "hpc-bridge.dead-letter"
STATUS_QUEUE = "hpc-bridge.status"
#: A request the bridge refuses at intake (no sample): an error reply, a dead-letter copy.
REFUSED_REQUEST = json.dumps({"inputs": {}, "settings": {}}).encode()


def guide_rights() -> dict[str, Rights]:
    return documented_rights(GUIDES[0]).rights


@pytest.fixture
def box(broker_url: str) -> Any:
    rights = guide_rights()
    with rights_vhost(broker_url, rights[BRIDGE_USER], rights[JOB_USER]) as made:
        yield made


# --- the two sides, each under its own account -----------------------------------------------------


class Job:
    """The Rodan 3.x job's broker side (``hpc_relay.step``), as one run of it polls."""

    def __init__(self, url: str, state_dir: Path) -> None:
        self.relay = load_relay()
        self.config = self.relay.RelayConfig(url=url, state_dir=str(state_dir), request_queue=REQUEST_QUEUE)
        self.correlation_id = str(uuid.uuid4())
        self.reply_queue = self.relay.reply_queue_name(self.correlation_id)

    def poll(self) -> Any:
        """One poll: publishes on the first; the reply's files, or None while there is none."""
        return self.relay.step(self.config, self.correlation_id, lambda: REFUSED_REQUEST, 3600.0)


def bridge_env(url: str, spool: Path) -> dict[str, str]:
    """A bridge with the guides' queue names (the defaults) and a Rodan it never needs to reach."""
    return {
        "RABBITMQ_URL": url,
        "RODAN_HOST": "127.0.0.1:9",
        "RODAN_SCHEME": "http",
        "RODAN_USER": "hpc@example.org",
        "RODAN_PASSWORD": "rights-test-password",
        "HPC_SPOOL_DIR": str(spool),
        "HPC_WORKER_PYTHON": sys.executable,
    }


def bridge(url: str, spool: Path, *args: str) -> tuple[int, str]:
    done = run_bridge(bridge_env(url, spool), *args, timeout=180)
    return done.returncode, done.stdout + done.stderr


def depth(admin_url: str, queue: str) -> int | None:
    """Messages ready in ``queue`` (None: no such queue), seen with the admin's account."""
    connection = pika.BlockingConnection(pika.URLParameters(admin_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return None
    finally:
        if connection.is_open:
            connection.close()


def refused(url: str, operation: str, queue: str) -> str:
    """The broker's refusal text when ``url``'s account tries ``operation`` on ``queue`` ('' if allowed)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        if operation == "get":
            channel.basic_get(queue, auto_ack=False)  # unacked: back in the queue when the channel closes
        elif operation == "consume":
            channel.basic_consume(queue, lambda *_a: None, auto_ack=False)
        elif operation == "purge":
            channel.queue_purge(queue)
        elif operation == "declare":
            channel.queue_declare(queue, durable=True)
        elif operation == "delete":
            channel.queue_delete(queue, if_empty=True)
        else:
            raise ValueError(operation)
        return ""
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 403, exc
        return str(exc.reply_text)
    finally:
        if connection.is_open:
            connection.close()


# --- the guides ---------------------------------------------------------------------------------------


def test_both_guides_give_the_same_anchored_rights() -> None:
    """Catches: one guide's line changed and not the other's (the job's README and the Rodan guide
    disagreed before), a pattern without its anchors (RabbitMQ matches it anywhere in a name), or
    the block gone from a guide (documented_rights fails naming the guide)."""
    first, second = (documented_rights(path) for path in GUIDES)
    assert first == second, f"{GUIDES[0].name} and {GUIDES[1].name} give different rights"
    for user, rights in first.rights.items():
        for right in ("configure", "write", "read"):
            pattern = getattr(rights, right)
            assert pattern.startswith("^") and pattern.endswith("$"), f"{user} {right} {pattern!r} is not anchored"


# --- the documented rights work ----------------------------------------------------------------------


def test_a_request_and_its_reply_go_through_under_the_documented_rights(box: RightsVhost, tmp_path: Path) -> None:
    """The whole round trip with the guides' rights: the job publishes (job account), a bridge pass
    takes the request, answers and dead-letters it, publishes its status (bridge account), the job
    reads the reply and deletes its queue, and ``hpc-bridge purge`` reads the dead letter.
    Catches: any right the guides give that an operation of either side lacks (each one alone is
    ``test_each_right_is_needed``), e.g. the job declaring the request queue without configure on it."""
    job = Job(box.job_url, tmp_path / "job-state")
    spool = tmp_path / "spool"
    assert job.poll() is None  # published: no reply yet
    assert depth(box.admin_url, REQUEST_QUEUE) == 1

    rc, output = bridge(box.bridge_url, spool, "check")
    assert rc == 0, output[-3000:]
    assert depth(box.admin_url, REQUEST_QUEUE) == 0
    assert depth(box.admin_url, job.reply_queue) == 1  # the error reply, in the run's own queue
    assert depth(box.admin_url, DEAD_LETTER_QUEUE) == 1
    assert (depth(box.admin_url, STATUS_QUEUE) or 0) >= 1

    with pytest.raises(job.relay.HPCJobError) as failed:
        job.poll()
    assert failed.value.summary.startswith("The HPC training failed:"), failed.value.summary
    assert "missing inputs" in failed.value.details, failed.value.details
    assert depth(box.admin_url, job.reply_queue) is None  # the job deleted its queue

    rc, output = bridge(box.bridge_url, spool, "purge", "--all", "--yes")
    assert rc == 0, output[-3000:]
    assert depth(box.admin_url, DEAD_LETTER_QUEUE) == 0


def test_each_account_is_refused_what_it_does_not_do(box: RightsVhost, broker_url: str, tmp_path: Path) -> None:
    """Catches: a pattern wider than the guides mean (e.g. the job's read right on ``hpc-jobs`` or
    ``hpc-bridge.*``, an unanchored ``hpc-results``, the bridge reading the runs' reply queues), and
    a bridge account that reaches another vhost's request queue."""
    job = Job(box.job_url, tmp_path / "job-state")
    assert job.poll() is None  # the run's queue and the request queue exist
    rc, output = bridge(box.bridge_url, tmp_path / "spool", "check")  # the bridge's queues exist
    assert rc == 0, output[-3000:]

    # The job: never the requests, never the bridge's queues, never the older jobs' shared reply queue.
    for operation, queue in [
        ("get", REQUEST_QUEUE),
        ("consume", REQUEST_QUEUE),
        ("purge", REQUEST_QUEUE),
        ("get", DEAD_LETTER_QUEUE),
        ("get", STATUS_QUEUE),
        ("declare", "hpc-bridge.dead-letter"),
        ("delete", STATUS_QUEUE),
        ("declare", "hpc-results"),
        ("declare", "x-hpc-results.run"),  # anchored: not a name that merely contains the pattern
        ("declare", "hpc-jobs.other"),
    ]:
        assert f"ACCESS_REFUSED - access to queue '{queue}'" in refused(box.job_url, operation, queue), (
            f"the job's account may {operation} {queue}"
        )
    # The bridge: never a run's reply (it only publishes there; the job declares and deletes the
    # queue), never the shared reply queue's messages.
    for operation, queue in [
        ("get", job.reply_queue),
        ("purge", job.reply_queue),
        ("delete", job.reply_queue),
        ("declare", f"{job.reply_queue}.2"),
        ("get", "hpc-results"),
    ]:
        assert f"ACCESS_REFUSED - access to queue '{queue}'" in refused(box.bridge_url, operation, queue), (
            f"the bridge's account may {operation} {queue}"
        )
    # The daemon (hpc-bridge run) consumes the request queue where a cron pass uses basic_get.
    assert refused(box.bridge_url, "consume", REQUEST_QUEUE) == ""
    # A retried run's queue (hpc-results.<uuid>.<n>) is the job's to declare and read like any other.
    retried = f"{job.reply_queue}.2"
    assert refused(box.job_url, "declare", retried) == ""
    assert refused(box.job_url, "get", retried) == ""
    assert refused(box.job_url, "delete", retried) == ""

    # Another vhost with a request queue of its own: the bridge's account cannot even open it.
    rights = guide_rights()
    with rights_vhost(broker_url, rights[BRIDGE_USER], rights[JOB_USER], tag="other") as other:
        other_job = Job(other.job_url, tmp_path / "other-job-state")
        assert other_job.poll() is None
        elsewhere = box.bridge_url.rsplit("/", 1)[0] + "/" + other.vhost
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
            pika.BlockingConnection(pika.URLParameters(elsewhere))
        assert depth(other.admin_url, REQUEST_QUEUE) == 1  # still there, untouched


# --- each right is needed ---------------------------------------------------------------------------

#: (account, right, pattern in place of the guides', what fails and how it says so). '' removes the
#: right; the others are the narrower sets the guides gave before issue #27.
WITHOUT = [
    pytest.param(JOB_USER, "configure", "", "access to queue 'hpc-results.", id="job-configure"),
    pytest.param(JOB_USER, "write", "", "access to exchange 'amq.default'", id="job-write"),
    pytest.param(JOB_USER, "read", "", "access to queue 'hpc-results.", id="job-read"),
    pytest.param(BRIDGE_USER, "configure", "", "access to queue 'hpc-jobs'", id="bridge-configure"),
    pytest.param(BRIDGE_USER, "write", "", "access to exchange 'amq.default'", id="bridge-write"),
    pytest.param(BRIDGE_USER, "read", "", "access to queue 'hpc-jobs'", id="bridge-read"),
    pytest.param(JOB_USER, "configure", r"^hpc-results\..+$", "access to queue 'hpc-jobs'", id="job-old-guide"),
    pytest.param(
        JOB_USER, "write", r"^(hpc-jobs|hpc-results\..*)$", "access to exchange 'amq.default'", id="job-old-readme"
    ),
    pytest.param(
        BRIDGE_USER,
        "write",
        r"^(hpc-jobs|hpc-results(\..*)?|hpc-bridge\..*)$",
        "access to exchange 'amq.default'",
        id="bridge-old-guide",
    ),
    pytest.param(BRIDGE_USER, "configure", r"^hpc-jobs$", "access to queue 'hpc-bridge.dead-letter'", id="bridge-own"),
]


@pytest.mark.parametrize(("user", "right", "pattern", "says"), WITHOUT)
def test_each_right_is_needed(broker_url: str, tmp_path: Path, user: str, right: str, pattern: str, says: str) -> None:
    """With one of the six patterns emptied (or narrowed as an older guide had it), the round trip
    fails at the operation that needs it, and the broker's refusal names it.
    Catches: a right the guides give that no operation needs (then nothing fails here), and a test
    that passes whatever the rights (the round trip is the one the documented rights complete)."""
    rights = guide_rights()
    rights[user] = rights[user].with_right(right, pattern)
    with rights_vhost(broker_url, rights[BRIDGE_USER], rights[JOB_USER], tag="without") as box:
        job = Job(box.job_url, tmp_path / "job-state")
        spool = tmp_path / "spool"
        if user == JOB_USER and right in ("configure", "write"):
            with pytest.raises(job.relay.HPCJobError) as failed:
                job.poll()  # the publish itself
            assert says in failed.value.details, failed.value.details
            assert not depth(box.admin_url, REQUEST_QUEUE)  # nothing went out
            return
        if user == JOB_USER:  # read: the publish went out, the reply cannot be taken
            with pytest.raises(job.relay.HPCJobError) as failed:
                job.poll()
            assert says in failed.value.details, failed.value.details
            assert depth(box.admin_url, REQUEST_QUEUE) == 1
            return
        assert job.poll() is None  # published
        rc, output = bridge(box.bridge_url, spool, "check")
        assert rc != 0, output[-3000:]
        assert says in output, output[-3000:]
        if right == "write":  # the request was taken, the reply refused: it waits in the outbox
            assert list((spool / "outbox").glob("*.json")), "the refused reply is not kept in the outbox"
        assert depth(box.admin_url, REQUEST_QUEUE) == 1  # not lost: back in the queue, unanswered
        assert not depth(box.admin_url, job.reply_queue)
        assert job.poll() is None  # the run waits on


def test_the_guides_name_the_rights_in_their_text() -> None:
    """The sentences beside each block name the patterns of that block.
    Catches: a block changed without its explanation (a reader follows the sentences too)."""
    for path in GUIDES:
        text = path.read_text(encoding="utf-8")
        job = documented_rights(path).rights[JOB_USER]
        for pattern in (job.configure, job.write, job.read):
            assert f"`{pattern}`" in text.replace(f"'{pattern}'", ""), (
                f"{path.relative_to(REPO)} never explains {pattern}"
            )
    guide = GUIDES[0].read_text(encoding="utf-8")
    bridge_rights = documented_rights(GUIDES[0]).rights[BRIDGE_USER]
    for pattern in (bridge_rights.configure, bridge_rights.write, bridge_rights.read):
        assert f"`{pattern}`" in guide, f"docs/rodan-guide.md never explains {pattern}"


# --- hpc-bridge doctor ------------------------------------------------------------------------------


def doctor_config(url: str, tmp_path: Path) -> Any:
    from bridge.config import load_config

    return load_config(environ={**bridge_env(url, tmp_path / "spool"), "HOME": str(tmp_path)})


def test_doctor_asks_for_the_documented_rights(box: RightsVhost, tmp_path: Path) -> None:
    """doctor's fix line is the guide's line for the default names, and the guide's rights pass
    its check; a request waiting in the queue is still there, unchanged, after the read probe.
    Catches: doctor suggesting rights other than the guide's, a probe that needs more than the
    guide gives, and a read probe that takes a request away."""
    from bridge.ops.doctor import bridge_permissions, check_rights

    config = doctor_config(box.bridge_url, tmp_path)
    documented = guide_rights()[BRIDGE_USER]
    assert bridge_permissions(config) == (documented.configure, documented.write, documented.read)
    job = Job(box.job_url, tmp_path / "job-state")
    assert job.poll() is None  # a request waits in hpc-jobs
    [check] = check_rights(config)
    assert check.status == "ok", check
    connection = pika.BlockingConnection(pika.URLParameters(box.admin_url))
    try:
        method, properties, body = connection.channel().basic_get(REQUEST_QUEUE, auto_ack=True)
    finally:
        connection.close()
    assert method is not None and properties.correlation_id == job.correlation_id and body == REFUSED_REQUEST


BRIDGE_WITHOUT = [
    pytest.param("configure", "", "cannot configure queue hpc-jobs", id="configure"),
    pytest.param("write", "", "cannot write to exchange amq.default: replies", id="write"),
    pytest.param("read", "", "cannot read queue hpc-jobs: requests are never taken", id="read"),
    pytest.param(
        "write",
        r"^(hpc-jobs|hpc-results(\..*)?|hpc-bridge\..*)$",
        "cannot write to exchange amq.default",
        id="write-old-guide",
    ),
    pytest.param("configure", r"^hpc-jobs$", "cannot configure queue hpc-bridge.dead-letter", id="configure-no-own"),
    pytest.param("read", r"^hpc-jobs$", "cannot read queue hpc-bridge.dead-letter", id="read-no-dead-letters"),
]


@pytest.mark.parametrize(("right", "pattern", "says"), BRIDGE_WITHOUT)
def test_doctor_names_the_missing_right(broker_url: str, tmp_path: Path, right: str, pattern: str, says: str) -> None:
    """With one of the bridge's rights missing (or narrowed), doctor's broker-rights line fails,
    names that right and what it breaks, and gives the guide's set_permissions line as the fix.
    Catches: a probe that proves nothing (passes without the right), a missing right reported as
    another, and a fix line that is not the guide's."""
    from bridge.ops.doctor import check_rights

    rights = guide_rights()
    bridge_rights = rights[BRIDGE_USER].with_right(right, pattern)
    with rights_vhost(broker_url, bridge_rights, rights[JOB_USER], tag="doctor") as box:
        [check] = check_rights(doctor_config(box.bridge_url, tmp_path))
        assert check.status == "FAIL", check
        assert says in check.found, check.found
        documented = rights[BRIDGE_USER]
        assert check.fix.startswith(
            f"rabbitmqctl set_permissions -p {box.vhost} {box.bridge_user} "
            f"'{documented.configure}' '{documented.write}' '{documented.read}'"
        ), check.fix

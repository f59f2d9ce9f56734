"""``hpc-bridge doctor``: check a deployment end to end and say what to fix.

Every check is independent and prints one line: ``ok``, ``FAIL`` or ``warn``, what it found and,
when something is wrong, what to change. A check whose premise failed (a setting it needs has a
problem, no broker) says ``skip`` and why: a problem in one setting skips only the checks that
need it (:data:`NEEDS`), the others still run. Exit 0 only when no check failed (warnings allowed).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import functools
import json
import os
import pwd
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pika
import pika.exceptions

from bridge.amqp import CONNECTION_ERRORS, connection_parameters, describe_url
from bridge.config import (
    CREDENTIALS_SETTING,
    BridgeConfig,
    ConfigReport,
    contains_secret,
    credentials_path,
    examine_config,
)
from bridge.errors import ConfigError, PermanentError, RodanAuthError, SchedulerUnavailable, TransientError
from bridge.handoff import PROBE_RODAN_TIMEOUT_S
from bridge.instance import Instance
from bridge.intake import rodan_job_spec
from bridge.logs import configure_logging, register_secret
from bridge.ops import probe as job_probe
from bridge.ops.checks import Check, fail, ok, skip, warn
from bridge.ops.heartbeat import status_queue_arguments
from bridge.ops.install import LINGER_DIR, installed_user_units, lingering
from bridge.ops.instances import collisions, other_instances
from bridge.protocol import RequestSettings
from bridge.rodan import RodanClient
from bridge.schedulers import BACKENDS, Scheduler, get_scheduler, option_problems
from bridge.schedulers.base import scrubbed_environment
from bridge.shell import CommandError, CommandNotFound, CommandTimeout, run_command
from bridge.spool import LOCK_FIX, NO_LOCKS, Spool, fsync_dir, mount_of
from bridge.version import DISTRIBUTION, package_version

EPILOG = """Each line: ok / FAIL / warn / skip, the check, what was found and what to fix.
Exit status 0 when no check failed (warnings allowed), 1 otherwise.

examples:
  hpc-bridge doctor                                   # after installing, or when requests go unanswered
  hpc-bridge doctor --job                             # and a probe job: the same checks from a compute node
  hpc-bridge --credentials ~/hpc-bridge/credentials.env doctor --json | jq '.checks[] | select(.status=="FAIL")'
"""

#: Filesystems that compute nodes share; anything else is local to this machine unless exported.
SHARED_FS = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs", "panfs", "wekafs"}
)
NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
NODE_LOCAL_DIRS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))  # noqa: S108 - judged, never written to
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)'.*?: received (?P<ours>.+?) but current is (?P<theirs>.+)$"
)
#: Run by HPC_WORKER_PYTHON: prints the worker environment's hpc-bridge version (compared with the
#: bridge's own), its TensorFlow version and how many GPUs it sees.
WORKER_PROBE = (
    "import importlib.metadata as m, worker.trainer, tensorflow as tf; "
    f"print(m.version({DISTRIBUTION!r}), tf.__version__, len(tf.config.list_physical_devices('GPU')))"
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the deployment (credentials, broker, queues, Rodan, scheduler, spool, template, worker)",
        description="Check every part of a deployment and say, for each problem, what to fix.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument(
        "--skip-worker",
        action="store_true",
        help="skip the login node's worker check (HPC_WORKER_PYTHON importing the worker and TensorFlow "
        "here: seconds); --job's node-worker check still imports them on the compute node",
    )
    job_probe.add_arguments(p)
    p.set_defaults(operator=run, loads_config=True)


def run(args: argparse.Namespace) -> int:
    configure_logging(level="ERROR", component="doctor")  # the findings are the output, not log events
    probe = None
    if getattr(args, "job", False):
        options = job_probe.options_from(args)
        probe = functools.partial(job_probe.doctor_checks, options=options)
    checks = diagnose(args.credentials, skip_worker=args.skip_worker, probe=probe)
    failed = any(c.status == "FAIL" for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=1))
    else:
        for check in checks:
            print(check.line())
        print(f"{sum(c.status == 'FAIL' for c in checks)} failed, {sum(c.status == 'warn' for c in checks)} warnings")
    return 1 if failed else 0


#: Stands, in NEEDS, for every scheduler setting: which backend, its options and every backend's site
#: settings (HPC_SLURM_*, HPC_SGE_*, ...: the backends registered when it is asked).
SCHEDULER = "<scheduler>"
BROKER_SETTINGS = ("RABBITMQ_*", "HPC_BROKER_HEARTBEAT")
#: Where the secrets come from that the batch script must not hold (the template check looks for them).
SECRET_SETTINGS = ("RODAN_PASSWORD", "RABBITMQ_URL", "RABBITMQ_PASSWORD")
TEMPLATE_SETTINGS = (
    SCHEDULER,
    "HPC_SPOOL_DIR",
    "HPC_GPU_RULES",
    "HPC_WARN_SECONDS",
    "HPC_JOB_*",
    "HPC_WORKER_PYTHON",
    *SECRET_SETTINGS,
)
#: The settings each check needs (fnmatch patterns; CREDENTIALS_SETTING, the file's mode, is the
#: credentials check's own): a problem in one of them skips the check, and the checks that go with
#: it (scheduler: its commands, it, its accounting; spool: it, spool-shared, spool-lock; probe: the
#: probe job's lines). A problem about no one setting skips every check but these three.
NEEDS: dict[str, tuple[str, ...]] = {
    "broker": BROKER_SETTINGS,
    "queues": (*BROKER_SETTINGS, "HPC_REQUEST_QUEUE", "HPC_REPLY_QUEUE", "HPC_DEAD_LETTER_QUEUE"),
    "broker-rights": (
        *BROKER_SETTINGS,
        "HPC_REQUEST_QUEUE",
        "HPC_REPLY_QUEUE",
        "HPC_DEAD_LETTER_QUEUE",
        "HPC_STATUS_QUEUE",
    ),
    "rodan": ("RODAN_*", "HPC_RODAN_TIMEOUT"),
    "scheduler": (SCHEDULER,),
    "spool": ("HPC_SPOOL_DIR",),
    "instances": (
        "RABBITMQ_*",
        "HPC_REQUEST_QUEUE",
        "HPC_DEAD_LETTER_QUEUE",
        "HPC_STATUS_QUEUE",
        "HPC_SPOOL_DIR",
        "HPC_LOG_FILE",
        "HPC_METRICS_FILE",
        "HPC_BRIDGE_INSTANCE",
    ),
    "template": TEMPLATE_SETTINGS,
    "worker": ("HPC_WORKER_PYTHON",),
    "probe": (
        *TEMPLATE_SETTINGS,
        "RABBITMQ_*",
        "RODAN_SCHEME",
        "RODAN_HOST",
        "HPC_RODAN_TIMEOUT",
        "HPC_RUNS_DIR",
        "HPC_NODE_LOCAL_DIR",
        "HPC_MAX_CONTINUATIONS",
    ),
}


#: The lines check_scheduler gives.
SCHEDULER_CHECKS = ("scheduler-commands", "scheduler", "scheduler-accounting")


def needed_settings(check: str) -> tuple[str, ...]:
    """NEEDS[check], with SCHEDULER spelled out."""
    patterns: list[str] = []
    for pattern in NEEDS[check]:
        if pattern == SCHEDULER:
            patterns += ["HPC_SCHEDULER", "HPC_SCHEDULER_*", *(f"{cls.setting_prefix}*" for cls in BACKENDS.values())]
        else:
            patterns.append(pattern)
    return tuple(patterns)


def blocking(check: str, problems: Mapping[str, list[str]] | None) -> str:
    """Why ``check`` cannot run, given the configuration's ``problems`` by setting (None: it did not
    load at all); "" when it can."""
    if problems is None:
        return "the configuration did not load"
    patterns = needed_settings(check)
    names = sorted(s for s in problems if s and any(fnmatch.fnmatchcase(s, p) for p in patterns))
    if names:
        has = "has a problem" if len(names) == 1 else "have problems"
        return f"{', '.join(names)} {has} (see settings)"
    if "" in problems:
        return "the configuration has a problem (see settings)"
    return ""


def diagnose(
    credentials: Path | None,
    *,
    skip_worker: bool = False,
    environ: Mapping[str, str] | None = None,
    probe: Callable[[BridgeConfig | None, list[Check]], list[Check]] | None = None,
) -> list[Check]:
    """Every check; ``probe`` (``doctor --job``) adds its lines last, given the configuration and the
    lines before it. A check that needs a setting with a problem is skipped (:data:`NEEDS`)."""
    env = dict(os.environ if environ is None else environ)
    checks: list[Check] = []
    path = _credentials_path(credentials, env)
    checks.append(check_credentials_file(path))
    report, settings = check_settings(path, env)
    checks.extend(settings)
    checks.append(check_linger())
    problems = report.by_setting(without=[CREDENTIALS_SETTING]) if report is not None else None
    config = report.config if report is not None else None
    if config is not None:
        for secret in config.secrets:
            register_secret(secret)

    def blocked(check: str) -> str:
        return blocking(check, problems)

    if config is None or blocked("broker"):
        checks += [skip(name, blocked("broker")) for name in ("broker", "queues", "broker-rights")]
    else:
        broker = check_broker(config)
        checks.append(broker)
        for name, check in (("queues", check_queues), ("broker-rights", check_rights)):
            if blocked(name):
                checks.append(skip(name, blocked(name)))
            elif broker.status == "ok":
                checks.extend(check(config))
            else:
                checks.append(skip(name, "no broker connection (see broker)"))
    checks.append(skip("rodan", blocked("rodan")) if config is None or blocked("rodan") else check_rodan(config))
    if config is None or blocked("scheduler"):
        checks += [skip(name, blocked("scheduler")) for name in SCHEDULER_CHECKS]
    else:
        checks.extend(check_scheduler(config))
    if config is None or blocked("spool"):
        checks += [skip(name, blocked("spool")) for name in ("spool", "spool-shared", "spool-lock")]
    else:
        checks.extend(check_spool(config.spool_dir))
        checks.append(check_spool_lock(config.spool_dir))
    checks.append(
        skip("instances", blocked("instances"))
        if config is None or blocked("instances")
        else check_instances(config, env)
    )
    if config is None or blocked("template"):
        checks.append(skip("template", blocked("template")))
    else:
        checks.append(check_template(config))
    if skip_worker:
        checks.append(skip("worker", "--skip-worker"))
    elif config is None or blocked("worker"):
        checks.append(skip("worker", blocked("worker")))
    else:
        checks.append(check_worker(config))
    if probe is not None:
        why = blocked("probe")
        checks.extend(job_probe.skipped(why) if config is None or why else probe(config, checks))
    return checks


def check_instances(config: BridgeConfig, env: Mapping[str, str]) -> Check:
    """What this instance shares with the account's other instances (bridge/ops/instances.py)."""
    name = "instances"
    others = other_instances(config, env)
    if not others:
        return ok(name, f"{config.instance} is the only instance of this account")
    shared = collisions(config, others)
    if shared:
        return fail(name, "; ".join(shared), "give each instance its own (docs/operator-guide.md, Several instances)")
    unread = [f"{o.name} ({o.problem})" for o in others if o.config is None]
    if unread:
        return warn(name, f"cannot read the settings of {', '.join(unread)}", "hpc-bridge --instance NAME doctor")
    return ok(name, f"{config.instance} shares nothing with {', '.join(o.name for o in others)}")


# --- 1. credentials ----------------------------------------------------------------------------


def _credentials_path(credentials: Path | None, env: Mapping[str, str]) -> Path | None:
    return credentials_path(credentials, env, Instance.from_environment(None, env))


def check_credentials_file(path: Path | None) -> Check:
    name = "credentials"
    if path is None:
        return warn(name, "no credentials file (settings from the environment only)", "")
    if not path.exists():
        return fail(name, f"{path} does not exist", "create it from credentials.env.example, or pass --credentials")
    if not path.is_file():
        return fail(name, f"{path} is not a file", "point --credentials or HPC_BRIDGE_CREDENTIALS at the file")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return fail(
            name, f"{path} has mode {mode:o}: group or others can read the passwords in it", f"chmod 600 {path}"
        )
    if not os.access(path, os.R_OK):
        return fail(name, f"{path} is not readable by this user", "chown it to the user the bridge runs as")
    return ok(name, f"{path} (mode {mode:o})")


def check_settings(path: Path | None, env: Mapping[str, str]) -> tuple[ConfigReport | None, list[Check]]:
    """The settings line, and a settings-warnings line when there is something harmless to say (a name
    in the file that this version does not read). The file's mode is the credentials line's: the
    settings are judged all the same. The report is None when no settings could be read at all."""
    name = "settings"
    try:
        report = examine_config(path, env)
    except ConfigError as exc:  # the file named cannot be read
        return None, [fail(name, str(exc), "fix that setting in the credentials file or the environment")]
    checks: list[Check]
    if report.by_setting(without=[CREDENTIALS_SETTING]):
        checks = [
            fail(
                name,
                str(report.error(without=[CREDENTIALS_SETTING])),
                "fix that setting in the credentials file or the environment (the checks that need it are skipped)",
            )
        ]
    elif report.source.mode_problem:
        checks = [ok(name, "every setting is valid (the file's mode aside)")]
    else:
        checks = [ok(name, "every setting is valid")]
    if report.warnings:
        checks.append(
            warn(
                "settings-warnings",
                "; ".join(report.warnings),
                "remove each name from the file, or run the version that reads it",
            )
        )
    return report, checks


# --- 2. broker and 3. queues -------------------------------------------------------------------


def _user(url: str) -> str:
    return pika.URLParameters(url).credentials.username  # type: ignore[no-any-return]


def check_broker(config: BridgeConfig) -> Check:
    name = "broker"
    url = config.broker_url
    where = describe_url(url)
    try:
        connection = _connect(config)
    except pika.exceptions.ProbableAuthenticationError:
        return fail(
            name,
            f"login refused for user {_user(url)!r} at {where} (ACCESS_REFUSED)",
            "check RABBITMQ_PASSWORD and RABBITMQ_USER (or the user:password in RABBITMQ_URL)",
        )
    except pika.exceptions.ProbableAccessDeniedError as exc:
        return fail(
            name,
            f"user {_user(url)!r} may not use the virtual host at {where} ({_closed_text(exc)})",
            "check RABBITMQ_VHOST (or the path of RABBITMQ_URL) and the user's permissions "
            "(rabbitmqctl set_permissions)",
        )
    except OSError as exc:  # ssl.SSLError, certificate errors, a refused or unreachable socket
        return _connection_failure(name, url, where, exc)
    except pika.exceptions.AMQPConnectionError as exc:
        return _connection_failure(name, url, where, exc)
    server = connection._impl.server_properties or {}  # pika keeps them on the connection implementation
    version = server.get("version", b"")
    connection.close()
    text = version.decode() if isinstance(version, bytes) else str(version)
    tls = " over TLS" if url.startswith("amqps:") else ""
    return ok(name, f"logged in as {_user(url)!r} at {where}{tls} (RabbitMQ {text or 'unknown version'})")


def _connect(config: BridgeConfig) -> pika.BlockingConnection:
    params = connection_parameters(
        config.broker_url, heartbeat=config.broker_heartbeat_s, ca_file=config.broker_ca_file, name="hpc-bridge-doctor"
    )
    return pika.BlockingConnection(params)


def _closed_text(exc: BaseException) -> str:
    text = " ".join(str(a) for a in exc.args)
    match = re.search(r"'([A-Z_]+ - [^']*)'", text)
    return match.group(1) if match else text[:200]


def _connection_failure(name: str, url: str, where: str, exc: BaseException) -> Check:
    text = f"{type(exc).__name__}: {exc}"
    if "SSL" in text or "CERTIFICATE" in text.upper():
        if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
            return fail(
                name,
                f"TLS handshake with {where} failed ({_short(text)}): the port does not speak TLS",
                "use amqp:// for a plain port (5672) or the TLS port (5671) for amqps:// (RABBITMQ_URL/RABBITMQ_PORT)",
            )
        return fail(
            name,
            f"TLS handshake with {where} failed ({_short(text)})",
            "set RABBITMQ_CA_FILE to the CA that signed the broker's certificate, and check the host name matches it",
        )
    tls_hint = " (or amqps:// if the broker only takes TLS)" if url.startswith("amqp:") else ""
    return fail(
        name,
        f"broker unreachable at {where} ({_short(text)})",
        f"check RABBITMQ_HOST and RABBITMQ_PORT (or RABBITMQ_URL){tls_hint}, and that RabbitMQ runs there",
    )


def _short(text: str) -> str:
    return text.replace("\n", " ")[:200]


def check_queues(config: BridgeConfig) -> list[Check]:
    expected: list[tuple[str, bool, str]] = [
        (config.request_queue, False, "Rodan declares it with queue_declare(name): durable=False, no x-arguments"),
        (config.reply_queue, False, "Rodan declares it with queue_declare(name): durable=False, no x-arguments"),
        (config.dead_letter_queue, True, "the bridge declares it durable=True, no x-arguments"),
    ]
    try:
        connection = _connect(config)
    except (pika.exceptions.AMQPError, *CONNECTION_ERRORS) as exc:
        return [skip("queues", f"the broker went away ({type(exc).__name__})")]
    try:
        return [_check_queue(connection, queue, durable, how) for queue, durable, how in expected]
    finally:
        if connection.is_open:
            connection.close()


def _check_queue(connection: pika.BlockingConnection, queue: str, durable: bool, how: str) -> Check:
    name = f"queue {queue}"
    channel = connection.channel()
    try:
        depth = int(channel.queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return ok(name, "not declared yet (declared on first use, as expected)")
        if exc.reply_code == 405:
            return fail(
                name,
                f"declared exclusive by another connection ({exc.reply_text})",
                "stop whatever holds it; Rodan and the bridge need it non-exclusive",
            )
        return fail(name, f"passive declare refused: {exc.reply_text}", "check the user's configure permissions")
    if channel.is_open:
        channel.close()
    channel = connection.channel()  # a throw-away channel: a mismatch closes it
    try:
        channel.queue_declare(queue, durable=durable, exclusive=False, auto_delete=False, arguments=None)
    except pika.exceptions.ChannelClosedByBroker as exc:
        text = str(exc.reply_text)
        if exc.reply_code == 405:
            return fail(name, f"exclusive to another connection ({text})", "stop whatever holds it exclusively")
        match = _INEQUIVALENT.search(text)
        if exc.reply_code == 406 and match:
            arg, ours, theirs = match["arg"], match["ours"], match["theirs"]
            return fail(
                name,
                f"declared with {arg} = {theirs} but {how} (expects {ours}): declaring it fails with "
                "406 PRECONDITION_FAILED",
                f"when it is empty, delete it (rabbitmqctl delete_queue {queue}) so it is declared again correctly",
            )
        return fail(name, f"declare refused ({exc.reply_code} {text})", "check the queue's declaration and permissions")
    finally:
        if channel.is_open:
            channel.close()
    return ok(name, f"declared as expected, {depth} message(s) waiting")


#: The rights of the bridge's account that docs/rodan-guide.md (step 1) gives, for the default names.
OWN_QUEUES_PATTERN = r"hpc-bridge\..+"
DEFAULT_EXCHANGE = "amq.default"
_PATTERN_SPECIALS = re.compile(r"([.^$*+?{}\[\]\\|()])")


def _literal(name: str) -> str:
    """``name`` as a RabbitMQ permission pattern that matches it alone."""
    return _PATTERN_SPECIALS.sub(r"\\\1", name)


def bridge_permissions(config: BridgeConfig) -> tuple[str, str, str]:
    """(configure, write, read) patterns for the bridge's account with this configuration's queue
    names: docs/rodan-guide.md's line for the default names (anchored: RabbitMQ matches a pattern
    anywhere in a name otherwise)."""
    own = re.compile(OWN_QUEUES_PATTERN)
    dead = [] if own.fullmatch(config.dead_letter_queue) else [_literal(config.dead_letter_queue)]
    status = [] if not config.status_queue or own.fullmatch(config.status_queue) else [_literal(config.status_queue)]
    request = _literal(config.request_queue)
    configure = [request, _literal(config.reply_queue), OWN_QUEUES_PATTERN, *dead, *status]
    read = [request, OWN_QUEUES_PATTERN, *dead]
    return f"^({'|'.join(configure)})$", f"^{_literal(DEFAULT_EXCHANGE)}$", f"^({'|'.join(read)})$"


def set_permissions_line(config: BridgeConfig) -> str:
    """The ``rabbitmqctl set_permissions`` line that gives the bridge's account what it needs."""
    parts = urlsplit(config.broker_url)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    configure, write, read = bridge_permissions(config)
    return f"rabbitmqctl set_permissions -p {vhost} {_user(config.broker_url)} '{configure}' '{write}' '{read}'"


def check_rights(config: BridgeConfig) -> list[Check]:
    """The broker rights the bridge uses, each tried with an operation that changes nothing anyone
    relies on (the management plugin may be off: AMQP only). Declaring the request, dead-letter and
    status queues is what the bridge does on every connection; a message taken to prove a read
    right is given back at once (``basic_reject`` with requeue: only its redelivered flag changes);
    the write right is proven by a ``mandatory`` publish to a queue that does not exist (returned,
    stored nowhere). The older jobs' reply queue is declared by the queues check."""
    name = "broker-rights"
    try:
        connection = _connect(config)
    except (pika.exceptions.AMQPError, *CONNECTION_ERRORS) as exc:
        return [skip(name, f"the broker went away ({type(exc).__name__})")]
    scratch = f"doctor-{uuid.uuid4().hex[:12]}"
    probes: list[tuple[str, str, str, Callable[[Any], object]]] = [
        (
            "configure", config.request_queue, "the bridge cannot declare the request queue, so it does not start",
            lambda ch: ch.queue_declare(config.request_queue, durable=False, exclusive=False, auto_delete=False),
        ),
        (
            "read", config.request_queue, "requests are never taken",
            lambda ch: _get_and_give_back(ch, config.request_queue),
        ),
        (
            "configure", config.dead_letter_queue,
            "the bridge cannot declare its dead-letter queue, so it does not start",
            lambda ch: ch.queue_declare(config.dead_letter_queue, durable=True),
        ),
        (
            "read", config.dead_letter_queue, "hpc-bridge requeue-dead and purge cannot take the dead letters",
            lambda ch: _get_and_give_back(ch, config.dead_letter_queue),
        ),
        (
            "write", f"exchange {DEFAULT_EXCHANGE}", "replies, dead-letter copies and status messages would be refused",
            lambda ch: _publish_nowhere(ch, f"{config.dead_letter_queue}.{scratch}"),
        ),
    ]  # fmt: skip
    if config.status_queue:
        probes.append((
            "configure", config.status_queue, "no status message is published",
            lambda ch: ch.queue_declare(config.status_queue, durable=True, arguments=status_queue_arguments()),
        ))  # fmt: skip
    missing: list[str] = []
    try:
        for right, what, harm, probe in probes:
            channel = connection.channel()
            channel.confirm_delivery()
            try:
                probe(channel)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 403:
                    continue  # not about rights (a 406 of the queue's declaration: the queues line says it)
                target = what if what.startswith("exchange ") else f"queue {what}"
                verb = "write to" if right == "write" else right
                missing.append(f"the account cannot {verb} {target}: {harm}")
                continue
            if channel.is_open:
                channel.close()
    except (pika.exceptions.AMQPError, *CONNECTION_ERRORS) as exc:
        return [skip(name, f"the broker went away ({type(exc).__name__})")]
    finally:
        if connection.is_open:
            connection.close()
    fix = f"{set_permissions_line(config)} (docs/rodan-guide.md, step 1)"
    if missing:
        return [fail(name, "; ".join(missing), fix)]
    return [ok(name, f"configure, write and read as the bridge needs them ({len(probes)} operations tried)")]


def _get_and_give_back(channel: Any, queue: str) -> None:
    """Prove the read right on ``queue``: a message taken goes straight back (redelivered)."""
    method, _properties, _body = channel.basic_get(queue, auto_ack=False)
    if method is not None:
        channel.basic_reject(method.delivery_tag, requeue=True)


def _publish_nowhere(channel: Any, queue: str) -> None:
    """Prove the write right on the default exchange: a ``mandatory`` message to a queue that does
    not exist is returned (no queue stores it); a refusal closes the channel with 403."""
    try:
        channel.basic_publish("", queue, b"hpc-bridge doctor: write right probe", mandatory=True)
    except pika.exceptions.UnroutableError:
        pass


# --- 4. Rodan ----------------------------------------------------------------------------------


def check_rodan(config: BridgeConfig) -> Check:
    name = "rodan"
    client = RodanClient(
        config.rodan_base_url,
        user=config.rodan_user,
        email=config.rodan_email,
        password=config.rodan_password,
        timeout_s=min(config.rodan_timeout_s, PROBE_RODAN_TIMEOUT_S),
        retries=0,
    )
    who = config.rodan_email or config.rodan_user
    base = config.rodan_base_url
    try:
        client.get_token()
    except RodanAuthError as exc:
        text = str(exc).split(";")[0]
        generation = _generation_from(text)
        if "Invalid username" in text:
            fix = (
                "this Rodan (<= 2.0.14) logs in by user name: set RODAN_USER to the account's user name "
                "(and RODAN_EMAIL to its e-mail), and check RODAN_PASSWORD"
            )
        elif "not activated" in text:
            fix = "activate the account in Rodan's admin, or use another with RODAN_USER/RODAN_PASSWORD"
        else:
            fix = "check RODAN_PASSWORD and RODAN_USER (the account's e-mail for Rodan >= 2.0.15)"
        return fail(name, f"{text} at {base}{generation}", fix)
    except TransientError as exc:
        return fail(
            name,
            f"{exc}",
            "check RODAN_HOST (host[:port]) and RODAN_SCHEME (http or https), and that Rodan runs there",
        )
    except PermanentError as exc:
        return fail(
            name,
            f"{exc} (POST {base}/api/auth/token/)",
            "check RODAN_HOST and RODAN_SCHEME point at Rodan itself (its API answers under /api/)",
        )
    finally:
        client.session.close()
    return ok(name, f"token issued to {who!r} by {base} (sent both the username and the email field)")


def _generation_from(text: str) -> str:
    if "Invalid email" in text or "supply an email" in text:
        return "; the server logs in by e-mail (Rodan >= 2.0.15)"
    if "Invalid username" in text or "supply a username" in text:
        return "; the server logs in by user name (Rodan <= 2.0.14)"
    return ""


# --- 5. scheduler ------------------------------------------------------------------------------


def _scheduler(config: BridgeConfig) -> Scheduler:
    return get_scheduler(
        config.scheduler,
        timeout_s=config.scheduler_timeout_s,
        options=config.scheduler_options,
        scheduler_args=config.scheduler_args,
    )


def check_scheduler(config: BridgeConfig) -> list[Check]:
    scheduler = _scheduler(config)
    wanted = scheduler.commands
    missing = [c for c in wanted if shutil.which(c) is None]
    label = scheduler.display_name
    if missing:
        commands = fail(
            "scheduler-commands",
            f"{', '.join(missing)} not on PATH ({label})",
            f"load the {label} module or add its bin directory to PATH in the cron/systemd environment"
            + scheduler.commands_hint,
        )
    else:
        commands = ok("scheduler-commands", f"{', '.join(wanted)} found ({shutil.which(wanted[0])})")
    try:
        answer = scheduler.ping()
    except SchedulerUnavailable as exc:
        answered = fail(
            "scheduler",
            f"{label} is not answering: {exc}",
            f"check that {scheduler.controller} runs and this node reaches it{scheduler.controller_hint}; if it is "
            f"only slow, raise HPC_SCHEDULER_TIMEOUT (now {config.scheduler_timeout_s:g} s)",
        )
    else:
        answered = ok("scheduler", f"{label} answers: {scheduler.clean(answer)}")
    return [commands, answered, check_accounting(scheduler, answered)]


def check_accounting(scheduler: Scheduler, answered: Check) -> Check:
    """The accounting that judges a job once it has left the live queue.

    Without it, the query of every pass fails as soon as one watched job has left the queue (Slurm:
    MinJobAge, 300 s by default, after it ends), so reconciliation stops as a whole: no job that ended
    without a reply is judged, and its Rodan task waits, for as long as accounting does not answer.
    """
    name = "scheduler-accounting"
    label = scheduler.display_name
    command = scheduler.accounting_command
    if shutil.which(command) is None:
        return skip(name, f"{command} is not on PATH (see scheduler-commands)")
    if scheduler.accounting_needs_controller and answered.status != "ok":
        return skip(name, f"{label} is not answering (see scheduler)")
    why = (
        "a job that has left the queue can only be judged from accounting: while it does not answer, every "
        f"reconcile pass stops ('{command} failed' in the log) and a request whose job ended without a reply "
        "is never answered"
    )
    try:
        answer = scheduler.check_accounting()
    except SchedulerUnavailable as exc:
        return fail(name, f"{label} accounting does not answer ({exc}): {why}", scheduler.accounting_fix)
    return ok(name, f"{label} accounting answers ({answer}): ended jobs can be judged")


# --- 6. spool ----------------------------------------------------------------------------------


def check_spool(spool: Path) -> list[Check]:
    name = "spool"
    existing = spool
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    result: Check
    if spool.exists() and not spool.is_dir():
        result = fail(name, f"{spool} exists but is not a directory", "move it away or set HPC_SPOOL_DIR elsewhere")
    elif not spool.exists():
        if not existing.is_dir():
            result = fail(name, f"{spool} cannot be created: {existing} is not a directory", "set HPC_SPOOL_DIR")
        elif not os.access(existing, os.W_OK | os.X_OK):
            result = fail(
                name,
                f"{spool} does not exist and {existing} is not writable, so it cannot be created",
                f"create it (mkdir -m 700 -p {spool}) as a user who may, or set HPC_SPOOL_DIR elsewhere",
            )
        else:
            result = ok(name, f"{spool} does not exist yet; it will be created (0700) on the first run")
    else:
        result = _probe_spool(spool)
    if result.status == "FAIL" and not spool.is_dir():
        return [result, skip("spool-shared", "no spool directory (see spool)")]
    return [result, _check_shared(spool, existing)]


def _probe_spool(spool: Path) -> Check:
    name = "spool"
    probe = spool / f".doctor-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"hpc-bridge doctor\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
        fsync_dir(spool)
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        return fail(
            name,
            f"{spool} is not writable ({exc.strerror or exc})",
            f"make it writable by this user (chown/chmod 700 {spool}) or set HPC_SPOOL_DIR elsewhere",
        )
    mode = stat.S_IMODE(spool.stat().st_mode)
    if mode & (stat.S_IRWXO | stat.S_IRGRP | stat.S_IWGRP):  # group x only (0710): HPC_RUNS_SHARED=group
        return fail(
            name,
            f"{spool} has mode {mode:o}: others may read job parameters (they hold Rodan tokens)",
            f"chmod 700 {spool}",
        )
    return ok(name, f"{spool} writable (write, fsync, delete) and private (mode {mode:o})")


def check_spool_lock(spool: Path) -> Check:
    """Take and release a lock (flock, as the bridge does) on a file in the spool, or where it will be."""
    name = "spool-lock"
    directory = spool
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".doctor-lock-", dir=directory)
    except OSError as exc:
        return skip(name, f"no file can be made in {directory} ({exc.strerror or exc}; see spool)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno not in NO_LOCKS:
            return fail(name, f"locking a file in {directory} failed: {exc.strerror or exc}", LOCK_FIX)
        point, fstype = mount_of(directory)
        where = f"{fstype or 'an unknown filesystem'} at {point or '?'}"
        return fail(name, f"{directory} is on {where}, which does not support file locks ({exc.strerror})", LOCK_FIX)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return ok(name, f"file locks work in {directory} (flock)")


def _check_shared(spool: Path, existing: Path) -> Check:
    name = "spool-shared"
    point, fstype = mount_of(existing)
    resolved = existing.resolve()
    fix = "set HPC_SPOOL_DIR to a directory on storage the compute nodes mount (e.g. NFS, Lustre, GPFS home/project)"
    if fstype in NODE_LOCAL_FS or any(resolved == d or d in resolved.parents for d in NODE_LOCAL_DIRS):
        return warn(name, f"{spool} is on node-local storage ({fstype or 'unknown'} at {point or '?'})", fix)
    if fstype in SHARED_FS or fstype.startswith("nfs"):
        return ok(name, f"{spool} is on {fstype} ({point}), shared with the compute nodes")
    return warn(
        name,
        f"{spool} is on {fstype or 'an unknown filesystem'} ({point or '?'}): local to this machine unless exported",
        f"make sure the compute nodes see it at the same path, or {fix[0].lower()}{fix[1:]}",
    )


# --- 7. template and 8. worker -----------------------------------------------------------------


def check_template(config: BridgeConfig) -> Check:
    name = "template"
    spec = rodan_job_spec(config, Spool(config.spool_dir), RequestSettings(), "doctor-sample")
    backend = config.backend
    fix = (
        f"fix {backend.setting_prefix}*/HPC_GPU_RULES/HPC_SCHEDULER_ARGS/HPC_JOB_DIRECTIVES/HPC_JOB_PROLOGUE "
        "named above"
    )
    # The checks of load_config, for a configuration that got past them (built in code): the site's
    # options, omitted options, directives and submit arguments the bridge can work with.
    problems = option_problems(
        config.scheduler,
        options=config.scheduler_options,
        scheduler_args=config.scheduler_args,
        directives=config.job_directives,
    )
    if problems:
        return fail(name, f"the {backend.display_name} batch job cannot be submitted: {'; '.join(problems)}", fix)
    scheduler = _scheduler(config)
    try:
        script = scheduler.render(spec)
    except (ValueError, KeyError) as exc:
        return fail(name, f"the {scheduler.display_name} batch script does not render for a sample request: {exc}", fix)
    leaked = [s for s in config.secrets if contains_secret(script, [s])]
    if leaked:
        return fail(
            name,
            f"the rendered batch script contains {len(leaked)} secret(s) from the credentials",
            "remove the password from HPC_SCHEDULER_ARGS and the other settings that reach the script",
        )
    try:  # the site's prologue is pasted into the script: a syntax error would fail every job at its start
        syntax = run_command(["bash", "-n"], timeout=30.0, input_text=script, env=scrubbed_environment(), check=False)
    except CommandError:
        syntax = None  # no bash on this machine: the compute nodes' bash runs the script
    if syntax is not None and syntax.returncode != 0:
        said = " ".join(syntax.stderr.split())[:300]
        return fail(
            name,
            f"the {scheduler.display_name} batch script is not valid bash ({said})",
            "fix the shell syntax of HPC_JOB_PROLOGUE (check the lines with 'bash -n')"
            if config.job_prologue
            else "the bridge's template is broken: reinstall hpc-bridge",
        )
    site = f", without {', '.join(scheduler.omit)} ({scheduler.omit_setting})" if scheduler.omit else ""
    site += f", {len(config.job_directives)} site directive(s)" if config.job_directives else ""
    site += ", the site's prologue" if config.job_prologue else ""
    lines = len(script.splitlines())
    return ok(
        name,
        f"{scheduler.display_name} batch script renders for a sample request ({lines} lines{site}, no secret); "
        "`hpc-bridge script` prints a request's",
    )


def check_worker(config: BridgeConfig, runner: Callable[..., Any] = run_command) -> Check:
    name = "worker"
    python = config.worker_python
    fix = (
        f"install the worker into that environment ({python} -m pip install 'hpc-bridge[worker]'), or fix "
        "HPC_WORKER_PYTHON"
    )
    try:
        result = runner([python, "-c", WORKER_PROBE], timeout=180.0, env=scrubbed_environment())
    except CommandNotFound:
        return fail(name, f"HPC_WORKER_PYTHON {python} does not exist", fix)
    except CommandTimeout:
        return fail(name, f"{python} took over 180 s to import worker.trainer and tensorflow", fix)
    except CommandError as exc:
        lines = [ln for ln in exc.output.splitlines() if ln.strip()]
        return fail(name, f"{python} cannot import the worker: {lines[-1] if lines else exc.reason}", fix)
    words = result.stdout.split()
    if len(words) < 3:
        return fail(name, f"{python} printed {result.stdout.strip()!r} instead of versions and a GPU count", fix)
    worker_version, version, gpus = words[-3:]
    ours = package_version()
    if worker_version != ours:
        return fail(
            name,
            f"{python} has hpc-bridge {worker_version}, this bridge is {ours}",
            f"install the same version in the worker environment ({python} -m pip install "
            f"'hpc-bridge[worker]=={ours}', or from the bridge's checkout; docs/upgrade.md)",
        )
    note = " (none here is normal on a login node: the jobs' nodes have them)" if gpus == "0" else ""
    return ok(
        name, f"{python}: hpc-bridge {ours}, worker.trainer imports, TensorFlow {version}, {gpus} GPU(s) visible{note}"
    )


# --- systemd user units ---------------------------------------------------------------------------


def check_linger(config_home: Path | None = None, linger_dir: Path = LINGER_DIR) -> Check:
    """A systemd user unit of hpc-bridge runs only while its user manager does: without lingering,
    from the user's first login to the end of their last session."""
    name = "systemd-linger"
    units = installed_user_units(config_home)
    if not units:
        return ok(name, "no hpc-bridge systemd user unit installed (cron and system units need no lingering)")
    user = pwd.getpwuid(os.getuid()).pw_name
    listed = ", ".join(u.name for u in units)
    fix = f"loginctl enable-linger {user} (some sites reserve it for their administrators: ask them), or use cron"
    state = lingering(user, linger_dir)
    if state is True:
        return ok(name, f"{listed} installed and lingering is on for {user}: they run without a login session")
    if state is None:
        return warn(
            name,
            f"{listed} installed in {units[0].parent}, but whether lingering is on for {user} cannot be told "
            "(no systemd login manager answers here)",
            f"check with loginctl show-user {user} --property=Linger; if it is not 'yes': {fix}",
        )
    return warn(
        name,
        f"{listed} installed in {units[0].parent}, but lingering is off for {user}: the units stop when "
        "your last login session ends, and start again only at your next login",
        fix,
    )

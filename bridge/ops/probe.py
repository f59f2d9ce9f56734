"""``hpc-bridge doctor --job``: a probe job that checks the site from a compute node.

The probe is submitted the way a Rodan request's job is: the job specification comes from
``Intake.job_spec`` (account, partition, GPU rule, site directives and prologue, the time-limit
warning and continuation directives, ``HPC_WORKER_PYTHON``), it is rendered by the scheduler's own
template and submitted with the same command. Only the command differs: ``python -m worker.probe``
instead of ``python -m worker run``, and the resources: one CPU, ``--job-memory`` MB and
:data:`PROBE_MINUTES` minutes.

The login side writes the probe folder (``SPOOL/jobs/doctor-probe-ID/``: a random token, the probe
file, a lock it holds while waiting), submits, waits (reporting the scheduler's reason while the
job is pending, and cancelling it when ``--job-timeout`` runs out), and turns the node's findings
(``result.json``, see worker/probe.py) into doctor's lines. The probe file and the findings are
typed records of bridge/handoff.py (:class:`~bridge.handoff.ProbeParameters`,
:class:`~bridge.handoff.ProbeResult`), as are the folder's file names. The probe file holds
nothing secret.
The folder is removed when every check passed, and kept (its path in the ``probe-job`` line) when
one did not, with the job's output in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from bridge.config import BridgeConfig
from bridge.errors import SchedulerRejected, SchedulerUnavailable
from bridge.handoff import (
    DEFAULT_PROBE_MIN_SCRATCH_BYTES,
    PROBE_CHECKS,
    PROBE_FILE,
    PROBE_HELD_LOCK_FILE,
    PROBE_MODULE,
    PROBE_RESULT_FILE,
    PROBE_RESULT_MARKER,
    PROBE_RODAN_TIMEOUT_S,
    PROBE_SCRIPT_FILE,
    PROBE_TOKEN_FILE,
    BrokerAddress,
    ProbeContinuation,
    ProbeFinding,
    ProbeParameters,
    ProbeResult,
    SchedulerAccess,
)
from bridge.intake import rodan_job_spec
from bridge.ops.checks import Check, fail, from_finding, ok, skip
from bridge.protocol import RequestSettings
from bridge.schedulers import BACKENDS, JobInfo, JobSpec, JobState, Scheduler, format_duration, get_scheduler
from bridge.spool import Spool, atomic_write, atomic_write_json, read_json

log = structlog.get_logger(__name__)

#: The probe job's time limit: long enough for a slow TensorFlow import, short enough to backfill.
PROBE_MINUTES = 5
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MEMORY_MB = 4096
DEFAULT_MIN_SCRATCH_GB = DEFAULT_PROBE_MIN_SCRATCH_BYTES / 2**30
KEY_PREFIX = "doctor-probe-"
#: The backends' own settings, for fixes: ``HPC_SLURM_*/HPC_SGE_*``.
_SITE_SETTINGS = "/".join(f"{cls.setting_prefix}*" for cls in BACKENDS.values())


@dataclass(frozen=True)
class ProbeOptions:
    timeout_s: float = DEFAULT_TIMEOUT_S  # queue and run together
    memory_mb: int = DEFAULT_MEMORY_MB
    min_scratch_bytes: int = int(DEFAULT_MIN_SCRATCH_GB * 2**30)
    poll_s: float = 1.0
    keep: bool = False  # keep the probe folder even when every check passed


def add_arguments(parser: Any) -> None:
    """doctor's options for the probe job."""
    parser.add_argument(
        "--job",
        action="store_true",
        help="also submit a probe job (1-2 minutes) through the batch template and check the site from a compute node",
    )
    parser.add_argument(
        "--job-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give up on the probe job after this long, queue wait included (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--job-memory",
        type=int,
        default=DEFAULT_MEMORY_MB,
        metavar="MB",
        help=f"memory the probe job asks for; its GPU request follows HPC_GPU_RULES (default {DEFAULT_MEMORY_MB})",
    )
    parser.add_argument(
        "--min-scratch",
        type=float,
        default=DEFAULT_MIN_SCRATCH_GB,
        metavar="GB",
        help=f"warn when node-local scratch has less free space (default {DEFAULT_MIN_SCRATCH_GB:g})",
    )
    parser.add_argument("--keep-probe", action="store_true", help="keep the probe folder in the spool afterwards")


def options_from(args: Any) -> ProbeOptions:
    return ProbeOptions(
        timeout_s=float(args.job_timeout),
        memory_mb=int(args.job_memory),
        min_scratch_bytes=int(float(args.min_scratch) * 2**30),
        keep=bool(args.keep_probe),
    )


def doctor_checks(config: BridgeConfig | None, earlier: Sequence[Check], options: ProbeOptions) -> list[Check]:
    """The probe's lines, after doctor's own ``earlier`` checks (a probe whose premise failed is skipped)."""
    if config is None:
        return skipped("the configuration did not load")
    status = {c.name: c.status for c in earlier}
    for premise in ("scheduler", "template"):
        if status.get(premise) == "FAIL":
            return skipped(f"the {premise} check failed")
    return advise_inputs_fetch(run_probe(config, options), login_reaches_rodan=status.get("rodan") == "ok")


#: The line that makes the bridge fetch the inputs on the login node (docs/operator-guide.md).
INPUTS_FETCH_LOGIN_LINE = "HPC_INPUTS_FETCH=login"


def advise_inputs_fetch(checks: list[Check], *, login_reaches_rodan: bool) -> list[Check]:
    """Which HPC_INPUTS_FETCH the site needs, on the node-rodan line: a node that does not reach Rodan
    while the login node does (doctor's own rodan check) needs the bridge to fetch the inputs there.
    With HPC_INPUTS_FETCH=login the node's finding already says whether the jobs need Rodan."""
    for check in checks:
        if check.name != "node-rodan" or check.status != "FAIL":
            continue
        if login_reaches_rodan:
            check.fix = (
                "the login node reaches Rodan (the rodan check) and this compute node does not: put the line "
                f"{INPUTS_FETCH_LOGIN_LINE} in the credentials file, and the bridge fetches every input on the "
                f"login node at intake (docs/operator-guide.md); or else {check.fix}"
            )
        else:
            check.fix = (
                f"{check.fix}; the login node does not reach Rodan either (the rodan check): fix that first, "
                f"as {INPUTS_FETCH_LOGIN_LINE} needs it"
            )
    return checks


def skipped(why: str) -> list[Check]:
    return [skip("probe-job", why), *_node_skips(why)]


def _node_skips(why: str) -> list[Check]:
    return [skip(f"node-{name}", why) for name in PROBE_CHECKS]


# --- the probe job -----------------------------------------------------------------------------


def probe_spec(config: BridgeConfig, spool: Spool, key: str, memory_mb: int) -> JobSpec:
    """The job a Rodan request of one CPU, ``memory_mb`` MB and PROBE_MINUTES minutes gets, running the probe
    with the same (pinned) worker interpreter instead of the worker."""
    settings = RequestSettings(max_time=format_duration(PROBE_MINUTES), max_memory_mb=memory_mb, cpus=1)
    spec = rodan_job_spec(config, spool, settings, key)
    return replace(spec, command=(spec.command[0], "-m", PROBE_MODULE, str(spool.job_dir(key) / PROBE_FILE)))


def broker_address(url: str) -> tuple[str, int]:
    """The broker's host and port (no credentials): what the node connects to."""
    parts = urlsplit(url)
    return parts.hostname or "localhost", parts.port or (5671 if parts.scheme == "amqps" else 5672)


def probe_parameters(
    config: BridgeConfig, scheduler: Scheduler, spool: Spool, probe_dir: Path, spec: JobSpec, options: ProbeOptions
) -> ProbeParameters:
    """The probe file: what the node checks, and nothing secret."""
    host, port = broker_address(config.broker_url)
    continuation, skipped_why = None, ""
    if spec.warn_seconds and config.max_continuations:
        access = SchedulerAccess(
            scheduler=scheduler.name,
            options=config.scheduler_options,
            timeout_s=config.scheduler_timeout_s,
            script=probe_dir / PROBE_SCRIPT_FILE,
            spec=spec,
        )
        continuation = ProbeContinuation(mode=scheduler.continues_by(spec), job=access)
    else:
        why = "HPC_WARN_SECONDS=0" if not spec.warn_seconds else "HPC_MAX_CONTINUATIONS=0"
        skipped_why = f"{why}: jobs never continue past their time limit"
    return ProbeParameters(
        dir=probe_dir,
        write_dirs={
            "probe folder": probe_dir,
            "outbox": spool.outbox_dir,
            "jobs": spool.root / "jobs",
            "params": spool.root / "params",
            "runs": config.runs_dir or spool.root / "runs",
        },
        gpus_asked=spec.gpus,
        gres=spec.gres or "",
        node_local_dir=config.node_local_dir,
        min_scratch_bytes=options.min_scratch_bytes,
        rodan_url=config.rodan_base_url,
        rodan_timeout_s=min(config.rodan_timeout_s, PROBE_RODAN_TIMEOUT_S),
        inputs_fetch=config.inputs_fetch,  # HPC_INPUTS_FETCH: login needs no route from the node
        broker=BrokerAddress(host=host, port=port),
        continuation=continuation,
        continuation_skipped=skipped_why,
    )


@dataclass
class Outcome:
    """What the wait found."""

    job_id: str = ""
    result: ProbeResult | None = None
    unreadable: str = ""  # why the node's findings could not be read (another hpc-bridge version's)
    info: JobInfo | None = None  # the last state the scheduler gave
    queued_s: float = 0.0
    ran_s: float = 0.0
    timed_out: bool = False
    pending_reason: str = ""
    requeued: bool = False  # seen back in the queue after the node asked for the requeue


def run_probe(
    config: BridgeConfig,
    options: ProbeOptions,
    *,
    scheduler: Scheduler | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Check]:
    """Submit the probe, wait for it, and return doctor's lines for it."""
    say = say or _say
    scheduler = scheduler or get_scheduler(
        config.scheduler,
        timeout_s=config.scheduler_timeout_s,
        options=config.scheduler_options,
        scheduler_args=config.scheduler_args,
    )
    label = scheduler.display_name
    spool = Spool(config.spool_dir).ensure()
    key = f"{KEY_PREFIX}{uuid.uuid4().hex[:12]}"
    probe_dir = spool.job_dir(key)
    probe_dir.mkdir(parents=True, mode=0o700)
    token = uuid.uuid4().hex
    atomic_write(probe_dir / PROBE_TOKEN_FILE, f"{token}\n".encode())
    try:
        spec = probe_spec(config, spool, key, options.memory_mb)
        script = scheduler.render(spec)
    except (ValueError, KeyError) as exc:
        shutil.rmtree(probe_dir, ignore_errors=True)
        return [
            fail("probe-job", f"the probe job's batch script does not render: {exc}", "see the template check"),
            *_node_skips("no probe job"),
        ]
    if any(secret in script for secret in config.secrets):
        shutil.rmtree(probe_dir, ignore_errors=True)
        return [
            fail("probe-job", "the rendered batch script contains a secret", "see the template check"),
            *_node_skips("no probe job"),
        ]
    params = probe_parameters(config, scheduler, spool, probe_dir, spec, options)
    atomic_write_json(params.path(PROBE_FILE), params.to_json())
    atomic_write(params.path(PROBE_SCRIPT_FILE), script.encode("utf-8"), mode=0o700)
    held = os.open(params.path(PROBE_HELD_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    outcome = Outcome()
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            outcome.job_id = scheduler.submit(params.path(PROBE_SCRIPT_FILE), spec)
        except SchedulerRejected as exc:
            return _refused(label, str(exc), spec, probe_dir)
        except SchedulerUnavailable as exc:
            return [
                fail("probe-job", f"{label} did not take the probe job: {exc}", "see the scheduler check"),
                *_node_skips("no probe job"),
            ]
        log.info("probe_submitted", job_id=outcome.job_id, scheduler=scheduler.name, probe=key)
        say(f"probe: {label} job {outcome.job_id} submitted; waiting up to {options.timeout_s:g} s")
        _wait(scheduler, probe_dir, outcome, options, say)
    finally:
        os.close(held)
        _clean_up(scheduler, outcome)
    checks = judge(outcome, token, label, scheduler.log_file(probe_dir, outcome.job_id) if outcome.job_id else None)
    passed = all(c.status in ("ok", "skip") for c in checks)
    if passed and not options.keep:
        shutil.rmtree(probe_dir, ignore_errors=True)
    else:
        checks[0].found += f"; its folder, with the job's output, is kept: {probe_dir}"
    log.info("probe_done", job_id=outcome.job_id, failed=[c.name for c in checks if c.status == "FAIL"])
    return checks


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _refused(label: str, reason: str, spec: JobSpec, probe_dir: Path) -> list[Check]:
    shutil.rmtree(probe_dir, ignore_errors=True)
    asked = f"1 CPU, {spec.memory_mb} MB, {spec.time_minutes} minutes" + (f", {spec.gres}" if spec.gres else "")
    return [
        fail(
            "probe-job",
            f"{label} refused the probe job ({asked}): {reason}",
            "every Rodan request would be refused the same way: fix the account, partition, queue, GPU rule or "
            f"directive it names ({_SITE_SETTINGS}, HPC_GPU_RULES, HPC_JOB_DIRECTIVES, HPC_SCHEDULER_ARGS), "
            "or lower --job-memory",
        ),
        *_node_skips("no probe job"),
    ]


def read_result(probe_dir: Path, log_file: Path | None) -> ProbeResult | None:
    """The node's findings: ``result.json``, else the last result line in the job's output; None
    while there are none. A ValueError when they are there but cannot be read (another version's)."""
    data: Any = None
    with contextlib.suppress(OSError, ValueError):  # not written yet (written whole: atomic_write_json)
        data = read_json(probe_dir / PROBE_RESULT_FILE)
    if data is None and log_file is not None:
        with contextlib.suppress(OSError, ValueError):
            text = log_file.read_text(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.startswith(PROBE_RESULT_MARKER)]
            if lines:
                data = json.loads(lines[-1][len(PROBE_RESULT_MARKER) :])
    return None if data is None else ProbeResult.from_json(data)


def _read(probe_dir: Path, log_file: Path | None, outcome: Outcome) -> None:
    """``outcome.result`` (or ``outcome.unreadable``) from what the node left."""
    try:
        outcome.result = read_result(probe_dir, log_file)
    except ValueError as exc:
        outcome.result, outcome.unreadable = None, str(exc)


def _wait(
    scheduler: Scheduler, probe_dir: Path, outcome: Outcome, options: ProbeOptions, say: Callable[[str], None]
) -> None:
    started = time.monotonic()
    deadline = started + options.timeout_s
    running_since: float | None = None
    log_file = scheduler.log_file(probe_dir, outcome.job_id)
    last_reason = ""
    while True:
        _read(probe_dir, log_file, outcome)
        if (outcome.result is not None and outcome.result.finished) or outcome.unreadable:
            break
        try:
            info = scheduler.query([outcome.job_id]).get(outcome.job_id)
        except SchedulerUnavailable:
            info = None  # a busy controller: ask again until the deadline
        now = time.monotonic()
        if info is not None:
            outcome.info = info
            if info.state is JobState.RUNNING and running_since is None:
                running_since = now
                outcome.queued_s = now - started
            if _asking(outcome.result) and info.state in (JobState.PENDING, JobState.REQUEUED):
                outcome.requeued = True  # the requeue the node asked for took the job off the node
                break
            if info.state is JobState.PENDING and running_since is None and info.reason != last_reason:
                last_reason = info.reason
                outcome.pending_reason = info.reason
                if info.reason:
                    say(f"probe: job {outcome.job_id} pending: {info.reason}")
            if info.state.is_terminal:
                _read(probe_dir, log_file, outcome)
                break
        if now >= deadline:
            outcome.timed_out = True
            break
        time.sleep(options.poll_s)
    if running_since is not None:
        outcome.ran_s = time.monotonic() - running_since
    elif outcome.result is not None:
        outcome.queued_s = time.monotonic() - started  # ran between two looks


def _asking(result: ProbeResult | None) -> bool:
    """Whether the node had asked to continue its job (and may not have said how that went)."""
    return result is not None and result.continuation is not None and result.continuation.state == "asking"


def _clean_up(scheduler: Scheduler, outcome: Outcome) -> None:
    """Cancel the probe job (pending, requeued or still running) and a successor the node submitted."""
    ids = [outcome.job_id] if outcome.job_id else []
    continuation = outcome.result.continuation if outcome.result is not None else None
    if continuation is not None and continuation.successor:
        ids.append(continuation.successor)
    for job_id in ids:
        with contextlib.suppress(SchedulerUnavailable, ValueError):
            scheduler.cancel(job_id)


# --- the verdicts ------------------------------------------------------------------------------


def judge(outcome: Outcome, token: str, label: str, log_file: Path | None) -> list[Check]:
    job = f"{label} job {outcome.job_id}"
    result = outcome.result
    state = (outcome.info.native_state or outcome.info.state.value) if outcome.info else "unknown"
    if result is None and outcome.unreadable:
        first = fail(
            "probe-job",
            f"{job} left findings this hpc-bridge cannot read ({outcome.unreadable})",
            "HPC_WORKER_PYTHON's environment must have the same hpc-bridge version as the bridge (docs/upgrade.md)",
        )
        return [first, *_node_skips("the node's findings cannot be read")]
    if result is None:
        if outcome.timed_out and (outcome.info is None or outcome.info.state is JobState.PENDING):
            why = outcome.pending_reason or (outcome.info.native_state if outcome.info else "")
            reason = f" ({why})" if why else ""
            first = fail(
                "probe-job",
                f"{job} was still waiting in the queue after the timeout{reason}; it was cancelled",
                "when the reason is only a busy cluster (Priority, Resources), run again with a longer "
                f"--job-timeout; otherwise fix what it names (account, partition, QOS, GPU: {_SITE_SETTINGS}, "
                "HPC_GPU_RULES, HPC_JOB_DIRECTIVES)",
            )
            return [first, *_node_skips("the probe job did not run")]
        ended = "was still running after the timeout (cancelled)" if outcome.timed_out else f"ended ({state})"
        tail = _tail(log_file)
        first = fail(
            "probe-job",
            f"{job} {ended} without leaving its findings in the spool"
            + (f"; its output ends: {tail}" if tail else f"; its output {log_file} is not there either"),
            "the node must see HPC_SPOOL_DIR at the same path and write there, and HPC_WORKER_PYTHON must run "
            f"'python -m {PROBE_MODULE}' on the node (the job's output says which)",
        )
        return [first, *_node_skips("no findings from the node")]
    where = f"on {result.host or '?'}"
    timing = f"queued {outcome.queued_s:.0f} s, ran {outcome.ran_s:.0f} s"
    checks = [ok("probe-job", f"{job} ran {where} with the bridge's batch template ({timing})")]
    for name in PROBE_CHECKS:
        finding = result.checks.get(name)
        if name == "continue" and finding is None:
            finding = _continuation(outcome, result)
        if finding is None:
            stop = "the probe timed out" if outcome.timed_out else f"the job ended ({state})"
            checks.append(fail(f"node-{name}", f"{stop} before this check", f"see the job's output {log_file}"))
            continue
        check = from_finding(f"node-{name}", finding)
        if name == "spool" and check.status == "ok" and result.token != token:
            check = fail(
                "node-spool",
                "the node read another token than the login node wrote: it sees another directory at the path "
                "of HPC_SPOOL_DIR",
                "HPC_SPOOL_DIR must be on storage shared by the login node and the compute nodes, at the same path",
            )
        elif name == "spool" and check.status == "ok":
            check.found = f"the login node reads what the node wrote; {check.found}"
        checks.append(check)
    if result.reran is not None and checks[-1].status == "ok":
        checks[-1].found += f" (and it ran again: restart {result.reran.restart})"
    return checks


def _continuation(outcome: Outcome, result: ProbeResult) -> ProbeFinding | None:
    """The continue check when the node could not write it: a requeue ends the node's process."""
    if not _asking(result) or result.continuation is None:
        return None
    if outcome.requeued or result.reran is not None:
        return ProbeFinding(
            status="ok",
            found=f"the requeue asked from the node put job {result.continuation.job_id} back in the queue "
            "(then cancelled)",
        )
    return None


def _tail(log_file: Path | None, lines: int = 3) -> str:
    if log_file is None:
        return ""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-600:]

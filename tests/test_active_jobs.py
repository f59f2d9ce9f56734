"""Submit limits are not refusals, and HPC_MAX_ACTIVE_JOBS keeps the bridge below them.

* The scheduler's submit-limit refusals (Slurm: QOSMaxSubmitJobPerUserLimit, AssocMaxSubmitJobLimit,
  ...GrpSubmitJobs..., MaxSubmitJobsPerAccount; Grid Engine: max_u_jobs, max_jobs) raise
  ``SubmitLimitReached``, a transient error, while a size or time limit stays a refusal. Shown with
  the words the real daemons print, then on real daemons of our own: a private slurmctld with
  accounting limits enforced (the shared dev cluster enforces none, and turning it on would restart
  everyone's slurmctld) and a private Grid Engine qmaster with max_u_jobs / max_jobs. Both use their
  own ports and state, so no other test sees them.
* In the intake, a submit limit defers the request: while the bridge has jobs of its own in the
  scheduler they will make room, so the ``HPC_DEFER_LIMIT`` clock does not run; with none, the limit
  is someone else's (or 0) and the request is answered after ``HPC_DEFER_LIMIT`` like any other
  transient failure.
* With ``HPC_MAX_ACTIVE_JOBS=1``, on the real broker and Slurm (cron passes): the second request waits
  in the request queue, not counted as an attempt and not answered even past ``HPC_DEFER_LIMIT``,
  while the first job is in the scheduler, and is submitted once that job has ended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.config import BridgeConfig
from bridge.errors import SchedulerRejected, SchedulerUnavailable, SubmitLimitReached, TransientError
from bridge.intake import Intake, Message, Outcome
from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import GridEngineScheduler, JobSpec, SlurmScheduler
from bridge.schedulers.base import current_user
from bridge.spool import Spool
from bridge.testing.rodan import RodanStandin
from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL, RODAN_PASSWORD, bridge_environ, fake_command, run_bridge
from tests.support.broker import Queues, Rodan
from tests.support.cluster import cancel_spool_jobs
from tests.support.wait import wait_until

POLICY = (
    "Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"
)
#: What sbatch printed when each limit was reached (measured on Slurm 22.05 with the private controller below).
SLURM_LIMITS = [
    "AssocMaxSubmitJobLimit",
    "QOSMaxSubmitJobPerUserLimit",
    "QOSGrpSubmitJobsLimit",
    "AssocGrpSubmitJobsLimit",
    "MaxSubmitJobsPerAccount",
    "QOSMaxSubmitJobPerAccountLimit",
]


def job(tmp_path: Path, **kw: Any) -> JobSpec:
    values: dict[str, Any] = dict(
        name=f"hpcbt-limit-{uuid.uuid4().hex[:10]}",
        comment="test",
        time_minutes=1,
        memory_mb=100,
        cpus=1,
        command=("/bin/true",),
        log_dir=tmp_path,
        workdir=tmp_path,
    )
    values.update(kw)
    return JobSpec(**values)


# --- classification, with the daemons' own words ---------------------------------------------------


def _sbatch_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """sbatch failing as it does at a policy limit: the limit's name, then the policy line."""
    said = f"sbatch: error: {limit}\nsbatch: error: {POLICY}"
    fake_command(tmp_path, monkeypatch, "sbatch", f"cat >&2 <<'EOF'\n{said}\nEOF\nexit 1\n")


@pytest.mark.parametrize("limit", SLURM_LIMITS)
def test_a_slurm_submit_limit_is_transient(limit: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _sbatch_says(tmp_path, monkeypatch, limit)
    with pytest.raises(SubmitLimitReached, match=f"^sbatch: submit limit reached: {limit} Batch job submission failed"):
        SlurmScheduler().submit(tmp_path / "job.sh", job(tmp_path))
    assert issubclass(SubmitLimitReached, SchedulerUnavailable) and issubclass(SubmitLimitReached, TransientError)


def test_a_slurm_size_or_time_limit_is_still_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same policy line, naming a limit no waiting can lift (QOS MaxWall with DenyOnLimit)."""
    _sbatch_says(tmp_path, monkeypatch, "QOSMaxWallDurationPerJobLimit")
    with pytest.raises(SchedulerRejected, match="QOSMaxWallDurationPerJobLimit"):
        SlurmScheduler().submit(tmp_path / "job.sh", job(tmp_path))


@pytest.mark.parametrize(
    "message",
    [
        "Unable to run job: job rejected: only 1 jobs are allowed per user (current job count: 1)",
        "Unable to run job: job rejected: Only 2000 jobs are allowed per user (current job count: 2000)",
        "Unable to run job: job rejected: only 1 jobs are allowed per cluster",
    ],
)
def test_a_gridengine_submit_limit_is_transient(message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, monkeypatch, "qsub", f"cat >&2 <<'EOF'\n{message}\nExiting.\nEOF\nexit 1\n")
    with pytest.raises(SubmitLimitReached, match="jobs are allowed per"):
        GridEngineScheduler().submit(tmp_path / "job.sh", job(tmp_path))
    # Any other "job rejected" stays a refusal.
    other = 'Unable to run job: job rejected: the requested project "nosuchproj" does not exist'
    fake_command(tmp_path, monkeypatch, "qsub", f"cat >&2 <<'EOF'\n{other}\nExiting.\nEOF\nexit 1\n")
    with pytest.raises(SchedulerRejected):
        GridEngineScheduler().submit(tmp_path / "job.sh", job(tmp_path))


# --- a private slurmctld with accounting limits enforced ------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def _sacctmgr(*args: str) -> None:
    result = _run(["sacctmgr", "-i", *args])
    assert result.returncode == 0, f"sacctmgr {' '.join(args)}: {result.stdout}{result.stderr}"


@pytest.fixture
def limited_slurm(slurm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A second slurmctld, for this test only: its own cluster in the shared slurmdbd, its own ports
    and state, ``AccountingStorageEnforce=associations,limits,qos``, no node that could run anything.
    Our association under account ``limited`` may submit 1 job; QOS ``submit1`` takes 1 job per user,
    QOS ``wall1`` has MaxWall 1 minute (DenyOnLimit). ``SLURM_CONF`` points this test's commands at it.
    Yields those names (all unique to this run)."""
    tag = uuid.uuid4().hex[:6]
    cluster, user = f"hpcbt{tag}", current_user()
    names = {"limited": f"hpcbt{tag}a", "submit1": f"hpcbt{tag}s", "wall1": f"hpcbt{tag}w"}
    state = tmp_path / "slurmctld"
    state.mkdir()
    host = _run(["hostname", "-s"]).stdout.strip()
    conf = state / "slurm.conf"
    conf.write_text(
        f"""ClusterName={cluster}
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
StateSaveLocation={state}
SlurmdSpoolDir={state}/slurmd
SlurmctldLogFile={state}/slurmctld.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
AccountingStorageEnforce=associations,limits,qos
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
NodeName=hpcbtnode{tag} NodeAddr=127.0.0.2 CPUs=1 RealMemory=1000 State=FUTURE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    ctld: subprocess.Popen[bytes] | None = None
    try:
        _sacctmgr("add", "cluster", cluster)
        _sacctmgr("add", "qos", names["submit1"], "MaxSubmitJobsPerUser=1")
        _sacctmgr("add", "qos", names["wall1"], "MaxWall=00:01:00", "Flags=DenyOnLimit")
        _sacctmgr("add", "account", names["limited"], f"cluster={cluster}")
        _sacctmgr("add", "user", user, f"account={names['limited']}", f"cluster={cluster}", "MaxSubmitJobs=1")
        if user != "root":  # root's association under account root comes with the cluster
            _sacctmgr("add", "user", user, "account=root", f"cluster={cluster}")
        _sacctmgr(
            "modify", "user", user, "where", f"cluster={cluster}", "account=root", "set",
            f"qos+={names['submit1']},{names['wall1']}",
        )  # fmt: skip
        # All set before the controller starts: it reads associations and QOS from slurmdbd then.
        with open(state / "slurmctld.out", "wb") as out:
            ctld = subprocess.Popen(
                ["/usr/sbin/slurmctld", "-D", "-f", str(conf)], stdout=out, stderr=out, start_new_session=True
            )
        wait_until(lambda: "is UP" in _run(["scontrol", "ping"], env).stdout, 60, what="the private slurmctld")
        monkeypatch.setenv("SLURM_CONF", str(conf))
        yield names
    finally:
        if ctld is not None:
            _run(["scancel", f"--user={user}"], env)  # sacctmgr keeps a cluster that has live jobs
            ctld.send_signal(signal.SIGTERM)
            try:
                ctld.wait(60)
            except subprocess.TimeoutExpired:
                ctld.kill()
                ctld.wait(10)
        _run(["sacctmgr", "-i", "delete", "cluster", cluster])
        _run(["sacctmgr", "-i", "delete", "account", names["limited"]])
        _run(["sacctmgr", "-i", "delete", "qos", f"{names['submit1']},{names['wall1']}"])


@pytest.mark.slurm
def test_real_slurm_submit_limits_are_transient_and_size_limits_refusals(
    limited_slurm: dict[str, str], tmp_path: Path
) -> None:
    scheduler = SlurmScheduler(timeout_s=30)

    def submit(*args: str, **kw: Any) -> str:
        spec = job(tmp_path, extra_args=("--hold", *args), **kw)
        script = tmp_path / f"{spec.name}.sh"
        script.write_text(scheduler.render(spec))
        return scheduler.submit(script, spec)

    limited = f"--account={limited_slurm['limited']}"
    assert submit(limited).isdigit()  # the association's one job
    with pytest.raises(SubmitLimitReached, match="AssocMaxSubmitJobLimit"):
        submit(limited)
    submit1 = f"--qos={limited_slurm['submit1']}"
    assert submit(submit1).isdigit()  # the QOS's one job per user
    with pytest.raises(SubmitLimitReached, match="QOSMaxSubmitJobPerUserLimit"):
        submit(submit1)
    with pytest.raises(SchedulerRejected, match="QOSMaxWallDurationPerJobLimit"):
        submit(f"--qos={limited_slurm['wall1']}", time_minutes=5)


# --- a private Grid Engine qmaster with max_u_jobs / max_jobs ----------------------------------------

SGE_ROOT = Path("/var/lib/gridengine")  # the Debian layout deploy/dev/gridengine.sh installs


@pytest.fixture
def limited_gridengine(
    gridengine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., None]]:
    """A second sge_qmaster, for this test only: a cell of its own (its own SGE_ROOT, spool database
    and ports), no execution host and no queue, so nothing it takes can run. This test's commands
    reach it through SGE_ROOT/SGE_QMASTER_PORT. Yields ``limit(max_u_jobs=, max_jobs=)``, which sets
    its global configuration."""
    root, spool, db = tmp_path / "sgeroot", tmp_path / "qmaster", tmp_path / "spooldb"
    common = root / "default" / "common"
    common.mkdir(parents=True)
    spool.mkdir()
    db.mkdir()
    for name in ("bin", "lib", "util", "utilbin"):
        (root / name).symlink_to(SGE_ROOT / name)
    (common / "bootstrap").write_text(
        f"""Version: 6.2
admin_user              none
default_domain          none
ignore_fqdn             false
spooling_method         berkeleydb
spooling_lib            libspoolb
spooling_params         {db}
binary_path             /usr/sbin
qmaster_spool_dir       {spool}
security_mode           none
listener_threads        2
worker_threads          2
scheduler_threads       1
"""
    )
    for name in ("act_qmaster", "host_aliases"):  # the host's name as the shared cell resolves it
        if (SGE_ROOT / "default" / "common" / name).exists():
            shutil.copy(SGE_ROOT / "default" / "common" / name, common / name)
    ports = {"SGE_QMASTER_PORT": str(_free_port()), "SGE_EXECD_PORT": str(_free_port())}
    env = {**os.environ, "SGE_ROOT": str(root), "SGE_CELL": "default", **ports}
    init = _run(["/usr/share/gridengine/scripts/init_cluster", str(root), "default", str(db), "root"], env)
    assert init.returncode == 0, init.stdout + init.stderr
    daemon_env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SGE_ROOT": str(root), "SGE_CELL": "default", **ports}
    started = _run(["/usr/lib/gridengine/sge_qmaster"], daemon_env)  # it daemonizes: its pid is in the spool
    assert started.returncode == 0, started.stdout + started.stderr
    pid_file = spool / "qmaster.pid"
    try:
        wait_until(lambda: _run(["qconf", "-sconf", "global"], env).returncode == 0, 60, what="the private qmaster")
        host = (common / "act_qmaster").read_text().split()[0]
        added = _run(["qconf", "-as", host], env)
        assert added.returncode == 0, added.stdout + added.stderr
        for name, value in {**ports, "SGE_ROOT": str(root), "SGE_CELL": "default"}.items():
            monkeypatch.setenv(name, value)

        def limit(max_u_jobs: int = 0, max_jobs: int = 0) -> None:
            settings = {"max_u_jobs": max_u_jobs, "max_jobs": max_jobs, "min_uid": 0, "min_gid": 0}
            lines = _run(["qconf", "-sconf", "global"], env).stdout.splitlines()
            lines = [f"{k} {settings[k]}" if k in settings else line for line in lines for k in [line.split(" ")[0]]]
            (tmp_path / "global").write_text("\n".join(lines) + "\n")
            result = _run(["qconf", "-Mconf", str(tmp_path / "global")], env)
            assert result.returncode == 0, result.stdout + result.stderr

        yield limit
    finally:
        # By its pid (never qconf -km: with a wrong environment that would stop the shared qmaster).
        pid = int(pid_file.read_text().strip()) if pid_file.exists() else 0
        if pid and f"SGE_ROOT={root}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            os.kill(pid, signal.SIGTERM)
            wait_until(
                lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 60, what="the private qmaster to stop"
            )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.gridengine
def test_real_gridengine_submit_limits_are_transient(limited_gridengine: Callable[..., None], tmp_path: Path) -> None:
    scheduler = GridEngineScheduler(timeout_s=30)
    # -h: never to run; -w n: the bridge's own "-w e" would refuse any job in a cell without queues.
    spec = job(tmp_path, extra_args=("-h", "-w", "n"))
    script = tmp_path / "job.sh"
    script.write_text(scheduler.render(spec))

    def fill_one() -> None:  # qsub warns (no queue at all) and exits 1, but the job is in
        _run(["qsub", "-h", "-w", "n", "-o", "/dev/null", str(script)], dict(os.environ))
        assert _run(["qstat", "-u", "*"], dict(os.environ)).stdout.strip()

    limited_gridengine(max_u_jobs=1)
    fill_one()
    with pytest.raises(
        SubmitLimitReached, match=r"job rejected: only 1 jobs are allowed per user \(current job count: 1\)"
    ):
        scheduler.submit(script, spec)
    limited_gridengine(max_jobs=1)
    with pytest.raises(SubmitLimitReached, match="job rejected: only 1 jobs are allowed per cluster"):
        scheduler.submit(script, spec)


# --- the intake: a submit limit defers, bounded only when no job of ours holds it -------------------


class Desk:
    """The production intake (real Rodan stand-in, spool, ledger, outbox) with a given scheduler."""

    def __init__(self, config: BridgeConfig, scheduler: SlurmScheduler, inputs: dict[str, str], reply_to: str) -> None:
        self.config = config
        self.spool = Spool(config.spool_dir).ensure()
        self.ledger = Ledger(self.spool)
        self.replies = ReplyBox(self.spool)
        rodan = RodanClient(config.rodan_base_url, user=RODAN_EMAIL, email=RODAN_EMAIL, password=RODAN_PASSWORD)
        self.intake = Intake(config, self.spool, self.ledger, scheduler, rodan, self.replies)
        self.body = json.dumps({"inputs": inputs, "settings": FAST_SETTINGS}).encode()
        self.reply_to = reply_to

    def process(self, correlation_id: str) -> Outcome:
        self.intake.active.new_pass()
        message = Message(self.body, correlation_id, self.reply_to, redelivered=False, delivery_tag=1)
        return self.intake.process(message).outcome

    def record(self, correlation_id: str) -> RequestRecord:
        record = self.ledger.get(correlation_id)
        assert record is not None
        return record


@pytest.fixture
def desk(
    make_config: Callable[..., BridgeConfig],
    sample_inputs: Callable[..., dict[str, str]],
    queues: Queues,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Desk:
    """The intake against an sbatch that answers QOSMaxSubmitJobPerUserLimit, HPC_DEFER_LIMIT 1 s."""
    _sbatch_says(tmp_path, monkeypatch, "QOSMaxSubmitJobPerUserLimit")
    config = make_config(HPC_DEFER_LIMIT="1")
    return Desk(config, SlurmScheduler(), sample_inputs(), queues.reply)


@pytest.mark.broker
def test_a_submit_limit_held_by_our_own_jobs_waits_without_the_defer_limit(desk: Desk) -> None:
    ours = RequestRecord("running-one", "running-one", desk.reply_to, state=RequestState.SUBMITTED, job_id="4242")
    desk.ledger.save(ours)  # a job of ours in the scheduler: it will end and make room
    corr = str(uuid.uuid4())
    for attempt in (1, 2, 3):
        assert desk.process(corr) is Outcome.DEFERRED
        record = desk.record(corr)
        assert record.state is RequestState.RECEIVED  # no job was made: nothing to look up by name next time
        assert record.attempts == attempt and record.deferred_since == 0.0
        assert "submit limit reached: QOSMaxSubmitJobPerUserLimit" in record.reason
        time.sleep(1.2)  # past HPC_DEFER_LIMIT each time
    assert desk.replies.staged() == []
    # Once our job has ended, the limit is someone else's: the clock runs, and the request is answered.
    ours.job_ended = True
    desk.ledger.save(ours)
    assert desk.process(corr) is Outcome.DEFERRED and desk.record(corr).deferred_since > 0
    time.sleep(1.2)
    assert desk.process(corr) is Outcome.REJECTED


@pytest.mark.broker
def test_a_submit_limit_with_no_job_of_ours_is_answered_after_the_defer_limit(desk: Desk) -> None:
    corr = str(uuid.uuid4())
    assert desk.process(corr) is Outcome.DEFERRED
    time.sleep(1.2)
    assert desk.process(corr) is Outcome.REJECTED
    staged = desk.replies.staged_entry(corr)
    assert staged is not None
    error = json.loads(staged.body_path.read_text())["error"]
    # The time it names is however long the two attempts were apart (at least the limit's second on
    # any machine; more on a busy one): only its lower bound is the intake's doing.
    match = re.match(
        r"gave up after retrying for (?:(\d+) min )?(\d+) s \(2 attempts, HPC_DEFER_LIMIT\): "
        r"sbatch: submit limit reached",
        error,
    )
    assert match is not None, error
    assert int(match.group(1) or 0) * 60 + int(match.group(2)) >= 1, error
    assert "QOSMaxSubmitJobPerUserLimit" in error


# --- HPC_MAX_ACTIVE_JOBS on the real broker and Slurm -------------------------------------------------


def _ledger(spool: Path, corr: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((spool / "ledger" / f"{corr}.json").read_text())
    return data


def _events(log_file: Path, event: str) -> list[dict[str, Any]]:
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == event]


def _slurm_state(job_id: str) -> str:
    acct = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    return acct.stdout.strip().split(" ")[0]


@pytest.mark.slurm
@pytest.mark.broker
def test_at_the_cap_a_request_waits_in_the_queue_until_a_job_ends(
    slurm: None,
    broker_url: str,
    standin: RodanStandin,
    queues: Queues,
    rodan: Rodan,
    sample_inputs: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    spool, log_file = tmp_path / "spool", tmp_path / "bridge.log"
    env = bridge_environ(
        broker_url,
        standin,
        queues,
        spool,
        HPC_SCHEDULER="slurm",
        HPC_MAX_ACTIVE_JOBS="1",
        HPC_DEFER_LIMIT="1",  # a wait at the cap is not a failure: it must never reach this
        HPC_SCHEDULER_ARGS="--hold",  # every job waits until the test releases it
        HPC_WORKER_PYTHON="/bin/true",  # the job ends COMPLETED without a reply: the bridge answers it
        HPC_LOG_FILE=str(log_file),
        # The site's knobs ride along: they reach the real job through the intake.
        HPC_JOB_DIRECTIVES="--export=ALL,HPCBT_SITE_DIRECTIVE=reached",
        HPC_JOB_PROLOGUE='echo "site prologue in job $SLURM_JOB_ID: directive $HPCBT_SITE_DIRECTIVE"',
    )
    inputs = sample_inputs()
    first, second = (rodan.publish_request(inputs, FAST_SETTINGS) for _ in range(2))
    replies: dict[str, list[dict[str, Any]]] = {first: [], second: []}

    def check() -> None:
        result = run_bridge(env, "check", timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        for corr, body, _headers in rodan.drain():
            replies[corr or ""].append(json.loads(body))

    try:
        for passes in (1, 2):
            check()
            job_id = _ledger(spool, first)["job_id"]
            assert _ledger(spool, first)["state"] == "submitted" and job_id
            waiting = _ledger(spool, second)
            assert waiting["state"] == "received" and waiting["attempts"] == 0 and not waiting["job_id"]
            assert waiting["reason"] == "waiting for a job to end: 1 of HPC_MAX_ACTIVE_JOBS=1 active"
            assert rodan.depth(queues.request) == 1  # given back to the queue, not answered
            assert len(_events(log_file, "max_active_jobs_reached")) == passes  # once per pass
            assert replies == {first: [], second: []}
            time.sleep(1.2)  # past HPC_DEFER_LIMIT

        _run(["scontrol", "release", job_id])
        # Up to the other tests' jobs on the shared node: they may hold it for a while.
        wait_until(lambda: _slurm_state(job_id) == "COMPLETED", 300, what=f"job {job_id} to complete")
        for _ in range(4):  # the pass that sees the job end answers it; the next one submits the second
            check()
            if _ledger(spool, second)["state"] == "submitted":
                break
        second_job = _ledger(spool, second)["job_id"]
        assert _ledger(spool, second)["state"] == "submitted" and second_job not in ("", job_id)
        assert _ledger(spool, first)["state"] == "replied"
        assert len(replies[first]) == 1, replies  # the first request's one reply: its job's real outcome
        assert replies[first][0]["error"].startswith(f"Slurm job {job_id} ended without a result: COMPLETED")
        assert replies[second] == [] and rodan.depth(queues.request) == 0 and rodan.depth(queues.dead) == 0
        log = (spool / "jobs" / first / f"job-{job_id}.out").read_text()
        assert f"site prologue in job {job_id}: directive reached\n" in log
    finally:
        cancel_spool_jobs(spool)

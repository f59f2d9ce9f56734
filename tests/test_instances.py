"""Two instances under one account: one bridge on Slurm, one on Grid Engine, each with its own queues.

Everything an operator does is done through the installed commands, with HOME redirected:
``hpc-bridge --instance NAME init`` makes each settings folder, ``install cron`` writes each
crontab block (a stand-in crontab records the table), and each block's line is run as cron runs
it (``/bin/sh -c`` with cron's bare environment). Rodan publishes one request to each bridge's
request queue; the jobs run on the real schedulers (the worker is tests/stub_worker.py: the real
parameter file and reply path without TensorFlow). Each reply must come back on its own bridge's
reply queue, each ledger lie in its own spool, each bridge own its queues, and neither may take
the other's spool. Then ``uninstall --purge`` of one leaves the other whole.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bridge.spool import safe_key
from tests import stub_worker
from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL, RODAN_PASSWORD
from tests.support.broker import Queues, Rodan, delete_queues, queue_exists
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.tables import FAKE_TABLE, entries
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parent.parent
HPC_BRIDGE = REPO / ".venv" / "bin" / "hpc-bridge"

pytestmark = [pytest.mark.broker, pytest.mark.slurm, pytest.mark.gridengine]


@dataclass
class Account:
    """One user's HOME, with a stand-in crontab."""

    home: Path
    tables: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "LOGNAME": "hpc",
            "PATH": f"{self.tables / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "FAKE_TABLE_DIR": str(self.tables),
            **extra,
        }

    def hpc_bridge(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(HPC_BRIDGE), *args], env=self.env(), cwd=self.home, capture_output=True, text=True, timeout=timeout
        )

    def cron_line(self, instance: str) -> str:
        """The command of ``instance``'s block in the crontab."""
        table = (self.tables / "crontab").read_text()
        start = table.index(f"# BEGIN hpc-bridge/{instance} cron")
        block = table[start : table.index(f"# END hpc-bridge/{instance} cron")]
        [entry] = entries(block)
        return entry.split(None, 5)[5]

    def as_cron(self, instance: str) -> subprocess.CompletedProcess[str]:
        """One run of the block's line, as cron runs it: sh -c with HOME, LOGNAME, SHELL and a bare PATH."""
        cron_env = {"HOME": str(self.home), "LOGNAME": "hpc", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin"}
        return subprocess.run(
            ["/bin/sh", "-c", self.cron_line(instance)], env=cron_env, capture_output=True, text=True, timeout=180
        )


@pytest.fixture
def account(tmp_path: Path) -> Account:
    tables = tmp_path / "tables"
    (tables / "bin").mkdir(parents=True)
    for name in ("crontab", "scrontab"):
        (tables / "bin" / name).write_text(FAKE_TABLE)
        (tables / "bin" / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return Account(home, tables)


@pytest.fixture
def second_queues(broker_url: str) -> Iterator[Queues]:
    q = Queues.fresh()
    yield q
    delete_queues(broker_url, q.all())


def _settings(broker_url: str, standin_host: str, queues: Queues, scheduler: str, worker: Path) -> dict[str, str]:
    return {
        "RABBITMQ_URL": broker_url,
        "RODAN_HOST": standin_host,
        "RODAN_SCHEME": "http",
        "RODAN_USER": RODAN_EMAIL,
        "RODAN_PASSWORD": RODAN_PASSWORD,
        "HPC_SCHEDULER": scheduler,
        "HPC_REQUEST_QUEUE": queues.request,
        "HPC_REPLY_QUEUE": queues.reply,
        "HPC_WORKER_PYTHON": str(worker),
        "HPC_GPU_RULES": "none",
        "HPC_LOG_FILE": "bridge.log",  # relative: next to the credentials file, where a pass runs
        "HPC_METRICS_FILE": f"~/metrics/{scheduler}.prom",  # one textfile-collector folder for both
    }


def _fill_in(path: Path, settings: dict[str, str]) -> None:
    """What the operator does in an editor: each setting's example line replaced, or added."""
    lines = path.read_text().splitlines()
    for name, value in settings.items():
        for i, line in enumerate(lines):
            if line.startswith((f"{name}=", f"# {name}=", f"#{name}=")):
                lines[i] = f"{name}={value}"
                break
        else:
            lines.append(f"{name}={value}")
    path.write_text("\n".join(lines) + "\n")


def test_two_instances_on_one_account_answer_their_own_requests_and_never_collide(
    account: Account,
    broker_url: str,
    standin,
    queues: Queues,
    second_queues: Queues,
    sample_inputs,
    slurm,
    gridengine,
    tmp_path: Path,
) -> None:
    worker = stub_worker.install(tmp_path / "stub")
    instances = {
        "lab-slurm": ("slurm", queues),
        "lab-sge": ("gridengine", second_queues),
    }
    home = account.home
    spools = {name: home / f"hpc-bridge-spool-{name}" for name in instances}
    try:
        for name, (scheduler, q) in instances.items():
            made = account.hpc_bridge("--instance", name, "init")
            assert made.returncode == 0, made.stderr
            credentials = home / ".config" / "hpc-bridge" / name / "credentials.env"
            assert f"wrote {credentials}" in made.stdout
            _fill_in(credentials, _settings(broker_url, standin.host_port, q, scheduler, worker))
            installed = account.hpc_bridge("--instance", name, "install", "cron")
            assert installed.returncode == 0, installed.stderr

        # One crontab, two blocks; each line names the instance and nothing else it can find itself.
        table = (account.tables / "crontab").read_text()
        for name in instances:
            assert table.count(f"# BEGIN hpc-bridge/{name} cron") == 1
            words = shlex.split(account.cron_line(name))
            assert words[0] == f"HPC_BRIDGE_INSTANCE={name}" and words[-1].endswith("/hpc-bridge-run-check"), words

        # Rodan asks each bridge once.
        rodans = {name: Rodan(broker_url, q) for name, (_s, q) in instances.items()}
        asked = {}
        for name, rodan in rodans.items():
            corr = "f" + str(uuid.uuid4())[1:]  # tests/stub_worker.py publishes this one's reply itself
            rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS, correlation_id=corr)
            asked[name] = corr
        for name in instances:
            ran = account.as_cron(name)
            assert ran.returncode == 0 and ran.stdout == "" and ran.stderr == "", ran  # cron would mail nothing

        for name, (scheduler, q) in instances.items():
            replies = wait_until(rodans[name].drain, 240, 2, f"{name}'s reply")
            assert [c for c, _body, _h in replies] == [asked[name]], "each reply on its own bridge's queue"
            assert "error" not in json.loads(replies[0][1])
            # The job ran on that bridge's scheduler, from that bridge's spool.
            key = safe_key(asked[name])
            record = json.loads((spools[name] / "ledger" / f"{asked[name]}.json").read_text())
            assert record["job_id"], record
            other = next(n for n in instances if n != name)
            assert not (spools[other] / "ledger" / f"{asked[name]}.json").exists()
            script = (spools[name] / "jobs" / key / "job.sh").read_text()
            assert ("#SBATCH" in script) == (scheduler == "slurm") and ("#$ " in script) == (scheduler != "slurm")
            assert (spools[name] / "instance").read_text().strip() == name
            # Its own log: run_check's and the bridge's (relative HPC_LOG_FILE beside its settings).
            run_check_log = home / ".local" / "state" / "hpc-bridge" / name / "run_check.log"
            assert '"run_check_done"' in run_check_log.read_text()
            bridge_log = (home / ".config" / "hpc-bridge" / name / "bridge.log").read_text()
            assert asked[name] in bridge_log and asked[other] not in bridge_log
            assert queue_exists(broker_url, f"hpc-bridge.{name}.dead-letter")

        # One node_exporter textfile folder holds both files: no series may appear twice.
        series: list[tuple[str, tuple[tuple[str, str], ...]]] = []
        for scheduler in ("slurm", "gridengine"):
            text = (home / "metrics" / f"{scheduler}.prom").read_text()
            for family in text_string_to_metric_families(text):
                series += [(sample.name, tuple(sorted(sample.labels.items()))) for sample in family.samples]
        assert series and len(series) == len(set(series)), "a series in both files"
        assert ("hpc_bridge_outbox_replies", (("bridge", "lab-sge"),)) in series

        # status answers per instance, each about its own request only.
        for name in instances:
            status = account.hpc_bridge("--instance", name, "status", "--json")
            assert status.returncode == 0, status.stderr
            other = next(n for n in instances if n != name)
            assert asked[name] in status.stdout and asked[other] not in status.stdout

        # A bridge pointed at the other instance's spool is refused before it touches it.
        stolen = account.hpc_bridge("--instance", "lab-sge", "check", timeout=60)
        assert stolen.returncode == 0, stolen.stderr  # its own spool: fine
        env_override = account.env(HPC_SPOOL_DIR=str(spools["lab-slurm"]))
        refused = subprocess.run(
            [str(HPC_BRIDGE), "--instance", "lab-sge", "check"],
            env=env_override,
            cwd=home,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2, refused.stderr
        assert "belongs to instance 'lab-slurm', not 'lab-sge'" in refused.stderr

        # Uninstalling one, data and all, leaves the other whole.
        gone = account.hpc_bridge("--instance", "lab-sge", "uninstall", "--purge", "--yes")
        assert gone.returncode == 0, gone.stdout + gone.stderr
        table = (account.tables / "crontab").read_text()
        assert "# BEGIN hpc-bridge/lab-sge cron" not in table and "# BEGIN hpc-bridge/lab-slurm cron" in table
        assert not spools["lab-sge"].exists() and spools["lab-slurm"].is_dir()
        assert not queue_exists(broker_url, "hpc-bridge.lab-sge.dead-letter")
        assert queue_exists(broker_url, "hpc-bridge.lab-slurm.dead-letter")
        assert (home / ".config" / "hpc-bridge" / "lab-sge" / "credentials.env").exists()  # the passwords stay
        assert "kept the settings" in gone.stdout
        again = account.as_cron("lab-slurm")
        assert again.returncode == 0, again
    finally:
        for name, (scheduler, _q) in instances.items():
            if spools[name].is_dir():
                cancel_ledger_jobs(spools[name], Cluster(scheduler))
        delete_queues(broker_url, [f"hpc-bridge.{n}.{role}" for n in instances for role in ("dead-letter", "status")])


def test_uninstall_without_purge_keeps_the_data_and_purge_needs_consent(
    account: Account, broker_url: str, standin, queues: Queues, tmp_path: Path
) -> None:
    name = "solo"
    made = account.hpc_bridge("--instance", name, "init")
    assert made.returncode == 0, made.stderr
    credentials = account.home / ".config" / "hpc-bridge" / name / "credentials.env"
    _fill_in(credentials, _settings(broker_url, standin.host_port, queues, "slurm", Path("/usr/bin/python3")))
    assert "left as it is" in account.hpc_bridge("--instance", name, "init").stdout  # never overwritten
    spool = account.home / f"hpc-bridge-spool-{name}"
    try:
        for target in ("cron", "logrotate", "systemd"):
            done = account.hpc_bridge("--instance", name, "install", target)
            assert done.returncode == 0, done.stderr
        unit = account.home / ".config" / "systemd" / "user" / f"hpc-bridge@{name}.service"
        assert unit.is_file()
        assert account.as_cron(name).returncode == 0
        assert spool.is_dir()

        kept = account.hpc_bridge("--instance", name, "uninstall")
        assert kept.returncode == 0, kept.stderr
        table = (account.tables / "crontab").read_text()
        assert "hpc-bridge/solo" not in table, table  # cron and logrotate blocks gone
        assert not unit.exists() and f"deleted {unit}" in kept.stdout
        assert "systemctl --user disable --now" in kept.stdout  # said, since no user manager runs here
        assert spool.is_dir() and "kept the data" in kept.stdout
        assert queue_exists(broker_url, f"hpc-bridge.{name}.dead-letter")

        refused = subprocess.run(  # no terminal and no --yes: no consent
            [str(HPC_BRIDGE), "--instance", name, "uninstall", "--purge"],
            env=account.env(),
            cwd=account.home,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
        assert refused.returncode == 1 and "--yes" in refused.stderr
        assert spool.is_dir()

        purged = account.hpc_bridge("--instance", name, "uninstall", "--purge", "--yes")
        assert purged.returncode == 0, purged.stdout + purged.stderr
        assert not spool.exists()
        assert not (account.home / ".local" / "state" / "hpc-bridge" / name).exists()
        assert not queue_exists(broker_url, f"hpc-bridge.{name}.dead-letter")
    finally:
        delete_queues(broker_url, [f"hpc-bridge.{name}.dead-letter", f"hpc-bridge.{name}.status"])

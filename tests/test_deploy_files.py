"""The deployment files: credentials.env.example, deploy/run_check, cron, systemd, logrotate.

run_check is run for real, with a cron-like bare environment, against a broker
that is not there: it must exit with hpc-bridge's status, keep its log private,
and never let a password out.
"""

from __future__ import annotations

import configparser
import dataclasses
import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.errors import ConfigError
from bridge.spool import Spool

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "credentials.env.example"
CONFIG_SOURCE = REPO / "bridge" / "config.py"
DEPLOY = REPO / "deploy"
RUN_CHECK = DEPLOY / "run_check"
SYSTEMD = DEPLOY / "systemd"
LOGROTATE = DEPLOY / "logrotate" / "hpc-bridge"
HPC_BRIDGE = REPO / ".venv" / "bin" / "hpc-bridge"

RODAN_SECRET = "Rodan-Pw-5d8e1c7a40"
BROKER_SECRET = "Broker-Pw-93b1f4e2c6"
# Read from the environment by config.py, never from the file: documented in prose only.
ENV_ONLY = {"HPC_BRIDGE_CREDENTIALS"}
REQUIRED = {"RABBITMQ_URL", "RODAN_HOST", "RODAN_USER", "RODAN_PASSWORD"}
ASSIGNMENT = re.compile(r"^(#\s?)?((?:HPC|RODAN|RABBITMQ)_[A-Z0-9_]+)=(.*)$")


def _settings_in_config_source() -> set[str]:
    """Every "HPC_X" / "RODAN_X" / "RABBITMQ_X" string literal in bridge/config.py."""
    text = CONFIG_SOURCE.read_text()
    return set(re.findall(r"""["']((?:HPC|RODAN|RABBITMQ)_[A-Z0-9_]+)["']""", text))


def _assignments() -> dict[str, tuple[bool, str]]:
    """NAME -> (commented out, value) for every `NAME=` / `# NAME=` line of the example."""
    found: dict[str, tuple[bool, str]] = {}
    for line in EXAMPLE.read_text().splitlines():
        match = ASSIGNMENT.match(line)
        if match:
            assert match.group(2) not in found, f"{match.group(2)} is assigned twice in the example"
            found[match.group(2)] = (match.group(1) is not None, match.group(3))
    return found


def _private_copy(tmp_path: Path, text: str, name: str = "credentials.env") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


# --- credentials.env.example ------------------------------------------------------


def test_example_loads_with_its_placeholders(tmp_path: Path) -> None:
    path = _private_copy(tmp_path, EXAMPLE.read_text())
    config = load_config(path, environ={})
    assert "CHANGE_ME" in config.broker_url
    assert config.broker_url.startswith("amqps://")
    assert "CHANGE_ME" in config.rodan_host and config.rodan_scheme == "https"
    assert "CHANGE_ME" in config.rodan_user and config.rodan_email == config.rodan_user
    assert config.rodan_password == "CHANGE_ME"
    assert config.credentials_file == path.resolve()


def test_example_refused_when_others_can_read_it(tmp_path: Path) -> None:
    path = _private_copy(tmp_path, EXAMPLE.read_text())
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_config(path, environ={})


def test_every_setting_in_config_py_is_documented() -> None:
    names = _settings_in_config_source()
    assert {"RABBITMQ_URL", "HPC_SPOOL_DIR", "HPC_LOG_LEVEL", "RODAN_PASSWORD"} <= names  # the grep works
    text = EXAMPLE.read_text()
    assignments = _assignments()
    for name in sorted(names):
        assert re.search(rf"\b{name}\b", text), f"{name} (read by bridge/config.py) is not in the example"
        if name not in ENV_ONLY:
            assert name in assignments, f"{name} has no `{name}=` or `# {name}=` line in the example"


def test_example_documents_only_settings_config_py_reads() -> None:
    unknown = set(_assignments()) - _settings_in_config_source()
    assert not unknown, f"the example documents settings bridge/config.py never reads: {sorted(unknown)}"


def test_required_settings_are_uncommented_placeholders_and_really_required(tmp_path: Path) -> None:
    assignments = _assignments()
    uncommented = {name for name, (commented, _) in assignments.items() if not commented}
    assert uncommented == REQUIRED
    for name in REQUIRED:
        assert "CHANGE_ME" in assignments[name][1], f"{name}'s placeholder does not say it must be changed"
    text = EXAMPLE.read_text()
    for name in REQUIRED - {"RODAN_USER"}:  # RODAN_USER may be replaced by RODAN_EMAIL
        without = "\n".join(line for line in text.splitlines() if not line.startswith(f"{name}="))
        with pytest.raises(ConfigError, match=name):
            load_config(_private_copy(tmp_path, without, f"without-{name}.env"), environ={})


def test_documented_defaults_are_config_py_defaults(tmp_path: Path) -> None:
    """Uncommenting every optional line (its documented default) must change nothing."""
    text = EXAMPLE.read_text()
    uncommented = "\n".join(
        line[2:] if ASSIGNMENT.match(line) and line.startswith("# ") else line for line in text.splitlines()
    )
    assert uncommented.count("\nHPC_") >= 20
    plain = load_config(_private_copy(tmp_path, text, "plain.env"), environ={})
    explicit = load_config(_private_copy(tmp_path, uncommented, "explicit.env"), environ={})
    assert dataclasses.replace(explicit, credentials_file=None) == dataclasses.replace(plain, credentials_file=None)


def test_example_header_explains_permissions_and_shared_spool() -> None:
    head = EXAMPLE.read_text()[:2500]
    assert "chmod 600 credentials.env" in head
    assert "HPC_SPOOL_DIR" in head and "compute node" in head and "share" in head


def test_example_documents_default_example_and_failure_for_each_setting() -> None:
    text = EXAMPLE.read_text()
    for name in sorted(_settings_in_config_source() - ENV_ONLY):
        # The comment block that introduces the setting ("# NAME: ..." or "# NAME (required...").
        intro = re.search(rf"^#\s+{name}\b[ :(,]", text, re.M)
        assert intro, f"{name} has no comment describing it"
        block = text[intro.start() : intro.start() + 2500]
        assert "Default" in block or "default" in block or "(required" in block, f"{name}: no default stated"
        assert "Example" in block, f"{name}: no example"
        assert "When wrong" in block, f"{name}: no word on what happens when it is wrong"


# --- deploy/run_check ----------------------------------------------------------------


@dataclass
class CronWorld:
    home: Path
    credentials: Path
    spool: Path
    log: Path

    def env(self, **extra: str) -> dict[str, str]:
        """What cron gives a job (HOME, LOGNAME, SHELL, PATH=/usr/bin:/bin) and nothing else."""
        env = {"HOME": str(self.home), "LOGNAME": "hpc", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin"}
        env.update(extra)
        return env


@pytest.fixture
def world(tmp_path: Path) -> CronWorld:
    home = tmp_path / "home"
    home.mkdir()
    spool = tmp_path / "spool"
    credentials = _private_copy(
        home,
        f"RABBITMQ_URL=amqp://guest:{BROKER_SECRET}@127.0.0.1:9/%2F\n"
        "RODAN_HOST=127.0.0.1:9\n"
        "RODAN_SCHEME=http\n"
        "RODAN_USER=x@example.org\n"
        f"RODAN_PASSWORD={RODAN_SECRET}\n"
        f"HPC_SPOOL_DIR={spool}\n",
    )
    return CronWorld(home=home, credentials=credentials, spool=spool, log=tmp_path / "logs" / "run_check.log")


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _run_check(world: CronWorld, **extra: str) -> subprocess.CompletedProcess[str]:
    env = world.env(
        HPC_BRIDGE_HOME=str(REPO),
        HPC_BRIDGE_CREDENTIALS=str(world.credentials),
        HPC_BRIDGE_LOG=str(world.log),
        **extra,
    )
    return _run([str(RUN_CHECK)], env, world.home)


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert RODAN_SECRET not in text
        assert BROKER_SECRET not in text


def test_run_check_is_executable_and_never_traces() -> None:
    assert os.access(RUN_CHECK, os.X_OK)
    text = RUN_CHECK.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"set\s+-[a-zA-Z]*x", code), "run_check must never turn on tracing"
    assert not re.search(r"\bxtrace\b", code)
    assert "umask 077" in code
    assert "check" in code and "--credentials" in code


def test_run_check_unreachable_broker_exits_1_with_private_log_and_no_secret(world: CronWorld) -> None:
    result = _run_check(world)
    assert result.returncode == 1, result.stderr
    assert stat.S_IMODE(world.log.stat().st_mode) == 0o600
    assert stat.S_IMODE(world.log.parent.stat().st_mode) == 0o700
    events = _events(world.log)
    names = [e["event"] for e in events]
    assert "broker_unavailable" in names
    assert names[0] == "run_check_start" and names[-1] == "run_check_done"
    assert events[-1]["exit_status"] == 1
    assert '"event": "broker_unavailable"' in world.log.read_text()
    # cron mails what it prints: a failure says so, with the run's lines.
    assert result.stdout == ""
    assert "exit status 1" in result.stderr and "broker_unavailable" in result.stderr
    _assert_no_secret(world.log.read_text(), result.stdout, result.stderr)
    # The log is appended to, run after run.
    again = _run_check(world)
    assert again.returncode == 1
    assert [e["event"] for e in _events(world.log)].count("run_check_done") == 2
    _assert_no_secret(world.log.read_text(), again.stdout, again.stderr)


def test_run_check_world_readable_credentials_exit_2_and_say_chmod_600(world: CronWorld) -> None:
    world.credentials.chmod(0o644)
    result = _run_check(world)
    assert result.returncode == 2
    assert "chmod 600" in result.stderr
    assert "chmod 600" in world.log.read_text()
    assert _events(world.log)[-1]["exit_status"] == 2
    _assert_no_secret(world.log.read_text(), result.stdout, result.stderr)


def test_run_check_under_bash_x_still_traces_nothing(world: CronWorld) -> None:
    env = world.env(
        HPC_BRIDGE_HOME=str(REPO), HPC_BRIDGE_CREDENTIALS=str(world.credentials), HPC_BRIDGE_LOG=str(world.log)
    )
    result = _run(["bash", "-x", str(RUN_CHECK)], env, world.home)
    assert result.returncode == 1
    traced = [line for line in result.stderr.splitlines() if line.startswith("+")]
    assert traced == ["+ set +x"]
    _assert_no_secret(world.log.read_text(), result.stdout, result.stderr)


def test_run_check_exits_0_silently_when_another_bridge_holds_the_lock(world: CronWorld) -> None:
    Spool(world.spool).ensure()
    fd = os.open(world.spool / "bridge.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = _run_check(world)
    finally:
        os.close(fd)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert "bridge_lock_busy" in [e["event"] for e in _events(world.log)]


@pytest.fixture
def install(tmp_path: Path, world: CronWorld) -> Iterator[Path]:
    """An install elsewhere: HOME/hpc-bridge/{deploy/run_check, .venv/bin/hpc-bridge, credentials.env}."""
    root = world.home / "hpc-bridge"
    (root / "deploy").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    shutil.copy2(RUN_CHECK, root / "deploy" / "run_check")
    (root / ".venv" / "bin" / "hpc-bridge").symlink_to(HPC_BRIDGE)
    shutil.copy2(world.credentials, root / "credentials.env")
    yield root


def test_run_check_finds_its_install_from_its_own_location(world: CronWorld, install: Path) -> None:
    # Called through a symlink in ~/bin, with no HPC_BRIDGE_* variable: everything is found
    # relative to the real script (the directory above deploy/).
    (world.home / "bin").mkdir()
    (world.home / "bin" / "run_check").symlink_to(install / "deploy" / "run_check")
    result = _run([str(world.home / "bin" / "run_check")], world.env(), world.home)
    assert result.returncode == 1, result.stderr
    log = install / "logs" / "run_check.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    assert "broker_unavailable" in [e["event"] for e in _events(log)]
    _assert_no_secret(log.read_text(), result.stdout, result.stderr)


def test_run_check_sources_site_env_but_never_traces(world: CronWorld, install: Path) -> None:
    site = install / "deploy" / "site-env.sh"
    # A careless site file: it turns tracing and errexit on and uses unset variables (as module scripts do).
    site.write_text('echo "site env loaded ${UNSET_IN_CRON}"\nexport SITE_MARK=1\nset -ex\n')
    site.chmod(0o644)
    result = _run([str(install / "deploy" / "run_check")], world.env(), world.home)
    assert result.returncode == 1, result.stderr
    log_text = (install / "logs" / "run_check.log").read_text()
    assert "site env loaded" in log_text
    assert not [line for line in (log_text + result.stderr).splitlines() if line.startswith("+")]
    _assert_no_secret(log_text, result.stdout, result.stderr)

    site.chmod(0o666)  # others could put commands in it: refused
    refused = _run([str(install / "deploy" / "run_check")], world.env(), world.home)
    assert refused.returncode == 2
    assert "site-env.sh" in refused.stderr


def test_run_check_without_hpc_bridge_exits_127(world: CronWorld, tmp_path: Path) -> None:
    empty = tmp_path / "empty-install"
    empty.mkdir()
    env = world.env(HPC_BRIDGE_HOME=str(empty), HPC_BRIDGE_CREDENTIALS=str(world.credentials))
    result = _run([str(RUN_CHECK)], env, world.home)
    assert result.returncode == 127
    assert "hpc-bridge not found" in result.stderr


def test_run_check_passes_bash_n_and_shellcheck() -> None:
    assert subprocess.run(["bash", "-n", str(RUN_CHECK)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    result = subprocess.run(["shellcheck", str(RUN_CHECK)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# --- cron -----------------------------------------------------------------------------


def test_crontab_example_runs_run_check_every_5_minutes() -> None:
    lines = [
        line
        for line in (DEPLOY / "cron" / "crontab.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert any(line.startswith("MAILTO=") for line in lines)
    entries = [line for line in lines if not line.startswith("MAILTO=")]
    assert len(entries) == 1
    assert re.fullmatch(r"\*/5 \* \* \* \* /\S+/deploy/run_check", entries[0])
    assert ">>" not in entries[0], "run_check logs by itself; a redirect would hide failures from MAILTO"


# --- systemd --------------------------------------------------------------------------


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def test_systemd_units_parse_and_run_the_right_commands() -> None:
    daemon = _unit("hpc-bridge.service")["Service"]
    assert daemon["Type"] == "simple"
    assert re.fullmatch(r"\S+/hpc-bridge --credentials %h/hpc-bridge/credentials\.env run", daemon["ExecStart"])
    assert daemon["Restart"] == "on-failure" and daemon["RestartSec"] == "5"
    assert daemon["KillSignal"] == "SIGTERM" and daemon["TimeoutStopSec"] == "60"
    assert daemon["NoNewPrivileges"] == "yes"
    assert _unit("hpc-bridge.service")["Install"]["WantedBy"] == "default.target"

    check = _unit("hpc-bridge-check.service")["Service"]
    assert check["Type"] == "oneshot"
    assert re.fullmatch(r"\S+/hpc-bridge --credentials %h/hpc-bridge/credentials\.env check", check["ExecStart"])

    timer = _unit("hpc-bridge-check.timer")["Timer"]
    assert timer["OnCalendar"] == "*:0/5" and timer["Persistent"] == "true"
    assert timer["Unit"] == "hpc-bridge-check.service"

    for name in ("hpc-bridge.service", "hpc-bridge-check.service"):
        service = _unit(name)["Service"]
        assert "EnvironmentFile" not in service, "secrets go through --credentials, never the unit"
        # sbatch needs /etc/slurm and munge's socket: no filesystem sandboxing.
        for option in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateNetwork"):
            assert option not in service, f"{name}: {option} would break sbatch or the user unit"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (the units were parsed with configparser)")
    names = ["hpc-bridge.service", "hpc-bridge-check.service", "hpc-bridge-check.timer"]
    for name in names:
        # verify checks that ExecStart's program exists: point it at this checkout's venv.
        text = (SYSTEMD / name).read_text().replace("%h/hpc-bridge/.venv/bin/hpc-bridge", str(HPC_BRIDGE))
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", *names], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "hpc-bridge" in line]
    assert not complaints, complaints


# --- logrotate ------------------------------------------------------------------------


def test_logrotate_config_rotates_privately(tmp_path: Path) -> None:
    text = LOGROTATE.read_text()
    for directive in ("rotate 14", "compress", "delaycompress", "missingok", "notifempty", "copytruncate"):
        assert re.search(rf"^\s+{directive}$", text, re.M), directive
    assert re.search(r"^\s+(daily|size 50M)$", text, re.M)
    assert re.search(r"^\s+create 0600$", text, re.M)
    if shutil.which("logrotate") is None and not Path("/usr/sbin/logrotate").exists():
        pytest.skip("logrotate is not installed (apt-get install -y logrotate)")
    logrotate = shutil.which("logrotate") or "/usr/sbin/logrotate"

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    conf = tmp_path / "logrotate.conf"
    conf.write_text(text.replace("/home/USERNAME/hpc-bridge/logs", str(logs)))
    assert str(logs / "run_check.log") in conf.read_text() and str(logs / "bridge.log") in conf.read_text()
    state = tmp_path / "state"

    dry = subprocess.run([logrotate, "-d", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "error" not in (dry.stdout + dry.stderr).lower(), dry.stderr

    live = logs / "run_check.log"
    live.write_text('{"event": "check_start"}\n')
    live.chmod(0o600)
    forced = subprocess.run([logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    rotated = logs / "run_check.log.1"
    assert rotated.read_text() == '{"event": "check_start"}\n'  # delaycompress: newest copy stays plain
    assert stat.S_IMODE(rotated.stat().st_mode) == 0o600
    assert live.stat().st_size == 0 and stat.S_IMODE(live.stat().st_mode) == 0o600  # copytruncate


# --- deploy/README.md and the template link ---------------------------------------------


@pytest.mark.parametrize("name", ["slurm.sh", "gridengine.sh"])
def test_template_links_point_at_the_package_templates(name: str) -> None:
    link = DEPLOY / "templates" / name
    assert link.is_symlink()
    assert os.readlink(link) == f"../../bridge/schedulers/templates/{name}"
    assert link.resolve() == (REPO / "bridge" / "schedulers" / "templates" / name).resolve()
    assert link.read_text().startswith("#!/bin/bash")


def test_deploy_readme_lists_every_deploy_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in (
        "run_check",
        "site-env.sh",
        "cron/crontab.example",
        "systemd/hpc-bridge.service",
        "systemd/hpc-bridge-check.service",
        "systemd/hpc-bridge-check.timer",
        "systemd/README.md",
        "logrotate/hpc-bridge",
        "templates/slurm.sh",
        "templates/gridengine.sh",
        "examples/",
        "dev/slurm.sh",
        "dev/gridengine.sh",
        "bridge/schedulers/templates/",
    ):
        assert path in readme, path
    for path in ("run_check", "cron/crontab.example", "logrotate/hpc-bridge", "systemd/README.md"):
        assert (DEPLOY / path).is_file(), path

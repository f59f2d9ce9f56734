"""The deployment files: credentials.env.example, run_check, cron, systemd, logrotate.

run_check (the package's bridge/ops/run_check.sh) is run for real, with a cron-like
bare environment, against a broker that is not there: through the
``hpc-bridge-run-check`` entry point with the new defaults (settings and log under
~/.config and ~/.local/state, keyed by the instance), and through deploy/run_check,
the wrapper an installation from a checkout keeps in its crontab (the old
defaults, inside the checkout). It must exit with hpc-bridge's status, keep its
log private, and never let a password out.
"""

from __future__ import annotations

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

from bridge.config import known_keys, load_config
from bridge.errors import ConfigError
from bridge.spool import Spool
from tests.support.broker import Queues

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "credentials.env.example"
DEPLOY = REPO / "deploy"
#: The wrapper for installations from a checkout (their crontab line names it).
RUN_CHECK = DEPLOY / "run_check"
#: The script itself, shipped in the package.
PACKAGED_RUN_CHECK = REPO / "bridge" / "ops" / "run_check.sh"
#: The package's entry point that runs it (what `hpc-bridge install cron` writes into the crontab).
ENTRY_POINT = REPO / ".venv" / "bin" / "hpc-bridge-run-check"
SYSTEMD = DEPLOY / "systemd"
HPC_BRIDGE = REPO / ".venv" / "bin" / "hpc-bridge"

RODAN_SECRET = "Rodan-Pw-5d8e1c7a40"
BROKER_SECRET = "Broker-Pw-93b1f4e2c6"
# Read from the environment (or --credentials, --instance) by config.py, never from the file:
# documented in prose only.
ENV_ONLY = {"HPC_BRIDGE_CREDENTIALS", "HPC_BRIDGE_INSTANCE"}
REQUIRED = {"RABBITMQ_URL", "RODAN_HOST", "RODAN_USER", "RODAN_PASSWORD"}
ASSIGNMENT = re.compile(r"^(#\s?)?((?:HPC|RODAN|RABBITMQ)_[A-Z0-9_]+)=(.*)$")


def _settings_in_config_source() -> set[str]:
    """Every setting bridge/config.py reads (the names it also accepts in a credentials file)."""
    return set(known_keys())


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


def _filled_in(text: str) -> str:
    """The example with its placeholders replaced, as an operator leaves it."""
    return text.replace("CHANGE_ME", "set")


def test_example_names_every_placeholder_left_in_one_run(tmp_path: Path) -> None:
    path = _private_copy(tmp_path, EXAMPLE.read_text())
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    left = {problem.split()[0] for problem in caught.value.problems if "CHANGE_ME" in problem}
    assert left == REQUIRED


def test_example_loads_once_its_placeholders_are_filled_in(tmp_path: Path) -> None:
    path = _private_copy(tmp_path, _filled_in(EXAMPLE.read_text()))
    config = load_config(path, environ={})
    assert config.broker_url.startswith("amqps://")
    assert config.rodan_scheme == "https" and config.rodan_email == config.rodan_user
    assert config.rodan_password == "set"
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
    text = _filled_in(EXAMPLE.read_text())
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


# --- run_check: deploy/run_check (the checkout's wrapper) and hpc-bridge-run-check ------------


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


@pytest.mark.parametrize("script", [PACKAGED_RUN_CHECK, RUN_CHECK], ids=["run_check.sh", "deploy-wrapper"])
def test_run_check_is_executable_and_never_traces(script: Path) -> None:
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert code[0] == "set +x", "tracing goes off before anything else"
    joined = "\n".join(code)
    assert not re.search(r"set\s+-[a-zA-Z]*x", joined), "run_check must never turn on tracing"
    assert not re.search(r"\bxtrace\b", joined)
    if script == PACKAGED_RUN_CHECK:
        assert "umask 077" in joined
        assert "check" in joined and "--credentials" in joined and "--instance" in joined
    else:  # the wrapper sets the old defaults and hands over to the packaged script
        assert joined.endswith('exec bash "$checkout/bridge/ops/run_check.sh" "$@"')


def test_the_entry_point_runs_the_packaged_run_check() -> None:
    from bridge.ops import run_check

    assert run_check.script_path().resolve() == PACKAGED_RUN_CHECK.resolve()
    assert os.access(ENTRY_POINT, os.X_OK), "hpc-bridge-run-check is not installed in .venv/bin (pip install -e .)"


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


@pytest.mark.parametrize("script", [PACKAGED_RUN_CHECK, RUN_CHECK], ids=["run_check.sh", "deploy-wrapper"])
def test_run_check_under_bash_x_still_traces_nothing(world: CronWorld, script: Path) -> None:
    env = world.env(
        HPC_BRIDGE_HOME=str(REPO), HPC_BRIDGE_CREDENTIALS=str(world.credentials), HPC_BRIDGE_LOG=str(world.log)
    )
    if script == PACKAGED_RUN_CHECK:
        env["HPC_BRIDGE_EXE"] = str(HPC_BRIDGE)  # what hpc-bridge-run-check sets
    result = _run(["bash", "-x", str(script)], env, world.home)
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


def _checkout(root: Path) -> Path:
    """What a checkout holds of run_check: deploy/run_check and the script it runs; its deploy/run_check."""
    (root / "deploy").mkdir(parents=True)
    (root / "bridge" / "ops").mkdir(parents=True)
    shutil.copy2(RUN_CHECK, root / "deploy" / "run_check")
    shutil.copy2(PACKAGED_RUN_CHECK, root / "bridge" / "ops" / "run_check.sh")
    return root / "deploy" / "run_check"


@pytest.fixture
def install(tmp_path: Path, world: CronWorld) -> Iterator[Path]:
    """An install from a checkout (the older guide's): HOME/hpc-bridge/{deploy/run_check,
    bridge/ops/run_check.sh, .venv/bin/hpc-bridge, credentials.env}."""
    root = world.home / "hpc-bridge"
    _checkout(root)
    (root / ".venv" / "bin").mkdir(parents=True)
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


@pytest.mark.parametrize("script", [PACKAGED_RUN_CHECK, RUN_CHECK], ids=["run_check.sh", "deploy-wrapper"])
def test_run_check_passes_bash_n_and_shellcheck(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# --- run_check: mail only when something changes ----------------------------------------


def _state(world: CronWorld) -> list[int]:
    """run_check.state next to the log: exit status, since, last reported, failed runs in a row."""
    return [int(word) for word in world.log.with_suffix(".state").read_text().split()]


def _healthy(world: CronWorld, broker_url: str, queues: Queues) -> None:
    """Point the credentials at the real broker, with this test's own queues."""
    world.credentials.write_text(
        f"RABBITMQ_URL={broker_url}\n"
        "RODAN_HOST=127.0.0.1:9\n"
        "RODAN_SCHEME=http\n"
        "RODAN_USER=x@example.org\n"
        f"RODAN_PASSWORD={RODAN_SECRET}\n"
        f"HPC_SPOOL_DIR={world.spool}\n"
        f"HPC_REQUEST_QUEUE={queues.request}\n"
        f"HPC_REPLY_QUEUE={queues.reply}\n"
        f"HPC_DEAD_LETTER_QUEUE={queues.dead}\n"
    )


@pytest.mark.broker
def test_run_check_reports_a_change_of_exit_status_once(world: CronWorld, broker_url: str, queues: Queues) -> None:
    # A broker outage: the first failed run is reported, the next ones (within the hour) are not.
    first = _run_check(world)
    assert first.returncode == 1
    assert "exit status 1" in first.stderr and "broker_unavailable" in first.stderr
    for _ in range(2):
        again = _run_check(world)
        assert again.returncode == 1  # still visible to monitoring
        assert again.stdout == "" and again.stderr == ""
    assert _state(world)[0] == 1 and _state(world)[3] == 3
    assert [e.get("notified") for e in _events(world.log) if e["event"] == "run_check_done"] == [
        "change", "none", "none"
    ]  # fmt: skip

    # The broker is back: one "recovered" note, then silence again.
    _healthy(world, broker_url, queues)
    recovered = _run_check(world)
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.stdout == ""
    assert "recovered" in recovered.stderr and "3 run(s) in a row" in recovered.stderr
    assert "exit status 1" in recovered.stderr
    quiet = _run_check(world)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""
    assert _state(world)[0] == 0

    # A different failure is a change too: 0 -> 2 (configuration), then 2 -> 1 (broker).
    world.credentials.chmod(0o644)
    bad_mode = _run_check(world)
    assert bad_mode.returncode == 2 and "chmod 600" in bad_mode.stderr
    world.credentials.chmod(0o600)
    world.credentials.write_text(world.credentials.read_text().replace(broker_url, "amqp://guest:x@127.0.0.1:9/%2F"))
    broker_down = _run_check(world)
    assert broker_down.returncode == 1 and "exit status 1" in broker_down.stderr
    _assert_no_secret(world.log.read_text(), *(r.stderr for r in (first, recovered, bad_mode, broker_down)))


def test_run_check_reminds_hourly_while_the_failure_lasts(world: CronWorld) -> None:
    first = _run_check(world)
    assert first.returncode == 1 and first.stderr
    since = _state(world)[1]
    # The last report was an hour and a bit ago: this failed run is reported again, as a reminder.
    world.log.with_suffix(".state").write_text(f"1 {since} {since - 3700} 7\n")
    reminder = _run_check(world)
    assert reminder.returncode == 1
    assert "still failing since" in reminder.stderr and "8 run(s) in a row" in reminder.stderr
    assert "broker_unavailable" in reminder.stderr  # with this run's lines
    status, kept_since, reported, failures = _state(world)
    assert (status, kept_since, failures) == (1, since, 8) and reported > since - 3700
    # Reported just now: the next failed run is quiet again.
    assert _run_check(world).stderr == ""
    # HPC_BRIDGE_REMIND_S=0: every failed run is reported.
    assert "still failing" in _run_check(world, HPC_BRIDGE_REMIND_S="0").stderr


def test_run_check_treats_an_unreadable_state_as_a_success_before(world: CronWorld) -> None:
    world.log.parent.mkdir(mode=0o700)
    world.log.with_suffix(".state").write_text("garbage\n")
    result = _run_check(world)
    assert result.returncode == 1 and "exit status 1" in result.stderr
    assert _state(world)[0] == 1


def test_run_check_lock_busy_says_nothing_and_keeps_the_state(world: CronWorld) -> None:
    assert _run_check(world).returncode == 1
    before = world.log.with_suffix(".state").read_text()
    Spool(world.spool).ensure()
    fd = os.open(world.spool / "bridge.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # hpc-bridge finds the spool taken (before it tries the broker) and exits 0: that run is
        # no news, neither a recovery nor a failure.
        busy = _run_check(world)
    finally:
        os.close(fd)
    assert busy.returncode == 0 and busy.stdout == "" and busy.stderr == ""
    assert world.log.with_suffix(".state").read_text() == before
    assert _events(world.log)[-1].get("lock_busy") is True


def test_run_check_leaves_at_once_while_the_previous_one_runs(world: CronWorld) -> None:
    world.log.parent.mkdir(mode=0o700)
    with world.log.with_suffix(".lock").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # what a running run_check holds
        result = _run_check(world)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    assert [e["event"] for e in _events(world.log)] == ["run_check_busy"]
    assert not world.log.with_suffix(".state").exists()
    # The lock is not the log: logrotate renames the log, and a run while it does must still be alone.
    world.log.rename(world.log.with_suffix(".log.1"))
    with world.log.with_suffix(".lock").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        again = _run_check(world)
    assert again.returncode == 0 and [e["event"] for e in _events(world.log)] == ["run_check_busy"]


def test_run_check_runs_the_hpc_bridge_named_by_hpc_bridge_exe(world: CronWorld, tmp_path: Path) -> None:
    empty = tmp_path / "empty-install"
    wrapper = _checkout(empty)  # no .venv
    env = world.env(HPC_BRIDGE_CREDENTIALS=str(world.credentials), HPC_BRIDGE_EXE=str(HPC_BRIDGE))
    result = _run([str(wrapper)], env, world.home)
    assert result.returncode == 1  # hpc-bridge ran: the broker is unreachable
    assert "broker_unavailable" in (empty / "logs" / "run_check.log").read_text()
    env["HPC_BRIDGE_EXE"] = str(tmp_path / "nothing-here")
    missing = _run([str(wrapper)], env, world.home)
    assert missing.returncode == 127 and "HPC_BRIDGE_EXE" in missing.stderr


# --- hpc-bridge-run-check: an installation without a checkout ------------------------------


def _instance_settings(world: CronWorld, instance: str, spool: str) -> Path:
    """world's settings as ~/.config/hpc-bridge/INSTANCE/credentials.env (where run_check looks), with
    HPC_SPOOL_DIR=spool."""
    settings = world.home / ".config" / "hpc-bridge" / instance
    settings.mkdir(parents=True)
    text = world.credentials.read_text().replace(f"HPC_SPOOL_DIR={world.spool}", f"HPC_SPOOL_DIR={spool}")
    return _private_copy(settings, text)


def test_the_entry_point_runs_one_pass_with_the_new_defaults(world: CronWorld, tmp_path: Path) -> None:
    # A relative spool: relative to the credentials file's folder, where the pass runs.
    credentials = _instance_settings(world, "default", "spool")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    # cron's bare environment: no hpc-bridge on PATH, no HPC_BRIDGE_* variable; the entry point
    # finds the hpc-bridge beside it, the settings and the log where the instance keeps them.
    result = _run([str(ENTRY_POINT)], world.env(), elsewhere)
    assert result.returncode == 1, result.stderr
    log = world.home / ".local" / "state" / "hpc-bridge" / "default" / "run_check.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    events = _events(log)
    names = [e["event"] for e in events]
    assert names[0] == "run_check_start" and names[-1] == "run_check_done"
    assert "broker_unavailable" in names and events[-1]["exit_status"] == 1
    assert log.with_name("run_check.state").is_file()
    assert (credentials.parent / "spool").is_dir() and not (elsewhere / "spool").exists()
    # cron mails what it prints: the failure, once.
    assert result.stdout == ""
    assert "exit status 1" in result.stderr and "broker_unavailable" in result.stderr
    again = _run([str(ENTRY_POINT)], world.env(), elsewhere)
    assert again.returncode == 1 and again.stdout == "" and again.stderr == ""
    assert [e["event"] for e in _events(log)].count("run_check_done") == 2
    assert not world.log.exists()
    _assert_no_secret(log.read_text(), result.stdout, result.stderr)


def test_the_entry_point_keeps_instances_apart_with_their_own_site_env(world: CronWorld) -> None:
    for name in ("default", "sge"):
        settings = _instance_settings(world, name, str(world.spool.with_name(f"spool-{name}"))).parent
        site = settings / "site-env.sh"
        site.write_text(f'echo "site env of {name}"\n')
        site.chmod(0o644)
    state = world.home / ".local" / "state" / "hpc-bridge"
    sge_log = state / "sge" / "run_check.log"

    by_option = _run([str(ENTRY_POINT), "--instance", "sge"], world.env(), world.home)
    assert by_option.returncode == 1, by_option.stderr
    text = sge_log.read_text()
    assert "site env of sge" in text and "site env of default" not in text
    assert '"event": "broker_unavailable"' in text
    assert world.spool.with_name("spool-sge").is_dir() and not world.spool.with_name("spool-default").exists()
    assert not (state / "default").exists()

    by_env = _run([str(ENTRY_POINT)], world.env(HPC_BRIDGE_INSTANCE="sge"), world.home)
    assert by_env.returncode == 1, by_env.stderr
    assert [e["event"] for e in _events(sge_log)].count("run_check_done") == 2
    assert not (state / "default").exists()

    default = _run([str(ENTRY_POINT)], world.env(), world.home)
    assert default.returncode == 1, default.stderr
    assert "site env of default" in (state / "default" / "run_check.log").read_text()
    assert world.spool.with_name("spool-default").is_dir()

    refused = _run([str(ENTRY_POINT), "--instance", "../x"], world.env(), world.home)
    assert refused.returncode == 2 and "not an instance name" in refused.stderr
    assert sorted(p.name for p in state.iterdir()) == ["default", "sge"]
    _assert_no_secret(sge_log.read_text(), by_option.stderr, default.stderr)


# --- one schedule everywhere ------------------------------------------------------------------


def test_every_schedule_is_one_pass_a_minute() -> None:
    """cron, scrontab, the systemd timer and every doc show the same schedule: every minute."""
    cron = (DEPLOY / "cron" / "crontab").read_text()
    scron = (DEPLOY / "cron" / "scrontab").read_text()
    for text in (cron, scron):
        entries = [line for line in text.splitlines() if line.strip() and not line.startswith(("#", "${"))]
        assert entries == ["* * * * * ${command}"], entries
    assert re.search(r"^OnCalendar=\*-\*-\* \*:\*:00$", (SYSTEMD / "hpc-bridge-check.timer").read_text(), re.M)
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *DEPLOY.rglob("*"), *(REPO / "bridge").rglob("*.py")]
    offenders = []
    for path in texts:
        if not path.is_file() or "dev" in path.relative_to(REPO).parts:
            continue
        text = path.read_text(errors="replace")
        for pattern in (r"\*/5(?!\d)", r"\*:0/5", r"pass(es)? every (5|five) minutes"):
            offenders += [f"{path.relative_to(REPO)}: {m.group(0)!r}" for m in re.finditer(pattern, text)]
    assert not offenders, f"still a pass every 5 minutes: {offenders}"


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
        "cron/crontab",
        "cron/crontab-logrotate",
        "cron/scrontab",
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
    for path in ("run_check", "cron/crontab", "logrotate/hpc-bridge", "systemd/README.md"):
        assert (DEPLOY / path).is_file(), path
    assert "hpc-bridge install" in readme


@pytest.mark.parametrize(
    ("link", "name"),
    [
        ("systemd/hpc-bridge.service", "hpc-bridge.service"),
        ("systemd/hpc-bridge-check.service", "hpc-bridge-check.service"),
        ("systemd/hpc-bridge-check.timer", "hpc-bridge-check.timer"),
        ("logrotate/hpc-bridge", "logrotate"),
        ("cron/crontab", "crontab"),
        ("cron/crontab-logrotate", "crontab-logrotate"),
        ("cron/scrontab", "scrontab"),
    ],
)
def test_deploy_files_are_the_install_templates(link: str, name: str) -> None:
    """One source: deploy/'s cron, systemd and logrotate files are links to what `hpc-bridge install` renders."""
    path = DEPLOY / link
    assert path.is_symlink()
    assert path.resolve() == (REPO / "bridge" / "ops" / "templates" / name).resolve()
    assert "${" in path.read_text()

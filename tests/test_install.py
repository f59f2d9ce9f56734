"""``hpc-bridge install cron|systemd|logrotate|scrontab``: the rendered files, with a temporary install's
real paths, written where they belong (HOME redirected), idempotent, and run for real where they can
be: the crontab line runs one pass against the real broker as cron would, logrotate rotates with the
rendered file, ``systemd-analyze verify`` judges the units, the real ``crontab`` accepts the block.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge.ops.doctor import check_linger
from bridge.ops.install import replace_block, scheduler_environment
from tests.support.broker import Queues
from tests.support.cluster import require_other_user

REPO = Path(__file__).resolve().parent.parent
HPC_BRIDGE = REPO / ".venv" / "bin" / "hpc-bridge"
RUN_CHECK = REPO / "deploy" / "run_check"
TEMPLATES = REPO / "bridge" / "ops" / "templates"
RODAN_SECRET = "Rodan-Pw-77c1e04b9d"

pytestmark = pytest.mark.broker  # every install loads a configuration; some tests run a pass

#: A stand-in for crontab/scrontab: `-l` prints the table (or "no crontab for ..."), `FILE` installs
#: FILE. Every call is recorded, to tell a rewrite from none.
FAKE_TABLE = """#!/bin/sh
store="$FAKE_TABLE_DIR/$(basename "$0")"
echo "$*" >>"$store.calls"
case "$1" in
    -l) if [ -f "$store" ]; then cat "$store"; else echo "no crontab for $LOGNAME" >&2; exit 1; fi ;;
    -*) echo "unexpected option $1" >&2; exit 2 ;;
    *) cp "$1" "$store" ;;
esac
"""


@dataclass
class Site:
    """HOME/hpc-bridge: a checkout's run_check, .venv/bin/hpc-bridge, credentials.env."""

    home: Path
    install: Path
    credentials: Path
    spool: Path
    tables: Path  # where the fake crontab/scrontab keep their tables

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "HOME": str(self.home),
            "LOGNAME": "hpc",
            "PATH": f"{self.tables / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HPC_BRIDGE_HOME": str(self.install),
            "FAKE_TABLE_DIR": str(self.tables),
        }
        env.update(extra)
        return env

    def run(self, *args: str, credentials: Path | None = None, **extra: str) -> subprocess.CompletedProcess[str]:
        argv = [str(HPC_BRIDGE), "--credentials", str(credentials or self.credentials), "install", *args]
        return subprocess.run(argv, env=self.env(**extra), cwd=self.home, capture_output=True, text=True, timeout=60)

    def table(self, name: str = "crontab") -> str:
        path = self.tables / name
        return path.read_text() if path.exists() else ""

    def calls(self, name: str = "crontab") -> list[str]:
        path = self.tables / f"{name}.calls"
        return path.read_text().splitlines() if path.exists() else []

    @property
    def user_units(self) -> Path:
        return self.home / ".config" / "systemd" / "user"


def _settings(broker_url: str, queues: Queues, spool: Path, logs: Path, **extra: str) -> str:
    settings = {
        "RABBITMQ_URL": broker_url,
        "RODAN_HOST": "127.0.0.1:9",
        "RODAN_SCHEME": "http",
        "RODAN_USER": "hpc@example.org",
        "RODAN_PASSWORD": RODAN_SECRET,
        "HPC_SPOOL_DIR": str(spool),
        "HPC_LOG_FILE": str(logs / "bridge.log"),
        "HPC_REQUEST_QUEUE": queues.request,
        "HPC_REPLY_QUEUE": queues.reply,
        "HPC_DEAD_LETTER_QUEUE": queues.dead,
        **extra,
    }
    return "".join(f"{k}={v}\n" for k, v in settings.items())


@pytest.fixture
def site(tmp_path: Path, broker_url: str, queues: Queues) -> Site:
    home = tmp_path / "home"
    install = home / "hpc-bridge"
    (install / "deploy").mkdir(parents=True)
    (install / ".venv" / "bin").mkdir(parents=True)
    shutil.copy2(RUN_CHECK, install / "deploy" / "run_check")
    (install / ".venv" / "bin" / "hpc-bridge").symlink_to(HPC_BRIDGE)
    spool = tmp_path / "spool"
    credentials = install / "credentials.env"
    credentials.write_text(_settings(broker_url, queues, spool, install / "logs"))
    credentials.chmod(0o600)
    tables = tmp_path / "tables"
    (tables / "bin").mkdir(parents=True)
    for name in ("crontab", "scrontab"):
        (tables / "bin" / name).write_text(FAKE_TABLE)
        (tables / "bin" / name).chmod(0o755)
    return Site(home, install, credentials, spool, tables)


def _entries(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _cron_env(site: Site) -> dict[str, str]:
    """What cron gives a job: HOME, LOGNAME, SHELL and PATH=/usr/bin:/bin, nothing else."""
    return {"HOME": str(site.home), "LOGNAME": "hpc", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin"}


def _unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (a key may repeat, e.g. Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting outside any section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=VALUE line: {line}"
        current.setdefault(key, []).append(value)
    return sections


def _one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, (key, values)
    return values[0]


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert RODAN_SECRET not in text and "guest:guest" not in text


# --- cron ---------------------------------------------------------------------------------------


def test_cron_print_shows_one_line_a_minute_with_the_real_run_check(site: Site) -> None:
    result = site.run("cron", "--print")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# BEGIN hpc-bridge cron") and lines[-1] == "# END hpc-bridge cron"
    [entry] = _entries(result.stdout)
    fields = entry.split(None, 5)
    assert fields[:5] == ["*"] * 5
    # Everything is where run_check finds it by itself: the line is just its path.
    assert fields[5] == str(site.install / "deploy" / "run_check")
    assert os.access(fields[5], os.X_OK)
    assert "would write" in result.stderr and "crontab" in result.stderr
    assert site.calls() == []  # --print never touches the crontab


@pytest.mark.broker
def test_the_installed_cron_line_runs_one_pass_as_cron_would(site: Site) -> None:
    result = site.run("cron")
    assert result.returncode == 0, result.stderr
    [entry] = _entries(site.table())
    command = entry.split(None, 5)[5]
    ran = subprocess.run(
        ["/bin/sh", "-c", command], env=_cron_env(site), cwd=site.home, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "" and ran.stderr == ""  # a healthy pass mails nothing
    run_check_log = site.install / "logs" / "run_check.log"
    done = [json.loads(line) for line in run_check_log.read_text().splitlines() if "run_check_done" in line]
    assert done and done[-1]["exit_status"] == 0
    bridge_log = (site.install / "logs" / "bridge.log").read_text()  # HPC_LOG_FILE
    assert '"event": "check_done"' in bridge_log
    _assert_no_secret(run_check_log.read_text(), bridge_log, site.table())


def test_cron_install_is_idempotent_keeps_the_rest_and_replaces_its_block_in_place(site: Site) -> None:
    (site.tables / "crontab").write_text("MAILTO=ops@example.org\n0 4 * * * /bin/true\n")
    first = site.run("cron")
    assert first.returncode == 0, first.stderr
    assert "added the cron block" in first.stdout
    assert "systemctl" not in first.stdout and "MAILTO" in first.stdout
    table = site.table()
    assert table.startswith("MAILTO=ops@example.org\n0 4 * * * /bin/true\n# BEGIN hpc-bridge cron")
    assert table.count("# BEGIN hpc-bridge cron") == 1

    again = site.run("cron")
    assert again.returncode == 0 and "unchanged" in again.stdout
    assert site.table() == table
    assert len([c for c in site.calls() if c != "-l"]) == 1  # written once: the second run left it alone

    # A line of the operator's after the block, then the credentials move: the block is rewritten
    # where it is, once.
    (site.tables / "crontab").write_text(table + "30 5 * * * /bin/date\n")
    moved = site.home / "elsewhere.env"
    shutil.copy2(site.credentials, moved)
    rewritten = site.run("cron", credentials=moved)
    assert rewritten.returncode == 0 and "replaced the cron block" in rewritten.stdout
    new = site.table()
    assert new.count("# BEGIN hpc-bridge cron") == 1 and new.endswith("30 5 * * * /bin/date\n")
    [entry] = [e for e in _entries(new) if "run_check" in e]
    assert f"HPC_BRIDGE_CREDENTIALS={moved}" in entry

    # logrotate adds a block of its own; removing cron's leaves it and the operator's lines.
    assert site.run("logrotate").returncode == 0
    removed = site.run("cron", "--remove", credentials=moved)
    assert removed.returncode == 0 and "removed the cron block" in removed.stdout
    final = site.table()
    assert "run_check" not in final and "# BEGIN hpc-bridge logrotate" in final
    assert final.startswith("MAILTO=ops@example.org\n0 4 * * * /bin/true\n") and "30 5 * * * /bin/date" in final


def test_cron_install_points_out_a_hand_made_line_running_run_check_too(site: Site) -> None:
    old_line = f"*/5 * * * * {site.install / 'deploy' / 'run_check'}"  # what an older guide had you type
    (site.tables / "crontab").write_text(old_line + "\n")
    result = site.run("cron")
    assert result.returncode == 0, result.stderr
    assert f"also runs it outside the block, remove that line: {old_line}" in result.stdout
    assert site.table().startswith(old_line + "\n")  # pointed out, not removed behind your back


def test_cron_line_names_what_run_check_would_not_find_by_itself(site: Site, tmp_path: Path) -> None:
    (site.install / ".venv" / "bin" / "hpc-bridge").unlink()  # the venv in use is elsewhere
    elsewhere = site.home / "cfg" / "bridge.env"
    elsewhere.parent.mkdir()
    shutil.copy2(site.credentials, elsewhere)
    log = tmp_path / "cronlogs" / "check.log"
    result = site.run("cron", "--print", credentials=elsewhere, HPC_BRIDGE_LOG=str(log))
    assert result.returncode == 0, result.stderr
    [entry] = _entries(result.stdout)
    command = entry.split(None, 5)[5]
    assert shlex.split(command) == [
        f"HPC_BRIDGE_EXE={HPC_BRIDGE}",
        f"HPC_BRIDGE_CREDENTIALS={elsewhere}",
        f"HPC_BRIDGE_LOG={log}",
        str(site.install / "deploy" / "run_check"),
    ]
    # The line works as written: run_check finds the hpc-bridge, the settings and its log.
    ran = subprocess.run(["/bin/sh", "-c", command], env=_cron_env(site), capture_output=True, text=True, timeout=120)
    assert ran.returncode in (0, 1), ran.stderr  # 1 only if the broker were down
    assert "run_check_done" in log.read_text()


def test_the_real_crontab_accepts_the_block(site: Site) -> None:
    crontab = shutil.which("crontab")
    assert crontab is not None, "crontab is missing: deploy/dev/setup.sh installs cron"
    user = require_other_user("setup.sh")
    before = subprocess.run([crontab, "-u", user, "-l"], capture_output=True, text=True)
    block = site.run("cron", "--print").stdout
    table = site.tables / "for-real"
    table.write_text(block)
    try:
        installed = subprocess.run([crontab, "-u", user, str(table)], capture_output=True, text=True)
        assert installed.returncode == 0, installed.stderr
        listed = subprocess.run([crontab, "-u", user, "-l"], capture_output=True, text=True)
        assert block in listed.stdout
    finally:
        if before.returncode == 0:
            table.write_text(before.stdout)
            subprocess.run([crontab, "-u", user, str(table)], check=True)
        else:
            subprocess.run([crontab, "-u", user, "-r"], capture_output=True)


def test_replace_block_refuses_a_block_without_its_end() -> None:
    from bridge.ops.install import InstallError

    with pytest.raises(InstallError, match="without"):
        replace_block("# BEGIN hpc-bridge cron: x\n* * * * * a\n", "cron", "new\n")
    # "cron" is not "crontab-something": only the exact block name matches.
    assert replace_block("# BEGIN hpc-bridge cronx\n", "cron", None) == "# BEGIN hpc-bridge cronx\n"


def test_write_file_replaces_atomically_with_its_mode_and_skips_what_is_there(tmp_path: Path) -> None:
    from bridge.ops.install import InstallError, Output, write_file

    path = tmp_path / "units" / "hpc-bridge.service"
    assert write_file(Output(path, "[Unit]\nDescription=ä\n", mode=0o640)) is True
    assert path.read_text("utf-8") == "[Unit]\nDescription=ä\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert write_file(Output(path, "[Unit]\nDescription=ä\n", mode=0o640)) is False, "already exactly this"
    assert write_file(Output(path, "[Unit]\nDescription=ä\n", mode=0o644)) is True, "only the mode differs"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    blocked = tmp_path / "blocked"
    (blocked / "inside").mkdir(parents=True)  # a non-empty directory where the file should go
    with pytest.raises(InstallError, match="cannot write"):
        write_file(Output(blocked, "x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "units"]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"


# --- systemd ---------------------------------------------------------------------------------------


def test_systemd_user_daemon_unit_is_written_with_the_real_paths(site: Site) -> None:
    result = site.run("systemd")
    assert result.returncode == 0, result.stderr
    path = site.user_units / "hpc-bridge.service"
    assert result.stdout.splitlines()[0] == f"wrote {path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    text = path.read_text()
    unit = _unit(text)
    service = unit["Service"]
    assert _one(unit, "Service", "ExecStart") == f"{HPC_BRIDGE} --credentials {site.credentials} run"
    assert _one(unit, "Service", "WorkingDirectory") == str(site.install)
    # systemd can watch it: readiness and a watchdog the daemon feeds (only the daemon may notify).
    assert _one(unit, "Service", "Type") == "notify" and _one(unit, "Service", "NotifyAccess") == "main"
    assert re.fullmatch(r"\d+(min|s)", _one(unit, "Service", "WatchdogSec"))
    assert _one(unit, "Service", "Restart") == "on-failure"
    assert _one(unit, "Service", "RestartPreventExitStatus") == "2"
    # A good neighbour on a shared login node.
    assert _one(unit, "Service", "Nice") == "10" and _one(unit, "Service", "IOSchedulingClass") == "idle"
    assert _one(unit, "Service", "NoNewPrivileges") == "yes" and _one(unit, "Service", "UMask") == "0077"
    assert _one(unit, "Install", "WantedBy") == "default.target"
    assert "EnvironmentFile" not in service, "secrets go through --credentials, never the unit"
    for option in ("ProtectSystem", "ProtectHome", "PrivateTmp", "User"):
        assert option not in service, f"{option} would stop a user unit from starting"
    _assert_no_secret(text)
    assert "${" not in text
    # The one command that enables it, and the word on lingering (off or unknown here).
    assert "systemctl --user daemon-reload && systemctl --user enable --now hpc-bridge.service" in result.stdout
    assert "loginctl enable-linger" in result.stdout

    again = site.run("systemd")
    assert again.returncode == 0 and again.stdout.splitlines()[0] == f"unchanged {path}"
    assert path.read_text() == text


def test_systemd_timer_runs_one_pass_a_minute(site: Site) -> None:
    result = site.run("systemd", "--timer")
    assert result.returncode == 0, result.stderr
    service = _unit((site.user_units / "hpc-bridge-check.service").read_text())
    assert _one(service, "Service", "Type") == "oneshot"
    assert _one(service, "Service", "ExecStart") == f"{HPC_BRIDGE} --credentials {site.credentials} check"
    timer = _unit((site.user_units / "hpc-bridge-check.timer").read_text())
    assert _one(timer, "Timer", "Unit") == "hpc-bridge-check.service"
    assert _one(timer, "Timer", "Persistent") == "true"
    assert _one(timer, "Install", "WantedBy") == "timers.target"
    calendar = _one(timer, "Timer", "OnCalendar")
    if shutil.which("systemd-analyze"):
        normalized = subprocess.run(["systemd-analyze", "calendar", calendar], capture_output=True, text=True)
        assert normalized.returncode == 0, normalized.stderr
        assert "Normalized form: *-*-* *:*:00" in normalized.stdout  # every minute, at :00
    else:
        assert calendar == "*-*-* *:*:00"
    assert "enable --now hpc-bridge-check.timer" in result.stdout
    assert not (site.user_units / "hpc-bridge.service").exists()


def test_system_unit_runs_as_the_owner_and_is_sandboxed(site: Site) -> None:
    user = require_other_user("setup.sh")
    owner = pwd.getpwnam(user)
    os.chown(site.credentials, owner.pw_uid, owner.pw_gid)
    result = site.run("systemd", "--system", "--print")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# /etc/systemd/system/hpc-bridge.service\n")
    unit = _unit(result.stdout)
    assert _one(unit, "Service", "User") == user
    assert _one(unit, "Service", "Group") == grp.getgrgid(owner.pw_gid).gr_name
    assert _one(unit, "Service", "ProtectSystem") == "full"
    assert _one(unit, "Service", "PrivateTmp") == "yes"
    assert _one(unit, "Service", "NoNewPrivileges") == "yes"
    writable = _one(unit, "Service", "ReadWritePaths").split()
    assert f"-{site.spool}" in writable and f"-{site.install / 'logs'}" in writable
    assert _one(unit, "Service", "Type") == "notify"
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "network-online.target" in _one(unit, "Unit", "After")
    assert "sudo" not in result.stdout and "systemctl daemon-reload && systemctl enable --now" in result.stderr

    # The bridge never runs as root: a root-owned install is refused.
    os.chown(site.credentials, 0, 0)
    refused = site.run("systemd", "--system", "--print")
    assert refused.returncode == 2 and "never runs as root" in refused.stderr


def test_rendered_units_pass_systemd_analyze_verify(site: Site, tmp_path: Path) -> None:
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: deploy/dev/setup.sh installs systemd"
    assert site.run("systemd").returncode == 0
    assert site.run("systemd", "--timer").returncode == 0
    user = require_other_user("setup.sh")
    os.chown(site.credentials, pwd.getpwnam(user).pw_uid, -1)
    system = tmp_path / "system"
    system.mkdir()
    (system / "hpc-bridge.service").write_text(site.run("systemd", "--system", "--print").stdout)
    for folder, names in (
        (site.user_units, ["hpc-bridge.service", "hpc-bridge-check.service", "hpc-bridge-check.timer"]),
        (system, ["hpc-bridge.service"]),
    ):
        result = subprocess.run(
            ["systemd-analyze", "verify", *names], cwd=folder, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        complaints = [ln for ln in (result.stdout + result.stderr).splitlines() if "hpc-bridge" in ln]
        assert not complaints, complaints


# --- logrotate -------------------------------------------------------------------------------------


def _logrotate() -> str:
    found = shutil.which("logrotate") or ("/usr/sbin/logrotate" if Path("/usr/sbin/logrotate").exists() else None)
    assert found is not None, "logrotate is missing: deploy/dev/setup.sh installs it"
    return found


def test_logrotate_conf_and_its_daily_line_rotate_privately(site: Site) -> None:
    logrotate = _logrotate()
    result = site.run("logrotate")
    assert result.returncode == 0, result.stderr
    conf = site.home / ".config" / "hpc-bridge" / "logrotate.conf"
    state = conf.with_name("logrotate.state")
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    logs = site.install / "logs"
    assert re.search(
        rf"^{re.escape(str(logs / 'run_check.log'))}\n{re.escape(str(logs / 'bridge.log'))}\n{{", text, re.M
    )
    for directive in ("rotate 14", "compress", "delaycompress", "missingok", "notifempty", "copytruncate"):
        assert re.search(rf"^\s+{directive}$", text, re.M), directive
    assert re.search(r"^\s+create 0600$", text, re.M) and not re.search(r"^\s+su ", text, re.M)
    [entry] = _entries(site.table())
    fields = entry.split(None, 5)
    assert fields[:5] == ["17", "3", "*", "*", "*"]
    assert shlex.split(fields[5]) == [logrotate, "-s", str(state), str(conf)]

    logs.mkdir(mode=0o700, exist_ok=True)  # hpc-bridge made it for HPC_LOG_FILE
    live = logs / "run_check.log"
    live.write_text('{"event": "check_start"}\n')
    live.chmod(0o600)
    dry = subprocess.run([logrotate, "-d", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert dry.returncode == 0 and "error" not in (dry.stdout + dry.stderr).lower(), dry.stderr
    daily = subprocess.run(shlex.split(fields[5]), env=_cron_env(site), capture_output=True, text=True)
    assert daily.returncode == 0, daily.stderr  # the crontab's command as written
    forced = subprocess.run([logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    rotated = logs / "run_check.log.1"
    assert rotated.read_text() == '{"event": "check_start"}\n'  # delaycompress: newest copy stays plain
    assert stat.S_IMODE(rotated.stat().st_mode) == 0o600
    assert live.stat().st_size == 0 and stat.S_IMODE(live.stat().st_mode) == 0o600  # copytruncate

    assert "unchanged" in site.run("logrotate").stdout


def test_system_logrotate_file_rotates_as_the_owner(site: Site, broker_url: str, queues: Queues) -> None:
    logrotate = _logrotate()
    user = require_other_user("setup.sh")
    owner = pwd.getpwnam(user)
    # An install that belongs to that account, where it can reach it (not under root's private tmp).
    root = Path(tempfile.mkdtemp(prefix="hpc-bridge-install-"))
    try:
        install = root / "hpc-bridge"
        logs = install / "logs"
        (install / "deploy").mkdir(parents=True)
        logs.mkdir()
        shutil.copy2(RUN_CHECK, install / "deploy" / "run_check")
        credentials = install / "credentials.env"
        credentials.write_text(_settings(broker_url, queues, site.spool, logs))
        credentials.chmod(0o600)
        (logs / "run_check.log").write_text('{"event": "run_check_done"}\n')
        (logs / "bridge.log").write_text("")
        for path in (root, *root.rglob("*")):
            os.chown(path, owner.pw_uid, owner.pw_gid)
            path.chmod(0o600 if path.is_file() and path.name != "run_check" else 0o700)

        result = site.run("logrotate", "--system", "--print", credentials=credentials, HPC_BRIDGE_HOME=str(install))
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("# /etc/logrotate.d/hpc-bridge\n")
        group = grp.getgrgid(owner.pw_gid).gr_name
        assert re.search(rf"^\s+su {user} {group}$", result.stdout, re.M)
        assert site.calls() == []  # a system file needs no crontab line

        # As the system's logrotate runs it: root, switching to the owner for these logs.
        conf = site.tables / "hpc-bridge.logrotate"
        conf.write_text(result.stdout)
        state = site.tables / "logrotate.state"
        forced = subprocess.run([logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True)
        assert forced.returncode == 0, forced.stderr
        rotated = logs / "run_check.log.1"
        assert rotated.read_text() == '{"event": "run_check_done"}\n'
        assert rotated.stat().st_uid == owner.pw_uid and stat.S_IMODE(rotated.stat().st_mode) == 0o600
        assert (logs / "run_check.log").stat().st_size == 0
    finally:
        shutil.rmtree(root)


# --- scrontab --------------------------------------------------------------------------------------


def test_scrontab_entry_carries_its_slurm_options(site: Site, broker_url: str, queues: Queues) -> None:
    charged = site.install / "charged.env"
    charged.write_text(_settings(broker_url, queues, site.spool, site.install / "logs", HPC_SLURM_ACCOUNT="def-lab"))
    charged.chmod(0o600)
    result = site.run("scrontab", credentials=charged)
    assert result.returncode == 0, result.stderr
    lines = site.table("scrontab").splitlines()
    [entry] = _entries("\n".join(lines))
    assert entry.split(None, 5)[:5] == ["*"] * 5 and entry.endswith(str(site.install / "deploy" / "run_check"))
    # #SCRON options apply to the next line: they stand right above the entry.
    at = lines.index(entry)
    options = []
    for line in reversed(lines[:at]):
        if not line.startswith("#SCRON "):
            break
        options.append(line.removeprefix("#SCRON "))
    assert "--account=def-lab" in options and "--job-name=hpc-bridge-check" in options
    assert f"--output={site.install / 'logs' / 'scrontab.out'}" in options
    assert any(o.startswith("--time=") for o in options)
    assert site.calls("crontab") == []  # scrontab only
    assert "unchanged" in site.run("scrontab", credentials=charged).stdout


# --- what cannot be installed ------------------------------------------------------------------------


def test_paths_that_cannot_be_written_plainly_are_refused(site: Site, tmp_path: Path) -> None:
    spaced = tmp_path / "my install"
    (spaced / "deploy").mkdir(parents=True)
    shutil.copy2(RUN_CHECK, spaced / "deploy" / "run_check")
    result = site.run("cron", "--print", HPC_BRIDGE_HOME=str(spaced))
    assert result.returncode == 2 and "cannot carry safely" in result.stderr
    assert result.stdout == ""

    bare = tmp_path / "bare"
    bare.mkdir()
    missing = site.run("cron", HPC_BRIDGE_HOME=str(bare))
    assert missing.returncode == 2 and "holds no deploy/run_check" in missing.stderr
    assert site.calls() == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["cron", "--system"], "--system is for systemd and logrotate"),
        (["cron", "--timer"], "--timer is for systemd"),
        (["systemd", "--remove"], "--remove is for the crontab blocks"),
    ],
)
def test_options_that_do_not_apply_are_refused(site: Site, args: list[str], says: str) -> None:
    result = site.run(*args)
    assert result.returncode == 2 and says in result.stderr


def test_settings_from_the_environment_only_are_refused(site: Site, broker_url: str) -> None:
    env = site.env(
        RABBITMQ_URL=broker_url, RODAN_HOST="127.0.0.1:9", RODAN_USER="hpc@example.org", RODAN_PASSWORD="x-123456"
    )
    result = subprocess.run(
        [str(HPC_BRIDGE), "install", "cron", "--print"], env=env, cwd=site.home, capture_output=True, text=True
    )
    assert result.returncode == 2 and "needs a credentials file" in result.stderr


def test_the_scheduler_commands_directory_and_grid_engine_cell_reach_cron_and_systemd(
    site: Site, tmp_path: Path
) -> None:
    sched = tmp_path / "opt" / "slurm" / "bin"
    sched.mkdir(parents=True)
    for name in ("sbatch", "qsub"):
        (sched / name).write_text("#!/bin/sh\n")
        (sched / name).chmod(0o755)
    env = {"PATH": f"{sched}:/usr/bin:/bin", "SGE_ROOT": "/opt/sge", "SGE_CELL": "default"}
    assert scheduler_environment("slurm", env) == [("PATH", f"{sched}:/usr/local/bin:/usr/bin:/bin")]
    assert scheduler_environment("gridengine", env)[1:] == [("SGE_ROOT", "/opt/sge"), ("SGE_CELL", "default")]

    path = f"{site.tables / 'bin'}:{sched}:/usr/bin:/bin"
    cron = site.run("cron", "--print", PATH=path)
    [entry] = _entries(cron.stdout)
    assert f"PATH={sched}:/usr/local/bin:/usr/bin:/bin " in entry
    unit = _unit(site.run("systemd", "--print", PATH=path).stdout)
    assert f"PATH={sched}:/usr/local/bin:/usr/bin:/bin" in unit["Service"]["Environment"]


# --- doctor: a user unit needs lingering ------------------------------------------------------------------


def test_check_linger_warns_about_a_user_unit_without_lingering(tmp_path: Path) -> None:
    config_home = tmp_path / "config"
    linger = tmp_path / "linger"
    linger.mkdir()
    me = pwd.getpwuid(os.getuid()).pw_name
    assert check_linger(config_home, linger).status == "ok"  # no unit: nothing to say
    units = config_home / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "hpc-bridge.service").write_text("[Service]\n")
    off = check_linger(config_home, linger)
    assert off.status == "warn" and "lingering is off" in off.found and "hpc-bridge.service" in off.found
    assert f"loginctl enable-linger {me}" in off.fix
    (linger / me).touch()
    assert check_linger(config_home, linger).status == "ok"


def test_doctor_warns_when_install_wrote_a_user_unit_and_lingering_is_not_on(site: Site) -> None:
    if Path("/var/lib/systemd/linger", pwd.getpwuid(os.getuid()).pw_name).exists():
        pytest.skip("lingering is on for this account on this machine")
    assert site.run("systemd").returncode == 0
    result = subprocess.run(
        [str(HPC_BRIDGE), "--credentials", str(site.credentials), "doctor", "--json", "--skip-worker"],
        env=site.env(),
        cwd=site.home,
        capture_output=True,
        text=True,
        timeout=240,
    )
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    linger = checks["systemd-linger"]
    assert linger["status"] == "warn", linger
    assert "hpc-bridge.service" in linger["found"] and "enable-linger" in linger["fix"]


# --- the templates ship with the package ----------------------------------------------------------------


def test_the_templates_ship_in_the_wheel(tmp_path: Path) -> None:
    """A non-editable install (the operator guide's) must find every template."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    for package in ("bridge", "worker"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in sorted(TEMPLATES.iterdir()):
        assert f"bridge/ops/templates/{template.name}" in names, f"{template.name} is not in the wheel"

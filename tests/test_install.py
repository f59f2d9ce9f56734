"""``hpc-bridge install cron|systemd|logrotate|scrontab``: the rendered files, with a temporary install's
real paths, written where they belong (HOME redirected), idempotent, keyed by the instance, and run for
real where they can be: the crontab line runs one pass against the real broker as cron would, logrotate
rotates with the rendered file, ``systemd-analyze verify`` judges the units, the real ``crontab`` accepts
the block.
"""

from __future__ import annotations

import configparser
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
from bridge.schedulers import scheduler_class
from tests.support.broker import Queues
from tests.support.cluster import require_other_user
from tests.support.tables import FAKE_TABLE, entries

REPO = Path(__file__).resolve().parent.parent
HPC_BRIDGE = REPO / ".venv" / "bin" / "hpc-bridge"
#: The package's crontab entry, installed beside hpc-bridge: what every crontab line runs.
RUN_CHECK = REPO / ".venv" / "bin" / "hpc-bridge-run-check"
TEMPLATES = REPO / "bridge" / "ops" / "templates"
RODAN_SECRET = "Rodan-Pw-77c1e04b9d"

pytestmark = pytest.mark.broker  # every install loads a configuration; some tests run a pass


@dataclass
class Site:
    """An account without a checkout (HOME redirected): the default instance's settings in
    HOME/.config/hpc-bridge/default/credentials.env, this checkout's .venv (hpc-bridge and the
    hpc-bridge-run-check beside it), HPC_LOG_FILE in HOME/logs, fake crontab/scrontab."""

    home: Path
    credentials: Path
    spool: Path
    tables: Path  # where the fake crontab/scrontab keep their tables

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "HOME": str(self.home),
            "LOGNAME": "hpc",
            "PATH": f"{self.tables / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "FAKE_TABLE_DIR": str(self.tables),
        }
        env.update(extra)
        return env

    def run(
        self, *args: str, credentials: Path | None = None, instance: str | None = None, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """``hpc-bridge [--instance NAME] [--credentials FILE] install ARGS``: the options only when given."""
        argv = [str(HPC_BRIDGE)]
        if instance is not None:
            argv += ["--instance", instance]
        if credentials is not None:
            argv += ["--credentials", str(credentials)]
        argv += ["install", *args]
        return subprocess.run(argv, env=self.env(**extra), cwd=self.home, capture_output=True, text=True, timeout=60)

    def settings(self, instance: str = "default") -> Path:
        """An instance's settings folder: credentials.env, logrotate.conf and .state."""
        return self.home / ".config" / "hpc-bridge" / instance

    def state(self, instance: str = "default") -> Path:
        """An instance's state folder: run_check.log (and scrontab.out beside it)."""
        return self.home / ".local" / "state" / "hpc-bridge" / instance

    @property
    def logs(self) -> Path:
        """HPC_LOG_FILE's folder (bridge.log)."""
        return self.home / "logs"

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


def _private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def site(tmp_path: Path, broker_url: str, queues: Queues) -> Site:
    home = tmp_path / "home"
    spool = tmp_path / "spool"
    credentials = home / ".config" / "hpc-bridge" / "default" / "credentials.env"
    _private(credentials, _settings(broker_url, queues, spool, home / "logs"))
    tables = tmp_path / "tables"
    (tables / "bin").mkdir(parents=True)
    for name in ("crontab", "scrontab"):
        (tables / "bin" / name).write_text(FAKE_TABLE)
        (tables / "bin" / name).chmod(0o755)
    return Site(home, credentials, spool, tables)


def _second_instance(site: Site, broker_url: str, queues: Queues, **extra: str) -> Path:
    """The instance ``sge`` beside the default one: its settings, spool, logs and queues its own."""
    own = Queues(f"{queues.request}-sge", f"{queues.reply}-sge", f"{queues.dead}-sge")
    text = _settings(broker_url, own, site.spool.with_name("spool-sge"), site.home / "logs-sge", **extra)
    return _private(site.settings("sge") / "credentials.env", text)


def _command(entry: str) -> str:
    """A crontab entry's command (after the five schedule fields)."""
    return entry.split(None, 5)[5]


def _blocks(table: str) -> dict[str, str]:
    """'OWNER BLOCK' (``hpc-bridge/sge cron``) -> the lines between the block's markers."""
    found: dict[str, str] = {}
    for match in re.finditer(r"^# BEGIN (\S+) (\S+?)(?::[^\n]*)?\n(.*?)^# END \1 \2\n", table, re.M | re.S):
        key = f"{match.group(1)} {match.group(2)}"
        assert key not in found, f"two {key} blocks"
        found[key] = match.group(3)
    assert len(found) == table.count("# BEGIN "), table
    return found


def _cron_env(site: Site, **extra: str) -> dict[str, str]:
    """What cron gives a job: HOME, LOGNAME, SHELL and PATH=/usr/bin:/bin, nothing else."""
    return {"HOME": str(site.home), "LOGNAME": "hpc", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin", **extra}


def _as_cron(site: Site, command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """A crontab entry's command run the way cron runs it (/bin/sh -c, cron's bare environment)."""
    env = _cron_env(site, **extra)
    return subprocess.run(
        ["/bin/sh", "-c", command], env=env, cwd=site.home, capture_output=True, text=True, timeout=120
    )


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


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


def test_cron_print_shows_one_line_a_minute_with_the_installed_entry_point(site: Site) -> None:
    result = site.run("cron", "--print")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# BEGIN hpc-bridge/default cron: ") and lines[-1] == "# END hpc-bridge/default cron"
    [entry] = entries(result.stdout)
    fields = entry.split(None, 5)
    assert fields[:5] == ["*"] * 5
    # Everything is where run_check finds it by itself: the line is just the entry point beside the
    # hpc-bridge in use (no checkout, no copy of a script).
    assert fields[5] == str(RUN_CHECK)
    assert os.access(fields[5], os.X_OK)
    assert "would write" in result.stderr and "crontab" in result.stderr
    assert site.calls() == []  # --print never touches the crontab


@pytest.mark.broker
def test_the_installed_cron_line_runs_one_pass_as_cron_would(site: Site) -> None:
    result = site.run("cron")
    assert result.returncode == 0, result.stderr
    run_check_log = site.state() / "run_check.log"
    assert f"its log: {run_check_log}" in result.stdout
    [entry] = entries(site.table())
    ran = _as_cron(site, _command(entry))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "" and ran.stderr == ""  # a healthy pass mails nothing
    assert stat.S_IMODE(run_check_log.stat().st_mode) == 0o600
    assert stat.S_IMODE(run_check_log.parent.stat().st_mode) == 0o700
    done = [e for e in _events(run_check_log) if e["event"] == "run_check_done"]
    assert done and done[-1]["exit_status"] == 0
    bridge_log = (site.logs / "bridge.log").read_text()  # HPC_LOG_FILE
    assert '"event": "check_done"' in bridge_log
    _assert_no_secret(run_check_log.read_text(), bridge_log, site.table())


def test_cron_install_is_idempotent_keeps_the_rest_and_replaces_its_block_in_place(site: Site) -> None:
    (site.tables / "crontab").write_text("MAILTO=ops@example.org\n0 4 * * * /bin/true\n")
    first = site.run("cron")
    assert first.returncode == 0, first.stderr
    assert "added the cron block" in first.stdout
    assert "systemctl" not in first.stdout and "MAILTO" in first.stdout
    table = site.table()
    assert table.startswith("MAILTO=ops@example.org\n0 4 * * * /bin/true\n# BEGIN hpc-bridge/default cron: ")
    assert list(_blocks(table)) == ["hpc-bridge/default cron"]

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
    assert list(_blocks(new)) == ["hpc-bridge/default cron"] and new.endswith("30 5 * * * /bin/date\n")
    [entry] = [e for e in entries(new) if str(RUN_CHECK) in e]
    assert shlex.split(_command(entry)) == [f"HPC_BRIDGE_CREDENTIALS={moved}", str(RUN_CHECK)]

    # logrotate adds a block of its own; removing cron's leaves it and the operator's lines.
    assert site.run("logrotate").returncode == 0
    removed = site.run("cron", "--remove", credentials=moved)
    assert removed.returncode == 0 and "removed the cron block" in removed.stdout
    final = site.table()
    assert str(RUN_CHECK) not in final and list(_blocks(final)) == ["hpc-bridge/default logrotate"]
    assert final.startswith("MAILTO=ops@example.org\n0 4 * * * /bin/true\n") and "30 5 * * * /bin/date" in final
    gone = site.run("cron", "--remove")
    assert gone.returncode == 0 and "already without the cron block" in gone.stdout and site.table() == final


def test_the_default_instance_takes_over_a_block_from_before_instances(site: Site) -> None:
    """An installation made before instances has `# BEGIN hpc-bridge cron` (a checkout's deploy/run_check)
    and `# BEGIN hpc-bridge logrotate`: the default instance rewrites them where they are, under its marker."""
    written = "written by `hpc-bridge install cron` (run it again to rewrite this block, with --remove to take it out)"
    legacy = (
        "MAILTO=ops@example.org\n"
        f"# BEGIN hpc-bridge cron: {written}\n"
        "* * * * * /home/hpc/hpc-bridge/deploy/run_check\n"
        "# END hpc-bridge cron\n"
        "0 4 * * * /bin/true\n"
        "# BEGIN hpc-bridge logrotate: written by `hpc-bridge install logrotate`\n"
        "17 3 * * * /usr/sbin/logrotate -s /home/hpc/.config/hpc-bridge/logrotate.state "
        "/home/hpc/.config/hpc-bridge/logrotate.conf\n"
        "# END hpc-bridge logrotate\n"
        "30 5 * * * /bin/date\n"
    )
    (site.tables / "crontab").write_text(legacy)
    result = site.run("cron")
    assert result.returncode == 0, result.stderr
    assert "replaced the cron block" in result.stdout
    assert "also runs it outside the block" not in result.stdout
    table = site.table()
    blocks = _blocks(table)
    assert list(blocks) == ["hpc-bridge/default cron", "hpc-bridge logrotate"]  # in place, one cron block
    assert "/home/hpc/hpc-bridge/deploy/run_check" not in table
    assert entries(blocks["hpc-bridge/default cron"]) == [f"* * * * * {RUN_CHECK}"]
    lines = table.splitlines()
    assert lines[0] == "MAILTO=ops@example.org" and lines[1].startswith("# BEGIN hpc-bridge/default cron: ")
    assert lines[lines.index("# END hpc-bridge/default cron") + 1] == "0 4 * * * /bin/true"
    assert table.endswith("# END hpc-bridge logrotate\n30 5 * * * /bin/date\n")

    assert site.run("logrotate").returncode == 0  # the old logrotate block too
    table = site.table()
    assert list(_blocks(table)) == ["hpc-bridge/default cron", "hpc-bridge/default logrotate"]
    assert str(site.settings() / "logrotate.conf") in table and "/home/hpc/" not in table
    assert entries(table)[:2] == ["MAILTO=ops@example.org", f"* * * * * {RUN_CHECK}"]
    assert entries(table)[-1] == "30 5 * * * /bin/date" and "0 4 * * * /bin/true" in entries(table)


def test_cron_install_points_out_a_hand_made_line_running_run_check_too(site: Site) -> None:
    old_line = f"*/5 * * * * {RUN_CHECK}"  # typed by hand, from a guide
    (site.tables / "crontab").write_text(old_line + "\n")
    result = site.run("cron")
    assert result.returncode == 0, result.stderr
    assert f"also runs it outside the block, remove that line: {old_line}" in result.stdout
    assert site.table().startswith(old_line + "\n")  # pointed out, not removed behind your back


def test_cron_line_names_what_run_check_would_not_find_by_itself(site: Site, tmp_path: Path) -> None:
    # Credentials outside the instance's folder, the pass run in another folder (a relative
    # HPC_LOG_FILE is relative to it), the log elsewhere.
    elsewhere = site.home / "cfg" / "bridge.env"
    text = site.credentials.read_text().replace(f"HPC_LOG_FILE={site.logs / 'bridge.log'}", "HPC_LOG_FILE=logs/b.log")
    _private(elsewhere, text)
    work = site.home / "work"
    work.mkdir()
    log = tmp_path / "cronlogs" / "check.log"
    result = site.run("cron", "--print", credentials=elsewhere, HPC_BRIDGE_LOG=str(log), HPC_BRIDGE_HOME=str(work))
    assert result.returncode == 0, result.stderr
    [entry] = entries(result.stdout)
    command = _command(entry)
    assert shlex.split(command) == [
        f"HPC_BRIDGE_CREDENTIALS={elsewhere}",
        f"HPC_BRIDGE_HOME={work}",
        f"HPC_BRIDGE_LOG={log}",
        str(RUN_CHECK),
    ]
    # The line works as written: run_check finds the hpc-bridge, the settings, the folder and its log.
    ran = _as_cron(site, command)
    assert ran.returncode in (0, 1), ran.stderr  # 1 only if the broker were down
    assert "run_check_done" in log.read_text()
    assert (work / "logs" / "b.log").is_file(), "the pass ran in HPC_BRIDGE_HOME"
    assert not (site.state() / "run_check.log").exists()


def test_cron_line_names_only_the_locations_that_are_not_the_defaults(site: Site, tmp_path: Path) -> None:
    # Set, but to what run_check finds by itself: nothing on the line.
    same = site.run("cron", "--print", XDG_CONFIG_HOME=str(site.home / ".config"), HPC_BRIDGE_HOME=str(site.settings()))
    assert same.returncode == 0, same.stderr
    assert [_command(e) for e in entries(same.stdout)] == [str(RUN_CHECK)]
    assert site.run("cron", "--print", credentials=site.credentials).stdout == same.stdout

    # XDG homes of the account's own: the settings and the log follow them, and the line says so.
    config_home, state_home = tmp_path / "xdg-config", tmp_path / "xdg-state"
    settings = config_home / "hpc-bridge" / "default" / "credentials.env"
    _private(settings, site.credentials.read_text())
    site.credentials.unlink()
    moved = site.run("cron", "--print", XDG_CONFIG_HOME=str(config_home), XDG_STATE_HOME=str(state_home))
    assert moved.returncode == 0, moved.stderr
    [entry] = entries(moved.stdout)
    command = _command(entry)
    assert shlex.split(command) == [f"XDG_CONFIG_HOME={config_home}", f"XDG_STATE_HOME={state_home}", str(RUN_CHECK)]
    ran = _as_cron(site, command)
    assert ran.returncode in (0, 1), ran.stderr
    assert "run_check_done" in (state_home / "hpc-bridge" / "default" / "run_check.log").read_text()
    assert not site.state().exists()


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


def test_replace_block_finds_only_its_own_instance() -> None:
    default = ("hpc-bridge/default", "hpc-bridge")  # the default instance also owns a block from before instances
    legacy = "a\n# BEGIN hpc-bridge cron: x\nold\n# END hpc-bridge cron\nb\n"
    assert replace_block(legacy, "cron", "new\n", default) == "a\nnew\nb\n"
    assert replace_block(legacy, "cron", "new\n", ("hpc-bridge/sge",)) == legacy + "new\n"
    other = "# BEGIN hpc-bridge/sge cron: x\nsge\n# END hpc-bridge/sge cron\n"
    assert replace_block(other, "cron", None, default) == other
    # The default instance's own block wins over a legacy one; a name that only starts alike is another's.
    both = "# BEGIN hpc-bridge/default cron\nmine\n# END hpc-bridge/default cron\n" + legacy
    assert replace_block(both, "cron", "new\n", default) == "new\n" + legacy
    alike = "# BEGIN hpc-bridge/default-2 cron\nx\n# END hpc-bridge/default-2 cron\n"
    assert replace_block(alike, "cron", None, default) == alike


def test_write_file_replaces_atomically_with_its_mode_and_skips_what_is_there(tmp_path: Path) -> None:
    from bridge.ops.install import InstallError, Output, write_file

    path = tmp_path / "units" / "hpc-bridge@default.service"
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
    path = site.user_units / "hpc-bridge@default.service"
    assert result.stdout.splitlines()[0] == f"wrote {path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    text = path.read_text()
    unit = _unit(text)
    service = unit["Service"]
    assert _one(unit, "Service", "ExecStart") == f"{HPC_BRIDGE} --instance default --credentials {site.credentials} run"
    assert _one(unit, "Service", "WorkingDirectory") == str(site.settings())  # relative settings: from there
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
    enable = "systemctl --user daemon-reload && systemctl --user enable --now hpc-bridge@default.service"
    assert enable in result.stdout
    assert "journalctl --user -u hpc-bridge@default.service" in result.stdout
    assert "loginctl enable-linger" in result.stdout
    assert sorted(p.name for p in site.user_units.iterdir()) == ["hpc-bridge@default.service"]

    again = site.run("systemd")
    assert again.returncode == 0 and again.stdout.splitlines()[0] == f"unchanged {path}"
    assert path.read_text() == text


def test_systemd_timer_runs_one_pass_a_minute(site: Site) -> None:
    result = site.run("systemd", "--timer")
    assert result.returncode == 0, result.stderr
    service = _unit((site.user_units / "hpc-bridge-check@default.service").read_text())
    assert _one(service, "Service", "Type") == "oneshot"
    expected = f"{HPC_BRIDGE} --instance default --credentials {site.credentials} check"
    assert _one(service, "Service", "ExecStart") == expected
    assert _one(service, "Service", "WorkingDirectory") == str(site.settings())
    timer = _unit((site.user_units / "hpc-bridge-check@default.timer").read_text())
    assert _one(timer, "Timer", "Unit") == "hpc-bridge-check@default.service"
    assert _one(timer, "Timer", "Persistent") == "true"
    assert _one(timer, "Install", "WantedBy") == "timers.target"
    calendar = _one(timer, "Timer", "OnCalendar")
    if shutil.which("systemd-analyze"):
        normalized = subprocess.run(["systemd-analyze", "calendar", calendar], capture_output=True, text=True)
        assert normalized.returncode == 0, normalized.stderr
        assert "Normalized form: *-*-* *:*:00" in normalized.stdout  # every minute, at :00
    else:
        assert calendar == "*-*-* *:*:00"
    assert "enable --now hpc-bridge-check@default.timer" in result.stdout
    assert not (site.user_units / "hpc-bridge@default.service").exists()

    # The daemon as well: said to be one too many.
    assert site.run("systemd").returncode == 0
    both = site.run("systemd", "--timer")
    assert f"{site.user_units / 'hpc-bridge@default.service'} is installed too" in both.stdout


def test_system_unit_runs_as_the_owner_and_is_sandboxed(site: Site) -> None:
    user = require_other_user("setup.sh")
    owner = pwd.getpwnam(user)
    os.chown(site.credentials, owner.pw_uid, owner.pw_gid)
    result = site.run("systemd", "--system", "--print")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# /etc/systemd/system/hpc-bridge@default.service\n")
    unit = _unit(result.stdout)
    assert _one(unit, "Service", "User") == user
    assert _one(unit, "Service", "Group") == grp.getgrgid(owner.pw_gid).gr_name
    assert _one(unit, "Service", "ProtectSystem") == "full"
    assert _one(unit, "Service", "PrivateTmp") == "yes"
    assert _one(unit, "Service", "NoNewPrivileges") == "yes"
    # spool, run_check's log folder and HPC_LOG_FILE's folder: what the bridge writes.
    writable = _one(unit, "Service", "ReadWritePaths").split()
    assert {f"-{site.spool}", f"-{site.state()}", f"-{site.logs}"} <= set(writable)
    assert _one(unit, "Service", "Type") == "notify"
    assert _one(unit, "Service", "ExecStart").endswith(f" --instance default --credentials {site.credentials} run")
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "network-online.target" in _one(unit, "Unit", "After")
    assert "sudo" not in result.stdout
    assert "systemctl daemon-reload && systemctl enable --now hpc-bridge@default.service" in result.stderr

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
    (system / "hpc-bridge@default.service").write_text(site.run("systemd", "--system", "--print").stdout)
    user_names = ["hpc-bridge@default.service", "hpc-bridge-check@default.service", "hpc-bridge-check@default.timer"]
    for folder, names in ((site.user_units, user_names), (system, ["hpc-bridge@default.service"])):
        result = subprocess.run(
            ["systemd-analyze", "verify", *names], cwd=folder, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        complaints = [ln for ln in (result.stdout + result.stderr).splitlines() if "hpc-bridge" in ln]
        assert not complaints, complaints


@pytest.mark.parametrize("installed", [["systemd"], ["systemd", "systemd --timer"]])
def test_systemd_remove_deletes_the_instances_units_and_says_what_to_run(
    site: Site, broker_url: str, queues: Queues, installed: list[str]
) -> None:
    _second_instance(site, broker_url, queues)
    assert site.run("systemd", instance="sge").returncode == 0
    theirs = site.user_units / "hpc-bridge@sge.service"
    before = theirs.read_text()
    for args in installed:
        assert site.run(*args.split()).returncode == 0
    present = sorted(p.name for p in site.user_units.iterdir() if "@default." in p.name)
    assert present

    removed = site.run("systemd", "--remove")
    assert removed.returncode == 0, removed.stderr
    said = removed.stdout.splitlines()
    for name in present:
        assert f"deleted {site.user_units / name}" in said
    # No user manager here (this environment has none, nor a bus): the command to run is said instead.
    started = [n for n in present if n != "hpc-bridge-check@default.service"]  # the timer starts that one
    for name in started:
        assert any(line.startswith(f"could not run `systemctl --user disable --now {name}` here") for line in said), (
            said
        )
    assert not any("disable --now hpc-bridge-check@default.service" in line for line in said)
    assert any(line.startswith("could not run `systemctl --user daemon-reload` here") for line in said), said
    assert sorted(p.name for p in site.user_units.iterdir()) == ["hpc-bridge@sge.service"]
    assert theirs.read_text() == before, "another instance's unit is left alone"

    again = site.run("systemd", "--remove")
    assert again.returncode == 0, again.stderr
    assert "systemctl" not in again.stdout and "deleted" not in again.stdout
    assert f"{site.user_units / 'hpc-bridge@default.service'}: not there (unchanged)" in again.stdout


# --- logrotate -------------------------------------------------------------------------------------


def _logrotate() -> str:
    found = shutil.which("logrotate") or ("/usr/sbin/logrotate" if Path("/usr/sbin/logrotate").exists() else None)
    assert found is not None, "logrotate is missing: deploy/dev/setup.sh installs it"
    return found


def test_logrotate_conf_and_its_daily_line_rotate_privately(site: Site) -> None:
    logrotate = _logrotate()
    result = site.run("logrotate")
    assert result.returncode == 0, result.stderr
    conf = site.settings() / "logrotate.conf"
    state = site.settings() / "logrotate.state"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    run_check_log = site.state() / "run_check.log"
    bridge_log = site.logs / "bridge.log"
    assert re.search(rf"^{re.escape(str(run_check_log))}\n{re.escape(str(bridge_log))}\n{{", text, re.M)
    for directive in ("rotate 14", "compress", "delaycompress", "missingok", "notifempty"):
        assert re.search(rf"^\s+{directive}$", text, re.M), directive
    assert not re.search(r"^\s+copytruncate$", text, re.M)  # renamed, not copied: hpc-bridge reopens it
    assert re.search(r"^\s+create 0600$", text, re.M) and not re.search(r"^\s+su ", text, re.M)
    assert list(_blocks(site.table())) == ["hpc-bridge/default logrotate"]
    [entry] = entries(site.table())
    fields = entry.split(None, 5)
    assert fields[:5] == ["17", "3", "*", "*", "*"]
    assert shlex.split(fields[5]) == [logrotate, "-s", str(state), str(conf)]

    run_check_log.parent.mkdir(mode=0o700, parents=True)  # run_check made it
    run_check_log.write_text('{"event": "check_start"}\n')
    run_check_log.chmod(0o600)
    dry = subprocess.run([logrotate, "-d", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert dry.returncode == 0 and "error" not in (dry.stdout + dry.stderr).lower(), dry.stderr
    daily = subprocess.run(shlex.split(fields[5]), env=_cron_env(site), capture_output=True, text=True)
    assert daily.returncode == 0, daily.stderr  # the crontab's command as written
    forced = subprocess.run([logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    rotated = run_check_log.with_name("run_check.log.1")
    assert rotated.read_text() == '{"event": "check_start"}\n'  # delaycompress: newest copy stays plain
    assert stat.S_IMODE(rotated.stat().st_mode) == 0o600
    assert run_check_log.stat().st_size == 0 and stat.S_IMODE(run_check_log.stat().st_mode) == 0o600  # create 0600

    assert "unchanged" in site.run("logrotate").stdout

    # --remove: the block, the configuration and logrotate's state; the logs stay.
    removed = site.run("logrotate", "--remove")
    assert removed.returncode == 0, removed.stderr
    assert "removed the logrotate block" in removed.stdout
    assert f"deleted {conf}" in removed.stdout and f"deleted {state}" in removed.stdout
    assert site.table() == "" and not conf.exists() and not state.exists()
    assert rotated.exists() and run_check_log.exists()


def test_system_logrotate_file_rotates_as_the_owner(site: Site, broker_url: str, queues: Queues) -> None:
    logrotate = _logrotate()
    user = require_other_user("setup.sh")
    owner = pwd.getpwnam(user)
    # Settings and logs that belong to that account, where it can reach them (not under root's private tmp).
    root = Path(tempfile.mkdtemp(prefix="hpc-bridge-install-"))
    try:
        settings = root / "settings"
        logs = root / "logs"
        settings.mkdir()
        logs.mkdir()
        credentials = _private(settings / "credentials.env", _settings(broker_url, queues, site.spool, logs))
        (logs / "run_check.log").write_text('{"event": "run_check_done"}\n')
        (logs / "bridge.log").write_text("")
        for path in (root, *root.rglob("*")):
            os.chown(path, owner.pw_uid, owner.pw_gid)
            path.chmod(0o600 if path.is_file() else 0o700)

        run_check_log = logs / "run_check.log"
        result = site.run(
            "logrotate", "--system", "--print", credentials=credentials, HPC_BRIDGE_LOG=str(run_check_log)
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("# /etc/logrotate.d/hpc-bridge-default\n")
        assert re.search(
            rf"^{re.escape(str(run_check_log))}\n{re.escape(str(logs / 'bridge.log'))}\n{{", result.stdout, re.M
        )
        group = grp.getgrgid(owner.pw_gid).gr_name
        assert re.search(rf"^\s+su {user} {group}$", result.stdout, re.M)
        assert site.calls() == []  # a system file needs no crontab line

        # As the system's logrotate runs it: root, switching to the owner for these logs.
        conf = site.tables / "hpc-bridge-default.logrotate"
        conf.write_text(result.stdout)
        state = site.tables / "logrotate.state"
        forced = subprocess.run([logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True)
        assert forced.returncode == 0, forced.stderr
        rotated = logs / "run_check.log.1"
        assert rotated.read_text() == '{"event": "run_check_done"}\n'
        assert rotated.stat().st_uid == owner.pw_uid and stat.S_IMODE(rotated.stat().st_mode) == 0o600
        assert run_check_log.stat().st_size == 0
    finally:
        shutil.rmtree(root)


# --- scrontab --------------------------------------------------------------------------------------


def test_scrontab_entry_carries_its_slurm_options(site: Site, broker_url: str, queues: Queues) -> None:
    charged = _private(
        site.home / "charged.env", _settings(broker_url, queues, site.spool, site.logs, HPC_SLURM_ACCOUNT="def-lab")
    )
    result = site.run("scrontab", credentials=charged)
    assert result.returncode == 0, result.stderr
    table = site.table("scrontab")
    assert list(_blocks(table)) == ["hpc-bridge/default scrontab"]
    lines = table.splitlines()
    [entry] = entries(table)
    assert entry.split(None, 5)[:5] == ["*"] * 5
    assert shlex.split(_command(entry)) == [f"HPC_BRIDGE_CREDENTIALS={charged}", str(RUN_CHECK)]
    # #SCRON options apply to the next line: they stand right above the entry.
    at = lines.index(entry)
    options = []
    for line in reversed(lines[:at]):
        if not line.startswith("#SCRON "):
            break
        options.append(line.removeprefix("#SCRON "))
    assert "--account=def-lab" in options and "--job-name=hpc-bridge-check" in options
    assert f"--output={site.state() / 'scrontab.out'}" in options  # next to run_check's log
    assert any(o.startswith("--time=") for o in options)
    assert site.calls("crontab") == []  # scrontab only
    assert "unchanged" in site.run("scrontab", credentials=charged).stdout
    removed = site.run("scrontab", "--remove")
    assert removed.returncode == 0 and "removed the scrontab block" in removed.stdout
    assert site.table("scrontab") == ""


# --- instances: two bridges under one account ----------------------------------------------------------


def test_two_instances_on_one_account_keep_their_own_blocks_units_and_files(
    site: Site, broker_url: str, queues: Queues
) -> None:
    sge = _second_instance(site, broker_url, queues, HPC_SCHEDULER="gridengine", RABBITMQ_URL="amqp://127.0.0.1:9/%2F")
    for target in ("cron", "logrotate", "systemd"):
        assert site.run(target).returncode == 0
    for target in ("cron", "systemd"):
        result = site.run(target, instance="sge")
        assert result.returncode == 0, result.stderr
    by_env = site.run("logrotate", HPC_BRIDGE_INSTANCE="sge")  # the environment names it as well
    assert by_env.returncode == 0, by_env.stderr

    table = site.table()
    blocks = _blocks(table)
    assert sorted(blocks) == [
        "hpc-bridge/default cron",
        "hpc-bridge/default logrotate",
        "hpc-bridge/sge cron",
        "hpc-bridge/sge logrotate",
    ]
    assert "`hpc-bridge --instance sge install cron`" in table  # how to rewrite the block
    # Each line carries what its instance needs, nothing more.
    [default_cron] = entries(blocks["hpc-bridge/default cron"])
    [sge_cron] = entries(blocks["hpc-bridge/sge cron"])
    assert shlex.split(_command(default_cron)) == [str(RUN_CHECK)]
    assert shlex.split(_command(sge_cron)) == ["HPC_BRIDGE_INSTANCE=sge", str(RUN_CHECK)]
    [default_rotate] = entries(blocks["hpc-bridge/default logrotate"])
    [sge_rotate] = entries(blocks["hpc-bridge/sge logrotate"])
    sge_state, sge_conf_path = site.settings("sge") / "logrotate.state", site.settings("sge") / "logrotate.conf"
    assert shlex.split(_command(sge_rotate))[1:] == ["-s", str(sge_state), str(sge_conf_path)]
    assert str(site.settings("default") / "logrotate.conf") in default_rotate
    # The logrotate files name each instance's own logs.
    default_conf = (site.settings() / "logrotate.conf").read_text()
    sge_conf = (site.settings("sge") / "logrotate.conf").read_text()
    assert str(site.state("sge") / "run_check.log") in sge_conf and str(site.home / "logs-sge") in sge_conf
    assert str(site.state() / "run_check.log") in default_conf and "-sge" not in default_conf
    # Distinct unit files, each with its instance and settings.
    daemons = {p.name: _unit(p.read_text()) for p in site.user_units.iterdir()}
    assert sorted(daemons) == ["hpc-bridge@default.service", "hpc-bridge@sge.service"]
    sge_unit = daemons["hpc-bridge@sge.service"]
    assert _one(sge_unit, "Service", "ExecStart") == f"{HPC_BRIDGE} --instance sge --credentials {sge} run"
    assert _one(sge_unit, "Service", "WorkingDirectory") == str(site.settings("sge"))
    assert scheduler_class("gridengine").display_name in _one(sge_unit, "Unit", "Description")
    default_exec = _one(daemons["hpc-bridge@default.service"], "Service", "ExecStart")
    assert default_exec == f"{HPC_BRIDGE} --instance default --credentials {site.credentials} run"

    # Run again: each instance leaves the other's alone.
    assert all("unchanged" in site.run(t).stdout for t in ("cron", "logrotate"))
    assert "unchanged" in site.run("cron", instance="sge").stdout
    assert site.table() == table

    # The sge line runs the sge instance: its settings (a broker that is not there), its log.
    ran = _as_cron(site, _command(sge_cron))
    assert ran.returncode == 1 and "exit status 1" in ran.stderr
    assert _events(site.state("sge") / "run_check.log")[-1]["exit_status"] == 1
    assert '"event": "broker_unavailable"' in (site.home / "logs-sge" / "bridge.log").read_text()
    assert not site.state().exists(), "the default instance's state is not touched"

    # Removing the second instance's blocks leaves the first one's exactly as they were.
    removed = site.run("cron", "--remove", instance="sge")
    assert removed.returncode == 0 and "removed the cron block" in removed.stdout
    assert site.run("logrotate", "--remove", instance="sge").returncode == 0
    left = site.table()
    assert sorted(_blocks(left)) == ["hpc-bridge/default cron", "hpc-bridge/default logrotate"]
    assert _blocks(left)["hpc-bridge/default cron"] == blocks["hpc-bridge/default cron"]
    assert _blocks(left)["hpc-bridge/default logrotate"] == blocks["hpc-bridge/default logrotate"]
    assert not (site.settings("sge") / "logrotate.conf").exists()
    assert (site.settings() / "logrotate.conf").read_text() == default_conf
    assert sge.exists(), "--remove never deletes the settings"


# --- what cannot be installed ------------------------------------------------------------------------


def test_paths_that_cannot_be_written_plainly_are_refused(site: Site, tmp_path: Path) -> None:
    spaced = _private(tmp_path / "my settings" / "credentials.env", site.credentials.read_text())
    result = site.run("cron", "--print", credentials=spaced)
    assert result.returncode == 2 and "cannot carry safely" in result.stderr
    assert result.stdout == ""
    assert site.calls() == []


def test_an_hpc_bridge_without_its_run_check_beside_it_is_refused(site: Site, tmp_path: Path) -> None:
    lonely = tmp_path / "lonely" / "bin"
    lonely.mkdir(parents=True)
    (lonely / "hpc-bridge").symlink_to(HPC_BRIDGE)
    missing = site.run("cron", HPC_BRIDGE_EXE=str(lonely / "hpc-bridge"))
    assert missing.returncode == 2
    assert f"no hpc-bridge-run-check beside {lonely / 'hpc-bridge'}" in missing.stderr
    assert site.calls() == []

    # With it beside, the line runs that one (through the link, which finds its hpc-bridge beside it).
    (lonely / "hpc-bridge-run-check").symlink_to(RUN_CHECK)
    found = site.run("cron", "--print", HPC_BRIDGE_EXE=str(lonely / "hpc-bridge"))
    assert found.returncode == 0, found.stderr
    assert [_command(e) for e in entries(found.stdout)] == [str(lonely / "hpc-bridge-run-check")]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["cron", "--system"], "--system is for systemd and logrotate"),
        (["cron", "--timer"], "--timer is for systemd"),
        (["scrontab", "--system"], "--system is for systemd and logrotate"),
        (["cron", "--remove", "--print"], "use one of them"),
    ],
)
def test_options_that_do_not_apply_are_refused(site: Site, args: list[str], says: str) -> None:
    result = site.run(*args)
    assert result.returncode == 2 and says in result.stderr
    assert site.calls() == []


def test_an_unusable_instance_name_is_refused(site: Site) -> None:
    for name in ("Bad Name", "../up", "-x"):
        result = site.run("cron", "--print", HPC_BRIDGE_INSTANCE=name)
        assert result.returncode == 2 and "not usable" in result.stderr, (name, result.stderr)
    assert site.calls() == []


def test_settings_from_the_environment_only_are_refused(site: Site, broker_url: str) -> None:
    site.credentials.unlink()  # no file anywhere: the instance's is gone, none in the current directory
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
    [entry] = entries(cron.stdout)
    assert shlex.split(_command(entry)) == [f"PATH={sched}:/usr/local/bin:/usr/bin:/bin", str(RUN_CHECK)]
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
    (units / "hpc-bridge@default.service").write_text("[Service]\n")
    off = check_linger(config_home, linger)
    assert off.status == "warn" and "lingering is off" in off.found and "hpc-bridge@default.service" in off.found
    assert f"loginctl enable-linger {me}" in off.fix
    (linger / me).touch()
    assert check_linger(config_home, linger).status == "ok"


def test_doctor_warns_when_install_wrote_a_user_unit_and_lingering_is_not_on(site: Site) -> None:
    if Path("/var/lib/systemd/linger", pwd.getpwuid(os.getuid()).pw_name).exists():
        pytest.skip("lingering is on for this account on this machine")
    assert site.run("systemd").returncode == 0
    result = subprocess.run(
        [str(HPC_BRIDGE), "doctor", "--json", "--skip-worker"],  # the instance's settings, found by themselves
        env=site.env(),
        cwd=site.home,
        capture_output=True,
        text=True,
        timeout=240,
    )
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    linger = checks["systemd-linger"]
    assert linger["status"] == "warn", linger
    assert "hpc-bridge@default.service" in linger["found"] and "enable-linger" in linger["fix"]


# --- the templates and run_check ship with the package ------------------------------------------------


def test_the_templates_and_run_check_ship_in_the_wheel(tmp_path: Path) -> None:
    """A non-editable install (the operator guide's, no checkout) must find every template, run_check.sh
    and the hpc-bridge-run-check entry point."""
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
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    for template in sorted(TEMPLATES.iterdir()):
        assert f"bridge/ops/templates/{template.name}" in names, f"{template.name} is not in the wheel"
    assert "bridge/ops/run_check.sh" in names and "bridge/ops/run_check.py" in names
    assert archive.read("bridge/ops/run_check.sh") == (REPO / "bridge" / "ops" / "run_check.sh").read_bytes()
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = configparser.ConfigParser()
    scripts.read_string(archive.read(entry_points).decode())
    assert scripts["console_scripts"]["hpc-bridge-run-check"].strip() == "bridge.ops.run_check:main"
    assert scripts["console_scripts"]["hpc-bridge"].strip() == "bridge.cli:main"

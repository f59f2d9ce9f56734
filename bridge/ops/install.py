"""``hpc-bridge install cron|systemd|logrotate|scrontab``: run the bridge on a schedule, with this
installation's real paths; ``--remove`` takes it out again.

The files come from the templates in ``bridge/ops/templates/`` (``deploy/systemd/``,
``deploy/cron/`` and ``deploy/logrotate/`` link to them): ``string.Template`` placeholders filled
in with the paths of the installation that runs the command: the ``hpc-bridge`` executable in
use and the ``hpc-bridge-run-check`` beside it, the credentials file in use, the logs, spool and
run directories of its configuration, and what the scheduler's commands need from the
environment (their directory on ``PATH``, Grid Engine's ``SGE_*``). Everything is keyed by the
instance (bridge/instance.py), so two instances under one account never overwrite each other.

- ``cron``: one pass a minute through ``hpc-bridge-run-check``, as a block between marker comments
  (``# BEGIN hpc-bridge/NAME cron``) in the user's crontab (``crontab -l``/``crontab FILE``),
  replaced in place when run again.
- ``systemd``: the daemon (``hpc-bridge@NAME.service``, ``Type=notify`` with a watchdog), or with
  ``--timer`` one pass a minute (``hpc-bridge-check@NAME.service`` + ``.timer``); user units in
  ``~/.config/systemd/user`` or, with ``--system``, sandboxed system units in
  ``/etc/systemd/system`` that run as the install's owner.
- ``logrotate``: ``~/.config/hpc-bridge/NAME/logrotate.conf`` and a daily crontab block that runs
  it with a state file of its own (no root), or with ``--system`` ``/etc/logrotate.d/hpc-bridge-NAME``.
- ``scrontab``: the cron line as a Slurm ``scrontab`` entry, for sites that forbid cron on
  login nodes.

Nothing is enabled behind the operator's back: files are written (``--print`` only shows them)
and the one command that enables them is printed. Everything is idempotent.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from bridge.atomic import atomic_file
from bridge.config import BridgeConfig
from bridge.instance import DEFAULT_INSTANCE, INSTANCE_ENV, Instance
from bridge.schedulers import scheduler_class
from bridge.shell import CommandError, CommandNotFound, CommandResult, run_command

EPILOG = """Without --print the files are written where they belong and the command that enables
them is printed; nothing is enabled behind your back. Run it again after moving the install or
changing the credentials file: it rewrites the files (and its crontab block) in place.

examples:
  hpc-bridge install cron                    # one pass a minute from your crontab (hpc-bridge-run-check)
  hpc-bridge install logrotate               # rotate the logs daily (no root needed)
  hpc-bridge install systemd                 # the daemon as a systemd user unit
  hpc-bridge install systemd --timer --print # show the one-pass-a-minute timer units, write nothing
  hpc-bridge install systemd --system --print | sudo tee /etc/systemd/system/hpc-bridge@default.service
  hpc-bridge --instance sge install cron     # a second bridge (another cluster or Rodan) beside the first
  hpc-bridge install cron --remove           # take it out again (hpc-bridge uninstall: everything)
  hpc-bridge install scrontab                # Slurm sites without cron on the login node
"""

TARGETS = ("cron", "systemd", "logrotate", "scrontab")
#: The watchdog the daemon's unit sets. The daemon pings from its loop at least every half of it;
#: a pass may block on a scheduler command (HPC_SCHEDULER_TIMEOUT) or on Rodan for minutes.
WATCHDOG = "3min"
#: Directories every PATH here has (cron's /usr/bin:/bin, run_check's /usr/local/bin, systemd's).
BASE_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
#: Paths and values written into units, crontabs and logrotate files without any quoting.
SAFE = re.compile(r"[A-Za-z0-9._/+,@=:~-]+")
LINGER_DIR = Path("/var/lib/systemd/linger")
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
#: The package's crontab entry (bridge/ops/run_check.py), installed beside ``hpc-bridge``.
RUN_CHECK = "hpc-bridge-run-check"
#: The crontab marker of an installation from before instances: the default instance's blocks.
LEGACY_MARK = "hpc-bridge"


class InstallError(Exception):
    """Why the files cannot be rendered or installed; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --- where this installation is ---------------------------------------------------------------


@dataclass(frozen=True)
class Installation:
    """The real paths the rendered files name."""

    home: Path  # where a pass runs (relative settings are relative to it): the credentials file's folder
    run_check: Path  # the package's hpc-bridge-run-check
    hpc_bridge: Path
    credentials: Path
    run_check_log: Path
    config: BridgeConfig
    user: str
    instance: Instance
    environment: tuple[tuple[str, str], ...] = ()  # what the scheduler's commands need
    cron_variables: tuple[tuple[str, str], ...] = field(default=())  # run_check's overrides

    @property
    def user_unit_dir(self) -> Path:
        return self.instance.config_home / "systemd" / "user"

    @property
    def logrotate_conf(self) -> Path:
        return self.instance.logrotate_conf

    @property
    def logrotate_state(self) -> Path:
        return self.instance.logrotate_state

    def at_home(self, path: Path) -> Path:
        """``path`` as the bridge sees it: cron (run_check) and systemd start it in ``home``."""
        return path if path.is_absolute() else self.home / path

    @property
    def logs(self) -> list[Path]:
        logs = [self.run_check_log]
        if self.config.log_file is not None and self.at_home(self.config.log_file) != self.run_check_log:
            logs.append(self.at_home(self.config.log_file))
        return logs

    @property
    def writable(self) -> list[Path]:
        """What the daemon writes: spool, runs, logs, metrics (for a sandboxed system unit)."""
        config = self.config
        paths = [self.at_home(config.spool_dir)]
        if config.runs_dir is not None:
            paths.append(self.at_home(config.runs_dir))
        paths.extend(log.parent for log in self.logs)
        if config.metrics_file is not None:
            paths.append(self.at_home(config.metrics_file).parent)
        unique: list[Path] = []
        for path in paths:
            if path not in unique:
                unique.append(path)
        return unique


def locate(
    config: BridgeConfig, environ: Mapping[str, str] | None = None, *, require_run_check: bool = True
) -> Installation:
    """This installation, as the process running ``hpc-bridge install`` sees it (``require_run_check``:
    refuse one without ``hpc-bridge-run-check``, which the crontab line runs)."""
    env = dict(os.environ if environ is None else environ)
    if config.credentials_file is None:
        raise InstallError(
            "install needs a credentials file (the settings came from the environment only, which cron "
            "and systemd do not give): pass --credentials FILE, or put it in ~/.config/hpc-bridge/INSTANCE/",
            2,
        )
    instance = Instance.from_environment(config.instance, env)
    credentials = config.credentials_file.absolute()
    home = Path(env["HPC_BRIDGE_HOME"]).expanduser().absolute() if env.get("HPC_BRIDGE_HOME") else credentials.parent
    hpc_bridge = _executable(env)
    run_check = hpc_bridge.parent / RUN_CHECK
    if require_run_check and not (run_check.is_file() and os.access(run_check, os.X_OK)):
        raise InstallError(
            f"no {RUN_CHECK} beside {hpc_bridge}: install the package into that environment again "
            "(pip install hpc-bridge, or the wheel), which creates it",
            2,
        )
    log = Path(env["HPC_BRIDGE_LOG"]).expanduser().absolute() if env.get("HPC_BRIDGE_LOG") else None
    account = pwd.getpwuid(os.getuid())

    cron: list[tuple[str, str]] = []  # what run_check would not find by itself (cron gives HOME only)
    if not instance.is_default:
        cron.append((INSTANCE_ENV, instance.name))
    for name, default in (("XDG_CONFIG_HOME", ".config"), ("XDG_STATE_HOME", ".local/state")):
        if env.get(name) and Path(env[name]).absolute() != instance.home / default:
            cron.append((name, str(Path(env[name]).absolute())))
    if not _same(instance.credentials, credentials):
        cron.append(("HPC_BRIDGE_CREDENTIALS", str(credentials)))
    if home != credentials.parent:
        cron.append(("HPC_BRIDGE_HOME", str(home)))
    if log is not None:
        cron.append(("HPC_BRIDGE_LOG", str(log)))
    installation = Installation(
        home=home,
        run_check=run_check,
        hpc_bridge=hpc_bridge,
        credentials=credentials,
        run_check_log=log or instance.run_check_log,
        config=config,
        user=account.pw_name,
        instance=instance,
        environment=tuple(scheduler_environment(config.scheduler, env)),
        cron_variables=tuple(cron),
    )
    for path in [
        installation.home,
        installation.hpc_bridge,
        installation.credentials,
        *installation.logs,
        *installation.writable,
        instance.config_home,
        run_check,
    ]:
        safe(str(path), "path")
    for name, value in installation.environment:
        safe(value, name)
    return installation


def _executable(env: Mapping[str, str]) -> Path:
    """The ``hpc-bridge`` to run: HPC_BRIDGE_EXE, this environment's, else the one on PATH."""
    if env.get("HPC_BRIDGE_EXE"):
        candidates = [Path(env["HPC_BRIDGE_EXE"]).expanduser()]
    else:
        candidates = [Path(sys.prefix) / "bin" / "hpc-bridge"]
        found = shutil.which("hpc-bridge", path=env.get("PATH"))
        if found:
            candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()
    raise InstallError(
        f"no hpc-bridge executable found (looked at {', '.join(map(str, candidates))}): "
        "run install with the hpc-bridge of the install, or set HPC_BRIDGE_EXE",
        2,
    )


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def safe(value: str, what: str) -> str:
    """``value`` if it can be written into a unit, crontab or logrotate file without quoting."""
    if not SAFE.fullmatch(value):
        raise InstallError(
            f"{what} {value!r} holds characters (spaces, quotes, $, %, ...) that the rendered files cannot "
            "carry safely: move the install to a plainer path, or write the files by hand from deploy/",
            2,
        )
    return value


def scheduler_environment(scheduler: str, env: Mapping[str, str]) -> list[tuple[str, str]]:
    """What the scheduler's commands need that cron's and systemd's bare environments lack."""
    needed: list[tuple[str, str]] = []
    backend = scheduler_class(scheduler)
    found = shutil.which(backend.commands[0], path=env.get("PATH"))  # where its commands live
    if found and str(Path(found).parent) not in BASE_PATH:
        needed.append(("PATH", ":".join([str(Path(found).parent), *BASE_PATH])))
    needed.extend((name, env[name]) for name in backend.command_environment if env.get(name))
    return needed


# --- rendering ------------------------------------------------------------------------------------


def template(name: str) -> str:
    return resources.files("bridge.ops").joinpath(f"templates/{name}").read_text()


def render(name: str, values: Mapping[str, str]) -> str:
    """Template ``name`` with ``values``; a line that is only a placeholder whose value is empty goes."""
    lines = []
    for line in template(name).splitlines():
        match = re.fullmatch(r"\$\{(\w+)\}", line.strip())
        if match and not values[match.group(1)]:
            continue
        lines.append(Template(line).substitute(values))
    return "\n".join(lines) + "\n"


def _header(path: Path, command: str, note: str = "") -> str:
    lines = [
        f"# {path}",
        f"# Written by `{command}` for this installation; run it again to rewrite this file.",
    ]
    if note:
        lines.append(f"# {note}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Output:
    """A file to write (``path``), or a block of a crontab (``table`` is ``crontab``/``scrontab``)."""

    path: Path | None
    text: str
    mode: int = 0o644
    table: str = ""
    block: str = ""
    marks: tuple[str, ...] = (LEGACY_MARK,)  # the block's marker owner; the first is written (block_marks)


def block_marks(instance: Instance) -> tuple[str, ...]:
    """The marker owners of ``instance``'s crontab blocks: ``hpc-bridge/NAME``; the default instance
    also takes over a block written before instances existed (``# BEGIN hpc-bridge cron``)."""
    return (instance.mark, LEGACY_MARK) if instance.is_default else (instance.mark,)


def cron_command(inst: Installation) -> str:
    """The crontab line's command: run_check, with the locations it would not find by itself."""
    variables = [*inst.cron_variables, *inst.environment]
    return " ".join([*(f"{name}={value}" for name, value in variables), str(inst.run_check)])


def render_cron(inst: Installation) -> Output:
    text = render("crontab", {"command": cron_command(inst)})
    return Output(None, text, table="crontab", block="cron", marks=block_marks(inst.instance))


def render_scrontab(inst: Installation) -> Output:
    options = []
    for setting, option in (("HPC_SLURM_ACCOUNT", "--account"), ("HPC_SLURM_QOS", "--qos")):
        if inst.config.site_option(setting):
            options.append(f"#SCRON {option}={safe(inst.config.site_option(setting), setting)}")
    values = {
        "command": cron_command(inst),
        "output": str(inst.run_check_log.parent / "scrontab.out"),
        "options": "\n".join(options),
    }
    text = render("scrontab", values)
    return Output(None, text, table="scrontab", block="scrontab", marks=block_marks(inst.instance))


def logrotate_program() -> str:
    found = shutil.which("logrotate") or next(
        (p for p in ("/usr/sbin/logrotate", "/sbin/logrotate") if os.access(p, os.X_OK)), None
    )
    return found or "/usr/sbin/logrotate"


def render_logrotate(inst: Installation, *, system: bool) -> list[Output]:
    command = "hpc-bridge install logrotate" + (" --system" if system else "")
    su = ""
    if system:
        user = system_account(inst)
        su = f"    su {user} {grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name}"
    values = {"logs": "\n".join(str(p) for p in inst.logs), "su": su}
    if system:
        path = inst.instance.system_logrotate
        return [Output(path, _header(path, command) + render("logrotate", values), 0o644)]
    conf = inst.logrotate_conf
    line = render("crontab-logrotate", {"command": f"{logrotate_program()} -s {inst.logrotate_state} {conf}"})
    return [
        Output(conf, _header(conf, command) + render("logrotate", values), 0o600),
        Output(None, line, table="crontab", block="logrotate", marks=block_marks(inst.instance)),
    ]


def render_systemd(inst: Installation, *, system: bool, timer: bool) -> list[Output]:
    command = "hpc-bridge install systemd" + (" --system" if system else "") + (" --timer" if timer else "")
    docs = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "README.md"  # in a checkout only
    environment = [f"Environment={name}={value}" for name, value in inst.environment]
    if system:
        user = system_account(inst)
        account = f"User={user}\nGroup={grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name}"
        sandbox = "\n".join(
            [
                "# A system unit can sandbox the filesystem: /usr, /boot and /etc read-only, a /tmp",
                "# of its own, and the folders it writes (spool, runs, logs; '-': may not exist yet).",
                "ProtectSystem=full",
                "PrivateTmp=yes",
                "ReadWritePaths=" + " ".join(f"-{p}" for p in inst.writable),
            ]
        )
        ordering = "After=network-online.target\nWants=network-online.target"
        wanted_by = "multi-user.target"
        directory = SYSTEM_UNIT_DIR
    else:
        account = ""
        sandbox = "\n".join(
            [
                "# Not set in a user unit: PrivateTmp=, ProtectSystem=, ProtectHome= and the like need",
                "# unprivileged user namespaces there (often disabled on login nodes: the unit would not",
                "# start). `hpc-bridge install systemd --system` writes a sandboxed system unit.",
            ]
        )
        ordering = ""
        wanted_by = "default.target"
        directory = inst.user_unit_dir
    values = {
        "scheduler": inst.config.backend.display_name,
        "documentation": f"Documentation=file://{docs}" if docs.is_file() else "",
        "ordering": ordering,
        "watchdog": WATCHDOG,
        "account": account,
        "home": str(inst.home),
        "hpc_bridge": str(inst.hpc_bridge),
        "credentials": str(inst.credentials),
        "instance": inst.instance.name,
        "check_service": inst.instance.check_service,
        "environment": "\n".join(environment),
        "sandbox": sandbox,
        "wanted_by": wanted_by,
    }
    edit = "systemctl edit" if system else "systemctl --user edit"
    outputs = []
    for template_name, name in unit_files(inst.instance, timer=timer):
        note = f"Site additions (PATH, SSL_CERT_FILE) go in a drop-in, which survives that: {edit} {name}"
        header = _header(directory / name, command, note if name.endswith(".service") else "")
        outputs.append(Output(directory / name, header + render(template_name, values), 0o644))
    return outputs


def unit_files(instance: Instance, *, timer: bool) -> list[tuple[str, str]]:
    """(template, unit file name) of the daemon, or of the one-pass timer and its service."""
    if timer:
        return [("hpc-bridge-check.service", instance.check_service), ("hpc-bridge-check.timer", instance.check_timer)]
    return [("hpc-bridge.service", instance.daemon_unit)]


def system_account(inst: Installation) -> str:
    """Who a system unit runs as: the install's owner, never root."""
    if os.getuid() != 0:
        return inst.user
    owner = inst.credentials.stat().st_uid
    if owner == 0:
        raise InstallError(
            f"{inst.credentials} belongs to root, and the bridge never runs as root: chown the install to the "
            "account it runs as and run this command as that account (with --print, then sudo tee)",
            2,
        )
    return pwd.getpwuid(owner).pw_name


# --- crontab blocks ---------------------------------------------------------------------------------


def begin_marker(block: str, mark: str = LEGACY_MARK) -> str:
    return f"# BEGIN {mark} {block}"


def end_marker(block: str, mark: str = LEGACY_MARK) -> str:
    return f"# END {mark} {block}"


def framed(block: str, body: str, mark: str = LEGACY_MARK) -> str:
    command = {"cron": "install cron", "logrotate": "install logrotate", "scrontab": "install scrontab"}[block]
    instance = mark.partition("/")[2]
    if instance and instance != DEFAULT_INSTANCE:
        command = f"--instance {instance} {command}"
    return (
        f"{begin_marker(block, mark)}: written by `hpc-bridge {command}` (run it again to rewrite this block, "
        f"with --remove to take it out)\n{body}{end_marker(block, mark)}\n"
    )


def replace_block(table: str, block: str, text: str | None, marks: tuple[str, ...] = (LEGACY_MARK,)) -> str:
    """``table`` with the lines between ``block``'s markers replaced by ``text`` (None: removed).

    The block keeps its place; a new one goes at the end. ``marks``: the marker owners to look
    for, in order (the first one found is the block; another instance's never matches).
    """
    lines = table.splitlines(keepends=True)
    for mark in marks:
        begin = re.compile(rf"{re.escape(begin_marker(block, mark))}(:|\s*$)")
        end = re.compile(rf"{re.escape(end_marker(block, mark))}\s*$")
        starts = [i for i, line in enumerate(lines) if begin.match(line)]
        if starts:
            break
    if not starts:
        if text is None:
            return table
        prefix = table if not table or table.endswith("\n") else table + "\n"
        return prefix + text
    if len(starts) > 1:
        raise InstallError(f"the table holds '{begin_marker(block, mark)}' {len(starts)} times: keep one (crontab -e)")
    start = starts[0]
    stop = next((i for i in range(start + 1, len(lines)) if end.match(lines[i])), None)
    if stop is None:
        raise InstallError(
            f"the table has '{begin_marker(block, mark)}' without '{end_marker(block, mark)}': fix it (crontab -e)"
        )
    return "".join(lines[:start]) + (text or "") + "".join(lines[stop + 1 :])


Runner = Callable[..., CommandResult]


def read_table(program: str, runner: Runner = run_command) -> str:
    """The user's crontab (``crontab -l``) or scrontab; "" when there is none yet."""
    try:
        result = runner([program, "-l"], timeout=30.0, check=False)
    except CommandNotFound:
        raise InstallError(
            f"{program} is not installed here"
            + (": use `hpc-bridge install systemd --timer`, or scrontab on Slurm" if program == "crontab" else ""),
        ) from None
    if result.returncode == 0:
        return result.stdout
    if re.search(r"no (s?crontab|cron table|entries)", f"{result.stderr} {result.stdout}", re.I):
        return ""
    raise InstallError(f"`{program} -l` failed ({result.returncode}): {(result.stderr or result.stdout).strip()}")


def write_table(program: str, text: str, runner: Runner = run_command) -> None:
    """Install ``text`` as the user's table (``crontab FILE``, which checks every line first)."""
    fd, name = tempfile.mkstemp(prefix="hpc-bridge-", suffix=f".{program}")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        runner([program, name], timeout=30.0)
    except CommandError as exc:
        raise InstallError(f"`{program}` refused the new table: {exc.output or exc.reason}") from None
    finally:
        os.unlink(name)


# --- writing --------------------------------------------------------------------------------------------


def write_file(output: Output) -> bool:
    """Write ``output`` atomically; False when it already held exactly this."""
    path = output.path
    if path is None:
        raise ValueError("a crontab block is not a file")
    try:
        if path.read_text() == output.text and (path.stat().st_mode & 0o777) == output.mode:
            return False
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, output.mode) as handle:
            handle.write(output.text.encode())
    except OSError as exc:
        hint = " (a system file: run it as root, or use --print and sudo tee)" if os.getuid() != 0 else ""
        raise InstallError(f"cannot write {path}: {exc.strerror or exc}{hint}") from None
    return True


def apply_block(
    output: Output, *, remove: bool = False, stray: tuple[str, ...] = (), runner: Runner = run_command
) -> list[str]:
    """Put ``output``'s block in the user's crontab/scrontab (or take it out); what changed, in words.

    A line outside the block that holds ``stray`` (e.g. run_check's path, from a hand-made crontab
    line) is pointed out, not removed: it would run a second pass each minute.
    """
    current = read_table(output.table, runner)
    new = replace_block(
        current, output.block, None if remove else framed(output.block, output.text, output.marks[0]), output.marks
    )
    said: list[str] = []
    if new == current:
        said.append(f"{output.table}: already {'without' if remove else 'holds'} the {output.block} block (unchanged)")
    else:
        write_table(output.table, new, runner)
        before = replace_block(current, output.block, None, output.marks) != current
        verb = "removed the" if remove else ("replaced the" if before else "added the")
        said.append(f"{output.table}: {verb} {output.block} block ({output.table} -l shows it)")
    outside = replace_block(new, output.block, None, output.marks)
    for line in outside.splitlines():
        if any(s in line for s in stray) and not line.lstrip().startswith("#"):
            said.append(f"note: your {output.table} also runs it outside the block, remove that line: {line}")
    return said


# --- lingering (also judged by doctor) --------------------------------------------------------------------


def installed_user_units(config_home: Path | None = None) -> list[Path]:
    """hpc-bridge's unit files in the systemd user directory."""
    base = config_home or (
        Path(os.environ["XDG_CONFIG_HOME"]) if os.environ.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    )
    folder = base / "systemd" / "user"
    return sorted(p for pattern in ("hpc-bridge*.service", "hpc-bridge*.timer") for p in folder.glob(pattern))


def lingering(user: str, linger_dir: Path = LINGER_DIR, runner: Runner = run_command) -> bool | None:
    """Whether ``user``'s systemd user manager keeps running without a login session; None: unknown."""
    if (linger_dir / user).exists():
        return True
    if linger_dir.is_dir():
        return False
    try:
        result = runner(["loginctl", "show-user", user, "--property=Linger", "--value"], timeout=10.0)
    except CommandError:
        return None
    return {"yes": True, "no": False}.get(result.stdout.strip())


# --- the command --------------------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "install",
        help="run the bridge on a schedule: the crontab line, systemd units, logrotate file or scrontab entry, "
        "with this installation's paths",
        description="Render the crontab line, the systemd units, the logrotate file or the scrontab entry with "
        "this installation's real paths, write them where they belong, and print the command that enables them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", choices=TARGETS, help="what to install")
    p.add_argument("--print", action="store_true", dest="print_only", help="print what would be written; write nothing")
    p.add_argument(
        "--system",
        action="store_true",
        help="systemd: system units in /etc/systemd/system (User= the install's owner, sandboxed); "
        "logrotate: /etc/logrotate.d/hpc-bridge (writing needs root)",
    )
    p.add_argument("--timer", action="store_true", help="systemd: one pass a minute from a timer instead of the daemon")
    p.add_argument(
        "--remove",
        action="store_true",
        help="take it out again: the crontab/scrontab block, the logrotate block and file, or the systemd units "
        "(disabled and stopped first)",
    )
    p.set_defaults(operator=run)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    try:
        return install(config, args)
    except InstallError as exc:
        print(f"hpc-bridge install: {exc}", file=sys.stderr)
        return exc.status


def install(config: BridgeConfig, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    target = args.target
    if args.remove and args.print_only:
        raise InstallError("--print shows what would be written, --remove takes a block out: use one of them", 2)
    if args.system and target not in ("systemd", "logrotate"):
        raise InstallError(f"--system is for systemd and logrotate, not {target}", 2)
    if args.timer and target != "systemd":
        raise InstallError("--timer is for systemd", 2)
    inst = locate(config, environ)
    if args.remove:
        _say(remove(inst, target, system=args.system), sys.stdout)
        return 0
    if target == "cron":
        outputs = [render_cron(inst)]
    elif target == "scrontab":
        outputs = [render_scrontab(inst)]
    elif target == "logrotate":
        outputs = render_logrotate(inst, system=args.system)
    else:
        outputs = render_systemd(inst, system=args.system, timer=args.timer)

    if args.print_only:
        for output in outputs:
            text = framed(output.block, output.text, output.marks[0]) if output.table else output.text
            print(text, end="")
            where = f"into your {output.table} (`{output.table} -l`)" if output.table else str(output.path)
            print(f"hpc-bridge install: would write this {where}", file=sys.stderr)
        _say(_enable_hints(inst, args), sys.stderr)
        return 0

    # A hand-made line running this run_check, or an old checkout's deploy/run_check, would be a second pass.
    stray = (str(inst.run_check), "deploy/run_check") if target in ("cron", "scrontab") else ()
    if target == "cron" and inst.instance.is_default:
        _say(legacy_notes(read_table("crontab"), inst), sys.stdout)
    for output in outputs:
        if output.table:
            _say(apply_block(output, stray=stray), sys.stdout)
        elif output.path is not None:
            changed = write_file(output)
            print(f"{'wrote' if changed else 'unchanged'} {output.path}")
    _say(_enable_hints(inst, args), sys.stdout)
    return 0


def remove(inst: Installation, target: str, *, system: bool = False, runner: Runner = run_command) -> list[str]:
    """Take out what ``install TARGET`` wrote for this instance; what was done, in words.

    cron, scrontab: the instance's block. logrotate: its block and its configuration file (with
    ``system``: /etc/logrotate.d/hpc-bridge-NAME). systemd: the instance's units, daemon and timer,
    disabled and stopped first (``systemctl``; where that cannot be done here, the command is
    said), then deleted. Whatever was not there is said so, never an error.
    """
    said: list[str] = []
    if target in ("cron", "scrontab"):
        output = render_cron(inst) if target == "cron" else render_scrontab(inst)
        said += apply_block(output, remove=True, runner=runner)
    elif target == "logrotate":
        files = [inst.instance.system_logrotate] if system else [inst.logrotate_conf, inst.logrotate_state]
        if not system:
            said += apply_block(render_logrotate(inst, system=False)[1], remove=True, runner=runner)
        said += [_delete(path) for path in files]
    else:
        manager = ["systemctl"] if system else ["systemctl", "--user"]
        folder = SYSTEM_UNIT_DIR if system else inst.user_unit_dir
        units = [name for timer in (False, True) for _template, name in unit_files(inst.instance, timer=timer)]
        present = [unit for unit in units if (folder / unit).exists()]
        for unit in (u for u in present if u != inst.instance.check_service):  # the timer starts that one
            said.append(_systemctl([*manager, "disable", "--now", unit], runner))
        said += [_delete(folder / unit) for unit in units]
        if present:
            said.append(_systemctl([*manager, "daemon-reload"], runner))
    return said


def _delete(path: Path) -> str:
    try:
        path.unlink()
    except FileNotFoundError:
        return f"{path}: not there (unchanged)"
    except OSError as exc:
        raise InstallError(f"cannot delete {path}: {exc.strerror or exc}") from None
    return f"deleted {path}"


def _systemctl(argv: list[str], runner: Runner) -> str:
    """Run a systemctl command; where it cannot run here, say the command to run."""
    try:
        runner(argv, timeout=60.0)
    except CommandError as exc:
        return f"could not run `{' '.join(argv)}` here ({exc.reason}): run it where the units run"
    return f"ran `{' '.join(argv)}`"


def legacy_notes(table: str, inst: Installation) -> list[str]:
    """What an old checkout's crontab block did that the new line does not (its block is taken over)."""
    if not re.search(rf"^{re.escape(begin_marker('cron'))}(:|\s*$)", table, re.M):
        return []
    return [
        "note: this replaces the block of an installation from a checkout (deploy/run_check); its "
        f"deploy/site-env.sh, if you had one, now belongs in {inst.instance.site_env}, and run_check's log "
        f"moves to {inst.run_check_log}"
    ]


def _say(lines: list[str], stream: Any) -> None:
    for line in lines:
        print(line, file=stream)


def _enable_hints(inst: Installation, args: argparse.Namespace) -> list[str]:
    """The command that enables what was written, and what else to know."""
    hints: list[str] = []
    target = args.target
    if target == "systemd":
        instance = inst.instance
        unit = instance.check_timer if args.timer else instance.daemon_unit
        manager = "systemctl" if args.system else "systemctl --user"
        hints.append(f"enable it: {manager} daemon-reload && {manager} enable --now {unit}")
        other = instance.daemon_unit if args.timer else instance.check_timer
        folder = SYSTEM_UNIT_DIR if args.system else inst.user_unit_dir
        if (folder / other).exists():
            hints.append(f"note: {folder / other} is installed too; run one of them ({manager} disable --now {other})")
        if not args.system:
            state = lingering(inst.user)
            if state is not True:
                hints.append(
                    f"user units stop when your last login session ends unless lingering is on "
                    f"({'it is off' if state is False else 'cannot tell whether it is'}): "
                    f"loginctl enable-linger {inst.user}   (some sites reserve this for admins: ask them)"
                )
        service = instance.check_service if args.timer else instance.daemon_unit
        journal = "journalctl" if args.system else "journalctl --user"
        hints.append(f"then: {manager} status {unit}; {journal} -u {service}")
    elif target == "cron":
        hints.append("enabled: cron runs it from the next minute on; its log: " + str(inst.run_check_log))
        hints.append(
            "cron mails what run_check prints (a change of exit status, an hourly reminder, a recovery) to MAILTO: "
            "put MAILTO=you@example.org at the top of the crontab (crontab -e) if your local mailbox is not read"
        )
    elif target == "scrontab":
        hints.append("enabled: Slurm runs it as a job every minute (squeue --me --name hpc-bridge-check)")
        hints.append(f"what run_check prints goes to {inst.run_check_log.parent / 'scrontab.out'}")
    elif target == "logrotate":
        if args.system:
            hints.append("enabled: the system's daily logrotate reads /etc/logrotate.d")
        else:
            hints.append("enabled: cron runs it daily at 03:17; to see what it would do now:")
            hints.append(f"  {logrotate_program()} -d -s {inst.logrotate_state} {inst.logrotate_conf}")
            if not shutil.which("logrotate") and not os.access("/usr/sbin/logrotate", os.X_OK):
                hints.append("note: logrotate is not installed here; ask your site for it (package logrotate)")
    return hints

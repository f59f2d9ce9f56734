"""``hpc-bridge upgrade SOURCE``: the bridge and a new worker environment of the same version, in one go.

docs/upgrade.md explains the layout: the worker environments live beside each other in ``ENVS/``
(``ENVS/current/bin/python`` is ``HPC_WORKER_PYTHON``), and a job keeps the environment it was
submitted with. The command, for SOURCE (a wheel, or anything ``pip install`` takes):

1. asks pip which version SOURCE is (``pip install --dry-run --report``; nothing is installed);
2. builds ``ENVS/worker-VERSION-TIMESTAMP`` with the site's extra (``--extra``, else the one recorded in
   the current environment's ``hpc-bridge-extra``, else the one its installed packages show) and
   checks its ``hpc-worker --version``; nothing uses it yet. With ``--build-on-node`` a batch job builds
   it on a compute node (:mod:`bridge.ops.node_build`);
3. holding the spool's lock (no pass runs meanwhile), installs SOURCE into the bridge's own
   environment, checks that both have the same version and switches ``current`` in one rename;
4. runs the new ``hpc-bridge doctor`` and exits with its status.

Until the switch, ``current`` is untouched; a failure before it removes the unused new environment.
The bridge is installed only under the lock, right before the switch, so no pass ever submits a job
with a bridge of another version than ``current``'s worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bridge.atomic import fsync_dir
from bridge.config import BridgeConfig
from bridge.errors import ConfigError
from bridge.instance import INSTANCE_ENV
from bridge.ops.node_build import NodeBuildFailed, build_on_node
from bridge.shell import CommandError, CommandResult, run_command
from bridge.spool import Spool
from bridge.version import DISTRIBUTION

EXTRAS = ("worker", "worker-gpu", "worker-jax")
NO_EXTRA = "none"  # the package alone, no TensorFlow or JAX: for trying the procedure (and the tests)
MARKER = "hpc-bridge-extra"  # in each environment built here: the extra it was built with
LINK = "current"
PIP_TIMEOUT_S = 1800.0
SHORT_TIMEOUT_S = 300.0  # creating a venv, asking an interpreter for versions
DOCTOR_TIMEOUT_S = 900.0
LOCK_POLL_S = 5.0
#: Every interpreter runs isolated: the working directory (a checkout, with its ``*.egg-info``)
#: must not stand in for what is installed.
ISOLATED = "-I"
TENSORFLOW = frozenset({"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel"})
VERSION_PROBE = f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"
PACKAGES_PROBE = "import importlib.metadata as m; print('\\n'.join(str(d.metadata['Name']) for d in m.distributions()))"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*(.*)$", re.DOTALL)

EPILOG = """examples:
  hpc-bridge upgrade hpc_bridge-0.3.0-py3-none-any.whl
  hpc-bridge upgrade 'hpc-bridge==0.3.0' --pip-arg=--no-index --pip-arg=--find-links=WHEELHOUSE
  hpc-bridge upgrade 'hpc-bridge @ git+https://example.org/hpc-bridge.git@v0.2.0' --extra worker-gpu
  hpc-bridge upgrade ./hpc-bridge --dry-run      # say what it would do
  hpc-bridge upgrade NEW.whl --skip-worker       # the worker is an Apptainer image (deploy/apptainer/README.md)
  hpc-bridge upgrade NEW.whl --build-on-node     # the compute nodes run another OS image or architecture

Going back is an upgrade to the previous version (its wheel or requirement). Under systemd, stop the
daemon first (it holds the spool's lock): systemctl --user stop hpc-bridge@INSTANCE.service.
"""


class UpgradeFailed(Exception):
    """A step failed; the message says what, and what state it left."""


def say(text: str) -> None:
    print(f"upgrade: {text}", flush=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "upgrade",
        help="install a new version of the bridge and a worker environment of the same version, switch to both",
        description="Build the new worker environment beside the old one, install SOURCE into the bridge's "
        "environment and switch ENVS/current while no pass runs, then run doctor (docs/upgrade.md).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="SOURCE", help="a wheel, or a requirement or path pip install takes")
    p.add_argument(
        "--pip-arg", action="append", default=[], metavar="ARG",
        help="one more argument for both pip runs (repeatable; write it with '=': --pip-arg=--no-index)",
    )  # fmt: skip
    p.add_argument(
        "--extra",
        choices=(*EXTRAS, NO_EXTRA),
        help="the worker's extra (default: the current environment's; none: the package alone, without "
        "TensorFlow or JAX, which cannot train: only for trying the procedure)",
    )
    p.add_argument("--python", help="the interpreter to base the new worker environment on (default: current's)")
    p.add_argument("--skip-worker", action="store_true", help="build no worker environment, install the bridge only")
    p.add_argument(
        "--build-on-node",
        action="store_true",
        help="build the worker environment in a batch job on a compute node (another OS image or CPU "
        "architecture than the login node); --python must then be a path the node can run",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="wait this long for a pass in progress (default 300)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")
    p.set_defaults(operator=run)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    try:
        return upgrade(config, args)
    except (UpgradeFailed, ConfigError) as exc:
        print(f"hpc-bridge upgrade: {exc}", file=sys.stderr, flush=True)
        return 1


@dataclass(frozen=True)
class Layout:
    link: Path  # ENVS/current
    interpreter: Path  # the interpreter's path inside an environment: bin/python

    def current(self) -> Path:
        return self.link.resolve()


def worker_layout(worker_python: str) -> Layout:
    """Where the worker environments are, from ``HPC_WORKER_PYTHON`` (``ENVS/current/bin/python``)."""
    python = Path(worker_python)
    link = python.parent.parent
    if link.name != LINK or not link.is_symlink():
        raise UpgradeFailed(
            f"HPC_WORKER_PYTHON ({worker_python}) does not go through an ENVS/{LINK} symlink, so there is no "
            f"place for versioned environments: make one for the environment in use (mkdir ENVS && ln -s "
            f"{link} ENVS/{LINK}), set HPC_WORKER_PYTHON=ENVS/{LINK}/{python.parent.name}/{python.name} "
            "and run this again (docs/upgrade.md, 'The first upgrade from a worker-venv')"
        )
    if (link / "bin" / "worker-python.env").exists():
        raise UpgradeFailed(
            f"{link} is an Apptainer image's wrapper: build and install the new image as "
            "deploy/apptainer/README.md says, and upgrade the bridge with --skip-worker"
        )
    return Layout(link, python.relative_to(link))


def extra_for(packages: Iterable[str]) -> tuple[str, str]:
    """The extra an environment with these distributions was built with, and why."""
    names = {re.sub(r"[-_.]+", "-", name).lower() for name in packages}
    tensorflow = sorted(names & TENSORFLOW)
    cuda = sorted(n for n in names if n.startswith("nvidia-cudnn-cu"))
    if "jax" in names and not tensorflow:
        return "worker-jax", "it has JAX without TensorFlow"
    if tensorflow and cuda:
        return "worker-gpu", f"it has {tensorflow[0]} with CUDA libraries ({cuda[0]})"
    if tensorflow:
        return "worker", f"it has {tensorflow[0]} without CUDA libraries"
    return "worker", "it has neither TensorFlow nor JAX: the CPU extra"


def choose_extra(layout: Layout, asked: str | None) -> tuple[str, str]:
    """``--extra``, else the current environment's marker, else what its packages show; and why."""
    if asked:
        return asked, "--extra"
    marker = layout.link / MARKER
    with contextlib.suppress(FileNotFoundError):
        recorded = marker.read_text().strip()
        if recorded in (*EXTRAS, NO_EXTRA):
            return recorded, f"recorded in {layout.current() / MARKER}"
    listed = command([layout.link / layout.interpreter, ISOLATED, "-c", PACKAGES_PROBE], timeout=SHORT_TIMEOUT_S)
    extra, why = extra_for(listed.stdout.split("\n"))
    return extra, f"the current environment {layout.current()}: {why}"


def with_extra(source: str, extra: str) -> str:
    """SOURCE as a requirement with ``extra``: ``path[extra]``, ``name[extra]==1.0``, ``name[extra] @ URL``."""
    if extra == NO_EXTRA:
        return source
    if _URL.match(source):
        return f"{DISTRIBUTION}[{extra}] @ {source}"
    match = _REQUIREMENT.match(source)
    path = os.sep in source or source.startswith(".") or source.endswith((".whl", ".tar.gz", ".zip"))
    if path and (match is None or not match[3].startswith("@")):  # not NAME @ URL
        return f"{source}[{extra}]"
    if match is None:
        raise UpgradeFailed(f"cannot add the extra to {source!r}: give a wheel, a path, a URL or a requirement")
    name, extras, rest = match.groups()
    chosen = [e.strip() for e in (extras or "").split(",") if e.strip()] + [extra]
    return f"{name}[{','.join(dict.fromkeys(chosen))}]{' ' if rest.startswith('@') else ''}{rest}"


def command(argv: Sequence[str | Path], *, timeout: float, env: dict[str, str] | None = None) -> CommandResult:
    """``run_command``; a failure becomes :class:`UpgradeFailed` with the end of what it printed."""
    try:
        return run_command([str(a) for a in argv], timeout=timeout, env=env)
    except CommandError as exc:
        tail = "\n".join(exc.output.splitlines()[-15:])
        raise UpgradeFailed(f"{' '.join(exc.result.argv)}: {exc.reason}\n{tail}") from None


def last_line(result: CommandResult) -> str:
    return (result.stdout.strip().splitlines() or ["done"])[-1]


def new_version(source: str, pip_args: list[str]) -> str:
    """The version SOURCE would install, from pip's report of a dry run."""
    argv = [sys.executable, ISOLATED, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
    report = command([*argv, "--report", "-", *pip_args, source], timeout=PIP_TIMEOUT_S).stdout
    try:
        installs = json.loads(report)["install"]
        return next(str(i["metadata"]["version"]) for i in installs if i["metadata"]["name"] == DISTRIBUTION)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise UpgradeFailed(
            f"pip does not say that {source} is {DISTRIBUTION} (its report: {report[:300]!r})"
        ) from None


def installed_version(python: str | Path) -> str:
    return command([python, ISOLATED, "-c", VERSION_PROBE], timeout=SHORT_TIMEOUT_S).stdout.strip()


def build_worker(new: Path, target: str, extra: str, python: str | Path, pip_args: list[str]) -> str:
    """Create the environment ``new`` with ``target`` installed; return its ``hpc-worker --version``."""
    say(f"creating {new} (from {python})")
    command([python, ISOLATED, "-m", "venv", new], timeout=SHORT_TIMEOUT_S)
    say(f"installing {target} into it (pip; minutes with TensorFlow)")
    pip: list[str | Path] = [new / "bin" / "python", ISOLATED, "-m", "pip", "install", *pip_args, target]
    say(f"pip: {last_line(command(pip, timeout=PIP_TIMEOUT_S))}")
    (new / MARKER).write_text(f"{extra}\n")
    return command([new / "bin" / "hpc-worker", "--version"], timeout=SHORT_TIMEOUT_S).stdout.split()[-1]


def daemon_pid(spool: Spool) -> int | None:
    """The pid of ``hpc-bridge run`` if the lock file names one that runs on this machine (the daemon
    holds the lock for as long as it runs), else None: a pass, which ends by itself."""
    try:
        pid = int((spool.root / "bridge.lock").read_text().split()[0])
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except (OSError, ValueError, IndexError):
        return None
    return pid if "run" in argv and any(Path(a).name in ("hpc-bridge", "bridge") for a in argv) else None


@contextlib.contextmanager
def spool_locked(spool: Spool, timeout_s: float, instance: str) -> Iterator[None]:
    """Hold the spool's lock, waiting up to ``timeout_s`` for the pass that holds it."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        with spool.lock() as held:
            if held:
                yield
                return
        pid = daemon_pid(spool)
        if pid is not None:
            raise UpgradeFailed(
                f"the daemon (pid {pid}) holds the spool's lock for as long as it runs: stop it first "
                f"(systemctl --user stop hpc-bridge@{instance}.service), run this again, then start it"
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpgradeFailed(f"{spool.root / 'bridge.lock'} was still held after {timeout_s:g} s")
        if not waited:
            say(f"a pass holds {spool.root / 'bridge.lock'}: waiting for it (up to {timeout_s:g} s)")
            waited = True
        time.sleep(min(LOCK_POLL_S, remaining))


def switch(link: Path, new: Path) -> None:
    """Point ``link`` at ``new`` (its sibling) in one rename: a job starting now sees one or the other."""
    temporary = link.with_name(f".{link.name}.{os.getpid()}.new")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    os.symlink(new.name, temporary)
    os.replace(temporary, link)
    fsync_dir(link.parent)


def upgrade(config: BridgeConfig, args: argparse.Namespace) -> int:
    source, pip_args = args.source, list(args.pip_arg)
    if Path(source).expanduser().exists():  # a path: named in full in what this prints
        source = str(Path(source).expanduser().resolve())
    layout = None if args.skip_worker else worker_layout(config.worker_python)
    say(f"asking pip which version {source} is")
    version = new_version(source, pip_args)
    before = installed_version(sys.executable)
    say(f"new version: {version}; this bridge: {before} ({sys.executable})")
    new = None if layout is None else build_step(layout, source, version, args, pip_args, config)
    lock = Spool(config.spool_dir).root / "bridge.lock"
    if args.dry_run:
        switching = f", point {layout.link} at {new}" if layout and new else ""
        say(f"would hold {lock}, install {source} into this bridge{switching}, then run doctor")
        return 0
    try:
        with spool_locked(Spool(config.spool_dir), args.lock_timeout, config.instance):
            say(f"holding {lock}: installing {source} into {sys.executable}'s environment")
            again = ["--force-reinstall", "--no-deps"] if before == version else []  # a rebuild of one version
            argv = [sys.executable, ISOLATED, "-m", "pip", "install", "--upgrade", *again, *pip_args, source]
            say(f"pip: {last_line(command(argv, timeout=PIP_TIMEOUT_S))}")
            bridge = installed_version(sys.executable)
            if bridge != version:
                raise UpgradeFailed(f"the bridge is now {bridge}, not {version}: install {version} by hand")
            if layout is not None and new is not None:
                old = os.readlink(layout.link)
                switch(layout.link, new)
                say(f"{layout.link}: {old} -> {new.name}")
    except BaseException:
        if layout is not None and new is not None and layout.current() != new.resolve():
            shutil.rmtree(new, ignore_errors=True)
            say(f"nothing switched: {LINK} still names {layout.current()}; removed the unused {new}")
        raise
    status = run_doctor(config, args)
    say(f"upgraded to {version}; doctor exited {status}")
    return status


def build_step(
    layout: Layout, source: str, version: str, args: argparse.Namespace, pip_args: list[str], config: BridgeConfig
) -> Path:
    """Build ``ENVS/worker-VERSION-TIMESTAMP`` (with ``--dry-run`` only say so), here or with
    ``--build-on-node`` in a batch job; a failure removes it."""
    extra, why = choose_extra(layout, args.extra)
    say(f"worker extra: {extra} ({why})")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S")  # unique per upgrade, sorts by time
    new = layout.link.parent / f"worker-{version}-{stamp}"
    python = args.python or layout.link / layout.interpreter
    target = with_extra(source, extra)
    where = " in a batch job on a compute node" if args.build_on_node else ""
    if args.dry_run:
        say(f"would build {new}{where} with {target} (from {python})")
        return new
    try:
        if args.build_on_node:
            try:
                built = build_on_node(config, new, target, extra, python, pip_args, say)
            except NodeBuildFailed as exc:
                raise UpgradeFailed(str(exc)) from exc
        else:
            built = build_worker(new, target, extra, python, pip_args)
        if built != version:
            raise UpgradeFailed(f"{new}/bin/hpc-worker --version says {built}, not {version}")
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        say(f"removed the half-built {new}; {LINK} still names {layout.current()}, the bridge is unchanged")
        raise
    say(f"{new} is ready: hpc-worker {built}")
    return new


def run_doctor(config: BridgeConfig, args: argparse.Namespace) -> int:
    """The new ``hpc-bridge doctor`` of the same credentials and instance; print it, return its status."""
    say("running the new hpc-bridge doctor")
    given = getattr(args, "credentials", None)
    credentials = ["--credentials", str(Path(given).resolve())] if given else []
    argv = [sys.executable, ISOLATED, "-m", "bridge", *credentials, "doctor"]
    environ = dict(os.environ, **{INSTANCE_ENV: config.instance})
    try:
        doctor = run_command(argv, timeout=DOCTOR_TIMEOUT_S, env=environ, check=False)
    except CommandError as exc:  # timed out, or could not start
        doctor = CommandResult(exc.result.argv, 1, exc.result.stdout, f"{exc}\n", exc.result.seconds)
    print(doctor.stdout + doctor.stderr, end="", flush=True)
    return doctor.returncode

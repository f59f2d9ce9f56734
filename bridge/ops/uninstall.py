"""``hpc-bridge uninstall [--purge]``: take one instance off this account.

Without ``--purge`` it removes what ``install`` wrote for the instance, whichever were installed:
the crontab blocks (cron, logrotate), the scrontab block, the systemd units (disabled and stopped
first where systemctl can, else the command is said) and the logrotate file. The data stays:
requests in flight keep their records, and ``install cron`` brings the bridge back as it was.

``--purge`` also deletes, after a confirmation (``--yes`` for scripts): the spool (ledger,
outbox, job folders), the run directories, the metrics file, the logs and run_check's state, the
bridge's own broker queues (dead-letter and status; never Rodan's request or reply queue) and,
when no other instance is left on the account, the cache (``~/.cache/hpc-bridge``: the oneDNN
tuning and JAX's compilation cache). The settings folder stays: it holds passwords the operator
typed, so its path is printed to delete by hand. Jobs still in the scheduler are named first:
their requests lose their replies once the spool is gone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pika.exceptions

from bridge.amqp import CONNECTION_ERRORS, connect
from bridge.config import BridgeConfig
from bridge.errors import BrokerUnavailable
from bridge.instance import APP, Instance, installed_instances
from bridge.ledger import Ledger, RequestState
from bridge.ops.install import TARGETS, Installation, InstallError, locate, remove
from bridge.spool import Spool

EPILOG = """examples:
  hpc-bridge uninstall                        # stop running it: crontab blocks, units, logrotate
  hpc-bridge --instance sge uninstall --purge # and delete that instance's spool, logs and own queues
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "uninstall",
        help="remove this instance's crontab blocks, systemd units and logrotate file; with --purge also its "
        "spool, runs, logs, metrics, cache and own queues",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--purge", action="store_true", help="also delete the instance's data and its own broker queues")
    p.add_argument("--yes", action="store_true", help="do not ask before --purge deletes (for scripts)")
    p.set_defaults(operator=run)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    try:
        inst = locate(config, require_run_check=False)
    except InstallError as exc:
        print(f"hpc-bridge uninstall: {exc}", file=sys.stderr)
        return exc.status
    active = jobs_in_flight(config)
    if args.purge and not args.yes and not confirmed(inst, active):
        print("hpc-bridge uninstall: nothing removed", file=sys.stderr)
        return 1
    for line in unschedule(inst):
        print(line)
    if not args.purge:
        if active:
            print(
                f"note: {len(active)} request(s) still have a job in the scheduler; without a pass their replies "
                "wait until the bridge runs again (hpc-bridge status --state running)"
            )
        print(f"kept the data (spool {config.spool_dir}); `hpc-bridge uninstall --purge` deletes it")
        return 0
    failed = False
    for line in purge(inst):
        failed = failed or line.startswith("could not")
        print(line)
    settings = inst.instance.settings_dir if inst.credentials.parent == inst.instance.settings_dir else inst.credentials
    print(f"kept the settings {settings} (they hold your passwords): delete them when you no longer need them")
    return 1 if failed else 0


def jobs_in_flight(config: BridgeConfig) -> list[str]:
    """Correlation ids of the requests that have a job in the scheduler now."""
    if not config.spool_dir.is_dir():
        return []
    ledger = Ledger(Spool(config.spool_dir))
    return [r.correlation_id for r in ledger.in_state(RequestState.SUBMITTING, RequestState.SUBMITTED)]


def confirmed(inst: Installation, active: list[str]) -> bool:
    """Ask on the terminal; no terminal, no consent."""
    if not sys.stdin.isatty():
        print("hpc-bridge uninstall: --purge deletes data; confirm with --yes when not on a terminal", file=sys.stderr)
        return False
    print(
        f"--purge deletes instance {inst.instance.name}'s spool {inst.config.spool_dir}, its runs, logs, metrics "
        f"and its own queues {', '.join(own_queues(inst.config))}."
    )
    if active:
        print(f"{len(active)} request(s) still have a job in the scheduler: they will never get a reply.")
    answer = input(f"Type the instance name ({inst.instance.name}) to go on: ")
    return answer.strip() == inst.instance.name


def unschedule(inst: Installation) -> list[str]:
    """What ``install`` wrote for this instance, taken out; what was done, in words."""
    said: list[str] = []
    for target in TARGETS:
        try:
            said += remove(inst, target)
        except InstallError as exc:  # e.g. no scrontab on a Grid Engine site: nothing of ours there
            said.append(f"{target}: {exc}")
    system = Path("/etc/systemd/system")
    for unit in inst.instance.units:
        if (system / unit).exists():
            said.append(
                f"note: the system unit {system / unit} is there too; as root: "
                f"systemctl disable --now {unit} && rm {system / unit}"
            )
    rotation = inst.instance.system_logrotate
    if rotation.exists():
        said.append(f"note: {rotation} is there too; as root: rm {rotation}")
    return said


def own_queues(config: BridgeConfig) -> list[str]:
    """The queues this bridge declares for itself (never Rodan's request or reply queues)."""
    return [q for q in (config.dead_letter_queue, config.status_queue) if q]


def purge(inst: Installation) -> list[str]:
    config = inst.config
    said: list[str] = []
    paths = [config.spool_dir, *([config.runs_dir] if config.runs_dir else [])]
    paths += [p for p in (config.metrics_file, config.log_file) if p is not None]
    run_check = inst.run_check_log
    paths += [run_check, run_check.with_suffix(".state"), run_check.with_suffix(".lock"), inst.instance.state_dir]
    for path in (inst.at_home(p) for p in paths):
        said.append(_delete(path))
    said += delete_queues(config)
    others = [name for name in installed_instances(inst.instance.config_home) if name != inst.instance.name]
    cache = cache_dir(inst.instance)
    if others:
        said.append(f"kept the cache {cache}: instance(s) {', '.join(others)} use it too")
    else:
        said.append(_delete(cache))
    return said


def cache_dir(instance: Instance) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(instance.home / ".cache")
    return Path(base) / APP


def _delete(path: Path) -> str:
    if not path.exists() and not path.is_symlink():
        return f"{path}: not there"
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        return f"could not delete {path}: {exc.strerror or exc}"
    return f"deleted {path}"


def delete_queues(config: BridgeConfig) -> list[str]:
    """Delete the bridge's own queues on the broker (with what they hold)."""
    try:
        connection = connect(config.broker_url, ca_file=config.broker_ca_file, name="hpc-bridge-uninstall")
    except BrokerUnavailable as exc:
        return [f"could not delete the queues {', '.join(own_queues(config))}: {exc}"]
    said = []
    try:
        for queue in own_queues(config):
            channel = connection.channel()
            try:
                channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker:  # 404: not there
                said.append(f"queue {queue}: not there")
                continue
            channel.queue_delete(queue)
            said.append(f"deleted the queue {queue}")
            channel.close()
    except CONNECTION_ERRORS as exc:
        said.append(f"could not delete the queues: the broker connection failed ({type(exc).__name__})")
    finally:
        if connection.is_open:
            connection.close()
    return said

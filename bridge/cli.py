"""``hpc-bridge``: the login-node command (cron ``check``, systemd ``run``, ``enqueue``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from bridge import schedulers
from bridge.config import BridgeConfig, load_config
from bridge.errors import ConfigError
from bridge.instance import INSTANCE_ENV, instance_name
from bridge.logs import configure_logging, register_secret
from bridge.progress import MODES
from bridge.version import package_version

log = structlog.get_logger(__name__)

EXAMPLES = """examples:
  hpc-bridge check                      # one pass: what cron's run_check runs
  hpc-bridge run                        # the daemon (systemd)
  hpc-bridge enqueue --inputs inputs.json --setting 'Maximum number of training epochs=2' --wait --out models/
  hpc-bridge chain --jobs 3 --time 1:00:00 --gpus 1 --wait -- python train.py   # longer than one job may run
"""

CHAIN_EPILOG = """The command runs in N batch jobs, one after the other, each under a supervisor that sets
HPC_CHECKPOINT_DIR, HPC_RESTART_COUNT, HPC_CHAIN_LINK, HPC_CHAIN_LINKS and HPC_RUN_DIR and sends it
SIGUSR1 --warn seconds before the job's limit. The command exits 0 when the work is finished (the
waiting jobs are cancelled), 75 to continue in the next job, anything else to stop the chain.
Needs no credentials.env. The contract: docs/researcher-guide.md.

example:
  hpc-bridge chain --jobs 3 --time 1:00:00 --gpus 1 -v DATA=/scratch/me/set --wait -- \\
      python deploy/examples/train_chain.py --total-steps 100000
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hpc-bridge",
        description="Take Rodan training requests from RabbitMQ, submit them as batch jobs, "
        "and make sure every request gets exactly one reply.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        help="the settings file (default: $HPC_BRIDGE_CREDENTIALS, else the instance's "
        "~/.config/hpc-bridge/INSTANCE/credentials.env, else ./credentials.env)",
    )
    parser.add_argument(
        "--instance",
        help="which bridge of this account (default $HPC_BRIDGE_INSTANCE, else 'default'): its settings are "
        "~/.config/hpc-bridge/INSTANCE/credentials.env, and its units, crontab blocks, spool and own queues "
        "are its own (docs/operator-guide.md, Several instances)",
    )
    parser.add_argument("--version", action="version", version=f"hpc-bridge {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Every subcommand's parser sets ``operator``, called as ``operator(config, args)`` with the
    # loaded configuration, or as ``operator(args)`` where it also sets ``loads_config=True``.
    for add_parsers in (_add_bridge_parsers, _add_enqueue_parser, _add_chain_parser, _add_ops_parsers):
        add_parsers(sub)
    for command in sub.choices.values():  # `hpc-bridge doctor --credentials F` works as well
        command.add_argument("--credentials", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.add_argument("--instance", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        with chosen_instance(args.instance):
            return _main(args)
    except ConfigError as exc:  # an unusable --instance
        return configuration_error(exc)


@contextmanager
def chosen_instance(name: str | None) -> Iterator[None]:
    """``--instance NAME`` for this command: it is ``$HPC_BRIDGE_INSTANCE`` while the command runs, so
    that whatever it starts (a pass, doctor's probe job, run_check) works for the same instance."""
    if name is None:
        yield
        return
    before = os.environ.get(INSTANCE_ENV)
    os.environ[INSTANCE_ENV] = instance_name(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INSTANCE_ENV, None)
        else:
            os.environ[INSTANCE_ENV] = before


def _main(args: argparse.Namespace) -> int:
    if getattr(args, "loads_config", False):  # chain needs no credentials.env, doctor judges it itself
        return int(args.operator(args))

    try:
        config = load_config(args.credentials)
    except ConfigError as exc:
        return configuration_error(exc)
    for secret in config.secrets:
        register_secret(secret)
    try:
        configure_logging(level=config.log_level, log_file=config.log_file, component="bridge")
    except OSError as exc:
        return configuration_error(ConfigError(f"HPC_LOG_FILE {config.log_file} cannot be written: {exc.strerror}"))
    for warning in config.warnings:  # harmless, but the operator should hear of it (a newer version's setting)
        log.warning("config_warning", warning=warning)

    return int(args.operator(config, args))


def configuration_error(exc: ConfigError) -> int:
    """Print every problem of a configuration, one per line, and return exit status 2."""
    if len(exc.problems) == 1:
        print(f"hpc-bridge: configuration error: {exc.problems[0]}", file=sys.stderr)
    else:
        print(f"hpc-bridge: {len(exc.problems)} configuration errors:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
    return 2


def _add_bridge_parsers(sub: Any) -> None:
    check = sub.add_parser(
        "check",
        help="one pass: drain the request queue, reconcile jobs, publish pending replies, exit",
        epilog="example: * * * * * ~/hpc-bridge/.venv/bin/hpc-bridge-run-check (hpc-bridge install cron writes it)",
    )
    check.set_defaults(operator=_run_bridge, once=True)
    daemon = sub.add_parser(
        "run",
        help="run as a daemon (pick up requests within a second, reconcile periodically)",
        epilog="example: systemctl --user start hpc-bridge@default.service (hpc-bridge install systemd writes it)",
    )
    daemon.set_defaults(operator=_run_bridge, once=False)


def _run_bridge(config: BridgeConfig, args: argparse.Namespace) -> int:
    """``check`` (one pass, ``args.once``) and ``run`` (the daemon)."""
    from bridge.runner import Bridge

    bridge = Bridge(config)
    bridge.install_signal_handlers()
    try:
        return bridge.check() if args.once else bridge.run()
    except ConfigError as exc:  # e.g. the spool lock on a filesystem without locks
        return configuration_error(exc)


def _add_enqueue_parser(sub: Any) -> None:
    enq = sub.add_parser(
        "enqueue",
        help="publish a request exactly as Rodan does, optionally wait for its reply",
        epilog="example: hpc-bridge enqueue --inputs inputs.json --setting CPUs=2 --wait --out models/",
    )
    enq.add_argument("--inputs", type=Path, required=True, help="JSON file: input name -> resource path")
    enq.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE", help="a Rodan setting (repeatable)"
    )
    enq.add_argument("--wait", action="store_true", help="wait for the reply like Rodan (nacking foreign replies)")
    enq.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")
    enq.add_argument("--out", type=Path, help="write the decoded models here")
    enq.add_argument(
        "--progress",
        choices=MODES,
        default="auto",
        help="with --wait, show the request's state, job, layer/epoch and elapsed time on standard error: "
        "a status line redrawn in place (bar), one line per change (lines), JSON lines (json), or none; "
        "auto (default): bar on a terminal, else json. Standard output stays the one result line",
    )
    enq.set_defaults(operator=_enqueue)


def _add_ops_parsers(sub: Any) -> None:
    from bridge.ops import add_parsers

    add_parsers(sub)  # status, doctor, logs, ... (bridge/ops/)


def _chain(args: argparse.Namespace) -> int:
    """``chain``: no broker, no Rodan, so no credentials.env either."""
    from bridge.chain import chain_command

    return chain_command(args)


def _add_chain_parser(sub: Any) -> None:
    chain = sub.add_parser(
        "chain",
        help="run a command (e.g. training) for longer than one job may: N dependent jobs that checkpoint and resume",
        description="Submit N batch jobs, each starting after the one before has ended, that run the same command.",
        epilog=CHAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chain.add_argument("--jobs", type=int, required=True, metavar="N", help="how many jobs (links) at most")
    chain.add_argument("--time", required=True, help="each job's time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    chain.add_argument("--gpus", type=int, default=0, help="GPUs per job (default 0)")
    chain.add_argument("--cpus", type=int, default=1, help="CPUs per job (default 1)")
    chain.add_argument("--mem", type=int, default=4096, metavar="MB", help="memory per job in MB (default 4096)")
    chain.add_argument("--name", default="chain", help="job name prefix; jobs are NAME-1, NAME-2, ... (default chain)")
    chain.add_argument("--run-dir", type=Path, help="the run directory (default ./chain-runs/NAME-UTCTIMESTAMP)")
    chain.add_argument(
        "--scheduler",
        help=f"{schedulers.choices_text()} (default $HPC_SCHEDULER, else slurm); each reads its site "
        f"settings from the environment ({', '.join(o.setting for o in schedulers.all_site_options() if o.keyword)})",
    )
    chain.add_argument("--account", help="Slurm account / Grid Engine project")
    chain.add_argument("--partition", help="Slurm partition / Grid Engine queue")
    chain.add_argument(
        "--warn",
        type=int,
        metavar="SECONDS",
        help="SIGUSR1 this long before each job's limit (default 300, at most a quarter of --time; 0: none)",
    )
    chain.add_argument(
        "-v", "--env", action="append", default=[], metavar="NAME=VALUE",
        help="export to the command (repeatable; one variable each, the value may hold commas and spaces; "
        "-v NAME takes its value from here)",
    )  # fmt: skip
    chain.add_argument(
        "--wait",
        action="store_true",
        help="follow the chain until it has ended; exit 0 only if "
        "the command finished (1: failed, 75: every job used and more to do)",
    )
    chain.add_argument(
        "--progress",
        choices=MODES,
        default="auto",
        help="with --wait, show the current link, its scheduler state and the elapsed time on standard error: "
        "a status line under the event lines (bar), one line per change (lines), the events and states as "
        "JSON lines (json), or none; auto (default): bar on a terminal, else json",
    )
    chain.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the command to run")
    chain.set_defaults(operator=_chain, loads_config=True)


def _enqueue(config: BridgeConfig, args: argparse.Namespace) -> int:
    from bridge.enqueue import RequestWatcher, progress_poller, publish_request, save_models, wait_for_reply
    from bridge.ops.status import runs_dir
    from bridge.progress import Progress
    from bridge.protocol import settings_from_args

    inputs = json.loads(args.inputs.read_text())
    try:
        settings = settings_from_args(args.setting)
    except ValueError as exc:
        print(f"hpc-bridge: {exc}", file=sys.stderr)
        return 2
    correlation_id = publish_request(
        config.broker_url, inputs, settings, request_queue=config.request_queue, reply_queue=config.reply_queue
    )
    result: dict[str, Any] = {"correlation_id": correlation_id}
    if args.wait:
        progress = Progress(correlation_id[:8], mode=args.progress)
        watcher = RequestWatcher(config.spool_dir, runs_dir(config), correlation_id)
        try:
            reply = wait_for_reply(
                config.broker_url,
                correlation_id,
                reply_queue=config.reply_queue,
                timeout_s=args.timeout,
                # the status line says it; log lines on the same terminal would garble it
                progress_every_s=None if progress.in_place and config.log_file is None else 15.0,
                on_poll=progress_poller(watcher, progress) if progress.mode != "none" else None,
            )
            view = watcher.poll()
            if reply is None:
                view.state = "timed-out"
            else:
                view.state, view.outcome = "replied", "error" if reply.is_error else "ok"
            view.report(progress)
        finally:
            progress.finish()
        if reply is None:
            result["error"] = "no reply before the timeout"
            print(json.dumps(result))
            return 1
        result["seconds"] = round(reply.seconds, 1)
        if reply.is_error:
            result["error"] = reply.data["error"]
        else:
            result["models"] = sorted(reply.data)
            if args.out:
                saved = save_models(reply, args.out)
                result["files"] = {k: {"path": str(p), "bytes": p.stat().st_size} for k, p in saved.items()}
    print(json.dumps(result))
    return 1 if "error" in result else 0

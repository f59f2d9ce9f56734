"""The ``hpc-bridge chain`` command line (its arguments are parsed in ``bridge/cli.py``).

:func:`chain_command` turns the parsed arguments into :class:`ChainSettings`, submits the
chain and, with ``--wait``, follows it to its end; it needs no broker and no credentials.
:func:`cancel_chain` cancels every link of a chain that has not ended (tests, clean-up).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bridge.chain.follow import follow
from bridge.chain.rundir import ChainRunDir, default_run_dir
from bridge.chain.settings import (
    EX_TEMPFAIL,
    ChainError,
    ChainSettings,
    default_warn,
    parse_environment,
    parse_time,
    resolve_command,
    scheduler_choice,
    scheduler_options,
)
from bridge.chain.submit import submit_chain
from bridge.errors import BridgeError, SchedulerUnavailable
from bridge.progress import Progress
from bridge.schedulers import Scheduler, get_scheduler


def chain_command(args: Any, environ: Mapping[str, str] | None = None, out: Callable[[str], None] = print) -> int:
    """``hpc-bridge chain`` (arguments parsed in bridge/cli.py). Needs no credentials.env."""
    from bridge.logs import configure_logging

    env = dict(os.environ if environ is None else environ)
    try:
        command = list(args.cmd)
        if command and command[0] == "--":
            command = command[1:]
        limit_s = parse_time(args.time)
        name = args.name
        scheduler_name = scheduler_choice(args.scheduler, env)
        options = scheduler_options(scheduler_name, env)
        settings = ChainSettings(
            name=name,
            links=args.jobs,
            time_limit_s=limit_s,
            warn_s=default_warn(limit_s) if args.warn is None else args.warn,
            cpus=args.cpus,
            memory_mb=args.mem,
            gpus=args.gpus,
            command=tuple(resolve_command(command, env)),
            command_given=tuple(command),
            workdir=str(Path.cwd()),
            scheduler=scheduler_name,
            scheduler_options=options,
            account=args.account or "",
            partition=args.partition or "",
            environment=parse_environment(args.env, env),
        )
        settings.check()
        run_path = (args.run_dir or default_run_dir(name, Path.cwd())).absolute()
        scheduler = get_scheduler(scheduler_name, options=options)
    except (ChainError, ValueError) as exc:
        print(f"hpc-bridge chain: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=env.get("HPC_LOG_LEVEL", "WARNING"), stream=sys.stderr, component="chain")
    run = ChainRunDir(run_path)
    try:
        job_ids = submit_chain(settings, run, scheduler)
    except (ChainError, ValueError, OSError) as exc:  # e.g. a run directory with a space (no valid directive)
        print(f"hpc-bridge chain: {exc}", file=sys.stderr)
        return 2
    except BridgeError as exc:
        print(f"hpc-bridge chain: submission failed, nothing left queued: {exc}", file=sys.stderr)
        return 1
    out(f"run directory: {run_path}")
    out(f"{scheduler_name} job ids: {' '.join(job_ids)} (each starts after the one before has ended)")
    if settings.command != tuple(command):
        out(f"command: {' '.join(settings.command)}")
    if not args.wait:
        out(f"follow: tail -f {run.log_file}")
        return 0
    progress = Progress(f"chain {name}", mode=getattr(args, "progress", "auto"))
    try:
        code = follow(run_path, scheduler, out=out, progress=progress)
        outcome = {0: "done", 1: "failed", EX_TEMPFAIL: "incomplete"}.get(code, f"exit {code}")
        progress.update(outcome, outcome=outcome, code=code)
        return code
    except ChainError as exc:  # the run directory is no longer private (see ChainRunDir.verify)
        progress.finish()
        print(f"hpc-bridge chain: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.finish()
        out("stopped following; the chain goes on")
        return 130
    finally:
        progress.finish()


def cancel_chain(run_path: Path, scheduler: Scheduler | None = None) -> list[str]:
    """Cancel every link of the chain in ``run_path`` that has not ended (tests, clean-up)."""
    record = ChainRunDir(run_path).read()
    if scheduler is None:
        scheduler = get_scheduler(str(record["scheduler"]), options=record.get("scheduler_options") or {})
    cancelled = []
    for job_id in reversed([str(j) for j in record.get("job_ids") or []]):
        try:
            scheduler.cancel(job_id)
            cancelled.append(job_id)
        except (SchedulerUnavailable, ValueError):
            continue
    return cancelled

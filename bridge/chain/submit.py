"""Submitting a chain: one batch job per link, each held on the one before.

:func:`link_spec` describes one link's job (it runs ``python -m bridge.chain RUN_DIR LINK``);
:func:`submit_chain` creates the run directory, records the settings in ``chain.json`` and
submits every link (Slurm ``afterany``, Grid Engine ``-hold_jid``), cancelling what it had
submitted if a submission fails.
"""

from __future__ import annotations

import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog

from bridge.chain.rundir import ChainLog, ChainRunDir
from bridge.chain.settings import ChainSettings
from bridge.errors import BridgeError
from bridge.schedulers import JobSpec, Scheduler
from bridge.spool import atomic_write

log = structlog.get_logger(__name__)


def link_spec(settings: ChainSettings, run: ChainRunDir, link: int, hold_after: str) -> JobSpec:
    return JobSpec(
        name=f"{settings.name}-{link}",
        comment=f"hpc-bridge-chain-link-{link}-of-{settings.links}",
        time_minutes=settings.time_limit_s // 60,
        memory_mb=settings.memory_mb,
        cpus=settings.cpus,
        command=(settings.python, "-m", "bridge.chain", str(run.path), str(link)),
        log_dir=run.logs,
        workdir=Path(settings.workdir),
        gres=f"gpu:{settings.gpus}" if settings.gpus else None,
        account=settings.account,
        partition=settings.partition,
        warn_seconds=settings.warn_s,
        hold_after=hold_after,
        environment=dict(settings.environment),
    )


def submit_chain(settings: ChainSettings, run: ChainRunDir, scheduler: Scheduler) -> list[str]:
    """Create the run directory and submit every link, each held on the one before.

    chain.json says ``"state": "submitting"`` until every link is in, so a link that starts
    meanwhile waits for the full list of job ids. If a submission fails, the links already
    submitted are cancelled, chain.json says ``submit_failed`` and the error is raised.
    """
    settings.check()
    for link in (1, 2):  # every value a batch script refuses shows here, before anything exists
        scheduler.render(link_spec(settings, run, link, "1" if link > 1 else ""))
    run.create()
    record: dict[str, Any] = {
        "version": 1,
        "state": "submitting",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(run.path),
        "submit_host": socket.gethostname(),
        **settings.to_json(),
        "job_ids": [],
    }
    run.write(record)
    events = ChainLog(run.log_file, chain=settings.name, links=settings.links)
    job_ids: list[str] = []
    try:
        for link in range(1, settings.links + 1):
            spec = link_spec(settings, run, link, job_ids[-1] if job_ids else "")
            script = run.scripts / f"link-{link}.sh"
            atomic_write(script, scheduler.render(spec).encode(), mode=0o700)
            job_ids.append(scheduler.submit(script, spec))
            record["job_ids"] = list(job_ids)
        record["state"] = "submitted"
        run.write(record)
        events.emit("chain_submitted", scheduler=scheduler.name, job_ids=job_ids, command=list(settings.command))
        return job_ids
    except (BridgeError, ValueError, KeyboardInterrupt) as exc:
        for job_id in reversed(job_ids):
            try:
                scheduler.cancel(job_id)
            except BridgeError as cancel_error:
                log.warning("cancel_failed", job_id=job_id, error=str(cancel_error))
        record.update(state="submit_failed", job_ids=job_ids, error=str(exc) or type(exc).__name__)
        run.write(record)
        events.emit(
            "chain_failed",
            level="error",
            reason=f"submission failed: {str(exc) or type(exc).__name__}",
            cancelled=job_ids,
        )
        raise
    finally:
        events.close()

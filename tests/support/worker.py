"""The worker run in the test process, from a parameter file the test writes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from bridge.logs import configure_logging
from bridge.spool import Spool, atomic_write_json
from bridge.testing.rodan import RodanStandin
from tests.support.bridge import job_parameters_json
from worker.job import run_job


def write_params(
    spool: Spool,
    corr: str,
    reply_to: str,
    inputs: dict[str, str],
    standin: RodanStandin,
    broker_url: str,
    **settings: Any,
) -> Path:
    """A parameter file as the bridge writes it, for a one-epoch training of ``inputs``."""
    layers = [["Background", "Background Model"]] + [
        [name, f"Model {name.rsplit(' ', 1)[1]}"] for name in sorted(inputs) if name.startswith("rgba PNG - Layer")
    ]
    params = job_parameters_json(
        correlation_id=corr,
        reply_to=reply_to,
        inputs=inputs,
        layers=layers,
        settings={"epochs": 1, "max_samples_per_label": 100, "patch_height": 64, "patch_width": 64, **settings},
        rodan={"base_url": standin.url, "token": standin.user("hpc@example.org").token},
        broker={"url": broker_url},
        spool=str(spool.root),
    )
    path = spool.params_path(corr)
    atomic_write_json(path, params)
    return path


def run(params: Path) -> tuple[int, str]:
    """The worker in this process: its exit status and its log."""
    stream = io.StringIO()
    configure_logging(stream=stream, component="worker")
    code = run_job(params)
    return code, stream.getvalue()

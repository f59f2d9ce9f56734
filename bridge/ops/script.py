"""``hpc-bridge script``: the batch script a request would get with the current settings.

Nothing is submitted and nothing is written: the request is read and validated as the bridge reads
one from RabbitMQ (``bridge.protocol.parse_request``), its job is described by the function the
bridge submits with (``bridge.intake.rodan_job_spec``) and rendered by the scheduler backend's one
renderer (``Scheduler.render``), so standard output is, byte for byte, the ``job.sh`` the bridge
would write in the request's spool folder. Standard error says how it would be submitted (the
submit command with ``HPC_SCHEDULER_ARGS``). No secret is printed: the Rodan token lives in the
job's parameter file, never in the script, and a script or command that held a password from the
credentials would not be printed at all.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from bridge.config import BridgeConfig, contains_secret
from bridge.errors import InvalidRequest
from bridge.intake import rodan_job_spec
from bridge.protocol import SAMPLE_PREFIX, build_request_body, parse_request, settings_from_args
from bridge.schedulers import get_scheduler
from bridge.spool import Spool, safe_key

#: The request shown without ``--request``: Rodan 3.x's (our job package's) with one sample zip and
#: Rodan's default settings, as ``hpc-bridge enqueue`` would publish it.
DEFAULT_INPUTS = {f"{SAMPLE_PREFIX}1": "/uploads/resources/sample-1.zip"}
#: The correlation id shown without ``--correlation-id`` (it names the job and its spool folder).
DEFAULT_CORRELATION_ID = "script-preview"
#: The batch script's name in a request's spool folder (bridge.intake writes it there at submit).
SCRIPT_NAME = "job.sh"

EPILOG = """Standard output is exactly the batch script the bridge would write and submit for the request;
standard error says the submit command. Nothing is submitted or written.

examples:
  hpc-bridge script                                          # a Rodan 3.x request with Rodan's defaults
  hpc-bridge script --setting CPUs=2 --setting 'Maximum time (D-HH:MM)=0-02:00'
  hpc-bridge script --request body.json > job.sh && bash -n job.sh   # a request body as Rodan publishes it
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "script",
        help="print the batch script a request would get with the current settings (nothing is submitted)",
        description="Print the batch script the bridge would submit for a request, with the current settings.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--request",
        type=Path,
        metavar="FILE.json",
        help='the request\'s body as Rodan publishes it ({"inputs": {...}, "settings": {...}}); default: a Rodan '
        f"3.x request with one sample zip ({SAMPLE_PREFIX}1) and Rodan's default settings",
    )
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Rodan setting, over the request's (repeatable), e.g. CPUs=2",
    )
    p.add_argument(
        "--correlation-id",
        default=DEFAULT_CORRELATION_ID,
        help=f"the request's correlation id, which names its job and spool folder (default {DEFAULT_CORRELATION_ID})",
    )
    p.set_defaults(operator=run)


def request_body(path: Path | None, settings: list[str]) -> bytes:
    """The request body: ``path``'s (or the default request's), with ``settings`` (``NAME=VALUE``,
    a whole number becomes a number, as ``hpc-bridge enqueue`` sends it) over its settings."""
    data: dict[str, Any] = (
        json.loads(path.read_text(encoding="utf-8")) if path is not None else {"inputs": DEFAULT_INPUTS}
    )
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a request body is a JSON object with 'inputs' and 'settings'")
    given = {**dict(data.get("settings") or {}), **settings_from_args(settings)}
    return build_request_body(dict(data.get("inputs") or {}), given)


def batch_script(config: BridgeConfig, body: bytes, correlation_id: str) -> tuple[str, list[str]]:
    """The batch script the bridge would write for the request ``body``, and the command that would
    submit it. Raises InvalidRequest (the bridge would refuse the request) or ValueError (a value
    that must never reach a script)."""
    request = parse_request(
        body, correlation_id=correlation_id, reply_to=config.reply_queue, rodan_origin=config.rodan_base_url
    )
    scheduler = get_scheduler(
        config.scheduler,
        timeout_s=config.scheduler_timeout_s,
        options=config.scheduler_options,
        scheduler_args=config.scheduler_args,
    )
    spool = Spool(config.spool_dir)
    key = safe_key(request.correlation_id)
    spec = rodan_job_spec(config, spool, request.settings, key)
    return scheduler.render(spec), scheduler.submit_command(spool.job_dir(key) / SCRIPT_NAME, spec)


def run(config: BridgeConfig, args: argparse.Namespace) -> int:
    try:
        body = request_body(args.request, args.setting)
        script, command = batch_script(config, body, args.correlation_id)
    except InvalidRequest as exc:
        print(f"hpc-bridge script: the bridge would refuse this request: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # an unreadable file, not JSON, a value no script may hold
        print(f"hpc-bridge script: {exc}", file=sys.stderr)
        return 2
    submit = shlex.join(command)
    if contains_secret(script + "\n" + submit, config.secrets):
        print("hpc-bridge script: not printed: it would contain a password from the credentials", file=sys.stderr)
        return 1
    sys.stdout.write(script)
    sys.stdout.flush()
    print(f"hpc-bridge script: submitted as: {submit}", file=sys.stderr)
    return 0

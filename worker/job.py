"""One training request, start to finish, inside the batch job.

parameter file (read, then deleted) -> download every input -> load the page
-> train one model per layer -> publish the reply (models, or an error naming
the step that failed). The reply is staged in the spool's outbox before it is
published, so a broker outage only delays it: the bridge publishes it later.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from bridge.amqp import connect
from bridge.errors import BridgeError, BrokerUnavailable
from bridge.logs import register_secret, tee_logs_to
from bridge.protocol import error_reply, success_reply
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.spool import Spool, read_json
from bridge.spool import safe_key as spool_key
from worker.gpumon import GpuMonitor

if TYPE_CHECKING:
    from worker.trainer.rundir import RunDirectory

log = structlog.get_logger("worker")


@dataclass(frozen=True)
class JobParameters:
    correlation_id: str
    reply_to: str
    inputs: dict[str, str]
    layers: list[tuple[str, str]]  # (input name, reply key)
    settings: dict[str, Any]
    rodan_base_url: str
    token: str
    broker_url: str
    broker_ca_file: str | None
    spool: Path
    runs_dir: Path
    save_optimizer: bool
    max_reply_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobParameters:
        return cls(
            correlation_id=str(data["correlation_id"]),
            reply_to=str(data["reply_to"]),
            inputs={str(k): str(v) for k, v in data["inputs"].items()},
            layers=[(str(a), str(b)) for a, b in data["layers"]],
            settings=dict(data["settings"]),
            rodan_base_url=str(data["rodan"]["base_url"]),
            token=str(data["rodan"]["token"]),
            broker_url=str(data["broker"]["url"]),
            broker_ca_file=data["broker"].get("ca_file"),
            spool=Path(data["spool"]),
            runs_dir=Path(data.get("runs_dir") or Path(data["spool"]) / "runs"),
            save_optimizer=bool(data.get("save_optimizer", False)),
            max_reply_bytes=int(data.get("max_reply_bytes", 128 * 1024 * 1024)),
        )


class StepFailed(Exception):
    def __init__(self, step: str, cause: BaseException) -> None:
        self.step = step
        self.cause = cause
        super().__init__(f"{step}: {cause}")


def run_job(params_path: Path) -> int:
    try:
        raw = read_json(params_path)
    except (OSError, ValueError) as exc:
        log.error("params_unreadable", path=str(params_path), error=type(exc).__name__)
        return 3
    params = JobParameters.from_json(raw)
    register_secret(params.token)
    register_secret(_password(params.broker_url))
    params_path.unlink(missing_ok=True)  # the token must not outlive its reading
    structlog.contextvars.bind_contextvars(
        correlation_id=params.correlation_id, job_id=os.environ.get("SLURM_JOB_ID", "")
    )
    replies = ReplyBox(Spool(params.spool), max_bytes=params.max_reply_bytes)
    if replies.already_replied(params.correlation_id):
        log.warning("already_replied", note="this request was answered before; nothing to do")
        return 0
    try:
        # Imports TensorFlow: an environment that cannot train still gets its error reply.
        from worker.trainer.rundir import RunDirectory

        run_dir = RunDirectory.create(params.runs_dir, spool_key(params.correlation_id))
    except Exception as exc:
        log.error("job_failed", step="starting", error=_describe(exc))
        deliver(replies, params, error_reply(f"the training job failed while starting: {_describe(exc)}"))
        return 1
    tee_logs_to(run_dir.log_path)
    log.info("job_start", layers=[key for _, key in params.layers], host=os.uname().nodename, run_dir=str(run_dir.path))
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="hpc-worker-", dir=os.environ.get("TMPDIR")))
    try:
        with GpuMonitor(run_dir.path / "gpu.csv"):
            body = success_reply(train(params, workdir, run_dir))
        ok = True
    except StepFailed as exc:
        log.error("job_failed", step=exc.step, error=str(exc.cause), error_type=type(exc.cause).__name__)
        body = error_reply(f"the training job failed while {exc.step}: {_describe(exc.cause)}")
        ok = False
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("job_trained", ok=ok, seconds=round(time.monotonic() - started, 1), reply_bytes=len(body))
    deliver(replies, params, body)
    return 0 if ok else 1


def train(params: JobParameters, workdir: Path, run_dir: RunDirectory | None = None) -> dict[str, bytes]:
    """Download, load, train; returns reply key -> HDF5 bytes. Raises StepFailed."""
    rodan = RodanClient(params.rodan_base_url, token=params.token)
    files: dict[str, Path] = {}
    for index, (name, resource) in enumerate(sorted(params.inputs.items())):
        try:
            result = rodan.download(resource, workdir / f"input-{index}")
        except Exception as exc:
            raise StepFailed(f"downloading {name!r}", exc) from exc
        files[name] = result.path
        log.info("input_downloaded", input=name, bytes=result.bytes, seconds=round(result.seconds, 3))

    try:
        from worker.trainer import Page, TrainSettings, load_page, train_page

        layer_paths = {key: files[input_name] for input_name, key in params.layers}
        page: Page = load_page(files["Image"], layer_paths, files.get("Selected Regions"))
    except Exception as exc:
        raise StepFailed("reading the input images", exc) from exc
    s = params.settings
    settings = TrainSettings(
        epochs=int(s["epochs"]),
        max_samples_per_label=int(s["max_samples_per_label"]),
        patch_height=int(s["patch_height"]),
        patch_width=int(s["patch_width"]),
        batch_size=int(s.get("batch_size", 16)),
        patience=int(s.get("patience", 3)),
        include_optimizer=params.save_optimizer,
    )
    out_dir = workdir / "models"
    out_dir.mkdir()
    try:
        paths = train_page(page, settings, out_dir, on_epoch=lambda event: log.info("epoch", **event), run_dir=run_dir)
    except Exception as exc:
        raise StepFailed("training", exc) from exc
    return {key: Path(paths[key]).read_bytes() for _, key in params.layers}


def deliver(replies: ReplyBox, params: JobParameters, body: bytes) -> None:
    """Stage the reply, then publish it; if the broker is unreachable the bridge will."""
    entry = replies.stage(params.correlation_id, params.reply_to, body, origin="worker")
    try:
        connection = connect(params.broker_url, heartbeat=60, ca_file=params.broker_ca_file, name="hpc-worker")
    except BrokerUnavailable as exc:
        log.error("reply_left_in_outbox", error=str(exc), note="hpc-bridge publishes it on its next pass")
        return
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        replies.publish_staged(channel, entry)
    except BridgeError as exc:
        log.error("reply_left_in_outbox", error=str(exc), note="hpc-bridge publishes it on its next pass")
    finally:
        if connection.is_open:
            connection.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (BridgeError, ValueError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _password(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).password or ""


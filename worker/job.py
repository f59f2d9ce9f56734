"""One training request, start to finish, inside the batch job (or a chain of them).

parameter file (the Rodan token is removed from it once read) -> download every input
into the run directory (from Rodan only, each at most the parameter file's
``limits.max_input_bytes``) -> load the page (PNG or JPEG only, at most
``limits.max_input_pixels`` per image) -> train one model per layer, checkpointing ->
publish the reply (models, or an error naming the step that failed). The reply is staged
in the spool's outbox before it is published, so a broker outage only delays it: the
bridge publishes it later.

Warned before its time limit (see worker/continuation.py), the job checkpoints at the
next batch, and continues in a new job that resumes from the checkpoint with the inputs
already downloaded: no Rodan token is needed, and none is kept. After the last allowed
continuation the request gets an error reply saying where training stopped.
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

from bridge.amqp import CONNECTION_ERRORS, connect
from bridge.errors import BridgeError, BrokerUnavailable
from bridge.logs import register_secret, tee_logs_to
from bridge.protocol import error_reply, success_reply, without_private
from bridge.replies import ReplyBox
from bridge.rodan import DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_PIXELS, RodanClient
from bridge.spool import Spool, atomic_write_json, read_json
from bridge.spool import safe_key as spool_key
from bridge.version import package_version
from worker import memory, onednn
from worker.continuation import ContinuationPlan, TimeLimitWarning, continue_job
from worker.gpumon import GpuMonitor

if TYPE_CHECKING:
    from worker.trainer.checkpoint import CheckpointStore
    from worker.trainer.rundir import RunDirectory

log = structlog.get_logger("worker")

#: Folders of the run directory that only matter until the final reply is out.
TRANSIENT_RUN_FOLDERS = ("inputs", "checkpoints")


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
    mixed_precision: str  # the bridge's HPC_MIXED_PRECISION
    max_reply_bytes: int
    run_dir: Path | None  # set once a first job created it: a continuation resumes there
    seed: int | None  # the bridge's HPC_TRAINING_SEED; None: the trainer draws one (and checkpoints it)
    rodan_timeout_s: float = 30.0  # the bridge's HPC_RODAN_TIMEOUT and HPC_RODAN_RETRIES, for downloads
    rodan_retries: int = 4
    # The bridge's HPC_MAX_INPUT_BYTES (one download, raw bytes) and HPC_MAX_INPUT_PIXELS (one image);
    # a parameter file written before they existed has no "limits": the defaults then.
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS
    runs_shared: bool = False  # the bridge's HPC_RUNS_SHARED=group: run directories 0750/0640

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobParameters:
        return cls(
            correlation_id=str(data["correlation_id"]),
            reply_to=str(data["reply_to"]),
            inputs={str(k): str(v) for k, v in data["inputs"].items()},
            layers=[(str(a), str(b)) for a, b in data["layers"]],
            settings=dict(data["settings"]),
            rodan_base_url=str(data["rodan"]["base_url"]),
            token=str(data["rodan"].get("token", "")),
            rodan_timeout_s=float(data["rodan"].get("timeout_s", 30.0)),
            rodan_retries=int(data["rodan"].get("retries", 4)),
            broker_url=str(data["broker"]["url"]),
            broker_ca_file=data["broker"].get("ca_file"),
            spool=Path(data["spool"]),
            runs_dir=Path(data.get("runs_dir") or Path(data["spool"]) / "runs"),
            save_optimizer=bool(data.get("save_optimizer", False)),
            mixed_precision=str(data.get("mixed_precision", "off")),
            max_reply_bytes=int(data.get("max_reply_bytes", 128 * 1024 * 1024)),
            run_dir=Path(data["run_dir"]) if data.get("run_dir") else None,
            seed=int(data["seed"]) if data.get("seed") is not None else None,
            max_input_bytes=_limit(data, "max_input_bytes", DEFAULT_MAX_INPUT_BYTES),
            max_input_pixels=_limit(data, "max_input_pixels", DEFAULT_MAX_INPUT_PIXELS),
            runs_shared=data.get("runs_shared") == "group",
        )

    @property
    def key(self) -> str:
        return spool_key(self.correlation_id)


class StepFailed(Exception):
    def __init__(self, step: str, cause: BaseException) -> None:
        self.step = step
        self.cause = cause
        super().__init__(f"{step}: {cause}")


def warn_on_version_mismatch(raw: Mapping[str, Any]) -> bool:
    """Log ``worker_version_mismatch`` (and return True) when the bridge that wrote the parameter
    file is another version than this worker: not fatal, but an upgrade was done on one side only."""
    theirs, ours = raw.get("bridge_version"), package_version()
    if theirs == ours:
        return False
    log.warning(
        "worker_version_mismatch",
        bridge_version=theirs,
        worker_version=ours,
        fix="install the bridge's version in the worker environment (docs/upgrade.md)",
    )
    return True


def run_job(params_path: Path) -> int:
    try:
        raw = read_json(params_path)
    except (OSError, ValueError) as exc:
        log.error("params_unreadable", path=str(params_path), error=type(exc).__name__)
        return 3
    params = JobParameters.from_json(raw)
    register_secret(params.token)
    register_secret(_password(params.broker_url))
    plan = ContinuationPlan.from_parameters(raw)
    raw = forget_token(params_path, raw, keep_file=plan is not None)
    structlog.contextvars.bind_contextvars(
        correlation_id=params.correlation_id,
        job_id=os.environ.get("HPC_JOB_ID") or os.environ.get("SLURM_JOB_ID", ""),
        continuation=plan.count if plan else 0,
    )
    warn_on_version_mismatch(raw)
    replies = ReplyBox(Spool(params.spool), max_bytes=params.max_reply_bytes)
    if replies.already_replied(params.correlation_id):
        log.warning("already_replied", note="this request was answered before; nothing to do")
        params_path.unlink(missing_ok=True)
        return 0
    warning = TimeLimitWarning.from_environment().install()
    try:
        onednn.choose(onednn.tuning_dir())  # before TensorFlow is imported
        # Imports TensorFlow: an environment that cannot train still gets its error reply.
        from worker.trainer._tf import keras  # noqa: F401
        from worker.trainer.rundir import RunDirectory, let_group_in

        memory.release_library_pages()  # what the import touched once (worker/memory.py)

        if params.run_dir is not None and params.run_dir.is_dir():
            run_dir = RunDirectory(params.run_dir, shared=params.runs_shared)
        else:
            run_dir = RunDirectory.create(params.runs_dir, params.key, shared=params.runs_shared)
        if params.runs_shared and params.runs_dir.parent == params.spool:
            let_group_in(params.spool, 0o010)  # SPOOL/runs: the group passes the spool, lists nothing
    except Exception as exc:
        log.error("job_failed", step="starting", error=_describe(exc, params))
        deliver(replies, params, error_reply(f"the training job failed while starting: {_describe(exc, params)}"))
        params_path.unlink(missing_ok=True)
        return 1
    tee_logs_to(run_dir.log_path)
    run_dir.share()  # the log (0600 when opened) too, where the group may read the run
    log.info(
        "job_resume" if params.run_dir else "job_start",
        layers=[key for _, key in params.layers],
        host=os.uname().nodename,
        run_dir=str(run_dir.path),
        deadline=warning.deadline,
    )
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="hpc-worker-", dir=os.environ.get("TMPDIR")))
    gpu_csv = run_dir.path / ("gpu.csv" if plan is None or plan.count == 0 else f"gpu-{plan.count}.csv")
    try:
        with GpuMonitor(gpu_csv):
            outcome = train_or_stop(params, plan, workdir, run_dir, warning)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        run_dir.share()
    done: dict[str, str] = {}  # what the success event says of the models
    if isinstance(outcome, Stopped):
        body = stopped(outcome, params, plan, params_path, raw, run_dir, warning)
        if body is None:
            return 0  # the next job carries on
        ok = False
    elif isinstance(outcome, StepFailed):
        log.error("job_failed", step=outcome.step, error=str(outcome.cause), error_type=type(outcome.cause).__name__)
        body = error_reply(f"the training job failed while {outcome.step}: {_describe(outcome.cause, params)}")
        ok = False
    else:
        from worker.trainer.saving import MODEL_INPUT  # the trainer is imported: free

        body = success_reply(outcome)
        ok = True
        done["models_accept"] = MODEL_INPUT
        done["trained_on"] = f"{params.settings['patch_height']}x{params.settings['patch_width']} patches"
    log.info("job_trained", ok=ok, seconds=round(time.monotonic() - started, 1), reply_bytes=len(body), **done)
    deliver(replies, params, body)
    finish(params_path, run_dir.path)
    return 0 if ok else 1


@dataclass(frozen=True)
class Stopped:
    """Training checkpointed and stopped on a time-limit warning."""

    where: str  # "layer 'Layer 1' epoch 3 batch 12 of 40"


def train_or_stop(
    params: JobParameters,
    plan: ContinuationPlan | None,
    workdir: Path,
    run_dir: RunDirectory,
    warning: TimeLimitWarning,
) -> dict[str, bytes] | Stopped | StepFailed:
    """Train with checkpoints in the run directory (node-local scratch, synced, where there is some)."""
    from worker.trainer import TrainingInterrupted
    from worker.trainer.sync import open_checkpoints

    local = node_local_checkpoints(plan, params.key)
    sync_s = plan.sync_s if plan else 60.0
    try:
        with open_checkpoints(run_dir.path / "checkpoints", local, sync_s) as store:
            try:
                return train(params, workdir, run_dir, checkpoints=store, stop_requested=warning)
            except TrainingInterrupted as exc:
                log.warning("training_stopped", reason=warning.reason, stopped_at=str(exc))
                store.flush()  # the checkpoint is on persistent storage before the job goes
                return Stopped(str(exc))
    except StepFailed as exc:
        return exc
    except Exception as exc:  # the checkpoint store itself failed
        return StepFailed("checkpointing", exc)
    finally:
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)


def stopped(
    outcome: Stopped,
    params: JobParameters,
    plan: ContinuationPlan | None,
    params_path: Path,
    raw: Mapping[str, Any],
    run_dir: RunDirectory,
    warning: TimeLimitWarning,
) -> bytes | None:
    """Continue in a new job (returns None), or the error reply when that is not allowed or fails."""
    limit = os.environ.get("HPC_JOB_TIME_LIMIT_S", "?")
    if plan is None or plan.maximum == 0:
        reason = f"training was stopped by {warning.reason} at {outcome.where}, and this bridge does not continue jobs"
    elif plan.exhausted:
        reason = (
            f"training needs more time than {plan.maximum + 1} jobs of {limit} s each: it stopped at "
            f"{outcome.where} after {plan.count} continuations; raise 'Maximum time (D-HH:MM)' or the "
            "bridge's HPC_MAX_CONTINUATIONS, or lower the epochs or samples per label"
        )
    else:
        try:
            continue_job(
                plan,
                params_path=params_path,
                raw_params=raw,
                spool=Spool(params.spool),
                key=params.key,
                run_dir=run_dir.path,
                stopped_at=outcome.where,
            )
            return None
        except Exception as exc:
            why = _describe(exc, params)
            reason = f"training stopped at {outcome.where} and could not continue in a new job: {why}"
    log.error("job_not_continued", reason=reason)
    return error_reply(reason)


def node_local_checkpoints(plan: ContinuationPlan | None, key: str) -> Path | None:
    """Fast node-local scratch for checkpoints: configured, else $SLURM_TMPDIR, else $TMPDIR."""
    configured = plan.node_local_dir if plan else None
    for base in (configured, os.environ.get("SLURM_TMPDIR"), os.environ.get("TMPDIR")):
        if not base:
            continue
        if Path(base).is_dir():
            from worker.trainer.sync import claim_node_local_dir

            return claim_node_local_dir(Path(base) / f"hpc-checkpoints-{key}")
        if base == configured:
            log.warning("node_local_dir_missing", path=str(base), note="checkpoints go to the run directory")
    return None


def forget_token(params_path: Path, raw: Mapping[str, Any], *, keep_file: bool) -> dict[str, Any]:
    """Remove the Rodan token from disk now that it is in memory.

    The file itself stays (0600, in the private spool) when the job may continue: a
    continuation needs the rest of it. Otherwise it is deleted.
    """
    data = dict(raw)
    data["rodan"] = {k: v for k, v in dict(raw["rodan"]).items() if k != "token"}
    if keep_file:
        atomic_write_json(params_path, data)
    else:
        params_path.unlink(missing_ok=True)
    return data


def finish(params_path: Path, run_dir: Path) -> None:
    """The request is answered: drop what only a continuation needed."""
    params_path.unlink(missing_ok=True)
    for name in TRANSIENT_RUN_FOLDERS:
        shutil.rmtree(run_dir / name, ignore_errors=True)


def train(
    params: JobParameters,
    workdir: Path,
    run_dir: RunDirectory | None = None,
    *,
    checkpoints: CheckpointStore | None = None,
    stop_requested: TimeLimitWarning | None = None,
) -> dict[str, bytes]:
    """Download (or find), load, train; returns reply key -> HDF5 bytes. Raises StepFailed.

    Inputs go to the run directory's ``inputs/`` (persistent: a continuation finds them
    there), or to ``workdir`` without a run directory.
    """
    rodan = RodanClient(
        params.rodan_base_url, token=params.token, timeout_s=params.rodan_timeout_s, retries=params.rodan_retries
    )
    inputs_dir = run_dir.path / "inputs" if run_dir is not None else workdir
    inputs_dir.mkdir(mode=0o700, exist_ok=True)
    files: dict[str, Path] = {}
    for index, (name, resource) in enumerate(sorted(params.inputs.items())):
        dest = inputs_dir / f"input-{index}"
        files[name] = dest
        if dest.exists():  # downloads are atomic: a file that exists is complete
            log.info("input_present", input=name, bytes=dest.stat().st_size)
            continue
        try:
            result = rodan.download(resource, dest, max_bytes=params.max_input_bytes)
        except Exception as exc:
            raise StepFailed(f"downloading {name!r}", exc) from exc
        log.info("input_downloaded", input=name, bytes=result.bytes, seconds=round(result.seconds, 3))

    try:
        from worker.trainer import Page, TrainingInterrupted, TrainSettings, load_page, train_page

        layer_paths = {key: files[input_name] for input_name, key in params.layers}
        page: Page = load_page(
            files["Image"], layer_paths, files.get("Selected Regions"), max_pixels=params.max_input_pixels
        )
    except Exception as exc:
        raise StepFailed("reading the input images", exc) from exc
    s = params.settings
    try:
        settings = TrainSettings(
            epochs=int(s["epochs"]),
            max_samples_per_label=int(s["max_samples_per_label"]),
            patch_height=int(s["patch_height"]),
            patch_width=int(s["patch_width"]),
            batch_size=int(s.get("batch_size", 16)),
            patience=int(s.get("patience", 3)),
            include_optimizer=params.save_optimizer,
            mixed_precision=params.mixed_precision,
            seed=params.seed,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise StepFailed("reading the training settings", exc) from exc
    out_dir = workdir / "models"
    out_dir.mkdir()
    try:
        paths = train_page(
            page,
            settings,
            out_dir,
            on_epoch=lambda event: log.info("epoch", **event),
            run_dir=run_dir,
            checkpoints=checkpoints,
            stop_requested=stop_requested,
        )
    except TrainingInterrupted:
        raise  # checkpointed: the caller continues the job
    except Exception as exc:
        raise StepFailed("training", exc) from exc
    return {key: Path(paths[key]).read_bytes() for _, key in params.layers}


#: What ends a worker's publication, leaving the staged reply to the bridge.
_DELIVERY_ERRORS: tuple[type[BaseException], ...] = (BridgeError, *CONNECTION_ERRORS)


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
        # The bytes just staged, unless stage() turned an oversized reply into an error reply.
        replies.publish_staged(channel, entry, body if len(body) <= replies.max_bytes else None)
    except _DELIVERY_ERRORS as exc:
        # The broker may go away between connecting and publishing (channel() and confirm_delivery()
        # raise pika's own errors): the reply is staged, so the bridge publishes it.
        log.error("reply_left_in_outbox", error=_describe(exc, params), note="hpc-bridge publishes it on its next pass")
    finally:
        if connection.is_open:
            try:
                connection.close()
            except CONNECTION_ERRORS:
                pass


def _limit(data: Mapping[str, Any], name: str, default: int) -> int:
    """``data["limits"][name]``, or ``default`` when the bridge that wrote the file set none."""
    limits = data.get("limits")
    value = limits.get(name) if isinstance(limits, Mapping) else None
    return int(value) if value is not None else default


def _describe(exc: BaseException, params: JobParameters) -> str:
    """An exception as Rodan's users read it: without the installation's paths."""
    text = str(exc) if isinstance(exc, (BridgeError, ValueError)) else f"{type(exc).__name__}: {exc}"
    paths = {str(params.spool): "<spool>", str(params.runs_dir): "<runs>", str(Path.home()): "<home>"}
    return without_private(text, paths, {})


def _password(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).password or ""

"""One training request, start to finish, inside the batch job (or a chain of them).

parameter file (``bridge.handoff.JobParameters``; the Rodan token is removed from it once
read) -> download every input into the run directory (from Rodan only, each at most the
parameter file's ``limits.max_input_bytes``; with HPC_INPUTS_FETCH=login the bridge fetched
them into the spool at intake, and the job reads them there without any connection) -> load
the page (PNG or JPEG only, at most ``limits.max_input_pixels`` per image) -> train one
model per layer, checkpointing -> publish the reply (models, or an error naming the step
that failed). The reply is staged in the spool's outbox before it is published, so a broker
outage only delays it: the bridge publishes it later.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import structlog
import urllib3

from bridge.amqp import CONNECTION_ERRORS, connect
from bridge.errors import BridgeError, BrokerUnavailable, TransientError
from bridge.handoff import TRANSIENT_RUN_FOLDERS, JobParameters
from bridge.logs import register_secret, tee_logs_to
from bridge.protocol import Generation, InputRole, error_reply, success_reply, without_private
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import own_job_id, scratch_variables
from bridge.spool import Spool, atomic_write_json, read_json
from bridge.version import package_version
from worker import memory, onednn
from worker.continuation import TimeLimitWarning, continue_job
from worker.gpumon import GpuMonitor
from worker.training_log import TrainingLog

if TYPE_CHECKING:
    from worker.trainer import Page
    from worker.trainer.checkpoint import CheckpointStore
    from worker.trainer.rundir import RunDirectory
    from worker.trainer.settings import TrainSettings

log = structlog.get_logger("worker")

#: What the worker's ``layer_learned_nothing`` event tells the operator to have the user change.
LEARNED_NOTHING_ADVICE = (
    "the model marks every pixel alike: train again with more of this layer (paint more of it, or raise the "
    "samples per label), more epochs, or a larger patch"
)
#: The reply key of the Log File (Rodan 3.x's output port; generation 3 only).
LOG_FILE_KEY = "Log File"


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
    try:
        params = JobParameters.from_json(raw)
    except ValueError as exc:  # another version's file, or a broken one: the message names no value
        log.error("params_unreadable", path=str(params_path), error=type(exc).__name__, reason=str(exc))
        if isinstance(raw, Mapping):
            warn_on_version_mismatch(raw)
        return 3
    register_secret(params.rodan.token)
    register_secret(_password(params.broker.url))
    forget_token(params_path, params, keep_file=True)  # a requeued or continued job reads it again
    structlog.contextvars.bind_contextvars(
        correlation_id=params.correlation_id,
        job_id=own_job_id(os.environ),
        continuation=params.continuation.count,
    )
    warn_on_version_mismatch(raw)
    replies = ReplyBox(Spool(params.spool), max_bytes=params.max_reply_bytes)
    if replies.already_replied(params.correlation_id):
        log.warning("already_replied", note="this request was answered before; nothing to do")
        params_path.unlink(missing_ok=True)
        _drop_fetched(params)
        return 0
    warning = TimeLimitWarning.from_environment().install()
    try:
        onednn.choose(onednn.tuning_dir())  # before TensorFlow is imported
        # Imports TensorFlow: an environment that cannot train still gets its error reply.
        from worker.trainer._keras import keras  # noqa: F401
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
        _drop_fetched(params)
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
    story = TrainingLog.open(run_dir.path)
    story.job_started(
        request=params.correlation_id,
        job=own_job_id(os.environ) or "",
        host=os.uname().nodename,
        continuation=params.continuation.count,
        settings=story_settings(params),
    )
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="hpc-worker-", dir=os.environ.get("TMPDIR")))
    gpu_csv = run_dir.path / ("gpu.csv" if params.continuation.count == 0 else f"gpu-{params.continuation.count}.csv")
    try:
        with GpuMonitor(gpu_csv):
            outcome = train_or_stop(params, workdir, run_dir, warning, story)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        run_dir.share()
    done: dict[str, str] = {}  # what the success event says of the models
    if isinstance(outcome, Stopped):
        story.stopped(where=outcome.where, reason=warning.reason or "the time-limit warning")
        body = stopped(outcome, params, params_path, run_dir, warning)
        if body is None:
            return 0  # the next job carries on
        ok = False
    elif isinstance(outcome, StepFailed):
        log.error("job_failed", step=outcome.step, error=str(outcome.cause), error_type=type(outcome.cause).__name__)
        cause = _describe(outcome.cause, params)
        body = error_reply(f"the training job failed while {outcome.step}: {cause}")
        story.failed(f"while {outcome.step}: {cause}")
        ok = False
    else:
        from worker.trainer.saving import MODEL_INPUT  # the trainer is imported: free

        story.finished(list(outcome))
        if params.generation is Generation.RODAN3:  # Rodan 3.x's Log File output
            outcome = {**outcome, LOG_FILE_KEY: story.text().encode("utf-8")}
        body = success_reply(outcome)
        ok = True
        done["models_accept"] = MODEL_INPUT
        done["trained_on"] = f"{params.settings.patch_height}x{params.settings.patch_width} patches"
    log.info("job_trained", ok=ok, seconds=round(time.monotonic() - started, 1), reply_bytes=len(body), **done)
    deliver(replies, params, body)
    finish(params_path, run_dir.path, params.inputs_dir)
    return 0 if ok else 1


@dataclass(frozen=True)
class Stopped:
    """Training checkpointed and stopped on a time-limit warning."""

    where: str  # "layer 'Layer 1' epoch 3 batch 12 of 40"


def train_or_stop(
    params: JobParameters,
    workdir: Path,
    run_dir: RunDirectory,
    warning: TimeLimitWarning,
    story: TrainingLog | None = None,
) -> dict[str, bytes] | Stopped | StepFailed:
    """Train with checkpoints in the run directory (node-local scratch, synced, where there is some)."""
    from worker.trainer import TrainingInterrupted
    from worker.trainer.sync import open_checkpoints

    local = node_local_checkpoints(params.continuation.node_local_dir, params.key)
    try:
        with open_checkpoints(run_dir.path / "checkpoints", local, params.continuation.sync_s) as store:
            try:
                return train(params, workdir, run_dir, checkpoints=store, stop_requested=warning, story=story)
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
    params_path: Path,
    run_dir: RunDirectory,
    warning: TimeLimitWarning,
) -> bytes | None:
    """Continue in a new job (returns None), or the error reply when that is not allowed or fails."""
    limit = os.environ.get("HPC_JOB_TIME_LIMIT_S", "?")
    state = params.continuation
    if state.max == 0:
        reason = f"training was stopped by {warning.reason} at {outcome.where}, and this bridge does not continue jobs"
    elif state.exhausted:
        reason = (
            f"training needs more time than {state.max + 1} jobs of {limit} s each: it stopped at "
            f"{outcome.where} after {state.count} continuations; raise 'Maximum time (D-HH:MM)' or the "
            "bridge's HPC_MAX_CONTINUATIONS, or lower the epochs or samples per label"
        )
    else:
        try:
            continue_job(
                params,
                params_path=params_path,
                run_dir=run_dir.path,
                stopped_at=outcome.where,
            )
            return None
        except Exception as exc:
            why = _describe(exc, params)
            reason = f"training stopped at {outcome.where} and could not continue in a new job: {why}"
    log.error("job_not_continued", reason=reason)
    return error_reply(reason)


def node_local_checkpoints(configured: Path | None, key: str) -> Path | None:
    """Fast node-local scratch for checkpoints: configured, else the scheduler's ($SLURM_TMPDIR), else $TMPDIR."""
    for base in (configured, *(os.environ.get(v) for v in (*scratch_variables(), "TMPDIR"))):
        if not base:
            continue
        if Path(base).is_dir():
            from worker.trainer.sync import claim_node_local_dir

            return claim_node_local_dir(Path(base) / f"hpc-checkpoints-{key}")
        if base == configured:
            log.warning("node_local_dir_missing", path=str(base), note="checkpoints go to the run directory")
    return None


def forget_token(params_path: Path, params: JobParameters, *, keep_file: bool) -> JobParameters:
    """Remove the Rodan token from disk now that it is in memory; returns the parameters as stored.

    The file itself stays (0600, in the private spool) when the job may continue: a
    continuation needs the rest of it. Otherwise it is deleted.
    """
    stored = replace(params, rodan=replace(params.rodan, token=""))
    if keep_file:
        atomic_write_json(params_path, stored.to_json())
    else:
        params_path.unlink(missing_ok=True)
    return stored


def finish(params_path: Path, run_dir: Path, inputs_dir: Path | None = None) -> None:
    """The request is answered: drop what only a continuation needed (and the inputs the bridge
    fetched into the spool, ``inputs_dir``, with HPC_INPUTS_FETCH=login)."""
    params_path.unlink(missing_ok=True)
    for name in TRANSIENT_RUN_FOLDERS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if inputs_dir is not None:
        shutil.rmtree(inputs_dir, ignore_errors=True)


#: Test hook, read from the job's environment (a test sets it in HPC_JOB_PROLOGUE): the most fresh
#: starts a layer may take (worker.trainer.settings.MAX_FRESH_STARTS when unset). For the tests whose
#: subject is not the trainer: each fresh start repeats a layer's first epoch, which a tiny test
#: training almost always ends where it started (tests/test_fresh_start.py tests the guard itself).
TEST_FRESH_STARTS = "HPC_TEST_FRESH_STARTS"


def train_settings(params: JobParameters, environ: Mapping[str, str] | None = None) -> TrainSettings:
    """The trainer's settings for this request: the request's own, the bridge's HPC_SAVE_OPTIMIZER,
    HPC_MIXED_PRECISION and HPC_TRAINING_SEED; the rest is the trainer's (strategy, validation split),
    but for the test hook :data:`TEST_FRESH_STARTS` in ``environ`` (default: this process's).
    Raises TrainingInputError for a value the trainer cannot use."""
    from worker.trainer.settings import MAX_FRESH_STARTS, TrainSettings

    hook = (os.environ if environ is None else environ).get(TEST_FRESH_STARTS, "")
    s = params.settings
    return TrainSettings(
        max_fresh_starts=int(hook) if hook.isdigit() else MAX_FRESH_STARTS,
        epochs=s.epochs,
        max_samples_per_label=s.max_samples_per_label,
        patch_height=s.patch_height,
        patch_width=s.patch_width,
        batch_size=s.batch_size,
        patience=s.patience,
        include_optimizer=params.save_optimizer,
        mixed_precision=params.mixed_precision,
        seed=params.seed,
    )


def train(
    params: JobParameters,
    workdir: Path,
    run_dir: RunDirectory | None = None,
    *,
    checkpoints: CheckpointStore | None = None,
    stop_requested: TimeLimitWarning | None = None,
    story: TrainingLog | None = None,
) -> dict[str, bytes]:
    """Download (or find), load, train; returns reply key -> HDF5 bytes. Raises StepFailed.

    Inputs go to the run directory's ``inputs/`` (persistent: a continuation finds them
    there), or to ``workdir`` without a run directory; with HPC_INPUTS_FETCH=login the bridge
    fetched them into ``params.inputs_dir`` and nothing connects to Rodan. ``story`` (the Log
    File) hears of the pages and of every epoch.
    """
    if params.inputs_dir is not None:
        files = fetched_inputs(params, params.inputs_dir)
    else:
        files = download_inputs(params, run_dir.path / "inputs" if run_dir is not None else workdir)

    if params.generation is Generation.RODAN3:
        pages, reply_keys, starting = read_rodan3_inputs(params, files, workdir)
    else:
        pages, reply_keys, starting = read_page_inputs(params, files), {key: key for _, key in params.layers}, {}
    if story is not None:
        story.inputs(
            [f"{page.name or 'the page'} ({page.width}x{page.height} pixels)" for page in pages],
            [reply_keys[label] for label in starting],
        )
    try:
        settings = train_settings(params)
    except ValueError as exc:  # TrainingInputError: a value the trainer cannot use
        raise StepFailed("reading the training settings", exc) from exc
    out_dir = workdir / "models"
    out_dir.mkdir()

    def on_epoch(event: dict[str, Any]) -> None:
        log.info("epoch", **event)
        if story is not None:
            story.epoch(event)

    def on_layer(event: dict[str, Any]) -> None:
        fields = {key: value for key, value in event.items() if key != "event"}
        model = reply_keys.get(str(event.get("label")), str(event.get("label")))
        if event["event"] == "fresh_start":
            log.warning("layer_fresh_start", model=model, **fields)
            if story is not None:
                story.fresh_start(event)
            return
        if event.get("one_class"):
            log.warning("layer_learned_nothing", model=model, advice=LEARNED_NOTHING_ADVICE, **fields)
        else:
            log.info("layer_trained", model=model, **fields)
        if story is not None:
            story.layer_trained(event, model)

    from worker.trainer import TrainingInterrupted, train_pages

    try:
        paths = train_pages(
            pages,
            settings,
            out_dir,
            on_epoch=on_epoch,
            run_dir=run_dir,
            checkpoints=checkpoints,
            stop_requested=stop_requested,
            initial_models=starting or None,
            on_layer=on_layer,
        )
    except TrainingInterrupted:
        raise  # checkpointed: the caller continues the job
    except Exception as exc:
        raise StepFailed("training", exc) from exc
    return {reply_keys[label]: Path(paths[label]).read_bytes() for label in reply_keys}


def download_inputs(params: JobParameters, inputs_dir: Path) -> dict[str, Path]:
    """Every input from Rodan into ``inputs_dir`` (a file already there is complete: downloads are
    atomic); input name -> file. Raises StepFailed, saying so when this node cannot reach Rodan."""
    from bridge.handoff import input_files

    access = params.rodan
    rodan = RodanClient(access.base_url, token=access.token, timeout_s=access.timeout_s, retries=access.retries)
    inputs_dir.mkdir(mode=0o700, exist_ok=True)
    files = input_files(params.inputs, inputs_dir)
    for name, dest in files.items():
        if dest.exists():
            log.info("input_present", input=name, bytes=dest.stat().st_size)
            continue
        try:
            result = rodan.download(params.inputs[name], dest, max_bytes=params.limits.max_input_bytes)
        except Exception as exc:
            if not _unreachable(exc):
                raise StepFailed(f"downloading {name!r}", exc) from exc
            cause = TransientError(
                f"this compute node could not reach Rodan at {access.base_url} ({exc}); where the compute nodes "
                f"have no route to Rodan, {INPUTS_FETCH_FIX}"
            )
            raise StepFailed(f"downloading {name!r}", cause) from exc
        log.info("input_downloaded", input=name, bytes=result.bytes, seconds=round(result.seconds, 3))
    return files


#: What to do where compute nodes cannot reach Rodan (the reply and the log say it).
INPUTS_FETCH_FIX = "the operator sets HPC_INPUTS_FETCH=login, and the bridge fetches the inputs on the login node"


def _unreachable(exc: BaseException) -> bool:
    """Whether a download failed before any connection to Rodan: no route, no name, a refused
    connection or proxy, a failed TLS handshake, a connect timeout (behind the client's
    TransientError); not a 5xx, a slow answer, a reset or a cut-off body from a Rodan reached."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (requests.exceptions.ProxyError, requests.exceptions.SSLError, requests.ConnectTimeout)):
            return True
        if isinstance(seen, requests.ConnectionError):
            reason = getattr(seen.args[0], "reason", None) if seen.args else None
            return isinstance(reason, urllib3.exceptions.NewConnectionError)
        seen = seen.__cause__
    return False


def fetched_inputs(params: JobParameters, folder: Path) -> dict[str, Path]:
    """HPC_INPUTS_FETCH=login: the inputs the bridge fetched into ``folder`` at intake (checked
    there against HPC_MAX_INPUT_BYTES and their kind; opened below with every other check)."""
    from bridge.handoff import input_files

    files = input_files(params.inputs, folder)
    for name, path in files.items():
        if not path.is_file():
            reason = ValueError(
                f"{name!r} is not in {folder}, where the bridge fetched every input at intake (HPC_INPUTS_FETCH=login)"
            )
            raise StepFailed("reading the inputs fetched on the login node", reason)
        log.info("input_present", input=name, bytes=path.stat().st_size, fetched="login")
    return files


def read_page_inputs(params: JobParameters, files: Mapping[str, Path]) -> list[Page]:
    """The older generations' one page: the image, its layers (labelled by reply key) and the selected regions."""
    try:
        from worker.trainer import load_page

        layer_paths = {key: files[input_name] for input_name, key in params.layers}
        return [
            load_page(
                files["Image"], layer_paths, files.get("Selected Regions"), max_pixels=params.limits.max_input_pixels
            )
        ]
    except Exception as exc:
        raise StepFailed("reading the input images", exc) from exc


def read_rodan3_inputs(
    params: JobParameters, files: Mapping[str, Path], workdir: Path
) -> tuple[list[Page], dict[str, str], dict[str, Path]]:
    """Generation 3: the pages of the sample zips, label -> reply key, and label -> starting model.

    The layers come from the zips (``Background``, ``Layer 1`` ...; reply keys ``Background
    Model``, ``Model 1`` ...); a starting model given for a layer the samples do not have is an
    error, as Rodan's own trainer cannot use it either.
    """
    from worker.sample_zips import model_name, read_sample_inputs

    try:
        samples = read_sample_inputs(
            {name: files[name] for name, role in params.roles.items() if role is not InputRole.MODEL},
            workdir / "samples",
            max_pixels=params.limits.max_input_pixels,
        )
    except Exception as exc:
        raise StepFailed("reading the sample zips", exc) from exc
    pages = [sample.page for sample in samples]
    reply_keys = {label: model_name(label) for label in pages[0].masks}
    label_of = {key: label for label, key in reply_keys.items()}
    starting: dict[str, Path] = {}
    for name, role in params.roles.items():
        if role is not InputRole.MODEL:
            continue
        if name not in label_of:
            layers = ", ".join(reply_keys.values())
            reason = ValueError(
                f"the starting model {name!r} has no layer to train: the samples have {len(reply_keys)} layers "
                f"({layers}); leave {name!r} out or add its layer in Pixel.js"
            )
            raise StepFailed("reading the starting models", reason)
        starting[label_of[name]] = files[name]
    return pages, reply_keys, starting


def story_settings(params: JobParameters) -> dict[str, Any]:
    """The settings the Log File shows, as Rodan names them."""
    s = params.settings
    return {
        "patch": f"{s.patch_height}x{s.patch_width}",
        "batch size": s.batch_size,
        "maximum epochs": s.epochs,
        "maximum samples per label": s.max_samples_per_label,
        "patience": s.patience,
        "maximum time per job": s.max_time,
    }


#: What ends a worker's publication, leaving the staged reply to the bridge.
_DELIVERY_ERRORS: tuple[type[BaseException], ...] = (BridgeError, *CONNECTION_ERRORS)


def deliver(replies: ReplyBox, params: JobParameters, body: bytes) -> None:
    """Stage the reply, then publish it; if the broker is unreachable the bridge will."""
    entry = replies.stage(
        params.correlation_id, params.reply_to, body, origin="worker", part_bytes=params.reply_part_bytes
    )
    try:
        connection = connect(params.broker.url, heartbeat=60, ca_file=params.broker.ca_file, name="hpc-worker")
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


def _describe(exc: BaseException, params: JobParameters) -> str:
    """An exception as Rodan's users read it: without the installation's paths."""
    text = str(exc) if isinstance(exc, (BridgeError, ValueError)) else f"{type(exc).__name__}: {exc}"
    paths = {str(params.spool): "<spool>", str(params.runs_dir): "<runs>", str(Path.home()): "<home>"}
    return without_private(text, paths, {})


def _drop_fetched(params: JobParameters) -> None:
    """The request is answered: the inputs the bridge fetched for it (HPC_INPUTS_FETCH=login) go."""
    if params.inputs_dir is not None:
        shutil.rmtree(params.inputs_dir, ignore_errors=True)


def _password(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).password or ""

"""The parameter file (bridge/handoff.py): one typed record from the bridge's intake to the worker.

It round-trips exactly; a field missing or unknown anywhere, a value of the wrong type or a file of
another layout version is refused with a message naming it (never a value: the file holds the Rodan
token); the defaults exist once; and a file the real ``Intake`` writes is what the worker reads.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from bridge.config import BridgeConfig, load_config
from bridge.handoff import (
    DEFAULT_CHECKPOINT_SYNC_S,
    DEFAULT_MAX_CONTINUATIONS,
    DEFAULT_MAX_INPUT_BYTES,
    DEFAULT_MAX_INPUT_PIXELS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_RODAN_RETRIES,
    DEFAULT_RODAN_TIMEOUT_S,
    DEFAULT_SCHEDULER_TIMEOUT_S,
    PARAMETERS_VERSION,
    BrokerAccess,
    ContinuationState,
    InputLimits,
    JobParameters,
    RodanAccess,
    SchedulerAccess,
)
from bridge.protocol import Generation, RequestSettings, parse_request
from bridge.replies import ReplyBox
from bridge.rodan import IMAGE_KINDS, InputInfo, InputKind, RodanClient
from bridge.schedulers import JobSpec
from bridge.spool import Spool, atomic_write_json, read_json

TOKEN = "token-3f9a8c-never-in-a-message"


def sample() -> JobParameters:
    """Parameters with no field at its default, so that a field dropped on either side shows."""
    spool = Path("/srv/spool")
    spec = JobSpec(
        name="rodan-k1",
        comment="k1",
        time_minutes=90,
        memory_mb=8000,
        cpus=4,
        command=("/envs/worker-1/bin/python", "-m", "worker", "run", "/srv/spool/params/k1.json"),
        log_dir=spool / "jobs" / "k1",
        workdir=spool / "jobs" / "k1",
        gres="gpu:1",
        email="me@example.org",
        account="lab",
        partition="gpu",
        warn_seconds=300,
        continue_by="successor",
        hold_after="41",
        environment={"A": "1"},
        extra_args=("--hold",),
        directives=("--qos=high",),
        prologue="module load cuda",
    )
    return JobParameters(
        correlation_id="k1",
        reply_to="hpc-results",
        generation=Generation.OLD,
        inputs={"Image": "/uploads/a", "Background": "/uploads/b"},
        layers=(("Background", "Background Model"), ("Text", "Text Model")),
        settings=RequestSettings(
            epochs=7,
            max_samples_per_label=500,
            patch_height=32,
            patch_width=48,
            max_time="0-01:30",
            max_memory_mb=8000,
            cpus=4,
            notification_email="me@example.org",
            batch_size=8,
            patience=2,
        ),
        rodan=RodanAccess(base_url="https://rodan.example.org:8443", token=TOKEN, timeout_s=7.5, retries=1),
        broker=BrokerAccess(url="amqps://u:p@broker:5671/%2F", ca_file="/etc/ca.pem"),
        spool=spool,
        runs_dir=Path("/lab/runs"),
        runs_shared=True,
        save_optimizer=True,
        mixed_precision="bfloat16",
        seed=11,
        max_reply_bytes=5_000_000,
        limits=InputLimits(max_input_bytes=5000, max_input_pixels=7000),
        job=SchedulerAccess(
            scheduler="gridengine",
            options={"pe": "smp"},
            timeout_s=12.0,
            script=spool / "jobs" / "k1" / "job.sh",
            spec=spec,
        ),
        continuation=ContinuationState(count=2, max=3, node_local_dir=Path("/local"), sync_s=5.0),
        run_dir=Path("/lab/runs/20261126-k1"),
        inputs_dir=spool / "jobs" / "k1" / "inputs",  # HPC_INPUTS_FETCH=login
        created_at=1764000000.5,
        bridge_pid=4321,
        bridge_version="9.9.9",
    )


def sample_json() -> dict[str, Any]:
    return json.loads(json.dumps(sample().to_json()))  # as it comes off the disk


def field_paths(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every field of the file, as the key path to it: ("rodan", "token"), ("job", "spec", "name")."""
    for name, value in data.items():
        path = (*prefix, name)
        yield path
        if isinstance(value, dict) and name not in ("inputs", "options", "environment"):  # groups, not mappings
            yield from field_paths(value, path)


def without(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    holder = changed
    for name in path[:-1]:
        holder = holder[name]
    del holder[path[-1]]
    return changed


def with_value(data: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    holder = changed
    for name in path[:-1]:
        holder = holder[name]
    holder[path[-1]] = value
    return changed


def test_a_round_trip_through_json_gives_the_same_parameters() -> None:
    params = sample()
    raw = sample_json()
    assert JobParameters.from_json(raw) == params
    assert JobParameters.from_json(raw).to_json() == raw
    assert raw["version"] == PARAMETERS_VERSION == 3
    # The defaults round-trip too (None where the bridge sets nothing).
    plain = replace(
        params, seed=None, run_dir=None, continuation=ContinuationState(), broker=BrokerAccess(url="amqp://x")
    )
    assert JobParameters.from_json(json.loads(json.dumps(plain.to_json()))) == plain


ALL_FIELDS = list(field_paths(sample_json()))


def test_the_field_list_covers_every_group() -> None:
    dotted = {".".join(p) for p in ALL_FIELDS}
    assert {"version", "rodan.token", "limits.max_input_pixels", "job.spec.continue_by", "settings.patience"} <= dotted
    assert {"continuation.sync_s", "broker.ca_file", "run_dir", "inputs_dir", "bridge_version"} <= dotted
    assert len(dotted) == len(ALL_FIELDS) > 60


@pytest.mark.parametrize("path", [p for p in ALL_FIELDS if p != ("version",)], ids=".".join)
def test_a_missing_field_is_refused_by_name(path: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"missing field '{'.'.join(path)}'")):
        JobParameters.from_json(without(sample_json(), path))


@pytest.mark.parametrize("group", [(), ("rodan",), ("broker",), ("limits",), ("job",), ("job", "spec"), ("settings",)])
def test_an_unknown_field_is_refused_by_name(group: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unknown field '{'.'.join((*group, 'surplus'))}'")):
        JobParameters.from_json(with_value(sample_json(), (*group, "surplus"), 1))
    renamed = without(with_value(sample_json(), ("rodan", "timeout"), 30), ("rodan", "timeout_s"))
    with pytest.raises(ValueError, match=re.escape("missing field 'rodan.timeout_s'; unknown field 'rodan.timeout'")):
        JobParameters.from_json(renamed)


@pytest.mark.parametrize(
    ("path", "value", "wanted"),
    [
        (("rodan", "token"), 12345, "field 'rodan.token' must be a string, not an integer"),
        (("rodan", "retries"), "4", "field 'rodan.retries' must be an integer, not a string"),
        (("rodan", "retries"), True, "field 'rodan.retries' must be an integer, not a boolean"),
        (("max_reply_bytes",), 1.5, "field 'max_reply_bytes' must be an integer, not a number"),
        (("runs_shared",), "group", "field 'runs_shared' must be a boolean, not a string"),
        (("continuation", "count"), None, "field 'continuation.count' must be an integer, not null"),
        (("settings", "epochs"), "15", "field 'settings.epochs' must be an integer, not a string"),
        (("inputs",), {"Image": 3}, "field 'inputs' must be an object of strings, not an object"),
        (("layers",), [["Background"]], "field 'layers' must be a list of [input name, reply key] pairs"),
        (("generation",), "newest", "field 'generation' must be one of 'old', 'new'"),
        (("roles",), {"Sample 1": "zip"}, "field 'roles' must be an object of input name -> one of 'image'"),
        (("roles",), [], "field 'roles' must be an object of input name"),
        (("reply_part_bytes",), "8", "field 'reply_part_bytes' must be an integer, not a string"),
        (("rodan",), [], "field 'rodan' must be an object, not a list"),
        (("job", "spec", "command"), 7, "field 'job.spec' is not a job spec"),
    ],
    ids=lambda v: ".".join(v) if isinstance(v, tuple) else None,
)
def test_a_value_of_the_wrong_type_is_refused_without_showing_it(
    path: tuple[str, ...], value: object, wanted: str
) -> None:
    raw = with_value(sample_json(), path, value)
    if path == ("rodan", "token"):
        raw = with_value(raw, ("broker", "url"), TOKEN)  # a secret elsewhere in the file stays out too
    with pytest.raises(ValueError) as caught:
        JobParameters.from_json(raw)
    message = str(caught.value)
    assert wanted in message, message
    assert TOKEN not in message and "12345" not in message


def test_numbers_may_be_written_as_integers() -> None:
    raw = with_value(sample_json(), ("rodan", "timeout_s"), 30)  # JSON has one number type
    assert JobParameters.from_json(raw).rodan.timeout_s == 30.0


@pytest.mark.parametrize(
    ("version", "wanted"),
    [
        (4, "version 4 (written by hpc-bridge 9.9.9, a newer hpc-bridge than this worker, which reads version 3)"),
        (2, "version 2 (written by hpc-bridge 9.9.9, an older hpc-bridge than this worker, which reads version 3)"),
        (None, "it has no 'version' (written by hpc-bridge 9.9.9 before parameter files had one)"),
        ("1", "field 'version' must be an integer, not a string"),
    ],
)
def test_a_file_of_another_version_is_refused_before_its_fields_are_read(version: object, wanted: str) -> None:
    raw = with_value(sample_json(), ("surplus_of_a_newer_layout",), {"x": 1})
    raw = without(raw, ("limits",))  # and one an older layout lacked: the version is what is reported
    raw = without(raw, ("version",)) if version is None else with_value(raw, ("version",), version)
    with pytest.raises(ValueError) as caught:
        JobParameters.from_json(raw)
    assert wanted in str(caught.value)
    if not isinstance(version, str):
        assert "install the same hpc-bridge version for the bridge and the worker environment" in str(caught.value)
        assert "docs/upgrade.md" in str(caught.value)


def test_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError, match="must be a JSON object, not a list"):
        JobParameters.from_json([1, 2])


def test_each_default_has_one_source(tmp_path: Path) -> None:
    """The bridge's configuration, the reply box and the Rodan client start from the hand-off's defaults."""
    config = load_config(environ=minimal_environ(tmp_path))
    assert config.max_reply_bytes == DEFAULT_MAX_REPLY_BYTES == 128 * 1024 * 1024
    assert (config.rodan_timeout_s, config.rodan_retries) == (DEFAULT_RODAN_TIMEOUT_S, DEFAULT_RODAN_RETRIES)
    assert (config.max_input_bytes, config.max_input_pixels) == (DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_PIXELS)
    assert config.scheduler_timeout_s == DEFAULT_SCHEDULER_TIMEOUT_S
    assert (config.max_continuations, config.checkpoint_sync_s) == (
        DEFAULT_MAX_CONTINUATIONS,
        DEFAULT_CHECKPOINT_SYNC_S,
    )
    assert ReplyBox(Spool(tmp_path)).max_bytes == DEFAULT_MAX_REPLY_BYTES
    client = RodanClient("https://rodan.example.org")
    assert (client.timeout_s, client.retries) == (DEFAULT_RODAN_TIMEOUT_S, DEFAULT_RODAN_RETRIES)
    assert RodanAccess(base_url="x", token="").timeout_s == DEFAULT_RODAN_TIMEOUT_S
    assert InputLimits() == InputLimits(
        max_input_bytes=DEFAULT_MAX_INPUT_BYTES, max_input_pixels=DEFAULT_MAX_INPUT_PIXELS
    )


# --- the real intake writes it, the real worker reads it -----------------------------------------


def minimal_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
        "RODAN_HOST": "rodan.example.org",
        "RODAN_USER": "hpc@example.org",
        "RODAN_PASSWORD": "a-password-for-the-handoff-tests",
        "HPC_SPOOL_DIR": str(tmp_path / "spool"),
        **extra,
    }


class RodanAnswers(RodanClient):
    """Rodan as the intake sees it: a token, and every input a small PNG (nothing on the network)."""

    def get_token(self) -> str:
        return TOKEN

    def check_input(
        self, resource: str, *, name: str, max_bytes: int, kinds: tuple[InputKind, ...] = IMAGE_KINDS
    ) -> InputInfo:
        return InputInfo(url=self.base_url + resource, bytes=1000, kind=kinds[0])


INPUTS = {
    "Image": "/uploads/projects/p/resources/a/original_file",
    "Background": "/uploads/projects/p/resources/b/original_file",
    "Selected Regions": "/uploads/projects/p/resources/c/original_file",
    "rgba PNG - Layer 0": "/uploads/projects/p/resources/d/original_file",
}
SETTINGS = {
    "Maximum number of training epochs": 7,
    "Maximum number of samples per label": 500,
    "Patch height": 64,
    "Patch width": 96,
    "Maximum time (D-HH:MM)": "0-01:30",
    "Maximum memory (MB)": 8000,
    "CPUs": 2,
    "Batch size": 8,
}


def intake_writes(config: BridgeConfig, correlation_id: str) -> Path:
    """The parameter file the real intake writes for one request (the scheduler records, submits nothing)."""
    from bridge.intake import Intake, Message, Outcome
    from bridge.ledger import Ledger
    from bridge.schedulers import get_scheduler

    spool = Spool(config.spool_dir).ensure()
    scheduler = get_scheduler("slurm", timeout_s=5, options=config.scheduler_options)
    scheduler.submit = lambda *_args: "4242"  # type: ignore[method-assign]
    scheduler.find_by_name = lambda _name: []  # type: ignore[method-assign]
    rodan = RodanAnswers(config.rodan_base_url)
    intake = Intake(config, spool, Ledger(spool), scheduler, rodan, ReplyBox(spool))
    body = json.dumps({"inputs": INPUTS, "settings": SETTINGS}).encode()
    message = Message(
        body=body, correlation_id=correlation_id, reply_to=config.reply_queue, redelivered=False, delivery_tag=1
    )
    assert intake.process(message).outcome is Outcome.SUBMITTED
    return spool.params_path(correlation_id)


def test_the_file_the_intake_writes_is_what_the_worker_reads(tmp_path: Path) -> None:
    from worker.job import train_settings

    config = load_config(
        environ=minimal_environ(
            tmp_path,
            HPC_RODAN_TIMEOUT="7.5",
            HPC_RODAN_RETRIES="1",
            HPC_MAX_INPUT_BYTES="5000",
            HPC_MAX_INPUT_PIXELS="7000",
            HPC_MAX_REPLY_BYTES="2000000",
            HPC_MAX_CONTINUATIONS="3",
            HPC_CHECKPOINT_SYNC="12",
            HPC_TRAINING_SEED="11",
            HPC_MIXED_PRECISION="bfloat16",
            HPC_SAVE_OPTIMIZER="true",
            HPC_RUNS_SHARED="group",
            HPC_RUNS_DIR=str(tmp_path / "lab-runs"),
            HPC_NODE_LOCAL_DIR=str(tmp_path / "scratch"),
        )
    )
    path = intake_writes(config, "corr-handoff")
    raw = read_json(path)
    params = JobParameters.from_json(raw)
    assert raw["version"] == PARAMETERS_VERSION
    request = parse_request(
        json.dumps({"inputs": INPUTS, "settings": SETTINGS}).encode(),
        correlation_id="corr-handoff",
        reply_to=config.reply_queue,
    )
    assert params.settings == request.settings and params.settings.batch_size == 8 and params.settings.patience == 3
    assert (params.correlation_id, params.reply_to, params.generation) == (
        "corr-handoff",
        config.reply_queue,
        Generation.NEW,
    )
    assert dict(params.inputs) == INPUTS
    assert params.layers == (("Background", "Background Model"), ("rgba PNG - Layer 0", "Model 0"))
    assert params.rodan == RodanAccess(base_url=config.rodan_base_url, token=TOKEN, timeout_s=7.5, retries=1)
    assert params.broker == BrokerAccess(url=config.broker_url, ca_file=None)
    assert params.limits == InputLimits(max_input_bytes=5000, max_input_pixels=7000)
    assert (params.max_reply_bytes, params.seed, params.mixed_precision) == (2_000_000, 11, "bfloat16")
    assert params.save_optimizer and params.runs_shared and params.runs_dir == tmp_path / "lab-runs"
    assert params.spool == config.spool_dir and params.run_dir is None
    # The continuation side: the batch script it was rendered with, the spec, the counts.
    job, state = params.job, params.continuation
    assert job.script == config.spool_dir / "jobs" / "corr-handoff" / "job.sh" and job.script.exists()
    assert (job.scheduler, state.count, state.max, state.sync_s) == ("slurm", 0, 3, 12.0)
    assert state.node_local_dir == tmp_path / "scratch"
    assert job.spec.name == "rodan-corr-handoff" and job.spec.time_minutes == 90 and job.spec.cpus == 2
    assert job.spec.command[-1] == str(path)
    # The trainer's settings: the request's, and the bridge's precision, optimizer and seed.
    from worker.trainer.settings import TrainSettings

    request = dict(epochs=7, max_samples_per_label=500, patch_height=64, patch_width=96, batch_size=8, patience=3)
    bridge = dict(include_optimizer=True, mixed_precision="bfloat16", seed=11)
    assert train_settings(params) == TrainSettings(**request, **bridge)


@pytest.fixture
def no_bound_context() -> Iterator[None]:
    yield
    structlog.contextvars.clear_contextvars()


def test_the_worker_reads_the_intakes_file_and_refuses_another_version(tmp_path: Path, no_bound_context: None) -> None:
    """``run_job`` on the intake's file of a request answered before: it reads the file, drops the
    token from it and stops (exit 0). The same file with another version: ``params_unreadable``, exit 3."""
    from worker.job import run_job

    config = load_config(environ=minimal_environ(tmp_path))
    path = intake_writes(config, "corr-read")
    original = read_json(path)
    Spool(config.spool_dir).reply_marker("corr-read").write_text("{}")
    with structlog.testing.capture_logs() as logs:
        assert run_job(path) == 0
    assert [e["event"] for e in logs] == ["already_replied"]
    assert not path.exists()

    newer = {**original, "version": PARAMETERS_VERSION + 1}
    atomic_write_json(path, newer)  # 0600, as the intake writes it: it holds the token
    with structlog.testing.capture_logs() as logs:
        assert run_job(path) == 3
    (event,) = [e for e in logs if e["event"] == "params_unreadable"]
    assert event["log_level"] == "error" and f"version {PARAMETERS_VERSION + 1}" in event["reason"]
    assert "a newer hpc-bridge than this worker" in event["reason"] and TOKEN not in json.dumps(logs, default=str)
    assert path.exists(), "a file the worker cannot read is left as it was"


def test_the_worker_builds_its_settings_only_from_the_file() -> None:
    """No default of the worker's own: ``train_settings`` takes every value from the parameters."""
    from worker.job import train_settings
    from worker.trainer.settings import TrainSettings

    params = sample()
    request = dict(epochs=7, max_samples_per_label=500, patch_height=32, patch_width=48, batch_size=8, patience=2)
    bridge = dict(include_optimizer=True, mixed_precision="bfloat16", seed=11)
    assert train_settings(params) == TrainSettings(**request, **bridge)
    other = train_settings(replace(params, settings=replace(params.settings, batch_size=4, patience=9), seed=None))
    assert (other.batch_size, other.patience, other.seed) == (4, 9, None)
    # The test hook HPC_TEST_FRESH_STARTS (a digit string) sets the trainer's fresh starts; else its own 2.
    assert train_settings(params, {"HPC_TEST_FRESH_STARTS": "0"}).max_fresh_starts == 0
    assert train_settings(params, {"HPC_TEST_FRESH_STARTS": "none"}).max_fresh_starts == 2
    assert train_settings(params, {}).max_fresh_starts == 2
    request_fields = {"epochs", "max_samples_per_label", "patch_height", "patch_width", "batch_size", "patience"}
    assert all(f.default is MISSING for f in fields(TrainSettings) if f.name in request_fields)

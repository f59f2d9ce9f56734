"""HPC_INPUTS_FETCH=login: the bridge downloads every input on the login node at intake, into the
spool, and the job reads them there without connecting to Rodan (compute nodes without a network).

Here without a broker or a cluster: the real ``Intake`` against the Rodan stand-in (a real HTTP
server on loopback), with the scheduler's submit replaced; the worker's input step and the probe's
Rodan check called directly. The whole path on the real Slurm, with the node's HTTP refused by an
unroutable proxy, is in tests/test_inputs_fetch_slurm.py. Each test names the mutation it catches.
"""

from __future__ import annotations

import json
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bridge.config import BridgeConfig, load_config
from bridge.handoff import JobParameters, ProbeParameters, input_files
from bridge.intake import Intake, Message, Outcome
from bridge.ledger import Ledger
from bridge.ops.checks import Check, fail, ok
from bridge.ops.probe import INPUTS_FETCH_LOGIN_LINE, advise_inputs_fetch
from bridge.replies import ReplyBox
from bridge.rodan import RodanClient
from bridge.schedulers import get_scheduler
from bridge.spool import Spool
from bridge.testing.rodan import RodanStandin, token_for_email
from bridge.testing.samples import make_sample_page, make_sample_zip, resource_path
from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL, bridge_environ, job_parameters_json
from tests.support.broker import Queues

#: No test here talks to a broker: the intake never does (the runner publishes).
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/%2F"


@pytest.fixture
def config_for(standin: RodanStandin, tmp_path: Path) -> Callable[..., BridgeConfig]:
    def build(**extra: str) -> BridgeConfig:
        queues = Queues.fresh()
        settings = {"HPC_RODAN_RETRIES": "0", "HPC_REPLY_QUEUE": f"{queues.reply}, {queues.reply}.*", **extra}
        return load_config(environ=bridge_environ(NO_BROKER, standin, queues, tmp_path / "spool", **settings))

    return build


class Submitted:
    """The scheduler's submit, recorded instead of run: what a job would have been given."""

    def __init__(self) -> None:
        self.scripts: list[Path] = []

    def __call__(self, script: Path, _spec: object) -> str:
        self.scripts.append(script)
        return str(4000 + len(self.scripts))


def make_intake(config: BridgeConfig) -> tuple[Intake, Spool, Submitted]:
    spool = Spool(config.spool_dir).ensure()
    scheduler = get_scheduler("slurm", timeout_s=5, options=config.scheduler_options)
    submitted = Submitted()
    scheduler.submit = submitted  # type: ignore[method-assign]
    scheduler.find_by_name = lambda _name: []  # type: ignore[method-assign]
    rodan = RodanClient(
        config.rodan_base_url, email=config.rodan_email, password=config.rodan_password, retries=0, backoff_s=0.01
    )
    return Intake(config, spool, Ledger(spool), scheduler, rodan, ReplyBox(spool)), spool, submitted


def message(intake: Intake, inputs: dict[str, str], corr: str) -> Message:
    body = json.dumps({"inputs": inputs, "settings": FAST_SETTINGS}).encode()
    reply_to = intake.config.reply_queue  # generation 3's per-run queue: HPC_REPLY_QUEUE.<RunJob>
    reply_to += f".{uuid.uuid5(uuid.NAMESPACE_URL, corr)}" if "Sample 1" in inputs else ""
    return Message(body=body, correlation_id=corr, reply_to=reply_to, redelivered=False, delivery_tag=1)


def put(uploads: Path, name: str, data: bytes) -> str:
    """A Rodan resource holding ``data``; returns its path as Rodan sends it."""
    file, path = resource_path(uploads, "fetch", uuid.uuid5(uuid.NAMESPACE_URL, name).hex)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)
    return path


def rodan3_inputs(uploads: Path) -> dict[str, str]:
    """Two sample zips as Pixel.js writes them and a starting model (HDF5: only its first bytes matter here)."""
    inputs = {}
    for number in (1, 2):
        page = make_sample_page(uploads, generation="new", n_layers=1, height=64, width=64, seed=number)
        data = make_sample_zip(uploads / f"sample-{number}.zip", uploads, page).read_bytes()
        inputs[f"Sample {number}"] = put(uploads, f"sample-{number}", data)
    inputs["Model 1"] = put(uploads, "model-1", b"\x89HDF\r\n\x1a\n" + bytes(200))
    return inputs


def uploaded(standin: RodanStandin, resource: str) -> bytes:
    return (standin.uploads_dir / resource.removeprefix("/uploads/")).read_bytes()


def whole_file_gets(standin: RodanStandin, resource: str) -> int:
    """GETs of the whole file (a download, not the intake's ranged check of 16 bytes)."""
    return sum(1 for r in standin.requests if r.method == "GET" and r.path == resource and not r.header("Range"))


def parameters(spool: Spool, corr: str) -> JobParameters:
    return JobParameters.from_json(json.loads(spool.params_path(corr).read_text()))


# --- the intake ------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", ["old", "new", "rodan3"])
def test_login_mode_fetches_every_input_into_the_spool_and_hands_the_job_no_token(
    generation: str, config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """Every generation: each input, byte for byte, under the name the worker reads it by, in the
    request's folder of the spool; the parameter file points there and holds no token.

    Mutations caught: the fetch not called in login mode; a file named otherwise than the worker's
    (``input_files``) order; the token still handed to the job; ``inputs_dir`` not in the parameter file."""
    uploads = standin.uploads_dir
    if generation == "rodan3":
        inputs = rodan3_inputs(uploads)
    else:
        inputs = make_sample_page(uploads, generation=generation, n_layers=2, height=64, width=64, seed=7)  # type: ignore[arg-type]
    intake, spool, submitted = make_intake(config_for(HPC_INPUTS_FETCH="login"))
    decision = intake.process(message(intake, inputs, f"fetch-{generation}"))
    assert decision.outcome is Outcome.SUBMITTED, decision.reason
    assert len(submitted.scripts) == 1
    params = parameters(spool, f"fetch-{generation}")
    assert params.inputs_dir == spool.inputs_dir(f"fetch-{generation}")
    assert params.rodan.token == ""
    files = input_files(inputs, params.inputs_dir)
    assert sorted(p.name for p in params.inputs_dir.iterdir()) == sorted(p.name for p in files.values())
    for name, resource in inputs.items():
        assert files[name].read_bytes() == uploaded(standin, resource), name
        assert whole_file_gets(standin, resource) == 1, name
    token = token_for_email(RODAN_EMAIL).encode()
    assert not [p for p in spool.root.rglob("*") if p.is_file() and token in p.read_bytes()], "no token on disk"
    # The job opens them as the pages it trains on, with its own checks (the worker's reading step).
    from worker.job import fetched_inputs, read_page_inputs, read_rodan3_inputs

    opened = fetched_inputs(params, params.inputs_dir)
    if generation == "rodan3":
        pages, reply_keys, starting = read_rodan3_inputs(params, opened, spool.root / "work")
        assert len(pages) == 2 and sorted(reply_keys.values()) == ["Background Model", "Model 1"]
        assert [reply_keys[label] for label in starting] == ["Model 1"]
    else:
        (page,) = read_page_inputs(params, opened)
        assert page.image.shape == (64, 64, 3) and len(page.masks) == len(params.layers)


def test_node_mode_fetches_nothing_and_hands_the_job_the_token(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """The default: the job downloads. Mutation caught: login's fetch (or its empty token) by default."""
    inputs = make_sample_page(standin.uploads_dir, generation="new", n_layers=1, height=64, width=64, seed=8)
    config = config_for()
    assert config.inputs_fetch == "node"
    intake, spool, _submitted = make_intake(config)
    assert intake.process(message(intake, inputs, "node-mode")).outcome is Outcome.SUBMITTED
    params = parameters(spool, "node-mode")
    assert params.inputs_dir is None and params.rodan.token == token_for_email(RODAN_EMAIL)
    assert not spool.inputs_dir("node-mode").exists()
    assert all(whole_file_gets(standin, resource) == 0 for resource in inputs.values())


def test_a_4xx_at_the_login_download_is_answered_at_once_and_never_retried(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """Rodan answers the intake's ranged check, then 404 to the download: an error reply now, one GET,
    no job, no file left. Mutations caught: a 4xx treated as transient (deferred, or retried by the
    client); the fetched files kept after the rejection."""
    inputs = make_sample_page(standin.uploads_dir, generation="new", n_layers=1, height=64, width=64, seed=9)
    layer = inputs["rgba PNG - Layer 0"]
    intake, spool, submitted = make_intake(config_for(HPC_INPUTS_FETCH="login", HPC_RODAN_RETRIES="3"))
    intake.rodan.retries = 3  # what would retry a transient failure three times
    standin.fail_next(1, 404, paths=layer, downloads_only=True)
    decision = intake.process(message(intake, inputs, "gone"))
    assert decision.outcome is Outcome.REJECTED
    assert "HTTP 404" in decision.reason and layer.rsplit("/", 1)[-1] in decision.reason
    assert whole_file_gets(standin, layer) == 1
    assert submitted.scripts == []
    assert not spool.inputs_dir("gone").exists() and not spool.params_path("gone").exists()
    staged = ReplyBox(spool).staged_entry("gone")
    assert staged is not None and b"HTTP 404" in staged.body_path.read_bytes()
    # Delivered again (Rodan's redelivery): the same answer, no second download.
    assert intake.process(message(intake, inputs, "gone")).outcome is Outcome.REJECTED
    assert whole_file_gets(standin, layer) == 1


def test_a_transient_failure_defers_and_the_next_attempt_keeps_the_complete_files(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """503 on one download: the request is deferred (not answered), no partial file stays, and the
    next attempt downloads only what is missing. Mutations caught: a 5xx answered with an error; a
    half-written file left under its final name; every file downloaded again on each attempt."""
    inputs = make_sample_page(standin.uploads_dir, generation="old", height=64, width=64, seed=10)
    names = sorted(inputs)
    later = inputs[names[-1]]  # the last one fetched: the others are complete by then
    intake, spool, submitted = make_intake(config_for(HPC_INPUTS_FETCH="login"))
    standin.fail_next(1, 503, paths=later, downloads_only=True)
    first = intake.process(message(intake, inputs, "busy"))
    assert first.outcome is Outcome.DEFERRED and "503" in first.reason
    files = input_files(inputs, spool.inputs_dir("busy"))
    assert [n for n in names if files[n].exists()] == names[:-1]
    assert [p.name for p in spool.inputs_dir("busy").iterdir()] != [] and submitted.scripts == []
    assert not [p for p in spool.inputs_dir("busy").iterdir() if not p.name.startswith("input-")], "no partial file"
    second = intake.process(message(intake, inputs, "busy"))
    assert second.outcome is Outcome.SUBMITTED, second.reason
    assert all(files[n].read_bytes() == uploaded(standin, inputs[n]) for n in names)
    assert [whole_file_gets(standin, inputs[n]) for n in names] == [1] * (len(names) - 1) + [2]


def test_the_byte_cap_applies_to_the_login_download(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """An input whose size Rodan does not say passes the check at intake; its download is cut at
    HPC_MAX_INPUT_BYTES and the request answered. Mutation caught: the login download without
    ``max_bytes`` (it would fill the spool: the body has no end)."""
    inputs = make_sample_page(standin.uploads_dir, generation="new", n_layers=1, height=64, width=64, seed=11)
    endless = inputs["Image"]
    standin.serve_generated(endless, size=None, chunked=True)  # a PNG signature, then zeros for ever
    intake, spool, _submitted = make_intake(config_for(HPC_INPUTS_FETCH="login", HPC_MAX_INPUT_BYTES="65536"))
    decision = intake.process(message(intake, inputs, "endless"))
    assert decision.outcome is Outcome.REJECTED
    assert "larger than the limit of 65536 bytes (HPC_MAX_INPUT_BYTES)" in decision.reason
    assert not spool.inputs_dir("endless").exists()


def test_the_whole_file_must_be_of_its_kind_again(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """The check at intake reads 16 bytes of a ranged answer; the download (here redirected, within
    Rodan, to a text file) is what the job would open: it is sniffed again and refused. Mutation
    caught: the login download's kind not checked (a file of another kind handed to the job)."""
    inputs = make_sample_page(standin.uploads_dir, generation="new", n_layers=1, height=64, width=64, seed=12)
    other = put(standin.uploads_dir, "not-an-image", b"<html>not an image</html>")
    standin.redirect_next(1, standin.url_for(other), paths=inputs["Image"], downloads_only=True)
    intake, spool, _submitted = make_intake(config_for(HPC_INPUTS_FETCH="login"))
    decision = intake.process(message(intake, inputs, "swapped"))
    assert decision.outcome is Outcome.REJECTED
    assert "input 'Image' is not a PNG or JPEG file (it starts with 3c68746d6c3e" in decision.reason
    assert not spool.inputs_dir("swapped").exists()


def test_a_hostile_zip_fetched_on_the_login_node_is_still_refused_by_the_job(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin, tmp_path: Path
) -> None:
    """A zip that passes every check of the download (it is a zip, under the byte cap) but whose member
    claims to inflate far beyond the job's pixel limit: the job opens the fetched file with the same
    zip checks as a downloaded one. Mutation caught: login mode reading the files around
    worker/sample_zips.py's checks."""
    from worker.job import StepFailed, fetched_inputs, read_rodan3_inputs

    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("Image.png", b"\x89PNG\r\n\x1a\n" + bytes(20_000_000))
    inputs = {"Sample 1": put(standin.uploads_dir, "bomb", bomb.read_bytes())}
    intake, spool, _submitted = make_intake(config_for(HPC_INPUTS_FETCH="login"))
    assert intake.process(message(intake, inputs, "bomb")).outcome is Outcome.SUBMITTED
    params = parameters(spool, "bomb")
    assert params.inputs_dir is not None
    files = fetched_inputs(params, params.inputs_dir)
    with pytest.raises(StepFailed) as failed:
        read_rodan3_inputs(params, files, tmp_path / "work")
    assert failed.value.step == "reading the sample zips"


# --- the job -------------------------------------------------------------------------------------


def job_params(tmp_path: Path, **overrides: Any) -> JobParameters:
    return JobParameters.from_json(job_parameters_json(spool=str(tmp_path / "spool"), **overrides))


def test_the_job_reads_the_fetched_files_and_says_which_one_is_missing(tmp_path: Path) -> None:
    """Mutations caught: the job falling back to a download (it would connect to Rodan: the address
    here is a closed port) or reading other names than the bridge wrote."""
    from worker.job import StepFailed, fetched_inputs

    folder = tmp_path / "spool" / "jobs" / "c" / "inputs"
    folder.mkdir(parents=True)
    inputs = {"Image": "/uploads/a.png", "Background": "/uploads/b.png", "Selected Regions": "/uploads/c.png"}
    params = job_params(
        tmp_path, inputs=inputs, inputs_dir=str(folder), rodan={"base_url": "http://127.0.0.1:1", "token": ""}
    )
    files = input_files(params.inputs, folder)
    for index, path in enumerate(files.values()):
        path.write_bytes(b"file %d" % index)
    assert fetched_inputs(params, folder) == files
    missing = sorted(params.inputs)[0]
    files[missing].unlink()
    with pytest.raises(StepFailed) as failed:
        fetched_inputs(params, folder)
    assert failed.value.step == "reading the inputs fetched on the login node"
    assert f"{missing!r} is not in {folder}" in str(failed.value.cause)


def test_a_node_without_a_route_to_rodan_gets_an_error_naming_the_setting(
    tmp_path: Path, standin: RodanStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node mode, Rodan refused (a closed port, or a proxy that refuses): the reply says the node
    could not reach Rodan and names HPC_INPUTS_FETCH=login; a 404 or a reset from a Rodan that was
    reached does not. Mutations caught: the advice never given, or given for answers Rodan did send."""
    from worker.job import StepFailed, download_inputs

    inputs = make_sample_page(standin.uploads_dir, generation="new", n_layers=1, height=64, width=64, seed=13)
    closed = job_params(tmp_path, inputs=inputs, rodan={"base_url": "http://127.0.0.1:1", "retries": 0})
    with pytest.raises(StepFailed) as failed:
        download_inputs(closed, tmp_path / "a")
    text = str(failed.value.cause)
    assert "this compute node could not reach Rodan at http://127.0.0.1:1" in text
    assert "the operator sets HPC_INPUTS_FETCH=login" in text
    standin.fail_next(1, 404, downloads_only=True)
    reachable = job_params(tmp_path, inputs=inputs, rodan={"base_url": standin.url, "retries": 0})
    with pytest.raises(StepFailed) as refused:
        download_inputs(reachable, tmp_path / "b")
    assert "HTTP 404" in str(refused.value.cause) and "HPC_INPUTS_FETCH" not in str(refused.value.cause)
    standin.reset_next(1, downloads_only=True)  # connected, then cut: Rodan was reached
    with pytest.raises(StepFailed) as reset:
        download_inputs(reachable, tmp_path / "c")
    assert "ConnectionError" in str(reset.value.cause) and "HPC_INPUTS_FETCH" not in str(reset.value.cause)
    with monkeypatch.context() as env:  # a proxy that refuses, as the Slurm test's prologue sets
        for name in ("NO_PROXY", "no_proxy"):
            env.delenv(name, raising=False)
        env.setenv("http_proxy", "http://127.0.0.1:9")
        with pytest.raises(StepFailed) as proxied:
            download_inputs(reachable, tmp_path / "d")
    assert "ProxyError" in str(proxied.value.cause) and "HPC_INPUTS_FETCH=login" in str(proxied.value.cause)


def test_the_fetched_inputs_go_with_the_run_directorys_when_the_reply_is_out(tmp_path: Path) -> None:
    """Mutation caught: ``finish`` leaving the spool's copies (a request's pages kept until prune)."""
    from worker.job import finish

    run_dir, fetched, params_path = tmp_path / "run", tmp_path / "spool-inputs", tmp_path / "params.json"
    for folder in (run_dir / "inputs", run_dir / "checkpoints", fetched):
        folder.mkdir(parents=True)
        (folder / "input-0").write_bytes(b"x")
    params_path.write_text("{}")
    finish(params_path, run_dir, fetched)
    assert not fetched.exists() and not (run_dir / "inputs").exists() and not params_path.exists()


def test_a_run_cancelled_in_rodan_leaves_no_fetched_inputs(
    config_for: Callable[..., BridgeConfig], standin: RodanStandin
) -> None:
    """Rodan 3's Cancel (bridge/rodan_cancel.py) removes what the run's reply would have: the spool's
    copies too. Mutation caught: the cancel path keeping them until prune."""
    from bridge.ledger import RequestRecord
    from bridge.rodan_cancel import RodanCancels

    inputs = rodan3_inputs(standin.uploads_dir)
    intake, spool, _submitted = make_intake(config_for(HPC_INPUTS_FETCH="login"))
    assert intake.process(message(intake, inputs, "cancelled")).outcome is Outcome.SUBMITTED
    assert spool.inputs_dir("cancelled").is_dir()
    cancels = RodanCancels(intake.config, spool, intake.ledger, intake.scheduler, intake.replies, intake.rodan)
    cancels._clean(RequestRecord(correlation_id="cancelled", key="cancelled", reply_to="q"))
    assert not spool.inputs_dir("cancelled").exists() and not spool.params_path("cancelled").exists()


# --- doctor --job ----------------------------------------------------------------------------------


def probe_params(tmp_path: Path, rodan_url: str, inputs_fetch: str) -> ProbeParameters:
    from bridge.handoff import BrokerAddress

    return ProbeParameters(
        dir=tmp_path,
        write_dirs={},
        gpus_asked=0,
        gres="",
        node_local_dir=None,
        rodan_url=rodan_url,
        rodan_timeout_s=5.0,
        inputs_fetch=inputs_fetch,
        broker=BrokerAddress(host="127.0.0.1", port=1),
        continuation=None,
    )


def test_the_node_check_says_whether_the_jobs_need_rodan(tmp_path: Path, standin: RodanStandin) -> None:
    """Mutations caught: a node without a route failing the probe although the bridge fetches the
    inputs (login); a failing node check without the setting in its fix (node); login called
    needed where the node reaches Rodan."""
    from worker.probe import FETCHED_ON_LOGIN, ProbeResult, check_rodan

    result = ProbeResult(host="n", job_id="1", restart="0", python="p", started_at=0.0)
    cut = check_rodan(probe_params(tmp_path, "http://127.0.0.1:1", "node"), result)
    assert cut.status == "FAIL" and "HPC_INPUTS_FETCH=login" in cut.fix
    fetched = check_rodan(probe_params(tmp_path, "http://127.0.0.1:1", "login"), result)
    assert fetched.status == "ok" and FETCHED_ON_LOGIN in fetched.found and "from the node failed" in fetched.found
    reached = check_rodan(probe_params(tmp_path, standin.url, "login"), result)
    assert reached.status == "ok" and "HPC_INPUTS_FETCH=login is not needed here" in reached.found


def test_doctor_names_the_setting_line_only_where_the_login_node_reaches_rodan() -> None:
    """Mutations caught: the exact line missing; advising login when the login node cannot reach
    Rodan either; touching a node-rodan line that passed."""

    def lines() -> list[Check]:
        return [ok("probe-job", "ran"), fail("node-rodan", "GET ... from the node failed", "open the route")]

    login_can = advise_inputs_fetch(lines(), login_reaches_rodan=True)[1]
    assert f"put the line {INPUTS_FETCH_LOGIN_LINE} in the credentials file" in login_can.fix
    assert INPUTS_FETCH_LOGIN_LINE == "HPC_INPUTS_FETCH=login"
    neither = advise_inputs_fetch(lines(), login_reaches_rodan=False)[1]
    assert "the login node does not reach Rodan either" in neither.fix and "put the line" not in neither.fix
    passed = [ok("node-rodan", "answered 401")]
    assert advise_inputs_fetch(passed, login_reaches_rodan=True)[0].fix == ""

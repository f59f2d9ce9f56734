"""Reply assembly, decoding and outputs: parts out of order, twice, missing; error replies; the
files each connected output port gets; the Multi-Sample Zip output; the layer checks."""

from __future__ import annotations

import base64
import json
import os
import zipfile
from types import SimpleNamespace

import pytest
from hpc_paco_trainer import hpc_relay, selftest
from hpc_paco_trainer.hpc_relay import HPCJobError, RunState


def _store(state_dir: str, body: bytes, parts: int, order: list) -> RunState:
    state = RunState(state_dir, "cid-1")
    pieces = selftest.reply_parts(body, parts)
    for number in order:
        state.save_part(number, parts, pieces[number - 1])
    return state


def test_parts_out_of_order_are_joined_in_order(state_dir: str) -> None:
    body = selftest.success_body({"Background Model": b"B" * 500, "Model 1": b"1" * 700, "Log File": b"log"})
    state = _store(state_dir, body, 3, [3, 1, 2])
    assert state.missing_parts() == []
    assert state.assemble() == body
    files = hpc_relay.decode_reply(state.assemble())
    assert files == {"Background Model": b"B" * 500, "Model 1": b"1" * 700, "Log File": b"log"}


def test_a_part_that_comes_twice_is_kept_once(state_dir: str) -> None:
    body = selftest.success_body({"Background Model": b"x" * 100, "Model 1": b"y" * 100, "Log File": b""})
    state = _store(state_dir, body, 2, [2, 2, 1])
    assert sorted(os.listdir(state.folder)) == ["part-1", "part-2", "state.json"]
    assert state.assemble() == body


def test_a_missing_part_keeps_the_run_waiting_and_survives_a_new_process(state_dir: str) -> None:
    body = selftest.success_body({"Background Model": b"x" * 300, "Model 1": b"y" * 300, "Log File": b"z"})
    _store(state_dir, body, 3, [1, 3])
    again = RunState(state_dir, "cid-1")  # what the next poll (another worker process) sees
    assert again.missing_parts() == [2]
    again.save_part(2, 3, selftest.reply_parts(body, 3)[1])
    assert again.missing_parts() == [] and again.assemble() == body


def test_no_part_yet_is_not_a_complete_reply(state_dir: str) -> None:
    assert RunState(state_dir, "cid-1").missing_parts() is None


def test_parts_that_disagree_on_their_number_fail_the_run(state_dir: str) -> None:
    state = RunState(state_dir, "cid-1")
    state.save_part(1, 2, b"a")
    with pytest.raises(HPCJobError, match="disagree"):
        state.save_part(2, 3, b"b")


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, (1, 1)),
        ({"x-hpc-part": 2, "x-hpc-parts": 3}, (2, 3)),
        ({"x-hpc-part": b"1", "x-hpc-parts": b"1"}, (1, 1)),
    ],
)
def test_part_headers(headers: object, expected: tuple) -> None:
    assert hpc_relay.part_numbers(SimpleNamespace(headers=headers)) == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"x-hpc-part": 4, "x-hpc-parts": 3},
        {"x-hpc-part": 0, "x-hpc-parts": 3},
        {"x-hpc-part": 1},
        {"x-hpc-part": "one", "x-hpc-parts": 2},
    ],
)
def test_bad_part_headers_fail_the_run(headers: dict) -> None:
    with pytest.raises(HPCJobError):
        hpc_relay.part_numbers(SimpleNamespace(headers=headers))


def test_an_error_reply_shows_its_reason() -> None:
    with pytest.raises(HPCJobError) as caught:
        hpc_relay.decode_reply(json.dumps({"error": "Slurm job 61 ended without a result: TIMEOUT"}).encode())
    assert caught.value.summary == "The HPC training failed: Slurm job 61 ended without a result: TIMEOUT"
    assert "TIMEOUT" in caught.value.details


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        json.dumps({"Background Model": "!!!", "Model 1": "AA==\n"}).encode(),
        b'{"Model 1": "AA==\\n"}',
    ],
)
def test_a_malformed_reply_fails_the_run(body: bytes) -> None:
    with pytest.raises(HPCJobError):
        hpc_relay.decode_reply(body)


def _sample(tmp: str, name: str, layers: int, seed: int = 1) -> dict:
    path = os.path.join(tmp, name)
    selftest.write_sample_zip(path, layers, seed)
    return {"resource_path": path, "resource_url": "/uploads/" + name}


def test_outputs_get_their_files_and_the_samples_in_one_zip(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    multi = os.path.join(tmp, "multi.zip")
    with zipfile.ZipFile(multi, "w") as archive:
        for folder in ("page-a", "Sample 1"):
            for member in selftest.sample_member_names(2):
                archive.writestr(folder + "/" + member, selftest.png_bytes(3, 3, (1, 2, 3, 255)))
    inputs = {"Sample 1": [_sample(tmp, "s1.zip", 2)], "Multi-Sample Zip": [{"resource_path": multi}]}
    outputs = {
        p: [{"resource_path": os.path.join(tmp, p.replace(" ", "_"))}]
        for p in ("Log File", "Model 1", "Multi-Sample Zip")
    }
    files = {"Background Model": b"bg", "Model 1": b"m1", "Model 2": b"m2", "Log File": b"log"}
    written = hpc_relay.write_outputs(files, outputs, inputs)
    assert written == ["Log File", "Model 1", "Multi-Sample Zip"]
    assert open(outputs["Model 1"][0]["resource_path"], "rb").read() == b"m1"
    assert open(outputs["Log File"][0]["resource_path"], "rb").read() == b"log"
    with zipfile.ZipFile(outputs["Multi-Sample Zip"][0]["resource_path"]) as archive:
        folders = sorted({n.split("/")[0] for n in archive.namelist()})
        assert folders == ["Sample 1", "Sample 1 (3)", "page-a"]
        with zipfile.ZipFile(inputs["Sample 1"][0]["resource_path"]) as sample:
            for member in sample.namelist():
                assert archive.read("Sample 1 (3)/" + member) == sample.read(member)
        assert len(archive.namelist()) == 3 * 5


def test_a_connected_model_the_training_did_not_produce_is_an_error(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    outputs = {
        p: [{"resource_path": os.path.join(tmp, p.replace(" ", "_"))}] for p in ("Log File", "Model 1", "Model 3")
    }
    with pytest.raises(HPCJobError, match="'Model 3'"):
        hpc_relay.write_outputs({"Background Model": b"b", "Model 1": b"1", "Log File": b"l"}, outputs, {})
    assert not any(os.path.exists(o[0]["resource_path"]) for o in outputs.values())


def test_layer_checks_before_anything_is_sent(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    two = {"Sample 1": [_sample(tmp, "a.zip", 2)], "Sample 2": [_sample(tmp, "b.zip", 2, 2)]}
    assert hpc_relay.check_layers(two, {"Model 1": [{}], "Model 2": [{}]}) == 3
    with pytest.raises(HPCJobError, match="'Model 3'"):
        hpc_relay.check_layers(two, {"Model 1": [{}], "Model 3": [{}]})
    mixed = {"Sample 1": [_sample(tmp, "c.zip", 2)], "Sample 2": [_sample(tmp, "d.zip", 3)]}
    with pytest.raises(HPCJobError, match="same layers"):
        hpc_relay.check_layers(mixed, {"Model 1": [{}]})
    models = dict(two, **{p: [{"resource_path": "m"}] for p in ("Background Model", "Model 1", "Model 2", "Model 3")})
    with pytest.raises(HPCJobError, match="exceeds number of layers"):
        hpc_relay.check_layers(models, {"Model 1": [{}]})
    with pytest.raises(HPCJobError, match="No training sample"):
        hpc_relay.check_layers({}, {"Model 1": [{}]})


def test_the_request_body_names_urls_and_the_settings_as_sent() -> None:
    inputs = {
        "Sample 3": [{"resource_path": "/x", "resource_url": "/uploads/a/original_file"}],
        "Model 2": [{"resource_path": "/y", "resource_url": "/uploads/b/original_file"}],
    }
    settings = {"Batch Size": 8, "Maximum time (D-HH:MM)": "0-06:00", "Slurm Notification Email": ""}
    body = json.loads(hpc_relay.build_request(inputs, settings).decode())
    assert body == {
        "inputs": {"Sample 3": "/uploads/a/original_file", "Model 2": "/uploads/b/original_file"},
        "settings": settings,
    }
    with pytest.raises(HPCJobError, match="No training sample"):
        hpc_relay.build_request({"Model 2": inputs["Model 2"]}, settings)


def test_base64_of_the_reply_is_what_the_bridge_sends() -> None:
    data = os.urandom(1000)
    files = hpc_relay.decode_reply(
        json.dumps(
            {"Background Model": base64.encodebytes(data).decode(), "Model 1": base64.b64encode(data).decode()}
        ).encode()
    )
    assert files["Background Model"] == data and files["Model 1"] == data


def test_the_state_of_finished_and_abandoned_runs_is_swept(state_dir: str) -> None:
    now = 10_000_000.0
    RunState(state_dir, "ended-long-ago").update(published_at=now - 9e5, ended_at=now - 86401, expires_at=now + 1e6)
    RunState(state_dir, "ended-just-now").update(published_at=now - 9e5, ended_at=now - 60, expires_at=now + 1e6)
    RunState(state_dir, "queue-expired").update(published_at=now - 9e5, expires_at=now - 1)
    RunState(state_dir, "waiting").update(published_at=now - 9e5, expires_at=now + 1)
    RunState(state_dir, "never-published").update(created_at=now - 8 * 86400)
    RunState(state_dir, "broker-down-today").update(created_at=now - 3600)
    removed = hpc_relay.sweep_state(state_dir, now)
    assert sorted(removed) == ["ended-long-ago", "never-published", "queue-expired"]
    assert sorted(os.listdir(state_dir)) == [".attempts", "broker-down-today", "ended-just-now", "waiting"]
    # A removed run that had published keeps the record of its attempt (a later Retry gets the next
    # correlation id, never one the bridge answered already).
    assert sorted(os.listdir(os.path.join(state_dir, ".attempts"))) == ["ended-long-ago", "queue-expired"]
    assert hpc_relay.read_attempt_record(state_dir, "queue-expired")["attempt"] == 1

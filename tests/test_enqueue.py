"""``hpc-bridge enqueue``: publishes like Rodan's task and waits like it (nacking foreign replies)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.support.bridge import REPO, bridge_environ

pytestmark = [pytest.mark.broker]


def test_enqueue_publishes_like_rodan_and_waits_for_its_own_reply(broker_url, standin, queues, tmp_path, rodan):
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool")
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"Image": "/uploads/a", "Background": "/uploads/b"}))
    model = bytes(range(256)) * 100
    seen: dict[str, object] = {}

    def play_bridge() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        channel = connection.channel()
        channel.queue_declare(queues.request)  # as the bridge does, with Rodan's (default) arguments
        channel.queue_declare(queues.reply)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            method, props, body = channel.basic_get(queues.request, auto_ack=True)
            if method:
                seen.update(props=props, body=body)
                break
            time.sleep(0.05)
        props = seen["props"]
        channel.basic_publish("", queues.reply, b'{"error": "not yours"}', pika.BasicProperties(correlation_id="other"))
        time.sleep(0.5)
        reply = json.dumps({"Model 0": base64.encodebytes(model).decode()})
        channel.basic_publish("", props.reply_to, reply, pika.BasicProperties(correlation_id=props.correlation_id))
        connection.close()

    thread = threading.Thread(target=play_bridge)
    thread.start()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bridge",
            "enqueue",
            "--inputs",
            str(inputs),
            "--setting",
            "CPUs=2",
            "--setting",
            "Maximum time (D-HH:MM)=0-01:00",
            "--wait",
            "--timeout",
            "60",
            "--out",
            str(tmp_path / "out"),
        ],
        env={
            **{k: v for k, v in __import__("os").environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))},
            **env,
        },
        capture_output=True,
        text=True,
        timeout=90,
        cwd=REPO,
    )
    thread.join()
    assert result.returncode == 0, result.stderr[-1500:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["models"] == ["Model 0"]
    assert (tmp_path / "out" / "Model_0.hdf5").read_bytes() == model
    props = seen["props"]
    assert props.reply_to == queues.reply and props.content_type is None and props.delivery_mode is None
    assert len(props.correlation_id) == 36 and props.correlation_id == out["correlation_id"]
    assert json.loads(seen["body"]) == {
        "inputs": {"Image": "/uploads/a", "Background": "/uploads/b"},
        "settings": {"CPUs": 2, "Maximum time (D-HH:MM)": "0-01:00"},
    }
    # the foreign reply was nacked back into the queue, not eaten
    assert [c for c, _b, _h in rodan.drain()] == ["other"]
    # standard output is the result line only; the progress (JSON: stderr is no terminal) is on
    # standard error, and without the spool (this bridge has none) it says it waits for the reply
    assert len(result.stdout.splitlines()) == 1
    progress = [e for e in map(json.loads, result.stderr.splitlines()) if e.get("event") == "progress"]
    assert [e["state"] for e in progress] == ["waiting", "replied"], result.stderr
    corr = out["correlation_id"]
    assert all(e["what"] == corr[:8] and e["correlation_id"] == corr for e in progress)
    assert progress[-1]["outcome"] == "ok" and "job_id" not in progress[-1]


def _answer_with(broker_url: str, queues: Any, reply: dict[str, str]) -> threading.Thread:
    """Plays the bridge: takes the next request off the request queue and answers it with ``reply``."""

    def play() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        channel = connection.channel()
        channel.queue_declare(queues.request)
        channel.queue_declare(queues.reply)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            method, props, _body = channel.basic_get(queues.request, auto_ack=True)
            if method:
                answer = pika.BasicProperties(correlation_id=props.correlation_id)
                channel.basic_publish("", props.reply_to, json.dumps(reply), answer)
                break
            time.sleep(0.05)
        connection.close()

    thread = threading.Thread(target=play)
    thread.start()
    return thread


def test_reply_keys_become_file_names_inside_out_never_paths(
    broker_url: str, standin: Any, queues: Any, tmp_path: Path, rodan: Any
) -> None:
    """A reply's keys are Rodan's output names, but the reply comes off a queue: whatever they
    say, each model lands in a file of its own directly in --out, and nothing is written elsewhere."""
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool")
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"Image": "/uploads/a"}))
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    victim = tmp_path / "victim.hdf5"  # a symbolic link already in --out points here
    victim.write_bytes(b"keep me")
    (out / "Model_0.hdf5").symlink_to(victim)
    keys = ["Background Model", "Model 0", "../escaped", "../../far", "a/b", "a_b", ".hidden", "..", "nul\0x"]
    models = {key: f"model {n} ".encode() * (n + 1) for n, key in enumerate(keys)}
    reply = {key: base64.encodebytes(data).decode() for key, data in models.items()}
    thread = _answer_with(broker_url, queues, reply)
    result = subprocess.run(
        [sys.executable, "-m", "bridge", "enqueue", "--inputs", str(inputs), "--wait", "--timeout", "60",
         "--progress", "none", "--out", str(out)],
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}, **env},
        capture_output=True, text=True, timeout=90, cwd=REPO,
    )  # fmt: skip
    thread.join()
    assert result.returncode == 0, result.stderr[-1500:]
    files = json.loads(result.stdout.strip().splitlines()[-1])["files"]
    assert sorted(files) == sorted(keys)
    # the readable common case is what it always was; the rest are plain names, none hidden
    assert files["Background Model"]["path"] == str(out / "Background_Model.hdf5")
    assert files["Model 0"]["path"] == str(out / "Model_0.hdf5")
    for key, saved in files.items():
        path = Path(saved["path"])
        assert path.parent == out and not path.name.startswith(".") and "\0" not in path.name, key
        assert path.is_file() and not path.is_symlink() and path.read_bytes() == models[key], key
    assert len({saved["path"] for saved in files.values()}) == len(keys)  # "a/b" and "a_b" do not collide
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(s["path"]).name for s in files.values())
    assert victim.read_bytes() == b"keep me"  # the link was replaced, not written through
    assert sorted(p.name for p in work.iterdir()) == ["out"]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(("escaped", "far"))]


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("Background Model", "Background_Model.hdf5"),
        ("Model 0", "Model_0.hdf5"),
        ("Layer 1/ä", "Layer_1_ä.hdf5"),
        ("/abs/path", "_abs_path.hdf5"),
        ("..\\..\\win", "___.._win.hdf5"),  # no separator left: ".." inside a name is harmless
        ("...", "___.hdf5"),
        (".", "_.hdf5"),
        ("", "model.hdf5"),
        ("tab\tnewline\n", "tab_newline_.hdf5"),
    ],
)
def test_a_reply_key_maps_to_one_plain_file_name(key: str, name: str) -> None:
    from bridge.enqueue import MAX_NAME_BYTES, model_file_name

    assert model_file_name(key) == name
    long = model_file_name("Ä" * 300)
    assert len(long.encode()) <= MAX_NAME_BYTES + len(".hdf5") and long != model_file_name("Ä" * 301)

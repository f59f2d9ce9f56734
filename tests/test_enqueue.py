"""``hpc-bridge enqueue``: publishes like Rodan's task and waits like it (nacking foreign replies)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time

import pika
import pytest

from tests.conftest import REPO, bridge_environ

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

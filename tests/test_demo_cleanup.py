"""deploy/dev/demo.py deletes the queues it made on the broker when it ends, however it ends: its
request, dead-letter and status queues, and the reply queues of its requests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from bridge.amqp import declare_own_queue, declare_rodan_queue

DEMO = Path(__file__).resolve().parents[1] / "deploy" / "dev" / "demo.py"


@pytest.fixture
def demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    """deploy/dev/demo.py, with queue names of this test's own and its work folder under tmp_path."""
    spec = importlib.util.spec_from_file_location(f"demo_{uuid.uuid4().hex}", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tag = uuid.uuid4().hex[:10]
    monkeypatch.setattr(module, "REQUEST_QUEUE", f"test-{tag}-demo-hpc-jobs")
    monkeypatch.setattr(module, "DEAD_LETTER_QUEUE", f"test-{tag}-demo-hpc-dead-letter")
    monkeypatch.setattr(module, "STATUS_QUEUE", f"test-{tag}-demo-hpc-status")
    monkeypatch.setattr(module, "WORK", tmp_path / "demo")
    return module


def _exists(broker_url: str, name: str) -> bool:
    """Whether queue ``name`` is on the broker (a passive declare: 404 when it is not)."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().queue_declare(queue=name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return False
    finally:
        connection.close()


@contextlib.contextmanager
def _declared(broker_url: str, names: list[str], reply_queue: str = "") -> Iterator[None]:
    """The demo's queues as Rodan and the bridge declare them, a message in the request queue;
    deleted afterwards whatever the test found."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    channel = connection.channel()
    request, dead, status = names
    declare_rodan_queue(channel, request)
    declare_own_queue(channel, dead)
    declare_own_queue(channel, status)
    if reply_queue:  # as Rodan's job declares its run's reply queue
        channel.queue_declare(queue=reply_queue, durable=True, arguments={"x-expires": 3_600_000})
    channel.basic_publish("", request, b"{}")
    connection.close()
    try:
        yield
    finally:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        for name in [*names, *([reply_queue] if reply_queue else [])]:
            connection.channel().queue_delete(queue=name)
        connection.close()


def _names(demo: types.ModuleType) -> list[str]:
    return [demo.REQUEST_QUEUE, demo.DEAD_LETTER_QUEUE, demo.STATUS_QUEUE]


def test_the_demo_deletes_its_queues_when_it_fails(
    demo: types.ModuleType, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rodan_fails(_url: str) -> dict[str, str]:
        raise SystemExit("deploy/dev/rodan.sh up failed (exit 1); its log is above")

    monkeypatch.setattr(demo, "rodan_up", rodan_fails)
    monkeypatch.setenv("RABBITMQ_URL", broker_url)
    monkeypatch.setattr(sys, "argv", ["demo.py"])
    names = _names(demo)
    with _declared(broker_url, names):
        assert all(_exists(broker_url, name) for name in names)
        with pytest.raises(SystemExit, match=r"rodan\.sh up failed"):
            demo.main()
        assert [name for name in names if _exists(broker_url, name)] == []


def test_the_reply_queues_of_the_demos_requests_are_deleted_too(
    demo: types.ModuleType, broker_url: str, tmp_path: Path
) -> None:
    reply_queue = f"hpc-results.test-{uuid.uuid4()}"
    spool = tmp_path / "spool"
    (spool / "ledger").mkdir(parents=True)
    (spool / "ledger" / "a.json").write_text(json.dumps({"correlation_id": "a", "reply_to": reply_queue}))
    (spool / "ledger" / "b.json").write_text(json.dumps({"correlation_id": "b", "reply_to": "someone-elses"}))
    (spool / "ledger" / "c.json").write_text("{half a record")
    names = _names(demo)
    assert demo.demo_queues(spool) == [*names, reply_queue]  # not another application's queue
    with _declared(broker_url, names, reply_queue):
        assert demo.delete_queues(broker_url, demo.demo_queues(spool)) == []
        assert [name for name in [*names, reply_queue] if _exists(broker_url, name)] == []
        assert demo.delete_queues(broker_url, names) == [], "deleting what is gone is no failure"


def test_queues_the_demo_could_not_delete_are_named(demo: types.ModuleType, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:  # bound, never listening: refused
        held.bind(("127.0.0.1", 0))
        url = f"amqp://guest:guest@127.0.0.1:{held.getsockname()[1]}/%2F"
        assert demo.delete_queues(url, _names(demo)) == _names(demo)
    assert demo.demo_queues(tmp_path / "no-spool") == _names(demo)

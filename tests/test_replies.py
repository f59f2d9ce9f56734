"""The outbox: replies staged on disk, published with confirms, never twice, never lost."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pika
import pytest

from bridge.amqp import connect
from bridge.errors import BrokerUnavailable, NoRoute
from bridge.replies import ReplyBox
from bridge.spool import Spool, atomic_write, safe_key


def test_spool_is_private(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    for sub in ("", "ledger", "params", "jobs", "outbox", "replies"):
        assert stat.S_IMODE((spool.root / sub).stat().st_mode) == 0o700
    atomic_write(spool.params_path("k"), b"{}")
    assert stat.S_IMODE(spool.params_path("k").stat().st_mode) == 0o600
    assert not list(spool.params_path("k").parent.glob(".*.tmp"))


def test_safe_keys() -> None:
    assert safe_key("3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10") == "3f2b8c1e-0d4a-4c1b-9a57-6f1f0c3e2d10"
    for hostile in ["../../etc/passwd", ".hidden", "a/b", "", "x" * 200, "a\nb"]:
        key = safe_key(hostile)
        assert key.startswith("sha256-") and "/" not in key


def test_lock_is_exclusive(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    with spool.lock() as first, spool.lock() as second:
        assert first is True and second is False


def test_staged_reply_is_published_once_and_marked(tmp_path: Path, broker_url: str, queues) -> None:
    box = ReplyBox(Spool(tmp_path).ensure())
    connection = connect(broker_url)
    channel = connection.channel()
    channel.queue_declare(queues.reply)
    channel.confirm_delivery()
    entry = box.stage("corr-1", queues.reply, b'{"Model 0": "AAAA\\n"}', origin="test")
    assert box.staged() and not box.already_replied("corr-1")
    assert box.publish_staged(channel, entry) is True
    assert box.already_replied("corr-1") and box.marker("corr-1")["outcome"] == "ok"
    assert box.staged() == []
    # staging again after the marker exists publishes nothing
    entry2 = box.stage("corr-1", queues.reply, b'{"error": "late"}', origin="test")
    assert box.publish_staged(channel, entry2) is False
    _method, props, body = channel.basic_get(queues.reply, auto_ack=True)
    assert props.correlation_id == "corr-1" and json.loads(body) == {"Model 0": "AAAA\n"}
    assert channel.basic_get(queues.reply, auto_ack=True)[0] is None
    connection.close()


def test_oversized_reply_becomes_an_error_naming_both_sizes(tmp_path: Path) -> None:
    box = ReplyBox(Spool(tmp_path).ensure(), max_bytes=2048)
    entry = box.stage("c", "q", b"x" * 5000, origin="test")
    body = json.loads(entry.body_path.read_bytes())
    assert "5000 bytes" in body["error"] and "2048 bytes" in body["error"]


def test_reply_to_a_missing_queue_fails_loudly_and_stays_staged(tmp_path: Path, broker_url: str) -> None:
    box = ReplyBox(Spool(tmp_path).ensure())
    connection = connect(broker_url)
    channel = connection.channel()
    channel.confirm_delivery()
    entry = box.stage("c", "no-such-queue-for-this-test", b'{"error": "x"}', origin="test")
    with pytest.raises(Exception, match="no queue"):
        box.publish_staged(channel, entry)
    assert box.staged() and not box.already_replied("c")
    connection.close()


def test_models_for_a_missing_queue_stay_models_when_the_queue_appears_mid_publish(
    tmp_path: Path, broker_url: str, queues, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI, stop 9): the queue came back between the unroutable models publish and the
    error reply that used to replace it, and Rodan got "could not be delivered" instead of models."""
    import bridge.replies as replies

    box = ReplyBox(Spool(tmp_path).ensure())
    connection = connect(broker_url)
    channel = connection.channel()
    channel.confirm_delivery()
    real_publish, calls = replies.publish, []

    def publish_then_rodan_declares(on, routing_key, body, **kw):  # type: ignore[no-untyped-def]
        calls.append(body)
        try:
            real_publish(on, routing_key, body, **kw)
        finally:
            if len(calls) == 1:
                channel.queue_declare(queues.reply)  # Rodan reconnects just after the first try

    monkeypatch.setattr(replies, "publish", publish_then_rodan_declares)
    models = b'{"Model 0": "AAAA"}'
    entry = box.stage("corr-race", queues.reply, models, origin="worker")
    with pytest.raises(NoRoute):
        box.publish_staged(channel, entry)
    assert calls == [models], "nothing but the models was published"
    assert channel.basic_get(queues.reply, auto_ack=True)[0] is None, "no error reply reached Rodan"
    assert [e.correlation_id for e in box.staged()] == ["corr-race"] and entry.body_path.read_bytes() == models
    assert box.flush(channel) == 1 and not box.staged()
    method, props, body = channel.basic_get(queues.reply, auto_ack=True)
    assert method is not None and props.correlation_id == "corr-race" and body == models
    assert box.marker("corr-race")["outcome"] == "ok"  # type: ignore[index]
    connection.close()


def test_unreachable_broker_is_transient() -> None:
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        connect("amqp://guest:guest@127.0.0.1:9/%2F")


def test_wrong_broker_password_is_reported(broker_url: str) -> None:
    bad = pika.URLParameters(broker_url)
    url = f"amqp://{bad.credentials.username}:wrong-password@{bad.host}:{bad.port}/%2F"
    with pytest.raises(BrokerUnavailable):
        connect(url)

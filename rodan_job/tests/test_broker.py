"""The job's polls against the real RabbitMQ: one request, the run's own reply queue, parts moved
to disk, errors that end the run (error reply, silence, a broker that stays down), TLS, secrets.
Every queue is unique to the test; the request queue is never the bridge's ``hpc-jobs``."""

from __future__ import annotations

import json
import logging
import socket
import urllib.parse
import uuid
from typing import Any

import pika
import pytest
from hpc_paco_trainer import hpc_relay, selftest
from hpc_paco_trainer.hpc_relay import HPCJobError, RelayConfig
from tls_proxy import tls_proxy

BOUND_S = 300.0
FILES = {
    "Background Model": selftest.HDF5_MAGIC + b"b" * 2000,
    "Model 1": selftest.HDF5_MAGIC + b"1" * 2000,
    "Log File": b"log\n",
}
INPUTS = {"Sample 1": [{"resource_path": "/unused", "resource_url": "/uploads/projects/p/resources/r/original_file"}]}
SETTINGS = {"Batch Size": 8, "Maximum time (D-HH:MM)": "0-00:01"}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _body() -> bytes:
    return hpc_relay.build_request(INPUTS, SETTINGS)


def _step(config: RelayConfig, cid: str, clock: Clock, **kw: Any) -> dict[str, bytes] | None:
    return hpc_relay.step(config, cid, _body, kw.pop("bound_s", BOUND_S), now=clock, **kw)


def _config(url: str, state_dir: str, request_queue: str, **kw: Any) -> RelayConfig:
    return RelayConfig(url, state_dir, request_queue=request_queue, **kw)


def _depth(channel: Any, queue: str) -> int:
    return int(channel.queue_declare(queue=queue, passive=True).method.message_count)


def _answer(channel: Any, cid: str, body: bytes, parts: int, order: list[int]) -> None:
    selftest.publish_reply(channel, hpc_relay.reply_queue_name(cid), cid, body, parts, order)


def test_one_request_then_the_reply_in_parts(
    broker_url: str, channel: Any, request_queue: str, correlation_id: str, state_dir: str
) -> None:
    config, clock, cid = _config(broker_url, state_dir, request_queue), Clock(), correlation_id
    assert _step(config, cid, clock) is None
    method, props, body = channel.basic_get(queue=request_queue, auto_ack=True)
    assert method is not None
    assert (props.correlation_id, props.reply_to, props.delivery_mode) == (cid, "hpc-results." + cid, 2)
    assert props.headers == {"x-rodan-runjob": cid}
    assert json.loads(body.decode()) == {
        "inputs": {"Sample 1": INPUTS["Sample 1"][0]["resource_url"]},
        "settings": SETTINGS,
    }
    # The reply queue is the run's own: durable, with x-expires a day past the bound (another
    # declaration with other arguments is refused with 406).
    reply_queue = hpc_relay.reply_queue_name(cid)
    assert _depth(channel, reply_queue) == 0
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        channel.queue_declare(queue=reply_queue, durable=True, arguments={"x-expires": 1000})
    assert refused.value.reply_code == 406 and "x-expires" in refused.value.reply_text
    channel = channel.connection.channel()
    channel.queue_declare(queue=reply_queue, durable=True, arguments=hpc_relay.reply_queue_arguments(BOUND_S))

    clock.t += 60
    assert _step(config, cid, clock) is None  # published once only
    assert _depth(channel, request_queue) == 0

    reply = selftest.success_body(FILES)
    _answer(channel, cid, reply, 3, [3, 1, 3])  # out of order, part 3 twice, part 2 missing
    assert _step(config, cid, clock) is None
    assert _depth(channel, reply_queue) == 0  # moved to disk, acknowledged
    assert hpc_relay.RunState(state_dir, cid).missing_parts() == [2]

    _answer(channel, cid, reply, 3, [2])
    assert _step(config, cid, clock) == FILES
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        channel.queue_declare(queue=reply_queue, passive=True)
    assert gone.value.reply_code == 404  # the run deleted its queue once the reply was complete
    # A redelivered task message (worker restart after the last poll) finds the reply on disk.
    assert _step(config, cid, clock) == FILES
    assert _depth(channel.connection.channel(), request_queue) == 0


def test_a_run_never_takes_another_runs_reply(
    broker_url: str, channel: Any, request_queue: str, state_dir: str
) -> None:
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        assert _step(config, first, clock) is None and _step(config, second, clock) is None
        _answer(channel, second, selftest.success_body(FILES), 2, [1, 2])
        assert _step(config, first, clock) is None
        assert _depth(channel, hpc_relay.reply_queue_name(second)) == 2
        assert _step(config, second, clock) == FILES
        assert _depth(channel, request_queue) == 2
    finally:
        for cid in (first, second):
            channel.connection.channel().queue_delete(queue=hpc_relay.reply_queue_name(cid))


def test_an_error_reply_ends_the_run_with_its_reason(
    broker_url: str, channel: Any, request_queue: str, correlation_id: str, state_dir: str
) -> None:
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    assert _step(config, correlation_id, clock) is None
    reason = "Slurm job 61 ended without a result: TIMEOUT after 0-06:00: raise 'Maximum time (D-HH:MM)'"
    _answer(channel, correlation_id, json.dumps({"error": reason}).encode(), 1, [1])
    with pytest.raises(HPCJobError) as caught:
        _step(config, correlation_id, clock)
    assert caught.value.summary == "The HPC training failed: " + reason
    with pytest.raises(HPCJobError, match="TIMEOUT"):
        _step(config, correlation_id, clock)  # the same outcome on a redelivery


def test_silence_past_the_bound_ends_the_run(
    broker_url: str, request_queue: str, correlation_id: str, state_dir: str
) -> None:
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    bound = hpc_relay.silence_bound_s(
        SETTINGS, RelayConfig(broker_url, state_dir, max_continuations=1, max_pending_s=60, slack_s=30)
    )
    assert bound == 60 * 2 + 60 + 30
    assert _step(config, correlation_id, clock, bound_s=bound) is None
    clock.t += bound
    assert _step(config, correlation_id, clock, bound_s=bound) is None
    clock.t += 1
    with pytest.raises(HPCJobError) as caught:
        _step(config, correlation_id, clock, bound_s=bound)
    assert caught.value.summary == "No reply from the HPC cluster after 4 minutes"
    assert "the bound is 210 s" in caught.value.details and "No part of the reply arrived" in caught.value.details
    # The same call again (a redelivery, same Celery task id): the same outcome, nothing published.
    with pytest.raises(HPCJobError) as again:
        _step(config, correlation_id, clock, bound_s=bound)
    assert again.value.summary == caught.value.summary and "the bound is 210 s" in again.value.details


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_broker_that_stays_down_ends_the_run_after_the_retry_limit(
    state_dir: str, correlation_id: str, broker_url: str, request_queue: str
) -> None:
    down = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2F"
    config, clock = _config(down, state_dir, request_queue, broker_retry_s=600), Clock()
    assert _step(config, correlation_id, clock) is None
    clock.t += 600
    assert _step(config, correlation_id, clock) is None
    assert hpc_relay.RunState(state_dir, correlation_id).get("broker_down_since") == 1_000_000.0
    clock.t += 1
    with pytest.raises(HPCJobError) as caught:
        _step(config, correlation_id, clock)
    assert caught.value.summary == "RabbitMQ unreachable for 10 minutes"
    assert "HPC_BROKER_RETRY_LIMIT is 600 s" in caught.value.details
    # Nothing was published: a Retry in Rodan, with the broker back, publishes the request.
    clock.t += 3600
    assert _step(_config(broker_url, state_dir, request_queue), correlation_id, clock) is None
    state = hpc_relay.RunState(state_dir, correlation_id)
    assert state.get("published_at") == clock.t and state.get("ended_at") is None


def test_a_broker_back_in_time_clears_the_outage(
    state_dir: str, correlation_id: str, broker_url: str, request_queue: str
) -> None:
    down = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2F"
    clock = Clock()
    assert _step(_config(down, state_dir, request_queue, broker_retry_s=600), correlation_id, clock) is None
    clock.t += 300
    assert _step(_config(broker_url, state_dir, request_queue), correlation_id, clock) is None
    state = hpc_relay.RunState(state_dir, correlation_id)
    assert state.get("broker_down_since") is None and state.get("published_at") == clock.t


def test_amqps_with_the_site_ca(
    tmp_path: Any, broker_url: str, channel: Any, request_queue: str, correlation_id: str, state_dir: str
) -> None:
    upstream = urllib.parse.urlsplit(broker_url)
    with tls_proxy(str(tmp_path), upstream.hostname or "127.0.0.1", upstream.port or 5672) as (port, cert):
        url = "amqps://{}@localhost:{}{}".format(upstream.netloc.rsplit("@", 1)[0], port, upstream.path or "/%2F")
        config, clock = _config(url, state_dir, request_queue, ca_file=cert), Clock()
        assert _step(config, correlation_id, clock) is None
        assert _depth(channel, request_queue) == 1
        _answer(channel, correlation_id, selftest.success_body(FILES), 1, [1])
        assert _step(config, correlation_id, clock) == FILES
        # Without the site's CA the certificate is not trusted: no connection, and after the
        # retry limit a clear error that names the verification failure.
        other = str(uuid.uuid4())
        strict = _config(url, state_dir, request_queue, broker_retry_s=0)
        assert _step(strict, other, clock) is None
        clock.t += 1
        with pytest.raises(HPCJobError) as caught:
            _step(strict, other, clock)
        assert "CERTIFICATE_VERIFY_FAILED" in caught.value.details
        assert _depth(channel, request_queue) == 1


def _leaks(secret: str, records: list[logging.LogRecord], *texts: str) -> list[str]:
    seen = [r.getMessage() for r in records] + [str(r.exc_info[1]) for r in records if r.exc_info] + list(texts)
    return [text for text in seen if secret in text]


def test_secrets_never_reach_a_log_or_an_error(
    secret_user: str,
    all_logs: list[logging.LogRecord],
    broker_url: str,
    channel: Any,
    request_queue: str,
    correlation_id: str,
    state_dir: str,
) -> None:
    password = urllib.parse.urlsplit(secret_user).password or ""
    clock = Clock()
    config = _config(secret_user, state_dir, request_queue)
    assert _step(config, correlation_id, clock) is None
    _answer(channel, correlation_id, selftest.success_body(FILES), 2, [2, 1])
    assert _step(config, correlation_id, clock) == FILES
    wrong = secret_user.replace(password, password[::-1])
    with pytest.raises(HPCJobError) as refused:
        _step(_config(wrong, state_dir, request_queue), str(uuid.uuid4()), clock)
    assert refused.value.summary == "RabbitMQ refused the job's account (HPC_RABBITMQ_URL)"
    down = secret_user.replace(f":{urllib.parse.urlsplit(secret_user).port}", f":{_closed_port()}")
    lost = str(uuid.uuid4())
    assert _step(_config(down, state_dir, request_queue, broker_retry_s=0), lost, clock) is None
    clock.t += 1
    with pytest.raises(HPCJobError) as unreachable:
        _step(_config(down, state_dir, request_queue, broker_retry_s=0), lost, clock)
    assert any(r.name.startswith("pika") for r in all_logs) and any(
        r.name == "rodan.hpc_paco_trainer" for r in all_logs
    )
    texts = [str(e.value) + e.value.details for e in (refused, unreachable)]
    assert _leaks(password, all_logs, *texts) == []
    assert _leaks(password[::-1], all_logs, *texts) == []

"""Attempts of one RunJob (Rodan's Retry dispatches the same RunJob under a new Celery task id), the
clean-up of an attempt Rodan ended (Cancel, a deleted RunJob), the sweep of runs Rodan ended, and
the cheap poll, against the real RabbitMQ (queues unique to each test, never ``hpc-jobs``)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterator

import pika
import pytest
from hpc_paco_trainer import hpc_relay, selftest
from hpc_paco_trainer.hpc_relay import AttemptOver, HPCJobError, RelayConfig, RunState
from test_broker import BOUND_S, FILES, Clock, _answer, _body, _config, _depth

LIMIT_S = 86400.0  # 'Maximum time' 1-00:00: the interval's cap is 1500 s


def _poll(config: RelayConfig, runjob: str, task: str | None, clock: Clock, **kw: Any) -> dict[str, bytes] | None:
    return hpc_relay.step(
        config, runjob, _body, kw.pop("bound_s", BOUND_S), now=clock, task_id=task, time_limit_s=LIMIT_S, **kw
    )


def _exists(broker_url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        connection.channel().queue_declare(queue=queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return False
    finally:
        if connection.is_open:
            connection.close()


def _take(channel: Any, queue: str) -> tuple[Any, dict[str, Any]]:
    method, props, body = channel.basic_get(queue=queue, auto_ack=True)
    assert method is not None, "no request in " + queue
    return props, json.loads(body.decode())


@pytest.fixture
def runjob(broker_url: str) -> Iterator[str]:
    """A RunJob uuid; the reply queues of its first attempts are deleted after the test."""
    value = str(uuid.uuid4())
    yield value
    from conftest import delete_queues

    delete_queues(broker_url, [hpc_relay.reply_queue_name(hpc_relay.correlation_id_for(value, n)) for n in (1, 2, 3)])


def test_a_new_celery_task_id_is_a_new_attempt_with_its_own_correlation_id(
    broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str
) -> None:
    """Rodan's Retry: same RunJob, new task id. Catches: reusing the RunJob uuid as correlation id
    (the bridge answers each once: the retry would wait for ever), not deleting the previous
    attempt's reply queue (its late reply would land where nobody reads, or be taken for the new
    one), keeping the previous attempt's parts, a second publish for the same task id."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    assert _poll(config, runjob, "task-a", clock) is None
    assert _poll(config, runjob, "task-a", clock) is None  # Celery's own retry: same attempt
    props, _ = _take(channel, request_queue)
    assert (props.correlation_id, props.headers) == (runjob, {"x-rodan-runjob": runjob})
    assert _depth(channel, request_queue) == 0  # published once for task-a
    reply = selftest.success_body(FILES)
    _answer(channel, runjob, reply, 2, [1])  # part 1 of attempt 1 arrives
    assert _poll(config, runjob, "task-a", clock) is None
    assert RunState(state_dir, runjob).missing_parts() == [2]

    clock.t += 120
    assert _poll(config, runjob, "task-b", clock) is None  # Rodan dispatched the RunJob again
    props, body = _take(channel, request_queue)
    second = runjob + ".2"
    assert (props.correlation_id, props.reply_to) == (second, "hpc-results." + second)
    assert props.headers == {"x-rodan-runjob": runjob} and body["settings"]["Batch Size"] == 8
    assert not _exists(broker_url, "hpc-results." + runjob)  # attempt 1's late reply is unroutable
    state = RunState(state_dir, runjob)
    assert (state.get("task_id"), state.get("attempt"), state.get("correlation_id")) == ("task-b", 2, second)
    assert state.missing_parts() is None and state.get("published_at") == clock.t  # attempt 1's part 1 is gone
    assert hpc_relay.read_attempt_record(state_dir, runjob)["attempt"] == 2

    assert _poll(config, runjob, "task-b", clock) is None
    assert _depth(channel, request_queue) == 0  # attempt 2 publishes once too
    _answer(channel, second, reply, 2, [2, 1])
    assert _poll(config, runjob, "task-b", clock) == FILES
    assert not _exists(broker_url, "hpc-results." + second)


def test_retry_of_a_failed_run_trains_again(
    broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str
) -> None:
    """A run failed by silence (or an error reply) and retried in Rodan starts attempt 2, which
    finishes with the reply. Catches: the 0.4.0 refusal "This run already ended", and a new task id
    that re-raises the old failure."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    assert _poll(config, runjob, "task-a", clock, bound_s=100) is None
    clock.t += 101
    with pytest.raises(HPCJobError, match="No reply from the HPC cluster"):
        _poll(config, runjob, "task-a", clock, bound_s=100)
    with pytest.raises(HPCJobError, match="No reply from the HPC cluster"):
        _poll(config, runjob, "task-a", clock, bound_s=100)  # a redelivery of the failed call
    assert _poll(config, runjob, "task-b", clock, bound_s=100) is None
    _take(channel, request_queue)
    props, _ = _take(channel, request_queue)
    assert props.correlation_id == runjob + ".2"
    _answer(channel, runjob + ".2", selftest.success_body(FILES), 1, [1])
    assert _poll(config, runjob, "task-b", clock, bound_s=100) == FILES

    # And an error reply, retried: attempt 3.
    assert _poll(config, runjob, "task-c", clock) is None
    props, _ = _take(channel, request_queue)
    assert props.correlation_id == runjob + ".3"
    _answer(channel, runjob + ".3", json.dumps({"error": "Slurm job 7 ended: TIMEOUT"}).encode(), 1, [1])
    with pytest.raises(HPCJobError, match="TIMEOUT"):
        _poll(config, runjob, "task-c", clock)
    assert _poll(config, runjob, "task-d", clock) is None
    props, _ = _take(channel, request_queue)
    assert props.correlation_id == runjob + ".4"
    hpc_relay.delete_reply_queues(config, [runjob + ".4"])


def test_state_of_0_4_0(broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str) -> None:
    """0.4.0's state has no task id. A failed one retried is attempt 2; one still waiting is the
    same attempt (its polls carry their task id from now on), with no second publish, and gets the
    cheap poll. Catches: a failed 0.4.0 run refused or re-published under the uuid the bridge
    answered; a waiting 0.4.0 run re-published (the bridge would see a second request), its parts
    dropped, or left to the full poll for ever (no silence bound in its state)."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    failed = str(uuid.uuid4())
    RunState(state_dir, failed).update(
        created_at=clock.t - 900, published_at=clock.t - 800, ended_at=clock.t - 10, failed="No reply"
    )
    try:
        assert _poll(config, failed, "task-x", clock) is None
        props, _ = _take(channel, request_queue)
        assert props.correlation_id == failed + ".2"
    finally:
        hpc_relay.delete_reply_queues(config, [failed + ".2"])

    channel.queue_declare(
        queue="hpc-results." + runjob, durable=True, arguments=hpc_relay.reply_queue_arguments(BOUND_S)
    )
    waiting = RunState(state_dir, runjob)
    waiting.update(created_at=clock.t - 100, published_at=clock.t - 90, expires_at=clock.t + 1e6, ended_at=None)
    waiting.save_part(1, 2, selftest.reply_parts(selftest.success_body(FILES), 2)[0])
    assert _poll(config, runjob, "task-old", clock) is None
    assert _depth(channel, request_queue) == 0
    state = RunState(state_dir, runjob)
    assert (state.get("task_id"), state.get("attempt"), state.get("correlation_id")) == ("task-old", 1, runjob)
    assert state.get("bound_s") == BOUND_S and hpc_relay.nothing_new(config, runjob, "task-old", clock.t)
    _answer(channel, runjob, selftest.success_body(FILES), 2, [2])
    assert _poll(config, runjob, "task-old", clock) == FILES


def test_an_attempt_rodan_ended_leaves_no_queue_and_no_state(
    broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str
) -> None:
    """What the job does on Cancel (the revoked signal, or a poll that finds its RunJob CANCELLED):
    the attempt's reply queue and state folder go; a later poll of that attempt ends quietly
    (AttemptOver); Rodan's Retry afterwards is attempt 2. A clean-up named for another attempt's
    task id leaves the current attempt alone. Catches: a state folder left behind (swept only days
    later), a queue left for the bridge's late reply, a Retry after Cancel reusing the uuid, a
    stale attempt's clean-up removing the new attempt's state."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    assert _poll(config, runjob, "task-a", clock) is None
    assert _exists(broker_url, "hpc-results." + runjob)
    assert hpc_relay.end_attempt(config, runjob, "task-a", "its RunJob is CANCELLED") is True
    assert not os.path.exists(os.path.join(state_dir, runjob))
    assert not _exists(broker_url, "hpc-results." + runjob)
    with pytest.raises(AttemptOver):
        _poll(config, runjob, "task-a", clock)  # the revoked poll, after a worker restart
    assert not os.path.exists(os.path.join(state_dir, runjob))
    assert hpc_relay.end_attempt(config, runjob, "task-a", "again") is False  # nothing left: no error

    assert _poll(config, runjob, "task-b", clock) is None  # Retry after Cancel
    _take(channel, request_queue)
    props, _ = _take(channel, request_queue)
    assert props.correlation_id == runjob + ".2"
    assert hpc_relay.end_attempt(config, runjob, "task-a", "a stale poll") is False
    assert RunState(state_dir, runjob).get("task_id") == "task-b"
    assert _exists(broker_url, "hpc-results." + runjob + ".2")


def test_the_sweep_removes_runs_rodan_ended(
    broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str
) -> None:
    """The sweep asks Rodan (``over``) about runs still waiting and removes those it ended; at most
    once per SWEEP_EVERY_S. Catches: a cancelled run's state kept until its queue expires (5 days),
    a live run's state removed, a sweep on every poll (a database query each)."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    live = str(uuid.uuid4())
    try:
        assert _poll(config, runjob, "task-a", clock) is None and _poll(config, live, "task-l", clock) is None
        asked: list[list[str]] = []

        def over(names: list[str]) -> list[str]:
            asked.append(names)
            return [runjob]

        removed = hpc_relay.maybe_sweep(state_dir, clock.t, over=over)
        assert removed == [runjob] and asked == [sorted([runjob, live])]
        assert hpc_relay.delete_reply_queues(config, removed)
        assert not _exists(broker_url, "hpc-results." + runjob)
        assert sorted(n for n in os.listdir(state_dir) if not n.startswith(".")) == [live]
        assert hpc_relay.maybe_sweep(state_dir, clock.t + hpc_relay.SWEEP_EVERY_S - 1, over=over) == []
        assert len(asked) == 1
        hpc_relay.maybe_sweep(state_dir, clock.t + hpc_relay.SWEEP_EVERY_S + 1, over=over)
        assert len(asked) == 2 and asked[1] == [live]
    finally:
        hpc_relay.delete_reply_queues(config, [live])


def test_the_cheap_poll_only_says_wait_when_nothing_can_have_changed(
    broker_url: str, channel: Any, request_queue: str, runjob: str, state_dir: str
) -> None:
    """``nothing_new`` lets a poll skip Rodan's inputs, the sample zips and the full step. Catches:
    skipping a poll while a reply part waits in the queue, past the silence bound, for another
    attempt's task id, before the first publish, or after the reply was complete."""
    config, clock = _config(broker_url, state_dir, request_queue), Clock()
    assert not hpc_relay.nothing_new(config, runjob, "task-a", clock.t)  # nothing published yet
    assert _poll(config, runjob, "task-a", clock) is None
    assert hpc_relay.nothing_new(config, runjob, "task-a", clock.t)
    assert not hpc_relay.nothing_new(config, runjob, "task-b", clock.t)  # a new attempt: full poll
    assert not hpc_relay.nothing_new(config, runjob, "task-a", clock.t + BOUND_S + 1)  # the bound
    _answer(channel, runjob, selftest.success_body(FILES), 2, [1])
    assert not hpc_relay.nothing_new(config, runjob, "task-a", clock.t)
    assert _poll(config, runjob, "task-a", clock) is None
    assert hpc_relay.nothing_new(config, runjob, "task-a", clock.t)
    _answer(channel, runjob, selftest.success_body(FILES), 2, [2])
    assert _poll(config, runjob, "task-a", clock) == FILES
    assert not hpc_relay.nothing_new(config, runjob, "task-a", clock.t)  # complete: outputs to write
    # The countdown after a poll follows the state: HPC_POLL_SECONDS at first, then growing.
    assert hpc_relay.next_poll_s(config, runjob, clock.t) == config.poll_seconds
    assert hpc_relay.next_poll_s(config, runjob, clock.t + 3000) == 300
    assert hpc_relay.next_poll_s(config, runjob, clock.t + 1e6) == 1500

"""Fixtures for the job package's own tests (Python 3.7, pika 1.1.0: rodan_job/requirements-tests.txt).

They talk to the real RabbitMQ of RABBITMQ_URL (else 127.0.0.1:5672, guest), never to Rodan; every
queue, user and folder they make is unique to the test and removed afterwards."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import urllib.parse
import uuid
from typing import Iterator

import pika
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpc_paco_trainer import hpc_relay

LOCAL_BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"


@pytest.fixture(scope="session")
def broker_url() -> str:
    url = os.environ.get("RABBITMQ_URL") or LOCAL_BROKER
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except pika.exceptions.AMQPError as exc:
        pytest.fail(f"no RabbitMQ at RABBITMQ_URL or 127.0.0.1:5672: {exc!r}")
    return url


@pytest.fixture
def channel(broker_url: str) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        yield connection.channel()
    finally:
        if connection.is_open:
            connection.close()


@pytest.fixture
def request_queue(broker_url: str) -> Iterator[str]:
    """A request queue of the test's own (never the bridge's hpc-jobs)."""
    name = "hpc-jobs.rodan-job-test-" + uuid.uuid4().hex
    yield name
    delete_queues(broker_url, [name])


@pytest.fixture
def correlation_id(broker_url: str) -> Iterator[str]:
    """A fresh run id; its reply queue is deleted after the test."""
    value = str(uuid.uuid4())
    yield value
    delete_queues(broker_url, [hpc_relay.reply_queue_name(value)])


def delete_queues(url: str, names: list[str]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for name in names:
            channel = connection.channel()
            with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                channel.queue_delete(queue=name)
    finally:
        connection.close()


@pytest.fixture
def state_dir(tmp_path: os.PathLike[str]) -> str:
    path = os.path.join(str(tmp_path), "media", "hpc_paco_trainer")
    os.makedirs(path)
    return path


@pytest.fixture
def secret_user(broker_url: str) -> Iterator[str]:
    """An AMQP URL with a broker user of the test's own and a long random password."""
    if not shutil.which("rabbitmqctl"):
        pytest.fail("rabbitmqctl is needed to make a broker user for the secrets test")
    user = "rodan-job-test-" + uuid.uuid4().hex[:12]
    password = "pw-" + uuid.uuid4().hex
    parts = urllib.parse.urlsplit(broker_url)
    vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    run = ["rabbitmqctl", "-q"]
    subprocess.run([*run, "add_user", user, password], check=True, capture_output=True)
    try:
        subprocess.run([*run, "set_permissions", "-p", vhost, user, ".*", ".*", ".*"], check=True, capture_output=True)
        netloc = f"{user}:{password}@{parts.hostname}:{parts.port or 5672}"
        yield urllib.parse.urlunsplit(("amqp", netloc, parts.path or "/%2F", "", ""))
    finally:
        subprocess.run([*run, "delete_user", user], check=False, capture_output=True)


@pytest.fixture
def all_logs() -> Iterator[list[logging.LogRecord]]:
    """Every log record of every logger (pika's included) at DEBUG while the test runs."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)

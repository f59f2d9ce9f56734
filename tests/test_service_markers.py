"""The service markers (tests/conftest.py): added from the fixtures a test uses, and checked, so
that ``-m "not broker and not slurm and not gridengine and not rodan and not training"`` runs only tests that
reach no service. Each case runs a small suite of its own with this project's conftest."""

from __future__ import annotations

import pytest

CONFTEST = 'pytest_plugins = ["tests.conftest"]  # its hooks and fixtures, in a suite of its own\n'

SUITE = """
import pytest


def test_plain():
    pass


def test_queues(queues):
    pass


def test_cluster(cluster):
    pass


@pytest.mark.slurm
def test_marked_by_hand():
    pass
"""

SERVICE_FREE = "not broker and not slurm and not gridengine and not rodan and not training"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    return pytester


def selected(result: pytest.RunResult) -> set[str]:
    return {line.split("::")[1] for line in result.outlines if "::" in line}


def test_markers_come_from_the_fixtures_and_the_cluster_parameter(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_suite=SUITE)
    everything = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    assert selected(everything) == {
        "test_plain",
        "test_queues",
        "test_cluster[slurm]",
        "test_cluster[gridengine]",
        "test_marked_by_hand",
    }
    free = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", SERVICE_FREE)
    assert selected(free) == {"test_plain"}
    on_grid_engine = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gridengine")
    assert selected(on_grid_engine) == {"test_cluster[gridengine]"}
    broker = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", "broker")
    assert selected(broker) == {"test_queues"}


def test_a_test_without_a_service_marker_cannot_run_a_scheduler_command(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_sneaky="""
import subprocess

def test_sbatch():
    subprocess.run(["sbatch", "--version"], capture_output=True)

def test_qstat_in_a_shell():
    subprocess.run("qstat -g c", shell=True, capture_output=True)

def test_nothing():
    subprocess.run(["true"], check=True)
"""
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    assert "reached a service: ['slurm: sbatch --version']" in result.stdout.str()
    assert "reached a service: ['gridengine: qstat -g c']" in result.stdout.str()


def test_a_test_without_a_service_marker_cannot_connect_to_the_broker(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_sneaky="""
import socket

def test_connect():
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        pass
"""
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    assert "reached a service: ['broker: connect to 127.0.0.1:5672']" in result.stdout.str()


def test_a_service_fixture_reached_without_its_marker_fails(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:1/%2F")  # the fixture connects to nothing
    suite.makepyfile(
        test_sneaky="""
import pytest

@pytest.mark.slurm
def test_asks_for_the_broker_at_run_time(request):
    request.getfixturevalue("broker_url")

@pytest.mark.slurm
@pytest.mark.broker
def test_marked(request):
    request.getfixturevalue("broker_url")
"""
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    assert "this test used ['broker'] without the marker(s)" in result.stdout.str()


def test_a_test_on_a_private_node_gets_the_broker_marker(suite: pytest.Pytester) -> None:
    """``private_broker`` (tests/support/private_broker.py), also through ``node``, is the broker."""
    suite.makepyfile(
        test_suite="""
from tests.support.private_broker import private_node


@private_node(max_message_size=4096)
def test_node(node):
    pass


@private_node(max_message_size=4096)
def test_private_broker(private_broker):
    pass


def test_plain():
    pass
"""
    )
    broker = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", "broker")
    assert selected(broker) == {"test_node[max_message_size=4096]", "test_private_broker[max_message_size=4096]"}
    free = suite.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", SERVICE_FREE)
    assert selected(free) == {"test_plain"}

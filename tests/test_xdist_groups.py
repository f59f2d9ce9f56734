"""deploy/dev/test.sh relies on pytest-xdist's ``--dist loadgroup``: the tests of one
``xdist_group`` run on one worker, one after another (the continuation variants, one private
RabbitMQ node, the outages of one cluster). Some pytest and xdist versions together ignore the
mark without a word (pytest 9.2 with pytest-xdist 3.8: pytest-xdist issue 1386): the run then
goes on with those tests side by side. This test runs a small suite the way test.sh does and
fails when the grouping is gone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SUITE = """
import pytest

@pytest.mark.xdist_group("one-at-a-time")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    pass

@pytest.mark.parametrize("n", range(4))
def test_free(n):
    pass
"""


def test_an_xdist_group_runs_on_one_worker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-v", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=8)
    grouped = [
        found.group(1)
        for line in result.outlines
        if (found := re.match(r"\[(gw\d+)\] .*PASSED test_suite\.py::test_grouped\[\d\]", line))
    ]
    assert len(grouped) == 4, result.outlines
    # Without the grouping, the first two grouped tests go to gw0 and gw1 (round robin).
    assert len(set(grouped)) == 1, f"one group ran on {sorted(set(grouped))}"


PRIVATE_NODE_SUITE = """
import pytest

from tests.support.private_broker import private_node


@pytest.fixture(scope="session")
def private_broker(request):  # stands in for tests/conftest.py's: no node boots here
    return request.param


@private_node(max_message_size=4096)
@pytest.mark.parametrize("n", range(4))
def test_on_the_node(private_broker, n):
    assert private_broker == 4096


@pytest.mark.parametrize("n", range(4))
def test_free(n):
    pass
"""


def test_the_tests_on_a_private_node_run_on_one_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/conftest.py puts every test that uses the ``private_broker`` fixture (through ``node``
    too) in the xdist group ``private_broker`` (tests/support/private_broker.py), before xdist reads it."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))  # the project's tests package
    pytester.makeconftest('pytest_plugins = ["tests.conftest"]\n')
    pytester.makepyfile(test_suite=PRIVATE_NODE_SUITE)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-v", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=8)
    on_node = [
        found.group(1)
        for line in result.outlines
        if (found := re.match(r"\[(gw\d+)\] .*PASSED test_suite\.py::test_on_the_node\[", line))
    ]
    assert len(on_node) == 4, result.outlines
    # Without the group, the first two of them go to gw0 and gw1 (round robin; they sort first: broker).
    assert len(set(on_node)) == 1, f"the private node's tests ran on {sorted(set(on_node))}"

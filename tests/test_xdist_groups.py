"""deploy/dev/test.sh relies on pytest-xdist's ``--dist loadgroup``: the tests of one
``xdist_group`` run on one worker, one after another (the continuation variants, one private
RabbitMQ node, the outages of one cluster). Some pytest and xdist versions together ignore the
mark without a word (pytest 9.2 with pytest-xdist 3.8: pytest-xdist issue 1386): the run then
goes on with those tests side by side. This test runs a small suite the way test.sh does and
fails when the grouping is gone.
"""

from __future__ import annotations

import re

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
    workers: dict[str, set[str]] = {}
    for line in result.outlines:
        found = re.match(r"\[(gw\d+)\] .*PASSED test_suite\.py::(test_\w+)\[\d+\]", line)
        if found:
            workers.setdefault(found.group(2), set()).add(found.group(1))
    assert workers.get("test_free") == {"gw0", "gw1"}, result.outlines  # both workers took tests
    assert len(workers.get("test_grouped", set())) == 1, f"one group ran on {workers.get('test_grouped')}"

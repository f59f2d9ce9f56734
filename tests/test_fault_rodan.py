"""Rodan down or misbehaving, end to end through ``hpc-bridge run`` and real Slurm jobs (fault suite item 3).

What is covered elsewhere is not repeated here: the client's retries against the stand-in
(tests/test_rodan_client.py), the download cap, other origins and the intake's input check
(tests/test_inputs_bounded.py), the token endpoint's 5xx outage deferring then giving up and the
refused HPC account with cron passes (tests/test_e2e.py), the worker's 404 and not-an-image in
process (tests/test_worker.py). Here every download fault happens in the real worker inside a
real Slurm job, each request with its own fault (the stand-in's faults match a path prefix, and
every request's page has its own paths; ``downloads_only`` leaves the intake's ranged check of
each input alone, so that the fault meets the worker's download), a file that is not a PNG is
refused at intake without a job, and the token endpoint's resets and timeouts go through the
daemon: bounded retries, then exactly one error reply that names the cause.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.testing.rodan import RodanStandin
from tests.support.bridge import NO_FRESH_STARTS, bridge_environ
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster, jobs_named, jobs_started
from tests.support.daemon import DAEMON_SETTINGS
from tests.support.harness import Harness
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.broker]

# The bridge's HPC_RODAN_RETRIES / HPC_RODAN_TIMEOUT reach the worker through the parameter file.
RETRIES, TIMEOUT_S = 3, 5
DOWNLOAD_ATTEMPTS = RETRIES + 1


@pytest.fixture
def bridge(
    broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path, slurm: None
) -> Iterator[Harness]:
    spool = tmp_path / "spool"
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"), HPC_GPU_RULES="none",
        HPC_JOB_PROLOGUE=NO_FRESH_STARTS,  # the downloads are tested here, not the training
    )  # fmt: skip
    harness = Harness(env, spool, rodan, Cluster("slurm"))
    yield harness
    harness.teardown()


def hits(standin: RodanStandin, path: str) -> int:
    return sum(1 for r in standin.requests if r.path == path)


def downloads(standin: RodanStandin, path: str) -> int:
    """Whole-file GETs of ``path`` (the worker's), not the intake's ranged check."""
    return sum(1 for r in standin.requests if r.path == path and r.method == "GET" and r.header("Range") is None)


@pytest.mark.training
def test_download_faults_in_real_jobs_end_in_one_clear_reply_each(
    bridge: Harness, standin: RodanStandin, rodan: Rodan, sample_inputs
) -> None:
    host = standin.host_port
    pages = {
        name: sample_inputs("new", n_layers=1, seed=seed)
        for seed, name in enumerate(["burst", "5xx", "reset", "truncated", "timeout", "refused", "not_png"], start=40)
    }
    pages["burst"] = sample_inputs("new", n_layers=1, height=256, width=320, seed=40)
    image = {name: page["Image"] for name, page in pages.items()}
    layer = pages["refused"]["rgba PNG - Layer 0"]
    only = {"downloads_only": True}  # the intake's ranged check of each input gets through
    standin.fail_next(2, status=503, paths=image["burst"], **only)  # a burst shorter than the retries: recovers
    standin.fail_next(1000, status=502, paths=image["5xx"], **only)
    standin.reset_next(1000, paths=image["reset"], **only)
    standin.truncate_next(1000, paths=image["truncated"], **only)
    standin.delay(15, paths=image["timeout"], **only)  # longer than the worker's read timeout, every time
    standin.fail_next(1000, status=401, paths=layer, detail="Ask bob@example.org for a login", **only)
    login_page = b"<html><body>Rodan's login page</body></html>"
    (standin.uploads_dir / "not-a-png").write_bytes(login_page)
    pages["not_png"]["rgba PNG - Layer 0"] = "/uploads/not-a-png"

    daemon = bridge.start_daemon(HPC_RODAN_RETRIES=str(RETRIES), HPC_RODAN_TIMEOUT=str(TIMEOUT_S))
    corr = {name: rodan.publish_request(page, DAEMON_SETTINGS) for name, page in pages.items()}
    wait_until(lambda: bridge.all_replied(list(corr.values())), 540, 2, "one reply per request")

    models = bridge.reply(corr["burst"])
    assert set(models) == {"Background Model", "Model 0"}, "a 5xx burst shorter than the retries is harmless"
    assert downloads(standin, image["burst"]) == 3

    prefix = "the training job failed while downloading 'Image': download of "
    assert bridge.error(corr["5xx"]) == f"{prefix}{host}{image['5xx']}: server answered 502"
    error = bridge.error(corr["reset"])
    assert error.startswith(f"{prefix}{host}{image['reset']} failed: ") and "Connection" in error, error
    error = bridge.error(corr["truncated"])
    assert error.startswith(f"{prefix}{host}{image['truncated']} truncated: "), error
    got, of = map(int, re.fullmatch(r".* truncated: (\d+) of (\d+) bytes", error).groups())  # type: ignore[union-attr]
    assert got == of // 2 > 0, "the stand-in sends half of the body: the reply says how much arrived"
    error = bridge.error(corr["timeout"])
    assert error.startswith(f"{prefix}{host}{image['timeout']} failed: ") and "Timeout" in error, error
    for name in ("5xx", "reset", "truncated", "timeout"):
        assert downloads(standin, image[name]) == DOWNLOAD_ATTEMPTS, f"{name}: bounded retries"

    error = bridge.error(corr["refused"])
    assert error == (
        f"the training job failed while downloading 'rgba PNG - Layer 0': download of {host}{layer} "
        "refused (401): Rodan did not accept the HPC account's token; check the account's rights in Rodan "
        "(hpc-bridge doctor)"
    ), "the status and what to do, never the server's body"
    assert downloads(standin, layer) == 1, "a 4xx is never retried"
    error = bridge.error(corr["not_png"])
    assert error == f"input 'rgba PNG - Layer 0' is not a PNG or JPEG file (it starts with {login_page[:16].hex()})"
    assert downloads(standin, "/uploads/not-a-png") == 0 and hits(standin, "/uploads/not-a-png") == 1

    for name, c in corr.items():
        text = bridge.error(c) or f"models: {sorted(bridge.reply(c))}"
        print(f"\n{name}: {downloads(standin, image[name])} downloads of the Image; reply: {text}")
        jobs = 0 if name == "not_png" else 1
        assert len(jobs_started(f"rodan-{c}")) == jobs, f"{name}: {jobs} job(s), never resubmitted"
    settled = {c: "rejected" if name == "not_png" else "replied" for name, c in corr.items()}
    wait_until(lambda: all(daemon.state(c) == s for c, s in settled.items()), 60, 0.5, "the ledger to settle")
    assert set(bridge.replies) == set(corr.values())
    assert not list((bridge.spool / "outbox").glob("*.json"))


def test_token_endpoint_resets_and_timeouts_defer_then_one_bounded_error(
    bridge: Harness, standin: RodanStandin, rodan: Rodan, queues: Queues, sample_inputs
) -> None:
    page = sample_inputs("new", n_layers=1, seed=50)
    token = "/api/auth/token/"
    # The second pass over a request comes at least 5 s after the first (the deferral's backoff).
    daemon = bridge.start_daemon(HPC_RODAN_RETRIES="1", HPC_RODAN_TIMEOUT="2", HPC_DEFER_LIMIT="3")
    standin.reset_next(1000, paths=token)
    reset = rodan.publish_request(page, DAEMON_SETTINGS)
    wait_until(lambda: bridge.all_replied([reset]), 120, 0.5, "the reply after connection resets")
    standin.clear_faults()
    standin.delay(6, paths=token)  # longer than HPC_RODAN_TIMEOUT
    slow = rodan.publish_request(page, DAEMON_SETTINGS)
    wait_until(lambda: bridge.all_replied([slow]), 120, 0.5, "the reply after timeouts")
    standin.clear_faults()

    url = standin.url
    error = bridge.error(reset)
    assert error.startswith("gave up after retrying for ") and "(2 attempts, HPC_DEFER_LIMIT): " in error, error
    assert f"Rodan at {url} unreachable: ConnectionError" in error, error
    error = bridge.error(slow)
    assert error.startswith("gave up after retrying for ") and "(2 attempts, HPC_DEFER_LIMIT): " in error, error
    assert f"Rodan at {url} unreachable: " in error and "Timeout" in error, error
    posts = [r for r in standin.requests if r.path == token]
    assert len(posts) == 2 * 2 * 2, "2 passes x (1 try + 1 retry) for each request: bounded"
    for c in (reset, slow):
        assert jobs_named(f"rodan-{c}") == [], "nothing was submitted"
        assert daemon.state(c) == "rejected"
    assert sorted(c for c, _b, _h in rodan.drain(queues.dead)) == sorted([reset, slow])
    assert rodan.depth(queues.request) == 0
    # Rodan is back: the next request goes through (the daemon did not give up on Rodan for good).
    ok = rodan.publish_request(page, DAEMON_SETTINGS)
    wait_until(lambda: daemon.state(ok) in ("submitted", "replied"), 60, 0.2, "the next request to be submitted")
    assert len(bridge.replies[reset]) == 1 and len(bridge.replies[slow]) == 1


def test_a_truncated_download_says_how_much_of_how_much_arrived(tmp_path: Path) -> None:
    """Regression: a body cut short inside one read chunk was reported as 'truncated: 0 bytes'."""
    from bridge.errors import TransientError
    from bridge.rodan import RodanClient

    (tmp_path / "f.bin").write_bytes(b"x" * 100_000)  # less than one 1 MiB read chunk
    with RodanStandin(tmp_path) as server:
        server.truncate_next(10, paths="/uploads/")
        client = RodanClient(server.url, retries=1, backoff_s=0.01)
        with pytest.raises(TransientError, match=r"truncated: 50000 of 100000 bytes$"):
            client.download("/uploads/f.bin", tmp_path / "out", max_bytes=1 << 20)
        assert hits(server, "/uploads/f.bin") == 2
    assert not (tmp_path / "out").exists()

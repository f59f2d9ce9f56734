"""Compute nodes without a network, on the real Slurm: the jobs' HTTP is refused, the login node's is not.

The batch jobs get an unroutable proxy from the site prologue (``HPC_JOB_PROLOGUE``: every proxy
variable set to ``http://127.0.0.1:9``, where nothing listens, and ``NO_PROXY`` unset). requests
(which the worker and the probe use) then sends every HTTP request through that proxy, loopback
included: the first test checks that before relying on it. So a job cannot fetch anything from
the Rodan stand-in, while the bridge on the login node (run without the prologue) can.

What this proves: in ``HPC_INPUTS_FETCH=login`` a job trains and replies without any HTTP request
of its own (the stand-in saw one download of each input: the bridge's at intake), and in ``node``
mode it fails with a reply naming the setting. What it does not: a node whose every socket is cut
(the worker still reaches the broker over AMQP here, which a proxy does not touch; a node that
cannot reach the broker either is the outbox's case, tested elsewhere).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from bridge.testing.rodan import RodanStandin
from tests.support.bridge import FAST_SETTINGS, NO_FRESH_STARTS, bridge_environ, run_bridge
from tests.support.broker import Queues, Rodan
from tests.support.cluster import Cluster
from tests.support.harness import Harness

pytestmark = [pytest.mark.broker, pytest.mark.slurm]

#: The site prologue of a cluster whose nodes have no route out: every HTTP request refused.
NO_ROUTE = "\n".join(
    [
        "export http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9",
        "export HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9",
        "unset NO_PROXY no_proxy",
        NO_FRESH_STARTS,  # the training is not what is tested here
    ]
)


@pytest.fixture
def harness(
    broker_url: str, standin: RodanStandin, queues: Queues, rodan: Rodan, tmp_path: Path, slurm: None
) -> Iterator[Harness]:
    spool = tmp_path / "spool"
    env = bridge_environ(broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"))
    env.update(HPC_SCHEDULER="slurm", HPC_JOB_PROLOGUE=NO_ROUTE)
    h = Harness(env, spool, rodan, Cluster("slurm"))
    yield h
    h.teardown()


def whole_file_gets(standin: RodanStandin, resource: str) -> int:
    """Downloads of a resource (GETs without Range; the intake's check asks for 16 bytes)."""
    return sum(1 for r in standin.requests if r.method == "GET" and r.path == resource and not r.header("Range"))


def test_the_proxy_would_catch_the_stand_ins_address(standin: RodanStandin, monkeypatch: pytest.MonkeyPatch) -> None:
    """The premise of the tests below: requests does not bypass a proxy for 127.0.0.1 when NO_PROXY
    is unset (the stand-in listens there). If it did, the prologue would refuse nothing and the
    'node' case below could not fail as it must."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert not requests.utils.should_bypass_proxies(standin.url, no_proxy=None)
    with pytest.raises(requests.exceptions.ProxyError):
        requests.get(standin.url_for("/api/auth/me/"), timeout=10)


@pytest.mark.training
def test_a_node_without_a_route_trains_in_login_mode_and_fails_clearly_in_node_mode(
    harness: Harness, rodan: Rodan, standin: RodanStandin, sample_inputs
) -> None:
    """Two requests, each under the no-route prologue: one taken in with HPC_INPUTS_FETCH=login, one
    with node.

    Mutations caught: the job downloading although the bridge fetched its inputs (it would fail
    like the node-mode one: its HTTP is refused); the bridge not fetching at intake; the spool's
    copies kept after the reply; the node-mode error not saying the node could not reach Rodan or
    not naming the setting; a token in the login-mode job's parameter file."""
    # A page large enough for 64x64 patches of each layer (as test_e2e's), one seed for the trainer.
    harness.env["HPC_TRAINING_SEED"] = "20261128"
    login_page = sample_inputs("new", n_layers=1, height=256, width=320, seed=31)
    node_page = sample_inputs("old", height=160, width=192, seed=32)
    fetched = rodan.publish_request(login_page, FAST_SETTINGS)
    harness.check(HPC_INPUTS_FETCH="login")
    record = harness.ledger(fetched)
    assert record["state"] == "submitted", record
    inputs_dir = harness.spool / "jobs" / fetched / "inputs"
    assert sorted(p.name for p in inputs_dir.iterdir()) == [f"input-{i}" for i in range(len(login_page))]
    params = json.loads((harness.spool / "params" / f"{fetched}.json").read_text())
    assert params["inputs_dir"] == str(inputs_dir) and params["rodan"]["token"] == ""
    assert [e["input"] for e in harness.log_events("input_fetched")] == sorted(login_page)

    cut_off = rodan.publish_request(node_page, FAST_SETTINGS)
    harness.check(HPC_INPUTS_FETCH="node")
    assert harness.ledger(cut_off)["state"] == "submitted"
    assert not (harness.spool / "jobs" / cut_off / "inputs").exists()

    harness.drive([fetched, cut_off], timeout=900)
    harness.settle([fetched, cut_off])

    reply = harness.reply(fetched)
    assert sorted(reply) == ["Background Model", "Model 0"], reply.get("error")
    assert all(base64.decodebytes(v.encode())[:8] == b"\x89HDF\r\n\x1a\n" for v in reply.values())
    # The job made no HTTP request: each input was downloaded once, by the bridge at intake.
    assert [whole_file_gets(standin, r) for r in login_page.values()] == [1] * len(login_page)
    (run_dir,) = (harness.spool / "runs").glob(f"*-{fetched}")
    job_log = [json.loads(line) for line in (run_dir / "job.log").read_text().splitlines() if line.startswith("{")]
    assert sorted(e["input"] for e in job_log if e["event"] == "input_present") == sorted(login_page)
    assert not [e for e in job_log if e["event"] in ("input_downloaded", "download_retry")]
    assert not inputs_dir.exists(), "the spool's copies go when the reply is out"
    assert harness.ledger(fetched)["outcome"] == "ok"

    error = harness.error(cut_off)
    assert "the training job failed while downloading " in error
    assert "this compute node could not reach Rodan at " in error and "ProxyError" in error
    assert "the operator sets HPC_INPUTS_FETCH=login" in error
    assert [whole_file_gets(standin, r) for r in node_page.values()] == [0] * len(node_page)


def doctor_job(env: dict[str, str]) -> dict[str, dict[str, str]]:
    result = run_bridge(
        env, "doctor", "--job", "--json", "--skip-worker", "--job-timeout", "300", "--job-memory", "2048", timeout=420
    )
    data = json.loads(result.stdout)
    return {c["name"]: c for c in data["checks"]}


def test_doctor_job_says_which_mode_a_node_without_a_route_needs(
    broker_url: str, standin: RodanStandin, queues: Queues, tmp_path: Path, slurm: None
) -> None:
    """The same node (no route, by the prologue) under both settings. node: node-rodan fails and its
    fix is the exact line to set, because doctor's own rodan check (the login node) passed. login:
    node-rodan passes and says the jobs need no route.

    Mutations caught: the probe not told the setting (login would still fail); the advice missing
    or not the exact setting line; login mode reported as a failure."""
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool", HPC_SCHEDULER="slurm")
    env.update(HPC_GPU_RULES="none", HPC_JOB_PROLOGUE=NO_ROUTE)
    node = doctor_job({**env, "HPC_INPUTS_FETCH": "node"})
    assert node["rodan"]["status"] == "ok", node["rodan"]
    assert node["probe-job"]["status"] == "ok", node["probe-job"]
    assert node["node-rodan"]["status"] == "FAIL", node["node-rodan"]
    assert "/api/auth/me/ from the node failed" in node["node-rodan"]["found"]
    assert "put the line HPC_INPUTS_FETCH=login in the credentials file" in node["node-rodan"]["fix"]

    login = doctor_job({**env, "HPC_INPUTS_FETCH": "login"})
    assert login["node-rodan"]["status"] == "ok", login["node-rodan"]
    assert "from the node failed" in login["node-rodan"]["found"]
    assert "the jobs need no route to Rodan" in login["node-rodan"]["found"]

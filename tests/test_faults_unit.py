"""bridge/faults.py (inert unless HPC_FAULT_KILL is set), and the defect the crash suite found.

Regression: a reply publisher SIGKILLed between the broker's confirm and its replied marker
published the same reply again on the next pass, with nothing to stop it circulating at Rodan.
The second copy now carries an expiry (``UNCERTAIN_REPLY_TTL_MS``); a first publish never does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pika
import pytest

from bridge import faults
from bridge.faults import FaultPlan, fault_point
from tests.support.bridge import REPO
from tests.support.broker import Queues


def test_inert_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_KILL, raising=False)
    for name in faults.POINTS:
        fault_point(name)  # returns: this test process is still alive


def test_a_named_point_kills_on_its_nth_visit() -> None:
    plan = FaultPlan.parse("after_submit:3,before_ack")
    assert [plan.should_kill("after_submit") for _ in range(4)] == [False, False, True, False]
    assert plan.should_kill("before_ack") is True
    assert plan.should_kill("after_get") is False


def test_random_is_reproducible_with_a_seed() -> None:
    draws = [[FaultPlan.parse("random:0.3", "42").should_kill("after_get") for _ in range(1)] for _ in range(2)]
    assert draws[0] == draws[1]
    a, b = FaultPlan.parse("random:0.3", "7"), FaultPlan.parse("random:0.3", "7")
    seq_a = [a.should_kill(p) for p in faults.POINTS * 20]
    seq_b = [b.should_kill(p) for p in faults.POINTS * 20]
    assert seq_a == seq_b and any(seq_a) and not all(seq_a)
    assert not any(FaultPlan.parse("random:0").should_kill("after_get") for _ in range(100))


@pytest.mark.parametrize("spec", ["random:2", "after_get:0", "after_get:x"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        FaultPlan.parse(spec)


def test_a_misspelt_point_fails_at_its_call_even_when_inert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_KILL, raising=False)
    with pytest.raises(ValueError, match="'after_sumbit' is not a fault point"):
        fault_point("after_sumbit")
    monkeypatch.setenv(faults.ENV_KILL, "before_ack:1000")
    with pytest.raises(ValueError, match="'befor_ack' is not a fault point"):
        fault_point("befor_ack")


@pytest.mark.parametrize("spec", ["after_sumbit", "after_get:2,befor_ack", "Random:0.5", "after get"])
def test_an_unknown_point_in_the_environment_is_an_error(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="is not a fault point"):
        FaultPlan.parse(spec)
    monkeypatch.setenv(faults.ENV_KILL, spec)
    with pytest.raises(ValueError, match="is not a fault point"):
        fault_point("after_get")  # a declared point: the environment is what is wrong


def test_every_call_site_names_a_declared_point_and_every_point_has_one() -> None:
    import ast

    named: dict[str, list[str]] = {}
    for package in ("bridge", "worker"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                func = getattr(node, "func", None)
                if not isinstance(node, ast.Call) or getattr(func, "id", getattr(func, "attr", "")) != "fault_point":
                    continue
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                (arg,) = node.args
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), f"{where}: not a literal"
                named.setdefault(arg.value, []).append(where)
    assert set(named) <= set(faults.POINTS), {n: w for n, w in named.items() if n not in faults.POINTS}
    assert sorted(named) == sorted(faults.POINTS), "a declared point that nothing calls"


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_process_is_sigkilled_at_the_point_and_the_point_logged(tmp_path: Path) -> None:
    log = tmp_path / "faults.log"
    code = (
        "from bridge.faults import fault_point\n"
        "for i in range(5):\n"
        "    fault_point('after_get'); print(i, flush=True)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HPC_FAULT_KILL": "after_get:3", "HPC_FAULT_LOG": str(log)}
    result = _python(code, env)
    assert result.returncode == -signal.SIGKILL
    assert result.stdout.split() == ["0", "1"]
    assert log.read_text() == "after_get\n"
    env.pop("HPC_FAULT_KILL")
    assert _python(code, env).returncode == 0


@pytest.mark.broker
def test_a_publish_killed_after_the_confirm_goes_out_again_only_with_an_expiry(
    broker_url: str, queues: Queues, tmp_path: Path
) -> None:
    from bridge.amqp import connect
    from bridge.replies import UNCERTAIN_REPLY_TTL_MS, ReplyBox
    from bridge.spool import Spool

    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    connection.channel().queue_declare(queues.reply)
    connection.close()
    spool = tmp_path / "spool"
    code = (
        "import sys\n"
        "from bridge.amqp import connect\n"
        "from bridge.replies import ReplyBox\n"
        "from bridge.spool import Spool\n"
        "from pathlib import Path\n"
        "box = ReplyBox(Spool(Path(sys.argv[1])).ensure())\n"
        "for corr in ('req-a', 'req-b'):\n"
        "    entry = box.stage(corr, sys.argv[3], b'{\"Model 0\": \"x\"}', origin='bridge')\n"
        "    channel = connect(sys.argv[2]).channel(); channel.confirm_delivery()\n"
        "    box.publish_staged(channel, entry)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HPC_FAULT_KILL": "after_publish:2"}  # req-a goes out, req-b dies
    result = subprocess.run(
        [sys.executable, "-c", code, str(spool), broker_url, queues.reply],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    box = ReplyBox(Spool(spool))
    assert not box.already_replied("req-b") and [e.correlation_id for e in box.staged()] == ["req-b"]
    channel = connect(broker_url).channel()
    channel.confirm_delivery()
    assert box.flush(channel) == 1  # the bridge's next pass: it cannot know req-b arrived
    assert box.already_replied("req-b") and box.staged() == []
    assert box.flush(channel) == 0
    assert not list((spool / "replies").glob("*.sending"))

    got = []
    while True:
        method, props, _body = channel.basic_get(queues.reply, auto_ack=True)
        if method is None:
            break
        got.append((props.correlation_id, props.expiration))
    channel.connection.close()
    assert got == [("req-a", None), ("req-b", None), ("req-b", str(UNCERTAIN_REPLY_TTL_MS))]


def test_a_request_given_up_on_at_submit_leaves_no_token_on_disk(make_config, sample_inputs) -> None:
    """Regression: a request rejected after HPC_DEFER_LIMIT of transient submit failures kept its
    parameter file, Rodan token inside, in the spool for ever (only marking a reply removed it)."""
    import json

    from bridge.errors import SchedulerUnavailable
    from bridge.intake import Intake, Message, Outcome
    from bridge.ledger import Ledger
    from bridge.replies import ReplyBox
    from bridge.rodan import RodanClient
    from bridge.schedulers import get_scheduler
    from bridge.spool import Spool
    from bridge.testing.rodan import token_for_email
    from tests.support.bridge import FAST_SETTINGS, RODAN_EMAIL

    config = make_config(HPC_DEFER_LIMIT="0.5")
    spool = Spool(config.spool_dir).ensure()
    scheduler = get_scheduler("slurm", timeout_s=5, options=config.scheduler_options)

    def unavailable(*_args: object) -> str:
        raise SchedulerUnavailable("sbatch failed: Unable to contact slurm controller (connect failure)")

    scheduler.submit = unavailable  # type: ignore[method-assign]
    scheduler.find_by_name = lambda _name: []  # type: ignore[method-assign]
    rodan = RodanClient(config.rodan_base_url, email=config.rodan_email, password=config.rodan_password, retries=0)
    ledger = Ledger(spool)
    intake = Intake(config, spool, ledger, scheduler, rodan, ReplyBox(spool))
    body = json.dumps({"inputs": sample_inputs("new", n_layers=1), "settings": FAST_SETTINGS}).encode()
    msg = Message(body=body, correlation_id="given-up", reply_to=config.reply_queue, redelivered=False, delivery_tag=1)
    assert intake.process(msg).outcome is Outcome.DEFERRED
    assert spool.params_path("given-up").exists()  # kept for the next attempt
    time.sleep(0.6)
    assert intake.process(msg).outcome is Outcome.REJECTED
    assert not spool.params_path("given-up").exists()
    token = token_for_email(RODAN_EMAIL).encode()
    assert not [p for p in spool.root.rglob("*") if p.is_file() and token in p.read_bytes()]

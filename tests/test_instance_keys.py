"""What an instance keys (bridge/instance.py), and what doctor says two instances share (bridge/ops/instances.py).

The real two-instance run (Slurm and Grid Engine, replies through cron's lines) is tests/test_instances.py;
these are the rules under it, checked without services.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.cli import main
from bridge.config import load_config
from bridge.errors import ConfigError
from bridge.instance import Instance, installed_instances, instance_name
from bridge.ops.checks import FAIL, OK
from bridge.ops.doctor import check_instances
from bridge.ops.instances import broker_target, collisions, other_instances
from bridge.ops.metrics import render
from bridge.spool import Spool


def test_the_default_instance_keeps_the_names_of_an_installation_from_before_instances(tmp_path: Path) -> None:
    default = Instance("default", tmp_path / "c", tmp_path / "s", tmp_path)
    assert default.default_spool == tmp_path / "hpc-bridge-spool"
    assert default.default_dead_letter_queue == "hpc-bridge.dead-letter"
    assert default.default_status_queue == "hpc-bridge.status"
    other = Instance("sge", tmp_path / "c", tmp_path / "s", tmp_path)
    assert other.default_spool == tmp_path / "hpc-bridge-spool-sge"
    assert other.default_dead_letter_queue == "hpc-bridge.sge.dead-letter"
    assert (other.daemon_unit, other.check_timer) == ("hpc-bridge@sge.service", "hpc-bridge-check@sge.timer")
    assert other.credentials == tmp_path / "c" / "hpc-bridge" / "sge" / "credentials.env"
    assert other.run_check_log == tmp_path / "s" / "hpc-bridge" / "sge" / "run_check.log"
    every = [
        other.settings_dir,
        other.state_dir,
        other.default_spool,
        other.system_logrotate,
        other.mark,
        *other.units,
        other.default_dead_letter_queue,
        other.default_status_queue,
    ]
    assert all("sge" in str(key) for key in every), "every key names the instance"


@pytest.mark.parametrize("name", ["", "Sge", "a b", "../x", "x" * 33, "-x", "a.b", "a/b"])
def test_a_name_that_cannot_key_a_unit_a_path_and_a_queue_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="not usable"):
        instance_name(name)


def test_the_instance_comes_from_the_option_then_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    assert instance_name(None, {"HPC_BRIDGE_INSTANCE": "lab2"}) == "lab2"
    assert instance_name("lab3", {"HPC_BRIDGE_INSTANCE": "lab2"}) == "lab3"
    assert instance_name(None, {}) == "default"
    assert main(["--instance", "Bad Name", "status"]) == 2
    assert "instance name 'Bad Name' is not usable" in capsys.readouterr().err


def _write(path: Path, **settings: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"RODAN_HOST": "rodan.example.org", "RODAN_USER": "hpc@example.org", "RODAN_PASSWORD": "pw-12345678"}
    path.write_text("".join(f"{k}={v}\n" for k, v in {**base, **settings}.items()))
    path.chmod(0o600)
    return path


def test_each_instance_reads_its_own_settings_and_gets_its_own_defaults(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    for name in ("default", "sge"):
        _write(tmp_path / "cfg" / "hpc-bridge" / name / "credentials.env", RABBITMQ_URL=f"amqp://u:p@h:5672/{name}")
    assert installed_instances(tmp_path / "cfg") == ["default", "sge"]
    sge = load_config(None, env, "sge")
    assert (sge.instance, sge.broker_url) == ("sge", "amqp://u:p@h:5672/sge")
    assert sge.credentials_file == (tmp_path / "cfg" / "hpc-bridge" / "sge" / "credentials.env").resolve()
    assert sge.dead_letter_queue == "hpc-bridge.sge.dead-letter" and sge.status_queue == "hpc-bridge.sge.status"
    assert sge.spool_dir.name == "hpc-bridge-spool-sge"
    default = load_config(None, env)
    assert (default.instance, default.broker_url) == ("default", "amqp://u:p@h:5672/default")
    assert default.dead_letter_queue == "hpc-bridge.dead-letter"
    missing = pytest.raises(ConfigError, match=r"instance lab3's .*credentials.env \(absent\)")
    with missing:
        load_config(None, env, "lab3")


def test_doctor_names_what_two_instances_share_and_nothing_else(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    folder = tmp_path / "cfg" / "hpc-bridge"
    url = "amqp://u:p@broker:5672/%2F"
    _write(folder / "default" / "credentials.env", RABBITMQ_URL=url, HPC_LOG_FILE="bridge.log")
    _write(folder / "sge" / "credentials.env", RABBITMQ_URL=url, HPC_LOG_FILE="bridge.log")
    sge = load_config(None, env, "sge")
    found = collisions(sge, other_instances(sge, env))
    # Same broker and vhost, same request queue (Rodan's default): they would take each other's requests.
    assert len(found) == 1 and "request queue hpc-jobs" in found[0] and "instance default" in found[0], found
    line = check_instances(sge, env)  # doctor's line
    assert (line.name, line.status) == ("instances", FAIL) and "request queue hpc-jobs" in line.found
    # A relative log file lies in each instance's own folder: no collision there.
    _write(folder / "sge" / "credentials.env", RABBITMQ_URL="amqp://u:p@broker:5672/sge", HPC_LOG_FILE="bridge.log")
    assert collisions(load_config(None, env, "sge"), other_instances(sge, env)) == []
    line = check_instances(load_config(None, env, "sge"), env)
    assert (line.status, line.found) == (OK, "sge shares nothing with default")
    shared = tmp_path / "spool"
    _write(folder / "sge" / "credentials.env", RABBITMQ_URL="amqp://u:p@broker/sge", HPC_SPOOL_DIR=str(shared))
    _write(folder / "default" / "credentials.env", RABBITMQ_URL=url, HPC_SPOOL_DIR=str(shared))
    sge = load_config(None, env, "sge")
    assert collisions(sge, other_instances(sge, env)) == [
        f"the spool {shared} is instance default's too: give each its own"
    ]
    assert broker_target("amqp://u:p@b/%2F") == ("b", 5672, "/") == broker_target("amqp://u:p@b:5672/")
    assert broker_target("amqps://u:p@b/lab2") == ("b", 5671, "lab2")


def test_a_spool_refuses_another_instance(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure().claim("lab1")
    assert (spool.root / "instance").read_text() == "lab1\n"
    assert spool.claim("lab1") is spool  # its own: fine, again and again
    with pytest.raises(ConfigError, match=r"belongs to instance 'lab1', not 'lab2'.*--instance lab1"):
        spool.claim("lab2")


def test_metrics_of_another_instance_carry_its_label_and_the_default_stays_unlabelled() -> None:
    default = render([], outbox=0, now=1.0)
    assert "hpc_bridge_outbox_replies 0" in default and "bridge=" not in default
    sge = render([], outbox=0, now=1.0, instance="sge")
    assert 'hpc_bridge_outbox_replies{bridge="sge"} 0' in sge
    assert 'hpc_bridge_requests_total{bridge="sge",outcome="received"} 0' in sge
    samples = [line for line in sge.splitlines() if not line.startswith("#")]
    assert samples and all('bridge="sge"' in line for line in samples)

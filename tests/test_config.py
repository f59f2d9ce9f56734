"""Configuration: every setting read, named in errors, credentials file kept private."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge.config import GpuRule, load_config, parse_gpu_rules
from bridge.errors import ConfigError

BASE = {
    "RABBITMQ_HOST": "mq.example.org",
    "RABBITMQ_USER": "hpc",
    "RABBITMQ_PASSWORD": "p@ss/word",
    "RODAN_HOST": "rodan.example.org",
    "RODAN_USER": "hpc@example.org",
    "RODAN_PASSWORD": "secret",
}


def test_seed_variable_names_build_an_amqp_url_with_quoted_password() -> None:
    config = load_config(environ=BASE)
    assert config.broker_url == "amqp://hpc:p%40ss%2Fword@mq.example.org:5672/%2F"
    assert config.rodan_base_url == "https://rodan.example.org"
    assert config.rodan_email == "hpc@example.org"
    assert config.request_queue == "hpc-jobs" and config.reply_queue == "hpc-results"


def test_tls_broker_defaults_to_5671() -> None:
    config = load_config(environ={**BASE, "RABBITMQ_TLS": "true"})
    assert config.broker_url.startswith("amqps://") and ":5671/" in config.broker_url


def test_rabbitmq_url_wins_and_is_checked() -> None:
    config = load_config(environ={**BASE, "RABBITMQ_URL": "amqps://u:p@h:5671/%2F"})
    assert config.broker_url == "amqps://u:p@h:5671/%2F"
    with pytest.raises(ConfigError, match="RABBITMQ_URL"):
        load_config(environ={**BASE, "RABBITMQ_URL": "http://h/"})


@pytest.mark.parametrize("missing", ["RODAN_HOST", "RODAN_PASSWORD", "RABBITMQ_HOST"])
def test_missing_settings_are_named(missing: str) -> None:
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=missing):
        load_config(environ=env)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HPC_DEFER_LIMIT", "many"),
        ("HPC_DEFER_LIMIT", "0"),
        ("HPC_DRAIN_BATCH", "0"),
        ("HPC_POISON_LIMIT", "0"),
        ("HPC_REPLY_QUEUE", ","),
        ("HPC_RECONCILE_INTERVAL", "-1"),
        ("RODAN_SCHEME", "ftp"),
        ("RODAN_HOST", "https://rodan.example.org/"),
        ("HPC_GPU_RULES", "big=gpu:1"),
        ("HPC_GPU_RULES", "gpu 1"),
        ("HPC_SCHEDULER_ARGS", "--qos='unclosed"),
        ("HPC_SCHEDULER", "pbs"),
        ("HPC_WORKER_PYTHON", "python3"),
        ("HPC_TRAINING_SEED", "-1"),
        ("HPC_WARN_SECONDS", "soon"),
        ("RABBITMQ_PORT", "amqp"),
        ("HPC_MIXED_PRECISION", "auto"),
        ("HPC_MIXED_PRECISION", "on"),
    ],
)
def test_malformed_settings_are_named(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(environ={**BASE, name: value})


def test_mixed_precision_is_float32_unless_an_operator_opts_in() -> None:
    assert load_config(environ=BASE).mixed_precision == "off"
    for value in ("off", "float16", "bfloat16", "BFloat16"):
        assert load_config(environ={**BASE, "HPC_MIXED_PRECISION": value}).mixed_precision == value.lower()


def test_gpu_rules_pick_the_largest_threshold_below_the_memory() -> None:
    rules = parse_gpu_rules("gpu:1; 128000=gpu:v100l:1")
    assert rules == (GpuRule(0, "gpu:1"), GpuRule(128000, "gpu:v100l:1"))
    config = load_config(environ={**BASE, "HPC_GPU_RULES": "gpu:1;128000=gpu:v100l:1"})
    assert config.gres_for(4096) == "gpu:1"
    assert config.gres_for(257000) == "gpu:v100l:1"
    assert load_config(environ={**BASE, "HPC_GPU_RULES": "none"}).gres_for(4096) is None


def test_credentials_file_is_read_and_environment_overrides(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.env"
    creds.write_text("".join(f"{k}={v}\n" for k, v in BASE.items()) + "HPC_REQUEST_QUEUE=from-file\n")
    creds.chmod(0o600)
    config = load_config(creds, environ={"HPC_REQUEST_QUEUE": "from-env"})
    assert config.request_queue == "from-env"
    assert config.rodan_password == "secret"
    assert config.credentials_file == creds.resolve()


def test_credentials_readable_by_others_are_refused(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.env"
    creds.write_text("".join(f"{k}={v}\n" for k, v in BASE.items()))
    os.chmod(creds, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_config(creds, environ={})


def test_secrets_are_not_in_the_repr() -> None:
    config = load_config(environ=BASE)
    assert "p@ss" not in repr(config) and "secret" not in repr(config)
    assert set(config.secrets) == {"secret", "p@ss/word", "p%40ss%2Fword"}


def test_cli_reports_configuration_errors_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from bridge.cli import main

    for key in list(os.environ):
        if key.startswith(("RABBITMQ_", "RODAN_", "HPC_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "RODAN_USER" in err


def test_values_are_taken_literally_without_expansion(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.env"
    creds.write_text(
        "".join(f"{k}={v}\n" for k, v in BASE.items() if k != "RODAN_PASSWORD") + "RODAN_PASSWORD='a${HOME}b'\n"
    )
    creds.chmod(0o600)
    assert load_config(creds, environ={}).rodan_password == "a${HOME}b"


def test_grid_engine_is_chosen_by_name_or_alias_with_its_site_settings() -> None:
    for spelling in ("gridengine", "sge", "GridEngine"):
        assert load_config(environ={**BASE, "HPC_SCHEDULER": spelling}).scheduler == "gridengine"
    config = load_config(
        environ={
            **BASE,
            "HPC_SCHEDULER": "sge",
            "HPC_SGE_PROJECT": "rodanlab",
            "HPC_SGE_QUEUE": "gpu.q",
            "HPC_SGE_PE": "omp",
            "HPC_SLURM_ACCOUNT": "def-lab",  # Slurm's: not used by Grid Engine
        }
    )
    assert (config.account, config.partition) == ("rodanlab", "gpu.q")
    assert config.scheduler_options == {"pe": "omp", "gpu_resource": "gpu", "memory_resource": "mem_free"}
    slurm = load_config(environ={**BASE, "HPC_SLURM_ACCOUNT": "def-lab"})
    assert (slurm.account, slurm.scheduler_options) == ("def-lab", {})


def test_the_time_limit_warning_is_at_most_half_the_limit() -> None:
    config = load_config(environ={**BASE, "HPC_WARN_SECONDS": "600"})
    assert config.warn_seconds_for(6 * 60) == 600
    assert config.warn_seconds_for(10) == 300
    assert config.warn_seconds_for(1) == 30
    assert load_config(environ={**BASE, "HPC_WARN_SECONDS": "0"}).warn_seconds_for(60) == 0

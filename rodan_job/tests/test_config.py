"""Settings from Rodan's environment, the silence bound, TLS parameters and redaction."""

from __future__ import annotations

import ssl

import pytest
from hpc_paco_trainer import hpc_relay
from hpc_paco_trainer.hpc_relay import DAY_S, HPCJobError


def test_defaults_and_the_bound() -> None:
    config = hpc_relay.config_from_env({"HPC_RABBITMQ_URL": "amqp://u:p@h/%2F"}, "/media")
    assert config.state_dir == "/media/hpc_paco_trainer"
    assert (config.request_queue, config.poll_seconds, config.max_continuations) == ("hpc-jobs", 30, 5)
    assert (config.max_pending_s, config.slack_s) == (3 * DAY_S, DAY_S)
    # 1 day x (1 + 5 continuations) + 3 days pending + 1 day slack
    assert hpc_relay.silence_bound_s({"Maximum time (D-HH:MM)": "1-00:00"}, config) == 10 * DAY_S
    assert hpc_relay.silence_bound_s({}, config) == 10 * DAY_S
    env = {
        "HPC_RABBITMQ_URL": "amqp://h",
        "HPC_BRIDGE_MAX_CONTINUATIONS": "0",
        "HPC_BRIDGE_MAX_PENDING": "60",
        "HPC_SILENCE_SLACK": "5",
    }
    short = hpc_relay.config_from_env(env, "/m")
    assert hpc_relay.silence_bound_s({"Maximum time (D-HH:MM)": "0-00:02"}, short) == 120 + 60 + 5
    assert hpc_relay.reply_queue_arguments(185) == {"x-expires": (185 + 86400) * 1000}


@pytest.mark.parametrize("text", ["1-24:00", "1:00", "x", "0-00:60", "1000-00:00"])
def test_a_bad_time_limit_is_refused(text: str) -> None:
    with pytest.raises(HPCJobError, match="D-HH:MM"):
        hpc_relay.parse_time_limit(text)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "HPC_RABBITMQ_URL is not set"),
        ({"HPC_RABBITMQ_URL": "http://h"}, "amqp:// or amqps://"),
        ({"HPC_RABBITMQ_URL": "amqp://h", "HPC_RABBITMQ_CA_FILE": "/ca.pem"}, "not amqps"),
        ({"HPC_RABBITMQ_URL": "amqp://h", "HPC_POLL_SECONDS": "1800"}, "between 1 and 1799"),
        ({"HPC_RABBITMQ_URL": "amqp://h", "HPC_BRIDGE_MAX_PENDING": "soon"}, "not a number"),
    ],
)
def test_bad_settings_are_clear_errors(env: dict, match: str) -> None:
    with pytest.raises(HPCJobError, match=match):
        hpc_relay.config_from_env(env, "/m")


def test_amqps_always_verifies_the_certificate_and_the_host(tmp_path: object) -> None:
    config = hpc_relay.RelayConfig("amqps://u:p@broker.example:5671/%2F", "/s")
    params = hpc_relay.connection_parameters(config)
    context = params.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert params.ssl_options.server_hostname == "broker.example"
    assert (params.host, params.port, params.virtual_host) == ("broker.example", 5671, "/")
    plain = hpc_relay.connection_parameters(hpc_relay.RelayConfig("amqp://u:p@h:5672/%2F", "/s"))
    assert plain.ssl_options is None


def test_a_missing_ca_file_is_an_error_not_a_silent_fallback() -> None:
    config = hpc_relay.RelayConfig("amqps://h", "/s", ca_file="/nonexistent/ca.pem")
    with pytest.raises(HPCJobError, match="HPC_RABBITMQ_CA_FILE"):
        hpc_relay.connection_parameters(config)


def test_redaction() -> None:
    url = "amqps://rodan:p%40ss-w0rd@mq.example:5671/vh"
    text = "failed amqps://rodan:p%40ss-w0rd@mq.example:5671/vh and p@ss-w0rd and p%40ss-w0rd"
    out = hpc_relay.redact(text, url)
    assert "p@ss-w0rd" not in out and "p%40ss-w0rd" not in out and "rodan:" not in out
    assert out.startswith("failed amqps://***@mq.example:5671/vh")


def test_the_poll_interval_grows_with_the_wait_and_stays_under_its_caps() -> None:
    """Catches: a fixed interval (no growth), no cap from 'Maximum time', a cap at or above
    RabbitMQ's 30-minute consumer_timeout, an interval below HPC_POLL_SECONDS."""
    interval = hpc_relay.poll_interval_s
    day = hpc_relay.parse_time_limit("1-00:00")
    assert interval(0, 30, day) == 30  # the first minutes: HPC_POLL_SECONDS, a quick error shows fast
    assert interval(299, 30, day) == 30
    assert interval(600, 30, day) == 60  # then a tenth of the time waited
    assert interval(3600, 30, day) == 360
    assert interval(5 * 3600, 30, day) == 1500  # capped below the consumer_timeout
    assert interval(30 * DAY_S, 30, None) == hpc_relay.MAX_POLL_S < hpc_relay.RABBITMQ_CONSUMER_TIMEOUT_S
    hour = hpc_relay.parse_time_limit("0-01:00")
    assert interval(5 * 3600, 30, hour) == 150  # a short run's cap: 1/24 of its Maximum time
    assert interval(5 * 3600, 30, 60.0) == 30  # never below HPC_POLL_SECONDS
    assert interval(5 * 3600, 200, hour) == 200
    assert interval(5 * 3600, 1799, None) == 1799  # 0.4.0 allowed up to 1799: still below the timeout
    # The pickup delay of a reply is at most the interval in force: never more than ~10 % of the wait.
    for waited in (400.0, 4000.0, 40000.0):
        assert interval(waited, 30, day) <= max(30, 0.1 * waited)

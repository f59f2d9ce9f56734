"""Configuration: every setting read, named in errors, credentials file kept private."""

from __future__ import annotations

import json
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
        ("HPC_MIXED_PRECISION", "on"),
        ("HPC_MIXED_PRECISION", "mixed_bfloat16"),
    ],
)
def test_malformed_settings_are_named(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(environ={**BASE, name: value})


def test_mixed_precision_is_float32_unless_an_operator_opts_in() -> None:
    assert load_config(environ=BASE).mixed_precision == "auto"  # float32 on CPUs and GPUs before compute 8.0
    for value in ("off", "auto", "float16", "bfloat16", "BFloat16"):
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


# --- every problem at once ------------------------------------------------------------------


def _file(tmp_path: Path, lines: dict[str, str], name: str = "credentials.env") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    path.chmod(0o600)
    return path


def test_a_bad_file_reports_every_problem_in_one_run(tmp_path: Path) -> None:
    bad = {
        **BASE,
        "RODAN_HOST": "CHANGE_ME.rodan.example.org",
        "HPC_SCHEDULAR": "gridengine",  # a typo
        "HPC_MAX_ATTEMPTS": "5",  # retired: harmless, so only a warning (below)
        "HPC_DRAIN_BATCH": "many",
        "HPC_RODAN_TIMEOUT": "-1",
        "HPC_SLURM_CONTINUE": "resubmit",
    }
    del bad["RODAN_PASSWORD"]
    with pytest.raises(ConfigError) as caught:
        load_config(_file(tmp_path, bad), environ={})
    problems = caught.value.problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "RODAN_PASSWORD is not set" in text
    assert "RODAN_HOST still holds the placeholder CHANGE_ME" in text
    assert "HPC_SCHEDULAR in" in text and "did you mean HPC_SCHEDULER?" in text
    assert "HPC_MAX_ATTEMPTS" not in text
    assert "HPC_DRAIN_BATCH must be a whole number, got 'many'" in text
    assert "HPC_RODAN_TIMEOUT must be positive" in text
    assert "HPC_SLURM_CONTINUE must be one of requeue, successor" in text
    # Each problem is filed under the setting it is about (a typo under the setting it was meant for).
    assert set(caught.value.settings) == {
        "RODAN_PASSWORD",
        "RODAN_HOST",
        "HPC_SCHEDULER",
        "HPC_DRAIN_BATCH",
        "HPC_RODAN_TIMEOUT",
        "HPC_SLURM_CONTINUE",
    }
    assert caught.value.settings["HPC_SCHEDULER"] == [p for p in problems if "HPC_SCHEDULAR" in p]


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("HPC_SCHEDULAR", "HPC_SCHEDULER"),  # a wrong letter
        ("HPC_SCHEDULER_ARG", "HPC_SCHEDULER_ARGS"),  # a missed one
        ("RODAN_PASWORD", "RODAN_PASSWORD"),
        ("HPC_SPOLO_DIR", "HPC_SPOOL_DIR"),  # two swapped: one slip
        ("HPC_SPOOLDIR", "HPC_SPOOL_DIR"),
        ("HPC_LOG_LEVELS", "HPC_LOG_LEVEL"),  # an added one
        ("HPC_MAX_INPUT_BYTE_", "HPC_MAX_INPUT_BYTES"),
        ("HPC_DRAIN_BACH_", "HPC_DRAIN_BATCH"),  # two slips: still a typo
    ],
)
def test_a_typo_of_a_setting_is_an_error_that_says_which(tmp_path: Path, name: str, meant: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_file(tmp_path, {**BASE, name: "x"}), environ={})
    (problem,) = caught.value.problems
    assert problem.startswith(f"{name} in ") and f"(did you mean {meant}?)" in problem
    assert caught.value.settings == {meant: [problem]}  # what doctor skips: the checks that need that one


@pytest.mark.parametrize("name", ["HPC_TENSORBOARD_UPLOAD", "HPC_MAX_INPUT_PAGES", "RODAN_API_VERSION", "HPC_X"])
def test_a_name_further_from_every_setting_only_warns(tmp_path: Path, name: str) -> None:
    """A newer version's setting, left in the file after a rollback: the bridge starts, and says so."""
    path = _file(tmp_path, {**BASE, name: "1"})
    config = load_config(path, environ={})
    (warning,) = config.warnings
    assert warning.startswith(f"{name} in {path} is not a setting of this version (ignored)")
    assert "did you mean" not in warning


def test_a_retired_setting_only_warns_and_says_what_replaced_it(tmp_path: Path) -> None:
    config = load_config(_file(tmp_path, {**BASE, "HPC_MAX_ATTEMPTS": "5"}), environ={})
    (warning,) = config.warnings
    assert "HPC_MAX_ATTEMPTS" in warning and "no longer read" in warning and "HPC_DEFER_LIMIT" in warning
    assert load_config(_file(tmp_path, BASE), environ={}).warnings == ()


def test_the_typo_distance_counts_slips() -> None:
    from bridge.config import TYPO_DISTANCE, closest_setting, edit_distance

    assert TYPO_DISTANCE == 2
    assert edit_distance("HPC_SCHEDULAR", "HPC_SCHEDULER") == 1
    assert edit_distance("HPC_SPOLO_DIR", "HPC_SPOOL_DIR") == 1  # a swap is one slip
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("a", "a") == 0
    assert closest_setting("HPC_SCHEDULAR", ["HPC_SCHEDULER", "HPC_SCHEDULER_ARGS"]) == "HPC_SCHEDULER"
    assert closest_setting("HPC_SLURM_QOSS", ["HPC_SLURM_ACCOUNT"]) == ""


def test_cli_logs_each_warning_as_an_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bridge.cli import main

    for key in list(os.environ):
        if key.startswith(("RABBITMQ_", "RODAN_", "HPC_")):
            monkeypatch.delenv(key)
    log = tmp_path / "bridge.log"
    settings = {**BASE, "HPC_SPOOL_DIR": str(tmp_path / "spool"), "HPC_LOG_FILE": str(log)}
    path = _file(tmp_path, {**settings, "HPC_TENSORBOARD_UPLOAD": "yes", "HPC_MAX_ATTEMPTS": "3"})
    assert main(["--credentials", str(path), "logs", "no-such-request"]) == 1  # it ran: the request is unknown
    assert "no request 'no-such-request'" in capsys.readouterr().err
    events = [json.loads(line) for line in log.read_text().splitlines()]
    warnings = [e for e in events if e["event"] == "config_warning"]
    assert [e["level"] for e in warnings] == ["warning", "warning"], events
    said = " | ".join(e["warning"] for e in warnings)
    assert "HPC_TENSORBOARD_UPLOAD" in said and "HPC_MAX_ATTEMPTS" in said and str(path) in said


def test_a_world_readable_file_is_still_read_and_every_problem_named(tmp_path: Path) -> None:
    path = _file(tmp_path, {**BASE, "HPC_DRAIN_BATCH": "0"})
    path.chmod(0o644)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    mode, drain = caught.value.problems
    assert f"credentials file {path} is readable by others (mode 644)" in mode and f"chmod 600 {path}" in mode
    assert "HPC_DRAIN_BATCH must be at least 1" in drain
    assert "not given" not in str(caught.value)  # the file was given, and read


def test_a_credentials_file_that_cannot_be_read_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"credentials file {tmp_path} is not a file"):
        load_config(tmp_path, environ={})  # a directory, which python-dotenv would read as empty
    unreadable = _file(tmp_path, BASE)
    unreadable.chmod(0)
    if os.access(unreadable, os.R_OK):  # root reads it all the same
        return
    with pytest.raises(ConfigError, match=f"credentials file {unreadable} cannot be read"):
        load_config(unreadable, environ={})


def test_unknown_names_in_the_environment_are_not_judged(tmp_path: Path) -> None:
    """Jobs and tools set HPC_* variables of their own (HPC_JOB_ID, ...): only the file is judged."""
    config = load_config(_file(tmp_path, BASE), environ={"HPC_JOB_ID": "12", "HPC_SCHEDULAR": "x"})
    assert config.rodan_host == "rodan.example.org"


def test_with_no_file_the_message_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"RODAN_HOST": "rodan.example.org"})
    last = caught.value.problems[-1]
    assert "no credentials file was read" in last
    assert "$HPC_BRIDGE_CREDENTIALS (not set)" in last and str(tmp_path) in last


def test_cli_prints_every_problem_and_takes_credentials_after_the_subcommand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bridge.cli import main

    for key in list(os.environ):
        if key.startswith(("RABBITMQ_", "RODAN_", "HPC_")):
            monkeypatch.delenv(key)
    path = _file(tmp_path, {**BASE, "HPC_SCHEDULAR": "slurm", "HPC_POISON_LIMIT": "0"})
    for argv in (["--credentials", str(path), "status"], ["status", "--credentials", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "2 configuration errors:" in err, err
        assert "  - HPC_POISON_LIMIT must be at least 1, got 0" in err
        assert "  - HPC_SCHEDULAR in" in err


def test_a_log_file_that_cannot_be_created_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bridge.cli import main

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    path = _file(tmp_path, {**BASE, "HPC_LOG_FILE": str(blocker / "bridge.log")})
    assert main(["--credentials", str(path), "check"]) == 2
    assert "HPC_LOG_FILE" in capsys.readouterr().err and not (blocker / "bridge.log").exists()


# --- site knobs -------------------------------------------------------------------------------


def test_site_knobs_default_to_the_plain_behaviour() -> None:
    config = load_config(environ=BASE)
    assert config.job_prologue == "" and config.job_directives == ()
    assert config.continue_by == "requeue" and config.max_active_jobs == 0
    assert config.site_option("HPC_SLURM_CONTINUE") == "requeue"
    assert config.runs_shared == "private"
    assert config.status_queue == "hpc-bridge.status" and config.status_interval_s == 60.0
    assert load_config(environ={**BASE, "HPC_STATUS_QUEUE": "none"}).status_queue == ""


def test_directives_are_one_option_per_entry_and_nothing_else(tmp_path: Path) -> None:
    config = load_config(
        _file(tmp_path, {**BASE, "HPC_JOB_DIRECTIVES": "'--constraint=v100;  --nice=10\n-l  h_vmem=4G'"}), environ={}
    )
    assert config.job_directives == ("--constraint=v100", "--nice=10", "-l h_vmem=4G")
    for smuggled in ("--qos=high$(id)", "constraint=v100", "--comment='x'", "--x=`id`", "--a=b #c", "--a=b|c"):
        with pytest.raises(ConfigError, match="HPC_JOB_DIRECTIVES"):
            load_config(environ={**BASE, "HPC_JOB_DIRECTIVES": smuggled})


def test_prologue_keeps_its_lines_but_never_a_password(tmp_path: Path) -> None:
    prologue = "module load cuda/11.2\n  source /etc/site.sh\nexport HTTPS_PROXY=http://proxy:3128"
    config = load_config(_file(tmp_path, {**BASE, "HPC_JOB_PROLOGUE": f"'{prologue}'"}), environ={})
    assert config.job_prologue == prologue
    with pytest.raises(ConfigError, match="HPC_JOB_PROLOGUE contains a password"):
        load_config(environ={**BASE, "HPC_JOB_PROLOGUE": "export RODAN_PASSWORD=secret"})
    with pytest.raises(ConfigError, match="HPC_JOB_DIRECTIVES contains a password"):
        load_config(environ={**BASE, "HPC_JOB_DIRECTIVES": "--comment=p@ss/word"})


def test_a_short_password_inside_another_word_is_not_a_leak() -> None:
    from bridge.config import contains_secret

    assert not contains_secret("#SBATCH --gres=gpu:1\nmodule load cuda\n#SBATCH -J rodan-test", ["gpu", "cud", "test"])
    assert contains_secret("--password=gpu now", ["gpu"])
    assert contains_secret("curl -u hpc:gpu https://x", ["gpu"])
    assert contains_secret("--index-url=https://hpc:gpu@pypi.example.org/simple", ["gpu"])
    assert contains_secret("export TOKEN='p@ss/word'", ["p@ss/word"])
    assert contains_secret("rodan-averylongpassword1-x", ["averylongpassword1"])
    config = load_config(environ={**BASE, "RODAN_PASSWORD": "gpu", "HPC_JOB_DIRECTIVES": "--constraint=gpu:2"})
    assert config.job_directives == ("--constraint=gpu:2",)


@pytest.mark.parametrize(
    ("scheduler", "directive", "says"),
    [("slurm", "--time=10", "HPC_JOB_DIRECTIVES entry '--time=10'"), ("gridengine", "-N other", "'-N other'")],
)
def test_a_directive_the_bridge_sets_itself_is_refused_at_start(scheduler: str, directive: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(environ={**BASE, "HPC_SCHEDULER": scheduler, "HPC_JOB_DIRECTIVES": f"--nice=10; {directive}"})
    ok = load_config(environ={**BASE, "HPC_SCHEDULER": scheduler, "HPC_JOB_DIRECTIVES": "-l h_vmem=4G"})
    assert ok.job_directives == ("-l h_vmem=4G",)

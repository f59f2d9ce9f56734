"""Every log line is JSON: the standard library's loggers (pika, urllib3, TensorFlow, absl, the
trainer), ``warnings.warn``, tracebacks and uncaught exceptions go through the same structlog
processors as our own events (timestamp, level, component, redaction), at HPC_LOG_LEVEL.

Each case runs in a fresh interpreter configured as the bridge and the worker configure
themselves (``bridge.logs.configure_logging``), then logs through the real libraries.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.logs import native_severity
from bridge.spool import Spool, atomic_write_json
from tests.support.bridge import REPO, job_parameters_json
from worker.onednn import cpu_key, python_version, tensorflow_version

SECRET = "s3cr3t-Hunter2-pass"  # registered as the bridge registers its passwords


def closed_port() -> int:
    """A local TCP port nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_python(
    code: str, *, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full.pop("HPC_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=REPO,
    )


def json_lines(text: str, where: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object; a plain-text line fails the test, naming it."""
    lines = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            pytest.fail(f"a line of {where} is not JSON: {line!r}\n--- all of it:\n{text}")
        assert isinstance(value, dict), line
        lines.append(value)
    return lines


THIRD_PARTY = """
    import logging, sys, threading, warnings
    from pathlib import Path
    from bridge.logs import configure_logging, register_secret

    SECRET, PORT, LEVEL, LOG = {secret!r}, {port}, {level!r}, {log!r}
    register_secret(SECRET)
    configure_logging(level=LEVEL, log_file=Path(LOG) if LOG else None, component="bridge")

    logging.getLogger("worker.trainer.train").info("layer %r: training on %d patches", "Layer 1", 812)
    logging.getLogger("worker.trainer.sync").debug("a debug line of the trainer")
    warnings.warn(f"a library is deprecated ({{SECRET}})", DeprecationWarning, stacklevel=1)
    try:
        raise ValueError(f"refused with {{SECRET}}")
    except ValueError:
        logging.getLogger("bridge.testing").exception("while serving %s", "/uploads/x")

    import pika  # a real connection attempt: pika logs every step of it, failures at ERROR
    try:
        pika.BlockingConnection(pika.URLParameters(f"amqp://hpc:{{SECRET}}@127.0.0.1:{{PORT}}/%2F?connection_attempts=1"))
    except pika.exceptions.AMQPConnectionError:
        pass

    import urllib3  # a real request with a retry: urllib3 warns "Retrying (...)" with the URL
    try:
        urllib3.PoolManager(retries=urllib3.Retry(total=1, backoff_factor=0)).request(
            "GET", f"http://127.0.0.1:{{PORT}}/api/?token={{SECRET}}"
        )
    except urllib3.exceptions.MaxRetryError:
        pass

    def worker_thread():
        raise RuntimeError(f"thread died holding {{SECRET}}")

    thread = threading.Thread(target=worker_thread, name="reply-flusher")
    thread.start()
    thread.join()
    raise KeyError(f"nobody caught {{SECRET}}")
"""


def third_party(level: str, log: Path | None) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    code = THIRD_PARTY.format(secret=SECRET, port=closed_port(), level=level, log=str(log) if log else "")
    result = run_python(code)
    assert SECRET not in result.stdout + result.stderr
    if log is not None:
        text = log.read_text()
        assert SECRET not in text
        assert result.stderr == "" and result.stdout == "", "with HPC_LOG_FILE, everything goes to the file"
        return result, json_lines(text, "the log file")
    assert result.stdout == ""
    return result, json_lines(result.stderr, "standard error")


def by_logger(lines: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [line for line in lines if str(line.get("logger", "")).startswith(prefix)]


def test_library_lines_warnings_and_tracebacks_are_json_with_secrets_redacted(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "bridge.log"
    result, lines = third_party("INFO", log)
    assert result.returncode == 1  # the uncaught exception still ends the process as a failure
    for line in lines:
        assert line["component"] == "bridge" and line["timestamp"].endswith("Z") and line["level"], line
    assert "debug" not in {line["level"] for line in lines}, "below HPC_LOG_LEVEL"

    (trainer,) = by_logger(lines, "worker.trainer")
    assert trainer["event"] == "layer 'Layer 1': training on 812 patches" and trainer["level"] == "info"

    (warned,) = by_logger(lines, "py.warnings")
    assert "DeprecationWarning: a library is deprecated ([REDACTED])" in warned["event"]
    assert warned["level"] == "warning"

    (failed,) = by_logger(lines, "bridge.testing")
    assert failed["event"] == "while serving /uploads/x" and failed["level"] == "error"
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert "ValueError: refused with [REDACTED]" in failed["exception"]

    assert by_logger(lines, "pika") == [], "pika's connection chatter and errors only at DEBUG"
    (retry,) = by_logger(lines, "urllib3")
    assert retry["level"] == "warning" and retry["event"].startswith("Retrying (Retry(total=0")
    assert "/api/?token=[REDACTED]" in retry["event"]

    thread, main = [line for line in lines if line["event"] == "uncaught_exception"]
    assert thread["thread"] == "reply-flusher" and thread["level"] == "critical"
    assert "RuntimeError: thread died holding [REDACTED]" in thread["exception"]
    assert "KeyError: 'nobody caught [REDACTED]'" in main["exception"] and "thread" not in main


def test_at_debug_pika_and_urllib3_speak_in_json_on_stderr() -> None:
    result, lines = third_party("DEBUG", None)
    assert result.returncode == 1
    pika_lines = by_logger(lines, "pika")
    assert any(line["level"] == "error" and "Connection refused" in line["event"] for line in pika_lines)
    assert [line for line in pika_lines if line["level"] == "debug"] == [], "pika's own debug chatter stays out"
    assert any("exception" in line for line in pika_lines), "pika's logged traceback is a field"
    assert any(line["event"].startswith("Starting new HTTP connection") for line in by_logger(lines, "urllib3"))
    (trainer_debug,) = by_logger(lines, "worker.trainer.sync")
    assert trainer_debug["level"] == "debug"


def test_tee_to_the_run_directory_carries_library_lines_too(tmp_path: Path) -> None:
    job_log = tmp_path / "run" / "job.log"
    result = run_python(
        f"""
        import logging, sys, structlog
        from pathlib import Path
        from bridge.logs import configure_logging, tee_logs_to
        configure_logging(level="INFO", stream=sys.stdout, component="worker")
        logging.getLogger("absl").warning("before the tee")
        tee_logs_to(Path({str(job_log)!r}))
        structlog.contextvars.bind_contextvars(correlation_id="corr-tee")
        structlog.get_logger("worker").info("job_start")
        logging.getLogger("tensorflow").warning("after the tee: %d", 2)
        """
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    stdout = json_lines(result.stdout, "standard output")
    assert [(line["event"], line.get("logger")) for line in stdout] == [
        ("before the tee", "absl"),
        ("job_start", None),
        ("after the tee: 2", "tensorflow"),
    ]
    teed = json_lines(job_log.read_text(), "job.log")
    assert teed == stdout[1:]
    assert teed[1]["correlation_id"] == "corr-tee" and teed[1]["component"] == "worker"


@pytest.mark.broker
@pytest.mark.parametrize("onednn", ["1", "0", "no record"])
def test_the_real_worker_writes_only_json(tmp_path: Path, standin: Any, onednn: str) -> None:
    """``python -m worker run`` as the batch script runs it, at DEBUG: it imports TensorFlow, downloads
    from the stand-in (urllib3's lines), fails on a missing input and cannot reach the broker. Its
    standard output is JSON throughout, and nothing (no TensorFlow start-up line) is on stderr,
    whichever oneDNN setting this node's cached measurement chose (with "1", TensorFlow's C++ start-up
    prints absl's pre-init lines on file descriptor 2: they become ``native_stderr`` events).

    The job starts without measuring oneDNN: it reads the record ("1", "0"), or, with none, keeps
    TensorFlow's default and says so (catches a job start that measures again, or at all)."""
    tuning = tmp_path / "tuning"
    tuning.mkdir()
    if onednn != "no record":
        step_s = {"0": 1.0, "1": 0.5 if onednn == "1" else 2.0}
        versions = {"tensorflow": tensorflow_version(), "python": python_version()}
        measured = {"setting": onednn, "step_s": step_s, "measured": 1.0, **versions}
        (tuning / f"onednn-{cpu_key()}.json").write_text(json.dumps(measured) + "\n")  # as worker/onednn.py reads it
    before = sorted(p.name for p in tuning.iterdir())
    spool = Spool(tmp_path / "spool").ensure()
    token = standin.user("hpc@example.org").token
    raw = job_parameters_json(
        correlation_id="corr-json-lines",
        reply_to="test-json-lines-replies",
        inputs={"Image": "/uploads/projects/missing/original_file"},
        layers=[["Background", "Background Model"]],
        settings={"epochs": 1, "patch_height": 16, "patch_width": 16},
        rodan={"base_url": standin.url, "token": token, "retries": 1},
        broker={"url": f"amqp://guest:{SECRET}@127.0.0.1:{closed_port()}/%2F"},
        spool=str(spool.root),
        runs_dir=str(tmp_path / "runs"),
    )
    params = spool.params_path("corr-json-lines")
    atomic_write_json(params, raw)
    environ = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL")}
    result = subprocess.run(
        [sys.executable, "-m", "worker", "run", str(params), "--log-level", "DEBUG"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": str(REPO), "HPC_TUNING_DIR": str(tuning), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr == "", "TensorFlow or a library wrote plain text to stderr"
    lines = json_lines(result.stdout, "the worker's standard output")
    events = [line["event"] for line in lines]
    assert "onednn_measured" not in events and sorted(p.name for p in tuning.iterdir()) == before
    native = [line for line in lines if line["event"] == "native_stderr"]
    assert all(line["component"] == "worker" and line["line"].strip() for line in native), native
    notices = [line for line in native if "oneDNN custom operations are on" in line["line"]]
    if onednn == "no record":
        (default,) = [line for line in lines if line["event"] == "onednn_default"]
        assert "no measurement" in default["reason"] and "hpc-bridge doctor --job" in default["note"], default
        assert "onednn_chosen" not in events, events
    else:
        (chosen,) = [line for line in lines if line["event"] == "onednn_chosen"]
        assert chosen["setting"] == onednn, "the cached measurement decided"
    if onednn == "1":  # TensorFlow 2.21's absl line from before InitializeLog, as an info event
        assert notices and all(line["level"] == "info" for line in notices), native
    elif onednn == "0":
        assert notices == [], native
    assert "reply_left_in_outbox" in events, events
    http = by_logger(lines, "urllib3.connectionpool")
    assert any("/uploads/projects/missing/original_file" in line["event"] for line in http), events
    assert all(line["component"] == "worker" and line["correlation_id"] == "corr-json-lines" for line in http)
    assert token not in result.stdout and SECRET not in result.stdout


# --- file descriptor 2 -------------------------------------------------------------------------

NATIVE = """
    import faulthandler, os, subprocess, sys, time
    from pathlib import Path
    from bridge.logs import capture_native_stderr, configure_logging, register_secret, tee_logs_to

    SECRET, MODE, JOB_LOG = {secret!r}, {mode!r}, {job_log!r}
    configure_logging(level="DEBUG", stream=sys.stderr if MODE == "to-stderr" else sys.stdout, component="worker")
    restore = capture_native_stderr()
    register_secret(SECRET)  # registered after the capture started, as the worker does
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
    os.write(2, b"I0000 00:00:1795757244.677237   18686 port.cc:153] oneDNN custom operations are on.\\nE0000 00:00")
    os.write(2, b":1795757245.1   18686 cuda_dnn.cc:8] Unable to register cuDNN with " + SECRET.encode() + b"\\n\\n")
    print("a Python write to sys.stderr", file=sys.stderr)
    if JOB_LOG:
        time.sleep(0.5)  # the lines so far are logged before the tee
        tee_logs_to(Path(JOB_LOG))
        os.write(2, "F0000 00:00:1795757246.2 1 check.cc:1] Check failed: \u00e9t\u00e9\\n".encode())
    if MODE == "crash":
        os.write(2, b"last words\\n")
        faulthandler.enable()
        faulthandler._sigsegv()
    if MODE == "child":  # a child that outlives us still holds fd 2: exiting must not wait for it
        # It lives until our end of its stdin closes: if the exit waited for it, neither would end.
        child = [sys.executable, "-c", "import sys; sys.stdin.read()"]
        subprocess.Popen(child, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    if MODE == "restore":
        os.write(2, b"partial line before the restore")
        restore()
        os.write(2, b"plain text after the restore\\n")
        sys.exit(0)
    os.write(2, b"a partial line, then more of it")
    os.write(2, b" and no newline at the end")
"""


def native(mode: str, job_log: Path | None = None) -> subprocess.CompletedProcess[str]:
    code = NATIVE.format(secret=SECRET, mode=mode, job_log=str(job_log) if job_log else "")
    result = run_python(code, timeout=60)
    assert SECRET not in result.stdout + result.stderr
    return result


def native_lines(lines: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(line["level"], line["line"]) for line in lines if line["event"] == "native_stderr"]


START = [
    ("warning", "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"),
    ("info", "I0000 00:00:1795757244.677237   18686 port.cc:153] oneDNN custom operations are on."),
    ("error", "E0000 00:00:1795757245.1   18686 cuda_dnn.cc:8] Unable to register cuDNN with [REDACTED]"),
    ("warning", "a Python write to sys.stderr"),
]


def test_raw_writes_to_fd_2_become_json_events_line_by_line(tmp_path: Path) -> None:
    job_log = tmp_path / "run" / "job.log"
    result = native("plain", job_log)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = json_lines(result.stdout, "standard output")
    fatal = ("critical", "F0000 00:00:1795757246.2 1 check.cc:1] Check failed: \u00e9t\u00e9")
    last = ("warning", "a partial line, then more of it and no newline at the end")  # flushed at exit
    assert native_lines(lines) == [*START, fatal, last]
    for line in lines:
        assert line["component"] == "worker" and line["timestamp"].endswith("Z"), line
        assert "process_ended" not in line, line
    assert native_lines(json_lines(job_log.read_text(), "job.log")) == [fatal, last], "teed like any event"


def test_when_logging_to_stderr_the_lines_still_go_there_as_json() -> None:
    result = native("to-stderr")
    assert result.returncode == 0 and result.stdout == ""
    lines = json_lines(result.stderr, "standard error")
    assert native_lines(lines) == [*START, ("warning", "a partial line, then more of it and no newline at the end")]


def test_a_crash_trace_is_relayed_as_json_after_the_process_died() -> None:
    result = native("crash")
    assert result.returncode == -11, result.stdout[-2000:] + result.stderr[-2000:]  # SIGSEGV
    assert result.stderr == ""
    # A line the reader thread logged just as the process died may come again from the guardian.
    lines = list(dict.fromkeys(native_lines(json_lines(result.stdout, "standard output"))))
    assert lines[: len(START) + 1] == [*START, ("warning", "last words")]
    texts = [text for _, text in lines]
    assert ("critical", "Fatal Python error: Segmentation fault") in lines, texts
    assert any(text.startswith("Current thread 0x") for text in texts), texts
    crashed = [line for line in json_lines(result.stdout, "") if line.get("line", "").startswith("Fatal Python")]
    assert crashed[0]["component"] == "worker"


def test_a_child_holding_the_pipe_does_not_keep_the_process_from_ending() -> None:
    started = time.monotonic()
    result = native("child")
    assert time.monotonic() - started < 20, "the exit waited for the child that still holds file descriptor 2"
    assert result.returncode == 0 and result.stderr == ""
    assert native_lines(json_lines(result.stdout, "standard output"))[-1] == (
        "warning",
        "a partial line, then more of it and no newline at the end",
    )


def test_restore_logs_the_partial_line_and_gives_fd_2_back() -> None:
    result = native("restore")
    assert result.returncode == 0
    assert native_lines(json_lines(result.stdout, "standard output")) == [
        *START,
        ("warning", "partial line before the restore"),
    ]
    assert result.stderr == "plain text after the restore\n"


@pytest.mark.parametrize(
    "line,level",
    [
        ("I0000 00:00:1795757244.677237   18686 port.cc:153] oneDNN custom operations are on.", "info"),
        ("W0000 00:00:1.2 7 gpu_device.cc:2] Cannot dlopen some GPU libraries.", "warning"),
        ("2024-01-01 12:00:00.000000: E tensorflow/core/x.cc:1] failed call to cuInit", "error"),
        ("F0000 00:00:1.2 7 check.cc:1] Check failed: ok", "critical"),
        ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", "warning"),
        ("ERROR: something", "error"),
        ("Fatal Python error: Aborted", "critical"),
        ("Traceback (most recent call last):", "warning"),
        ("Index 0 of the batch", "warning"),
    ],
)
def test_the_level_comes_from_the_line_prefix(line: str, level: str) -> None:
    assert native_severity(line) == level

"""Log rotation loses no line: ``HPC_LOG_FILE`` is renamed by the real logrotate with the config
``hpc-bridge install logrotate --print`` renders (``create 0600``, no ``copytruncate``), while a
process logging through ``bridge.logs`` exactly as the command line configures it keeps writing;
the process reopens the log by itself (``bridge.logs.ReopeningFile``). Every line written is found
exactly once across the live and the rotated files."""

from __future__ import annotations

import collections
import gzip
import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from bridge.logs import ReopeningFile
from tests.support.bridge import REPO, clean_environ
from tests.support.wait import wait_until

ROTATIONS = 5
#: Lines the writer must have put in the new live file before the next rotation: it has reopened.
LINES_BETWEEN = 200

#: A steady flow of events, through bridge.logs as ``hpc-bridge`` configures it (bridge/cli.py): our
#: own structlog events and standard-library records alternately, until the stop file appears.
WRITER = """
import logging, sys, time
from pathlib import Path
import structlog
from bridge.logs import configure_logging
configure_logging(level="INFO", log_file=Path(sys.argv[1]), component="bridge")
stop = Path(sys.argv[2])
events, records = structlog.get_logger("flow"), logging.getLogger("flow")
seq = 0
while not stop.exists():
    if seq % 2:
        records.info("seq=%d", seq)
    else:
        events.info("tick", seq=seq)
    seq += 1
    if seq % 20 == 0:
        time.sleep(0.001)
events.info("flow_done", lines=seq)
"""


def _logrotate() -> str:
    found = shutil.which("logrotate") or ("/usr/sbin/logrotate" if Path("/usr/sbin/logrotate").exists() else None)
    assert found is not None, "logrotate is missing: deploy/dev/setup.sh installs it"
    return found


def _rendered_config(tmp_path: Path, log: Path) -> Path:
    """The logrotate file as ``hpc-bridge install logrotate --print`` shows it for this install."""
    credentials = tmp_path / "credentials.env"
    credentials.write_text(
        "\n".join(
            [
                "RABBITMQ_URL=amqp://guest:guest@127.0.0.1:1/%2F",
                "RODAN_HOST=rodan.example.org",
                "RODAN_USER=hpc",
                "RODAN_PASSWORD=rotation-test-pw",
                f"HPC_SPOOL_DIR={tmp_path / 'spool'}",
                f"HPC_LOG_FILE={log}",
                "",
            ]
        )
    )
    credentials.chmod(0o600)
    home = tmp_path / "home"
    env = clean_environ(
        {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "HPC_BRIDGE_HOME": str(tmp_path),
            "HPC_BRIDGE_LOG": str(tmp_path / "logs" / "run_check.log"),
        }
    )
    printed = subprocess.run(
        [sys.executable, "-m", "bridge", "--credentials", str(credentials), "install", "logrotate", "--print"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert printed.returncode == 0, printed.stderr
    # The file comes first, then the crontab block that runs logrotate: keep the file.
    match = re.match(r"(?s)(.*?^\}\n)", printed.stdout, re.M)
    assert match is not None, printed.stdout
    text = match.group(1)
    assert str(log) in text.splitlines(), text
    assert re.search(r"^\s+create 0600$", text, re.M) and not re.search(r"^\s*copytruncate", text, re.M), text
    assert not re.search(r"^\s*(postrotate|prerotate)", text, re.M), "no signal to send: nothing to run"
    conf = tmp_path / "logrotate.conf"
    conf.write_text(text)
    conf.chmod(0o600)
    return conf


def _lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return handle.read().splitlines()
    return path.read_text(encoding="utf-8").splitlines()


def _sequence_number(line: str) -> int | None:
    """The writer's number in one JSON line (None for its last line, ``flow_done``)."""
    event = json.loads(line)  # a torn or interleaved line fails here
    if event["event"] == "flow_done":
        return None
    if event["event"] == "tick":
        return int(event["seq"])
    match = re.fullmatch(r"seq=(\d+)", event["event"])
    assert match is not None, line
    return int(match.group(1))


def test_rotation_with_the_rendered_config_loses_and_repeats_no_line(tmp_path: Path) -> None:
    logrotate = _logrotate()
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    log = logs / "bridge.log"
    conf = _rendered_config(tmp_path, log)
    state = tmp_path / "logrotate.state"
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(log), str(stop)],
        cwd=REPO,
        env=clean_environ({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def live_lines() -> int:
        try:
            return len(log.read_bytes().splitlines())
        except FileNotFoundError:
            return 0

    def writing() -> bool:
        assert writer.poll() is None, f"the writer ended: {writer.communicate()[0][-2000:]}"
        return live_lines() >= LINES_BETWEEN

    try:
        for _ in range(ROTATIONS):
            # The writer has put lines into the live file since the last rotation: it reopened it.
            wait_until(writing, 120, 0.05, f"{LINES_BETWEEN} lines in the live log")
            rotated = subprocess.run(
                [logrotate, "-f", "-s", str(state), str(conf)], capture_output=True, text=True, timeout=120
            )
            assert rotated.returncode == 0, rotated.stderr
            assert stat.S_IMODE(log.stat().st_mode) == 0o600  # create 0600
        wait_until(writing, 120, 0.05, f"{LINES_BETWEEN} lines in the last live log")
    finally:
        stop.touch()
        output, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0, output[-2000:]
    assert output == "", "nothing went past the log"

    files = sorted(logs.glob("bridge.log*"))
    assert {p.name for p in files} == {"bridge.log", "bridge.log.1"} | {
        f"bridge.log.{n}.gz" for n in range(2, ROTATIONS + 1)
    }, "each rotation made one file, compressed but the newest (delaycompress)"
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    numbers: list[int] = []
    last: list[str] = []
    for path in files:
        for line in _lines(path):
            number = _sequence_number(line)
            if number is None:
                last.append(line)
            else:
                numbers.append(number)
        # each file holds whole JSON lines only: checked by _sequence_number's json.loads
    assert len(last) == 1 and last[0] in _lines(log), "the writer's last line is in the live log"
    written = json.loads(last[0])["lines"]
    assert written >= (ROTATIONS + 1) * LINES_BETWEEN
    twice = [n for n, times in collections.Counter(numbers).items() if times > 1]
    assert twice == [], f"lines written twice: {twice[:20]}"
    missing = sorted(set(range(written)) - set(numbers))
    assert missing == [], f"{len(missing)} lines lost, e.g. {missing[:20]}"
    assert len(numbers) == written


# --- the reopening file itself ----------------------------------------------------------------


def test_a_renamed_log_is_reopened_before_the_next_line(tmp_path: Path) -> None:
    path = tmp_path / "bridge.log"
    out = ReopeningFile(path)
    try:
        out.write("one\n")
        path.rename(tmp_path / "bridge.log.1")
        out.write("two\n")  # nothing at the path: made again, private
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        (tmp_path / "bridge.log").rename(tmp_path / "bridge.log.2")
        path.write_text("")  # what logrotate's create does
        out.write("three\n")
        out.write("four\n")
        out.flush()
    finally:
        out.close()
    assert (tmp_path / "bridge.log.1").read_text() == "one\n"
    assert (tmp_path / "bridge.log.2").read_text() == "two\n"
    assert path.read_text() == "three\nfour\n"


def test_a_log_that_cannot_be_reopened_keeps_the_open_file(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    path = folder / "bridge.log"
    out = ReopeningFile(path)
    try:
        out.write("one\n")
        moved = tmp_path / "moved"
        folder.rename(moved)
        (tmp_path / "logs").write_text("a file where the folder was")  # the path cannot be made again
        out.write("two\n")  # not lost: still in the file it has open
        out.flush()
    finally:
        out.close()
    assert (moved / "bridge.log").read_text() == "one\ntwo\n"

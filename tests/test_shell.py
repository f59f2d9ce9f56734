"""Tests of bridge.shell.run_command, the interruptible form (``stop``) above all."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bridge.shell import (
    CommandError,
    CommandInterrupted,
    CommandNotFound,
    CommandTimeout,
    run_command,
    supervise,
)


def never() -> bool:
    return False


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def hanging_script(tmp_path: Path) -> tuple[list[str], Path]:
    """A command that prints, starts a child that hangs, writes its pid, and waits for it."""
    pid_file = tmp_path / "child.pid"
    script = f'echo started; echo to-stderr >&2; sleep 600 & echo $! > "{pid_file}.tmp"; '
    script += f'mv "{pid_file}.tmp" "{pid_file}"; wait'
    return ["sh", "-c", script], pid_file


@pytest.mark.parametrize("stop", [None, never], ids=["plain", "interruptible"])
def test_output_exit_status_and_input(stop: Callable[[], bool] | None, tmp_path: Path) -> None:
    result = run_command(
        ["sh", "-c", "cat; pwd; echo oops >&2"], timeout=10, input_text="hello\n", cwd=tmp_path, stop=stop
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, f"hello\n{tmp_path}\n", "oops\n")
    with pytest.raises(CommandError) as failed:
        run_command(["sh", "-c", "echo out; echo why >&2; exit 3"], timeout=10, stop=stop)
    assert failed.value.result.returncode == 3 and failed.value.reason == "exit status 3"
    assert (failed.value.result.stdout, failed.value.result.stderr) == ("out\n", "why\n")
    unchecked = run_command(["sh", "-c", "exit 4"], timeout=10, check=False, stop=stop)
    assert unchecked.returncode == 4
    with pytest.raises(CommandNotFound):
        run_command([str(tmp_path / "no-such-program")], timeout=10, stop=stop)
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho never\n")
    with pytest.raises(CommandError) as refused:  # typed like every other failure, both ways
        run_command([str(script)], timeout=10, stop=stop)
    assert refused.value.reason == "could not start" and not isinstance(refused.value, CommandNotFound)
    assert refused.value.result.stderr == f"{script}: Permission denied"


def test_a_supervised_command_that_cannot_start_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(CommandNotFound):
        supervise([str(tmp_path / "no-such-program")], timeout=10)
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\necho never\n")
    with pytest.raises(CommandError) as refused:
        supervise([str(script)], timeout=10)
    assert refused.value.reason == "could not start" and "Permission denied" in refused.value.result.stderr


def test_stop_kills_the_whole_process_group_and_keeps_the_output(tmp_path: Path) -> None:
    argv, pid_file = hanging_script(tmp_path)
    # The command would hang for the child's 600 s, past its 300 s limit: CommandInterrupted (not
    # CommandTimeout) says that stop ended it, whatever the machine's speed.
    with pytest.raises(CommandInterrupted) as stopped:
        run_command(argv, timeout=300, stop=pid_file.exists)
    assert stopped.value.result.stdout == "started\n" and stopped.value.result.stderr == "to-stderr\n"
    assert stopped.value.result.returncode == -1
    child = int(pid_file.read_text())
    wait_for(lambda: not alive(child))  # the grandchild went with its parent, not left running


def test_another_thread_stops_a_command_promptly(tmp_path: Path) -> None:
    argv, pid_file = hanging_script(tmp_path)
    flag = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            run_command(argv, timeout=300, stop=flag.is_set)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(pid_file.exists)
    flag.set()
    # Not timed: a stop that went unnoticed would end only at the 300 s limit, as CommandTimeout,
    # and the join, longer than that, waits for whichever comes.
    thread.join(600)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], CommandInterrupted)


def test_a_command_is_not_started_once_stop_is_true(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(CommandInterrupted):
        run_command(["touch", str(marker)], timeout=10, stop=lambda: True)
    assert not marker.exists()


def test_timeout_with_stop_kills_the_group(tmp_path: Path) -> None:
    argv, pid_file = hanging_script(tmp_path)
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as timed_out:
        run_command(argv, timeout=1, stop=never)
    # At least the limit; and far below the child's 600 s sleep (the group is killed, its output
    # not waited for): generous, since that difference is the point, not the speed.
    assert 1 <= time.monotonic() - started < 120
    assert timed_out.value.result.stdout == "started\n"
    child = int(pid_file.read_text())
    wait_for(lambda: not alive(child))


def test_a_child_that_leaves_the_group_does_not_hold_the_caller(tmp_path: Path) -> None:
    """A descendant in a session of its own keeps the pipes open: the kill does not wait for it."""
    pid_file = tmp_path / "escaped.pid"
    script = f"setsid sh -c 'echo $$ > \"{pid_file}\"; exec sleep 600' & echo started; wait"
    started = time.monotonic()
    try:
        with pytest.raises(CommandInterrupted) as stopped:
            run_command(["sh", "-c", script], timeout=300, stop=pid_file.exists)
        # The grace (5 s), not the escaped child's 600 s sleep: generous, the difference is the point.
        assert time.monotonic() - started < 120
        assert stopped.value.result.stdout == "started\n"
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

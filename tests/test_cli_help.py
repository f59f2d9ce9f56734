"""Every command and subcommand answers --help with a description and at least one example."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

COMMANDS = {"hpc-bridge": "bridge", "hpc-worker": "worker"}


def _help(module: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *args, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _subcommands(module: str) -> list[str]:
    usage = _help(module)
    match = re.search(r"\{([a-z,-]+)\}", usage)
    assert match, usage
    return match.group(1).split(",")


def test_every_bridge_command_is_listed() -> None:
    assert set(_subcommands("bridge")) == {
        "check", "run", "enqueue", "chain", "init", "status", "doctor", "script", "logs", "requeue-dead", "purge",
        "prune", "install", "uninstall", "upgrade",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("program", "sub"),
    [(p, s) for p, module in COMMANDS.items() for s in (None, *_subcommands(module))],
)
def test_help_has_an_example(program: str, sub: str | None) -> None:
    text = _help(COMMANDS[program], *([sub] if sub else []))
    examples = text[text.lower().index("example") :] if "example" in text.lower() else ""
    assert examples, f"{program} {sub or ''} --help has no example:\n{text}"
    # The example shows the command itself (check/run: the cron and systemd lines that run it).
    indirect = {("hpc-bridge", "check"): "hpc-bridge-run-check", ("hpc-bridge", "run"): "systemctl --user start"}
    shown = indirect.get((program, sub or ""), f"{program} {sub or ''}")
    assert shown.strip() in examples, f"no '{shown.strip()}' in the examples of {program} {sub or ''}:\n{examples}"

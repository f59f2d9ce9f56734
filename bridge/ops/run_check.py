"""``hpc-bridge-run-check``: the crontab entry, an entry point of the installed package.

It runs ``run_check.sh`` (shipped beside this module; its header says what it does) with the
``hpc-bridge`` of the same installation, so that a bridge installed from a wheel into any virtual
environment needs no checkout. ``--instance NAME`` is the same as ``HPC_BRIDGE_INSTANCE=NAME``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from bridge.instance import INSTANCE_ENV

SCRIPT = "run_check.sh"


def script_path() -> Path:
    """The packaged run_check.sh (a real file: the package is installed, not zipped)."""
    return Path(str(resources.files("bridge.ops").joinpath(SCRIPT)))


def installed_executable(argv0: str = "", prefix: str = sys.prefix) -> Path | None:
    """The ``hpc-bridge`` of this installation: beside this entry point, else in the environment's bin."""
    candidates = [Path(argv0).absolute().parent / "hpc-bridge"] if argv0 else []
    candidates.append(Path(prefix) / "bin" / "hpc-bridge")
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hpc-bridge-run-check",
        description="One hpc-bridge pass for cron: output to a private log, a mail (what it prints) only when "
        "the exit status changes. `hpc-bridge install cron` writes the crontab line.",
    )
    parser.add_argument("--instance", help="which bridge of this account (default $HPC_BRIDGE_INSTANCE or default)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if args.instance:
        env[INSTANCE_ENV] = args.instance
    if not env.get("HPC_BRIDGE_EXE"):
        exe = installed_executable(sys.argv[0])
        if exe is not None:
            env["HPC_BRIDGE_EXE"] = str(exe)
    bash = shutil.which("bash") or "/bin/bash"
    # exec, not a child: cron sees run_check's own exit status and flock holds for its lifetime.
    os.execve(bash, [bash, str(script_path())], env)  # noqa: S606 (bash runs the packaged script, no shell string)


if __name__ == "__main__":
    main()

"""Operator commands of ``hpc-bridge``: one module per command, for people on the login node.

Each module has ``add_parser(sub)``, which adds its subcommand to the ``hpc-bridge`` parser
and sets ``operator=<its run function>`` as the parser's default. ``run(config, args) -> int``
gets the loaded configuration; a command that must work without a valid configuration (doctor)
also sets ``loads_config=True`` and is called as ``run(args)`` to load (and judge) it itself.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The modules under bridge/ops/ that define commands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "init",
    "status",
    "doctor",
    "script",
    "request_log",
    "deadletter",
    "prune",
    "install",
    "upgrade",
    "uninstall",
)


def add_parsers(sub: Any) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"bridge.ops.{name}").add_parser(sub)

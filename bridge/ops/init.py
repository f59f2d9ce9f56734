"""``hpc-bridge init``: make an instance's settings folder with the annotated example settings.

``~/.config/hpc-bridge/NAME/`` (0700) gets ``credentials.env`` (0600), a copy of the package's
``credentials.env.example``, to fill in (every ``CHANGE_ME``). An existing file is never
overwritten. It needs no settings itself, so it is the first command of an installation.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from typing import Any

from bridge.atomic import atomic_write
from bridge.instance import Instance

EXAMPLE = "credentials.env.example"


def example_text() -> str:
    """The annotated example settings shipped in the package (the repository's credentials.env.example)."""
    return resources.files("bridge.ops").joinpath(f"templates/{EXAMPLE}").read_text()


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "init",
        help="create this instance's settings folder and its credentials.env from the annotated example",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        epilog="example: hpc-bridge init && ${EDITOR:-nano} ~/.config/hpc-bridge/default/credentials.env",
    )
    p.add_argument("--print", action="store_true", dest="print_only", help="print the example; write nothing")
    p.set_defaults(operator=run, loads_config=True)


def run(args: argparse.Namespace) -> int:
    if args.print_only:
        print(example_text(), end="")
        return 0
    instance = Instance.from_environment()
    folder = instance.settings_dir
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    target = instance.credentials
    if target.exists():
        print(f"{target} exists: left as it is (hpc-bridge doctor judges it)")
        return 0
    atomic_write(target, example_text().encode(), mode=0o600)
    print(f"wrote {target} (mode 600): replace every CHANGE_ME in it, then run hpc-bridge doctor")
    if instance.name != "default":
        print(f"this is instance {instance.name}: give every command --instance {instance.name}", file=sys.stderr)
    return 0

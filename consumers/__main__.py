"""``python -m consumers build`` builds the environments; ``check`` opens model files in all of them.

Examples:
  python -m consumers build                       # what deploy/dev/setup.sh runs
  python -m consumers check models/*.hdf5         # does Rodan's TensorFlow open these?
  python -m consumers check --page page.png models/Background_Model.hdf5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bridge.logs import configure_logging
from consumers import CONSUMERS, ConsumerUnavailable, by_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m consumers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build (or reuse) the consumer environments")
    build.add_argument("--only", action="append", help="a consumer's name (repeatable)")
    check = commands.add_parser("check", help="open model files in every consumer and compare with the weights")
    check.add_argument("models", nargs="+", type=Path)
    check.add_argument("--page", type=Path, help="an image to cut test windows from (default: a generated page)")
    check.add_argument("--patch", type=int, nargs=2, default=(64, 64), metavar=("HEIGHT", "WIDTH"))
    args = parser.parse_args(argv)
    configure_logging(level="WARNING", component="consumers")  # bridge.shell's debug lines stay out
    try:
        if args.command == "build":
            from consumers.build import build_all

            build_all([by_name(name) for name in args.only] if args.only else CONSUMERS, print)
            return 0
        from consumers.verify import page_image, print_table, verify

        image = page_image(args.page)
        verdicts = verify({path.name: path for path in args.models}, image, tuple(args.patch))
        print_table(verdicts, sys.stdout)
        return 0 if all(v.acceptable for v in verdicts) else 1
    except ConsumerUnavailable as exc:
        print(f"consumers: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m bridge.testing``: run the Rodan stand-in in the foreground, or write a sample page.

``serve`` prints exactly one JSON line on stdout once the server listens, e.g.
``{"url": "http://127.0.0.1:8123", "host_port": "127.0.0.1:8123", "uploads": "...",
"token_field": "email", "sample_page": "/tmp/req.json", "inputs": {...}}``, then serves until SIGTERM
or SIGINT (exit status 0). Neither the password nor the token is ever printed; pass the password
with ``--password`` or, to keep it out of the process list, in the environment variable named by
``--password-env`` (default ``STANDIN_PASSWORD``).

``--sample-page OUT_JSON`` writes a sample page into the uploads directory first and saves a whole
job request body, ``{"inputs": {...}, "settings": {...}}``, to OUT_JSON, ready to publish.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from bridge.testing.rodan import RodanStandin, User


def _crop(text: str) -> tuple[int, int, int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError("expected LEFT,TOP,RIGHT,BOTTOM")
    return parts[0], parts[1], parts[2], parts[3]


def _settings(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--settings must be a JSON object")
    return value


def _add_sample_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sample page")
    g.add_argument("--generation", choices=["old", "new"], default="new", help="the Rodan job generation")
    g.add_argument("--layers", type=int, default=2, help="number of numbered layers (new generation)")
    g.add_argument("--height", type=int, default=160)
    g.add_argument("--width", type=int, default=192)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--from-masks",
        type=Path,
        metavar="DATA_DIR",
        help="synthesize the page from real masks (e.g. the einsiedeln-32r-263v data directory)",
    )
    g.add_argument("--crop", type=_crop, metavar="L,T,R,B", help="crop of --from-masks (Pillow box)")
    g.add_argument(
        "--settings",
        type=_settings,
        default={},
        metavar="JSON",
        help="the request's settings object (default {})",
    )


def _write_sample(args: argparse.Namespace, uploads: Path, out: Path) -> dict[str, str]:
    from bridge.testing.samples import make_sample_page, synthesize_page_from_masks

    if args.from_masks is not None:
        inputs = synthesize_page_from_masks(
            args.from_masks, uploads, args.crop, generation=args.generation, seed=args.seed
        )
    else:
        inputs = make_sample_page(
            uploads,
            generation=args.generation,
            n_layers=args.layers,
            height=args.height,
            width=args.width,
            seed=args.seed,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"inputs": inputs, "settings": args.settings}, indent=2) + "\n")
    return inputs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bridge.testing", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the Rodan stand-in until SIGTERM/SIGINT")
    serve.add_argument("--uploads", type=Path, required=True, help="directory served under /uploads/")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    serve.add_argument("--email", default="hpc@example.org")
    serve.add_argument("--username", default="hpc")
    serve.add_argument("--password", help="the account's password (else from --password-env)")
    serve.add_argument("--password-env", default="STANDIN_PASSWORD", metavar="VAR")
    serve.add_argument("--token-field", choices=["email", "username", "both"], default="email")
    serve.add_argument("--require-auth-for-uploads", action="store_true")
    serve.add_argument("--sample-page", type=Path, metavar="OUT_JSON", help="write a sample job request")
    _add_sample_options(serve)

    sample = sub.add_parser("sample", help="only write a sample page and its job request")
    sample.add_argument("--uploads", type=Path, required=True)
    sample.add_argument("--out", type=Path, required=True, metavar="OUT_JSON")
    _add_sample_options(sample)
    return parser


def _serve(args: argparse.Namespace) -> int:
    password = args.password if args.password is not None else os.environ.get(args.password_env)
    if not password:
        print(f"error: give --password or set {args.password_env}", file=sys.stderr)
        return 2
    uploads: Path = args.uploads
    uploads.mkdir(parents=True, exist_ok=True)
    inputs = _write_sample(args, uploads, args.sample_page) if args.sample_page else None

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rodan = RodanStandin(
        uploads,
        [User(args.email, args.username, password)],
        token_field=args.token_field,
        require_auth_for_uploads=args.require_auth_for_uploads,
        host=args.host,
        port=args.port,
    )
    with rodan:
        line: dict[str, Any] = {
            "url": rodan.url,
            "host_port": rodan.host_port,
            "uploads": str(rodan.uploads_dir),
            "token_field": args.token_field,
            "pid": os.getpid(),
        }
        if inputs is not None:
            line["sample_page"] = str(args.sample_page)
            line["inputs"] = inputs
        print(json.dumps(line), flush=True)
        while not stop.wait(0.5):
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    inputs = _write_sample(args, args.uploads, args.out)
    print(json.dumps({"sample_page": str(args.out), "inputs": inputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resource download throughput: the worker's download code (`bridge.rodan.RodanClient.download`:
requests, 1 MiB raw chunks, the byte cap, length check, fsync, atomic rename) vs `curl -o` of the same file
from the same loopback server, interleaved, in the same run.

Two servers: the Rodan stand-in (`bridge/testing/rodan.py`, Python, 64 KiB writes; what the tests
use) and a plain `socket.sendfile` server (so that the server is never the slower side and the
clients are what is compared). Each download runs in a fresh process (ours: a child Python that
times `download()` alone; curl: its own `time_total`), so neither shares a GIL with the server.

    .venv/bin/python benchmarks/bench_download.py                     # 200 MB, 5 runs per case
    .venv/bin/python benchmarks/bench_download.py --quick             # smoke test: 20 MB, 2 runs
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import EMAIL, PASSWORD, REPO, load
from tables import print_table

from bridge.testing.rodan import RodanStandin, User

CHILD = """
import sys, time
from pathlib import Path
from bridge.handoff import DEFAULT_MAX_INPUT_BYTES
from bridge.rodan import RodanClient
client = RodanClient(sys.argv[1], token=sys.argv[3])
result = client.download(sys.argv[2], Path(sys.argv[4]), max_bytes=DEFAULT_MAX_INPUT_BYTES)
print(result.seconds, result.bytes)
"""


class _SendfileHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path

    def do_GET(self) -> None:
        path = self.root / self.path.lstrip("/").removeprefix("uploads/")
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with path.open("rb") as fh:
            self.connection.sendfile(fh)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _stopper(httpd: http.server.ThreadingHTTPServer) -> Callable[[], None]:
    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    return stop


def ours(base: str, url: str, token: str, dest: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, base, url, token, str(dest)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    dest.unlink()
    return float(out[0])


def curl(url: str, token: str, dest: Path) -> float:
    out = subprocess.run(
        ["curl", "-sS", "--fail", "-H", f"Authorization: Token {token}", "-o", str(dest), "-w", "%{time_total}", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    dest.unlink()
    return float(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=200, help="file size in MB (10^6 bytes; default 200)")
    parser.add_argument("--runs", type=int, default=5, help="runs per client and server (default 5)")
    parser.add_argument("--servers", default="standin,sendfile", help="comma-separated: standin, sendfile")
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 MB, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.runs = 20, 2
    size = args.size_mb * 1_000_000
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpc-bench-dl-") as tmp_name:
        tmp = Path(tmp_name)
        uploads = tmp / "uploads"
        uploads.mkdir()
        with (uploads / "page.png").open("wb") as fh:
            for _ in range(args.size_mb):
                fh.write(os.urandom(1_000_000))
        dest = tmp / "downloaded"
        for server in args.servers.split(","):
            if server == "standin":
                standin = RodanStandin(uploads, users=[User(EMAIL, "hpc", PASSWORD)]).start()
                base, url, stop = standin.url, standin.url_for("/uploads/page.png"), standin.stop
                token = standin.user(EMAIL).token
            elif server == "sendfile":
                handler = type("Handler", (_SendfileHandler,), {"root": uploads})
                httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
                threading.Thread(target=httpd.serve_forever, daemon=True).start()
                base = f"http://127.0.0.1:{httpd.server_address[1]}"
                url, token, stop = f"{base}/uploads/page.png", "x" * 40, _stopper(httpd)
            else:
                parser.error(f"unknown server {server!r}")
            times: dict[str, list[float]] = {"curl": [], "ours": []}
            loads = [load()]
            try:
                for _ in range(args.runs):  # interleaved, so both see the same background load
                    times["curl"].append(curl(url, token, dest))
                    times["ours"].append(ours(base, url, token, dest))
            finally:
                stop()
            loads.append(load())
            mbps = {k: [size / 1e6 / t for t in v] for k, v in times.items()}
            for client in ("curl", "ours"):
                best, median = max(mbps[client]), statistics.median(mbps[client])
                ratio = (
                    ""
                    if client == "curl"
                    else (f"{best / max(mbps['curl']):.2f} / {median / statistics.median(mbps['curl']):.2f}")
                )
                rows.append(
                    [
                        server,
                        "curl -o" if client == "curl" else "RodanClient.download",
                        f"{best:.0f}",
                        f"{median:.0f}",
                        f"{min(mbps[client]):.0f}",
                        ratio,
                        "/".join(loads),
                    ]
                )
    print(f"Download of a {args.size_mb} MB file over loopback, {args.runs} runs each, MB/s (10^6 bytes/s)\n")
    print_table(["server", "client", "best MB/s", "median MB/s", "worst MB/s", "ours/curl best / median", "load"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

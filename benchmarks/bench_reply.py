"""Reply publication: four 256x256 models of the standard network in one reply, through the worker's
real reply path (`worker.job.deliver`: `ReplyBox.stage` to the spool's outbox, connect, publish with
confirms, the replied marker, dropping the outbox entry) vs a bare pika publish with confirms of the
same bytes (connect, confirm mode, one persistent `basic_publish`, close).

Each run is a fresh Python process that first reads the reply body (so the payload is already in
its peak RSS), then does the one thing measured: wall time, and peak RSS growth above that baseline
(the peak RSS, VmHWM, reset through /proc/self/clear_refs
once the body is read, after minus the RSS before). Runs alternate between the two sides.

The models are real: `worker/trainer/model.py`'s network built at 256x256 four times (random
initial weights) and saved as Keras HDF5 without optimizer state, as the worker sends them (built
once and cached in the temporary directory; `--models random` uses random bytes of the same sizes
instead, which publishes the same number of bytes without importing TensorFlow).

    .venv/bin/python benchmarks/bench_reply.py                 # real models, 7 runs per side
    .venv/bin/python benchmarks/bench_reply.py --quick         # smoke test: random bytes, 2 runs
    .venv/bin/python benchmarks/bench_reply.py --trace         # + where the reply path allocates
    .venv/bin/python benchmarks/bench_reply.py --diagnose      # + ours without fsync: what durability costs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pika
from benchlib import BROKER, REPO, load
from tables import print_table

MODEL_BYTES = 5_800_000  # one model without optimizer state (docs/protocol.md §3.4)
CACHE = Path(tempfile.gettempdir()) / "hpc-bench-sae256"

BUILD = """
import sys
from pathlib import Path
from worker.trainer.model import build_sae
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for i in range(4):
    build_sae(256, 256).save(str(out / f".layer-{i}.hdf5"), include_optimizer=False)
    (out / f".layer-{i}.hdf5").rename(out / f"layer-{i}.hdf5")
"""

CHILD = """
import json, sys, time, tracemalloc
from pathlib import Path
from types import SimpleNamespace

side, body_path, spool, queue, broker, trace = sys.argv[1:7]
import pika
from bridge.replies import ReplyBox
from bridge.spool import Spool
from worker.job import deliver

body = Path(body_path).read_bytes()
if trace == "1":
    tracemalloc.start(25)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # resets the peak (VmHWM) to the current RSS: reading the body had its own peak
before = status("VmRSS:")
started = time.perf_counter()
if side == "nofsync":
    import os
    os.fsync = lambda fd: None  # diagnostic only: what the outbox's durability costs
if side == "before":  # the reply path before the fix of 2026-11-26, restored by patching
    import bridge.replies as replies
    replies._is_error = replies.reply_is_error  # JSON-decoded the whole body, in stage and in publish
    publish_staged = replies.ReplyBox.publish_staged
    replies.ReplyBox.publish_staged = lambda self, channel, entry, body=None: publish_staged(self, channel, entry)
if side in ("ours", "nofsync", "before"):
    params = SimpleNamespace(
        correlation_id="bench-" + queue,
        reply_to=queue,
        broker=SimpleNamespace(url=broker, ca_file=None),
        reply_part_bytes=None,  # one message, as the older generations' replies
    )
    deliver(ReplyBox(Spool(Path(spool)).ensure()), params, body)
    assert not list((Path(spool) / "outbox").iterdir()), "the reply stayed in the outbox"
else:
    connection = pika.BlockingConnection(pika.URLParameters(broker))
    channel = connection.channel()
    channel.confirm_delivery()
    props = pika.BasicProperties(correlation_id="bench-" + queue, delivery_mode=pika.DeliveryMode.Persistent)
    channel.basic_publish("", queue, body, props, mandatory=True)
    connection.close()
seconds = time.perf_counter() - started
after = status("VmHWM:")
top = []
if trace == "1":
    peak = tracemalloc.get_traced_memory()[1]
    top = [str(s) for s in tracemalloc.take_snapshot().statistics("lineno")[:8]]
    top.insert(0, f"tracemalloc peak {peak / 1e6:.1f} MB")
print(json.dumps({"seconds": seconds, "rss_growth": after - before, "trace": top}))
"""


def build_models(kind: str, tmp: Path) -> list[bytes]:
    if kind == "random":
        import os

        return [os.urandom(MODEL_BYTES) for _ in range(4)]
    if not all((CACHE / f"layer-{i}.hdf5").exists() for i in range(4)):
        subprocess.run([sys.executable, "-c", BUILD, str(CACHE)], cwd=REPO, check=True, capture_output=True)
    return [(CACHE / f"layer-{i}.hdf5").read_bytes() for i in range(4)]


def run_side(side: str, body_path: Path, tmp: Path, queue: str, trace: bool) -> dict[str, object]:
    spool = tmp / f"spool-{uuid.uuid4().hex[:6]}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, side, str(body_path), str(spool), queue, BROKER, "1" if trace else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="runs per side (default 7)")
    parser.add_argument("--models", choices=["keras", "random"], default="keras")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="two more sides: ours with os.fsync a no-op (not durable), ours before the fix",
    )
    parser.add_argument("--trace", action="store_true", help="one more run per side under tracemalloc")
    parser.add_argument("--quick", action="store_true", help="smoke test: random bytes, 2 runs per side")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.models = 2, "random"

    sys.path.insert(0, str(REPO))
    from bridge.protocol import success_reply

    queue = f"bench-{uuid.uuid4().hex[:8]}-results"
    connection = pika.BlockingConnection(pika.URLParameters(BROKER))
    channel = connection.channel()
    channel.queue_declare(queue)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="hpc-bench-reply-") as tmp_name:
            tmp = Path(tmp_name)
            models = build_models(args.models, tmp)
            body = success_reply({f"Layer {i}": data for i, data in enumerate(models)})
            body_path = tmp / "reply.json"
            body_path.write_bytes(body)
            sides = ["bare", "ours", "nofsync", "before"] if args.diagnose else ["bare", "ours"]
            results: dict[str, list[dict[str, object]]] = {side: [] for side in sides}
            loads = [load()]
            for _ in range(args.runs):
                for side in sides:
                    results[side].append(run_side(side, body_path, tmp, queue, False))
                    channel.queue_purge(queue)
            loads.append(load())
            traces = {}
            if args.trace:
                for side in ("bare", "ours"):
                    traces[side] = run_side(side, body_path, tmp, queue, True)["trace"]
                    channel.queue_purge(queue)
    finally:
        channel.queue_delete(queue)
        connection.close()

    payload = len(body)
    med: dict[str, tuple[float, float]] = {}
    names = {
        "bare": "bare pika publish + confirm",
        "ours": "worker deliver (stage + publish + confirm)",
        "nofsync": "worker deliver, os.fsync a no-op (diagnostic)",
        "before": "worker deliver before the fix (diagnostic)",
    }
    for side in sides:
        secs = [float(r["seconds"]) for r in results[side]]  # type: ignore[arg-type]
        rss = [float(r["rss_growth"]) for r in results[side]]  # type: ignore[arg-type]
        med[side] = (statistics.median(secs), statistics.median(rss))
        rows.append(
            [
                names[side],
                f"{statistics.median(secs) * 1000:.0f}",
                f"{min(secs) * 1000:.0f}",
                f"{statistics.median(rss) / 1e6:.1f}",
                f"{max(rss) / 1e6:.1f}",
                f"{statistics.median(rss) / payload:.2f}",
            ]
        )
    sizes = ", ".join(f"{len(m) / 1e6:.2f}" for m in models)
    print(
        f"Reply of 4 models ({args.models}: {sizes} MB) = {payload / 1e6:.1f} MB JSON body, "
        f"{args.runs} runs per side, load {'/'.join(loads)}\n"
    )
    print_table(["path", "median ms", "best ms", "peak RSS growth MB (median)", "(max)", "growth / payload"], rows)
    t_ratio = med["ours"][0] / med["bare"][0]
    r_ratio = med["ours"][1] / max(med["bare"][1], 1.0)
    print(f"\nours / bare: time {t_ratio:.2f}x (target <= 1.5x), RSS growth {r_ratio:.2f}x (target <= 2.5x)")
    for side, lines in traces.items():
        print(f"\ntracemalloc, {side}:")
        for line in lines:  # type: ignore[attr-defined]
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

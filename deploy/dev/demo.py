"""The end-to-end demo (run by deploy/dev/demo.sh after set-up).

1. A Rodan stand-in on loopback serves a generated page and its layers.
2. ``hpc-bridge enqueue --wait`` publishes a training request exactly as Rodan's task does and
   waits for the reply like Rodan (nacking replies that are not its own).
3. ``hpc-bridge check`` runs every few seconds, as cron would: it submits the job to the real
   local Slurm, and the worker in the job downloads, trains one model per layer and replies.
4. The models that came back are opened as Rodan opens them, in each consumer environment
   (Rodan's TensorFlow 2.5.1 on Python 3.7, 2.15.1 on Python 3.11, the worker's Keras 3; see
   consumers/): load, predict, one fit step, compared with the trained weights.

Uses its own queue names and a private spool under ./var/demo, so it never touches a real deployment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bridge.enqueue import RequestWatcher  # noqa: E402
from bridge.progress import Progress  # noqa: E402
from bridge.testing.rodan import RodanStandin, User  # noqa: E402
from bridge.testing.samples import make_sample_page  # noqa: E402

SETTINGS = {
    "Maximum number of training epochs": 2,
    "Maximum number of samples per label": 200,
    "Patch height": 64,
    "Patch width": 64,
    "Maximum time (D-HH:MM)": "0-00:20",
    "Maximum memory (MB)": 4096,
    "CPUs": 2,
}


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", choices=["old", "new"], default="new")
    parser.add_argument("--layers", type=int, default=2, help="numbered layers (new generation)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    work = REPO / "var" / "demo"
    work.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=work))
    uploads, spool, out = run_dir / "uploads", run_dir / "spool", run_dir / "models"
    uploads.mkdir()
    password = uuid.uuid4().hex
    tag = uuid.uuid4().hex[:8]

    with RodanStandin(uploads, users=[User("hpc@example.org", "hpc", password)], token_field="email") as rodan:
        inputs = make_sample_page(uploads, generation=args.generation, n_layers=args.layers, height=320, width=384)
        say(f"Rodan stand-in at {rodan.url} serving a 384x320 page: {', '.join(inputs)}")
        credentials = run_dir / "credentials.env"
        credentials.write_text(
            "\n".join(
                [
                    f"RABBITMQ_URL={os.environ.get('RABBITMQ_URL', 'amqp://guest:guest@127.0.0.1:5672/%2F')}",
                    f"RODAN_HOST={rodan.host_port}",
                    "RODAN_SCHEME=http",
                    "RODAN_USER=hpc@example.org",
                    f"RODAN_PASSWORD={password}",
                    f"HPC_REQUEST_QUEUE=demo-{tag}-hpc-jobs",
                    f"HPC_REPLY_QUEUE=demo-{tag}-hpc-results",
                    f"HPC_DEAD_LETTER_QUEUE=demo-{tag}-dead-letter",
                    f"HPC_SPOOL_DIR={spool}",
                    f"HPC_WORKER_PYTHON={sys.executable}",
                    f"HPC_LOG_FILE={run_dir / 'bridge.log'}",
                    "",
                ]
            )
        )
        credentials.chmod(0o600)
        (run_dir / "inputs.json").write_text(json.dumps(inputs))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
        bridge = [sys.executable, "-m", "bridge", "--credentials", str(credentials)]
        enqueue_cmd = [
            *bridge,
            "enqueue",
            "--inputs",
            str(run_dir / "inputs.json"),
            "--wait",
            "--out",
            str(out),
            "--timeout",
            str(args.timeout),
        ]
        for name, value in SETTINGS.items():
            enqueue_cmd += ["--setting", f"{name}={value}"]
        say("enqueueing the request as Rodan does, and waiting for the reply")
        # enqueue's own progress display is off: the demo draws it (under its own lines) instead
        waiter = subprocess.Popen(
            [*enqueue_cmd, "--progress", "none"], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        started = time.monotonic()
        passes = 0
        last_state = ""
        # a status line redrawn in place on a terminal, one line per change otherwise
        progress = Progress("request", mode="bar" if sys.stderr.isatty() else "lines")
        watcher: RequestWatcher | None = None
        next_check = 0.0
        try:
            while waiter.poll() is None:
                if time.monotonic() >= next_check:
                    subprocess.run([*bridge, "check"], env=env, cwd=REPO, check=False)
                    passes += 1
                    next_check = time.monotonic() + 3
                    state = _ledger_state(spool)
                    if state != last_state:
                        progress.note(f"bridge pass {passes}: request {state}", out=say)
                        last_state = state
                watcher = watcher or _watcher(spool)
                if watcher is None:
                    progress.update("waiting", state_text="waiting for the bridge")
                else:
                    view = watcher.poll()
                    progress.what = view.correlation_id[:8]
                    view.report(progress)
                time.sleep(0.5)
        finally:
            progress.finish()
        stdout = waiter.communicate()[0]
        result = json.loads(stdout.strip().splitlines()[-1])
        took = time.monotonic() - started

    if "error" in result:
        say(f"the request failed after {took:.0f} s: {result['error']}")
        say(f"bridge log: {run_dir / 'bridge.log'}; job logs: {spool / 'jobs'}")
        return 1
    say(f"reply received after {took:.0f} s and {passes} bridge passes; models written to {out}")
    say("opening every model as Rodan does, in each consumer's TensorFlow (consumers/)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from bridge.logs import configure_logging
    from consumers.verify import page_image, print_table, verify

    configure_logging(level="WARNING", component="demo")  # the consumer runs' command lines stay out

    files = dict(sorted(result["files"].items()))
    page = uploads / inputs["Image"].removeprefix("/uploads/")
    patch = (int(SETTINGS["Patch height"]), int(SETTINGS["Patch width"]))
    verdicts = verify({key: Path(info["path"]) for key, info in files.items()}, page_image(page), patch)
    print()
    print_table(verdicts, sys.stdout, sizes={key: int(info["bytes"]) for key, info in files.items()})
    print(f"\nrun directory: {run_dir}")
    return 0 if all(v.acceptable for v in verdicts) else 1


def _watcher(spool: Path) -> RequestWatcher | None:
    """What the demo watches: the one request in its private spool, once the bridge has taken it."""
    records = sorted((spool / "ledger").glob("*.json")) if (spool / "ledger").exists() else []
    if not records:
        return None
    try:
        correlation_id = str(json.loads(records[0].read_text())["correlation_id"])
    except (OSError, ValueError, KeyError):
        return None  # caught while being replaced: the next look will do
    return RequestWatcher(spool, spool / "runs", correlation_id)


def _ledger_state(spool: Path) -> str:
    records = list((spool / "ledger").glob("*.json")) if (spool / "ledger").exists() else []
    if not records:
        return "queued"
    record = json.loads(records[0].read_text())
    state = record["state"]
    if record.get("job_id"):
        state += f" (Slurm job {record['job_id']}{', ' + record['job_state'] if record.get('job_state') else ''})"
    return state


if __name__ == "__main__":
    raise SystemExit(main())

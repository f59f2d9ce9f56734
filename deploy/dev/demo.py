"""The end-to-end demo (run by deploy/dev/demo.sh after set-up): a Rodan 3.x user's training run,
through the real Rodan 3.1.0, the bridge and the local Slurm cluster, to models stored in Rodan and
classified by Paco_classifier's own code.

1. ``deploy/dev/rodan.sh up`` starts a Rodan 3.1.0 of the demo's own (state in ./var/demo/rodan,
   port 8785) with our job package (rodan_job/hpc_paco_trainer), whose Celery worker publishes to
   the demo's own request queue. Already up from an earlier demo: it is reused (seconds).
2. Through Rodan's REST API, as a user does in Rodan's client: a project, two Pixel.js sample zips
   (two pages, two layers each), a workflow of the job alone with its outputs (Log File, Background
   Model, Model 1, Model 2, Multi-Sample Zip), and a workflow run.
3. ``hpc-bridge check`` every few seconds, as cron runs it: it takes the job's request, gets a token
   from this Rodan, submits the training to the real local Slurm and replies once the worker in
   the job has trained one model per layer; Rodan's job, polling its run's queue, stores the files.
4. The outputs are downloaded from Rodan, and Paco_classifier's ``process_image_msae`` (what Rodan's
   classifier job runs) classifies the first page with them in both TensorFlow versions Rodan runs
   (consumers/). The label images are written beside the outputs.

It uses its own queue names, spool and Rodan, so it never touches a real deployment; its queues
are deleted when it ends, however it ends (Rodan declares its request queue again when it next
publishes). Rodan stays up at the end so that its API can be browsed (the last lines say where to
look and how to take it down).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bridge.enqueue import RequestWatcher  # noqa: E402
from bridge.progress import Progress  # noqa: E402
from bridge.testing.rodan_api import FAILED, FINISHED, Api, RodanApiError, Upload  # noqa: E402
from bridge.testing.samples import make_sample_page, make_sample_zip  # noqa: E402

JOB_NAME = "Training model for Patchwise Analysis of Music Document, HPC"
RODAN_SH = REPO / "deploy" / "dev" / "rodan.sh"
WORK = REPO / "var" / "demo"
#: The demo's own queues, deleted when it ends: the request queue (Rodan's job publishes to it), and
#: the bridge's dead-letter and status queues. The reply queues are the runs' (hpc-results.<id>).
REQUEST_QUEUE = "demo-hpc-jobs"
DEAD_LETTER_QUEUE = "demo-hpc-dead-letter"
STATUS_QUEUE = "demo-hpc-status"
REPLY_QUEUE_PATTERN = "hpc-results.*"
#: The demo's Rodan: its own state directory, port, Redis db (and request queue: REQUEST_QUEUE).
RODAN_ENV = {
    "HPC_DEV_RODAN_DIR": str(WORK / "rodan"),
    "HPC_DEV_RODAN_PORT": "8785",
    "HPC_DEV_RODAN_REDIS_DB": "11",
    "HPC_POLL_SECONDS": "3",  # how often the job looks at its run's queue (default 30)
}
#: The job's settings in the workflow: a training of seconds on 2 cores, to show the path, not a
#: model's quality (at this size the neumes' model seldom wins a pixel; the table shows it).
SETTINGS = {
    "Batch Size": 8,
    "Maximum number of training epochs": 4,
    "Maximum number of samples per label": 300,
    "Patience": 15,
    "Patch height": 32,
    "Patch width": 32,
    "Maximum time (D-HH:MM)": "0-00:15",
    "Maximum memory (MB)": 3000,
    "CPUs": 2,
    "Slurm Notification Email": "",
}
OUTPUTS = ["Log File", "Background Model", "Model 1", "Model 2", "Multi-Sample Zip"]
MODELS = ["Background Model", "Model 1", "Model 2"]  # Rodan's classifier takes them in this order
CONSUMERS = (("tf2.5.1-py3.7", "2.5.1"), ("tf2.15.1-py3.11", "2.15.1"))
#: A colour per label for the label images (background, layer 1, layer 2).
COLOURS = ((255, 255, 255), (200, 30, 30), (30, 90, 200))


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def rodan_up(broker_url: str) -> dict[str, str]:
    """``rodan.sh up`` for the demo's Rodan, then its ``env`` (URL, account)."""
    env = {**os.environ, **RODAN_ENV, "HPC_REQUEST_QUEUE": REQUEST_QUEUE, "HPC_RABBITMQ_URL": broker_url}
    env.pop("HPC_DEV_RODAN_JOB_PACKAGES", None)
    package = REPO / "rodan_job" / "hpc_paco_trainer"
    up = subprocess.run(["bash", str(RODAN_SH), "up", "--job-package", str(package)], env=env, check=False)
    if up.returncode != 0:
        raise SystemExit(f"deploy/dev/rodan.sh up failed (exit {up.returncode}); its log is above")
    printed = subprocess.run(["bash", str(RODAN_SH), "env"], env=env, capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in printed.stdout.splitlines() if "=" in line)


def demo_queues(spool: Path) -> list[str]:
    """The queues the demo leaves on the broker: its own, and the reply queues of its requests."""
    names = [REQUEST_QUEUE, DEAD_LETTER_QUEUE, STATUS_QUEUE]
    prefix = REPLY_QUEUE_PATTERN.removesuffix("*")
    for path in sorted((spool / "ledger").glob("*.json")) if (spool / "ledger").is_dir() else []:
        try:
            reply_to = str(json.loads(path.read_text()).get("reply_to", ""))
        except (OSError, ValueError, AttributeError):
            continue
        if reply_to.startswith(prefix) and reply_to not in names:
            names.append(reply_to)
    return names


def delete_queues(broker_url: str, names: Iterable[str]) -> list[str]:
    """Delete the queues ``names`` (one that is not there is fine); the ones that could not be."""
    import pika
    import pika.exceptions

    names = list(names)
    try:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    except pika.exceptions.AMQPError:
        return names
    left = []
    try:
        for name in names:
            try:
                connection.channel().queue_delete(queue=name)  # a refusal closes only its channel
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    left.append(name)
    except pika.exceptions.AMQPError:
        left.extend(name for name in names if name not in left)
    finally:
        if connection.is_open:
            connection.close()
    return left


def _terminated(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM ends the demo like Ctrl-C does: through its clean-up."""
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=900, help="seconds the workflow run may take")
    args = parser.parse_args()
    broker_url = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

    WORK.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=WORK))
    spool = run_dir / "spool"
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _demo(args, broker_url, run_dir)
    finally:  # however the demo ended: success, failure, Ctrl-C or SIGTERM
        signal.signal(signal.SIGTERM, previous)
        names = demo_queues(spool)
        left = delete_queues(broker_url, names)
        if left:
            say(f"could not delete the demo's queues {', '.join(left)} from the broker: delete them by hand")
        else:
            say(f"deleted the demo's queues from the broker: {', '.join(names)}")


def _demo(args: argparse.Namespace, broker_url: str, run_dir: Path) -> int:
    pages, spool, out = run_dir / "pages", run_dir / "spool", run_dir / "outputs"
    out.mkdir()

    say("starting the demo's Rodan 3.1.0 with the HPC training job (deploy/dev/rodan.sh up)")
    rodan = rodan_up(broker_url)
    api = Api.login(rodan["RODAN_URL"], rodan["RODAN_EMAIL"], rodan["RODAN_PASSWORD"])
    say(f"Rodan answers at {rodan['RODAN_URL']}/api/ (account {rodan['RODAN_EMAIL']})")

    inputs: dict[str, Upload] = {}
    first_page: dict[str, Path] = {}
    for n in (1, 2):
        page = make_sample_page(pages, generation="new", n_layers=2, height=224, width=256, seed=n)
        first_page = first_page or {name: pages / path.removeprefix("/uploads/") for name, path in page.items()}
        sample = make_sample_zip(run_dir / f"sample-{n}.zip", pages, page)
        inputs[f"Sample {n}"] = Upload(f"demo page {n}.zip", sample.read_bytes())
    project = api.create_project(f"hpc-bridge demo {time.strftime('%Y-%m-%d %H:%M:%S')}")
    say("uploading two Pixel.js sample zips (256x224 pages, two layers) and running a workflow of the job")
    run_url, _ = api.start_workflow(JOB_NAME, inputs, OUTPUTS, SETTINGS, project=project, name="hpc-bridge demo")
    say(f"workflow run {run_url}")

    credentials = run_dir / "credentials.env"
    credentials.write_text(
        "\n".join(
            [
                f"RABBITMQ_URL={broker_url}",
                f"RODAN_HOST={urlsplit(rodan['RODAN_URL']).netloc}",
                "RODAN_SCHEME=http",
                f"RODAN_EMAIL={rodan['RODAN_EMAIL']}",
                f"RODAN_PASSWORD={rodan['RODAN_PASSWORD']}",
                f"HPC_REQUEST_QUEUE={REQUEST_QUEUE}",
                f"HPC_REPLY_QUEUE={REPLY_QUEUE_PATTERN}",  # the job's run queues: hpc-results.<RunJob uuid>
                f"HPC_DEAD_LETTER_QUEUE={DEAD_LETTER_QUEUE}",
                f"HPC_STATUS_QUEUE={STATUS_QUEUE}",
                f"HPC_SPOOL_DIR={spool}",
                f"HPC_WORKER_PYTHON={sys.executable}",
                f"HPC_LOG_FILE={run_dir / 'bridge.log'}",
                "",
            ]
        )
    )
    credentials.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    bridge = [sys.executable, "-m", "bridge", "--credentials", str(credentials)]

    started = time.monotonic()
    passes, last_state, next_check = 0, "", 0.0
    progress = Progress("request", mode="bar" if sys.stderr.isatty() else "lines")
    watcher: RequestWatcher | None = None
    run: dict[str, object] = {}
    try:
        while time.monotonic() - started < args.timeout:
            if time.monotonic() >= next_check:  # a cron pass
                subprocess.run([*bridge, "check"], env=env, cwd=REPO, check=False)
                passes += 1
                next_check = time.monotonic() + 3
                state = _ledger_state(spool)
                if state != last_state:
                    progress.note(f"bridge pass {passes}: request {state}", out=say)
                    last_state = state
                run = api.json(run_url)
                if run["status"] in (FINISHED, FAILED):
                    break
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
    took = time.monotonic() - started
    if run.get("status") not in (FINISHED, FAILED):
        say(f"the workflow run did not end within {args.timeout:.0f} s; bridge log: {run_dir / 'bridge.log'}")
        return 1
    (runjob,) = api.run_jobs(run)
    if run["status"] != FINISHED:
        say(f"the workflow run FAILED after {took:.0f} s: {runjob['error_summary']}")
        say(f"bridge log: {run_dir / 'bridge.log'}; job logs: {spool / 'jobs'}")
        return 1
    say(f"the workflow run FINISHED after {took:.0f} s and {passes} bridge passes")

    files = api.output_files(runjob)
    for port, data in files.items():
        (out / f"{port}{_suffix(port)}").write_bytes(data)
    say(f"Rodan stored {len(files)} outputs; downloaded to {out}")
    log_lines = files["Log File"].decode("utf-8").splitlines()
    print("\n".join(f"    {line}" for line in log_lines if line.lstrip().startswith(("layer", "finished"))))

    say("classifying page 1 with the models through Paco_classifier's process_image_msae, as Rodan does")
    ok = _classify(first_page, [out / f"{m}.hdf5" for m in MODELS], out)

    print()
    print("Where to look:")
    print(f"  Rodan's API (browsable): {run_url}  (RunJob {runjob['url']})")
    print(f"    account {rodan['RODAN_EMAIL']}; its password: HPC_DEV_RODAN_DIR={_rel(WORK / 'rodan')} "
          "bash deploy/dev/rodan.sh env")  # fmt: skip
    print(f"  the outputs and label images: {_rel(out)}")
    print(f"  the bridge's log (JSON lines, jq): {_rel(run_dir / 'bridge.log')}")
    print(f"  the Slurm job's logs: {_rel(spool / 'jobs')}")
    print(f"  Rodan's own logs: {_rel(WORK / 'rodan' / 'logs')}")
    print(f"  take this Rodan down: HPC_DEV_RODAN_DIR={_rel(WORK / 'rodan')} bash deploy/dev/rodan.sh down")
    return 0 if ok else 1


def _classify(page: dict[str, Path], models: list[Path], out: Path) -> bool:
    """Paco's classifier in each of Rodan's TensorFlow versions: a table of the pixels each model
    won against the page's own layers, and a label image each."""
    import numpy as np
    from PIL import Image

    from bridge.logs import configure_logging
    from consumers import by_name, classify

    configure_logging(level="WARNING", component="demo")  # the consumer runs' command lines stay out
    layers = [page["Background"], page["rgba PNG - Layer 0"], page["rgba PNG - Layer 1"]]  # Model k's layer
    truth = np.zeros(np.asarray(Image.open(layers[0])).shape[:2], dtype=np.uint8)
    for index, layer in enumerate(layers):
        truth[np.asarray(Image.open(layer).convert("RGBA"))[..., 3] > 0] = index
    rows = [("the page's own layers", _shares(truth), "")]
    labels = {}
    for consumer, version in CONSUMERS:
        npy = out / f"labels-tf{version}.npy"
        try:
            info = classify(by_name(consumer), page["Image"], models, (128, 128), npy)
        except Exception as exc:  # shown in the table: the demo's verdict
            rows.append((f"TensorFlow {version}", f"FAILED: {exc}"[:200], ""))
            continue
        labels[version] = np.load(npy)
        Image.fromarray(np.array(COLOURS, dtype=np.uint8)[labels[version]]).save(out / f"labels-tf{version}.png")
        where = f"TensorFlow {info['tensorflow']} (Python {info.get('python', '?')})"
        rows.append((where, _shares(labels[version]), f"{float(np.mean(labels[version] == truth)):.1%}"))
    print()
    print(f"| page 1 classified by | pixels per model ({', '.join(MODELS)}) | same label as the page's layers |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    if len(labels) == len(CONSUMERS):
        same = float(np.mean(labels["2.5.1"] == labels["2.15.1"]))
        print(f"\nboth TensorFlow versions give the same label to {same:.1%} of the pixels")
    return len(labels) == len(CONSUMERS)


def _shares(labels: object) -> str:
    import numpy as np

    counts = np.bincount(np.asarray(labels).ravel(), minlength=len(MODELS))
    return " / ".join(f"{c / counts.sum():.1%}" for c in counts[: len(MODELS)])


def _suffix(port: str) -> str:
    return ".hdf5" if port in MODELS else ".txt" if port == "Log File" else ".zip"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


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
    state = str(record["state"])
    if record.get("job_id"):
        state += f" (Slurm job {record['job_id']}{', ' + record['job_state'] if record.get('job_state') else ''})"
    return state


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except RodanApiError as exc:
        say(f"Rodan's API: {exc}")
        raise SystemExit(1) from exc

"""The end-to-end demo (run by deploy/dev/demo.sh after set-up): a Rodan 3.x user's training run,
through the real Rodan 3.1.0, the bridge and the local Slurm cluster, to models stored in Rodan and
classified by Paco_classifier's own code.

1. ``deploy/dev/rodan.sh up`` starts a Rodan 3.1.0 of the demo's own (state in ./var/demo/rodan,
   port 8785) with our job package (rodan_job/hpc_paco_trainer), whose Celery worker publishes to
   the demo's own request queue. Already up from an earlier demo: it is reused (seconds).
2. Through Rodan's REST API, as a user does in Rodan's client: a project, two Pixel.js sample zips, a
   workflow of the job alone with its outputs (Log File, Background Model, Model 1, Model 2,
   Multi-Sample Zip), and a workflow run. The pages are two 1024 x 1024 crops of the real Einsiedeln
   masks (``bridge.testing.samples.EINSIEDELN_DIR``) with an image synthesized from them
   (``synthesize_page_from_masks``), three layers each: background, neumes (Layer 1), staff lines
   (Layer 2). Their selected region is the top :data:`TRAIN_ROWS` rows only, so the training never
   sees the rows from :data:`EVAL_TOP` down.
3. ``hpc-bridge check`` every few seconds, as cron runs it: it takes the job's request, gets a token
   from this Rodan, submits the training to the real local Slurm and replies once the worker in
   the job has trained one model per layer; Rodan's job, polling its run's queue, stores the files.
4. The outputs are downloaded from Rodan, and Paco_classifier's ``process_image_msae`` (what Rodan's
   classifier job runs) classifies, with them, the rows of each page below its selected region, in
   both TensorFlow versions Rodan runs (consumers/). A table scores the labels on the held-out rows
   (from :data:`EVAL_TOP` down) against the pages' own layers: per layer, its share of the pixels
   in the layers and in the labels, and the F1 of the layer. A label image per TensorFlow version
   (the held-out rows of both pages: the page, then its own layers, then the classifier's labels,
   the neumes and the staff lines painted over the page) is written beside the outputs.

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
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bridge.enqueue import RequestWatcher  # noqa: E402
from bridge.progress import Progress  # noqa: E402
from bridge.testing.rodan_api import FAILED, FINISHED, Api, RodanApiError, Upload  # noqa: E402
from bridge.testing.samples import EINSIEDELN_DIR, make_sample_zip, synthesize_page_from_masks  # noqa: E402

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
#: The two pages: crops (left, top, right, bottom) of the real Einsiedeln masks (4872 x 12992), 1024 x 1024
#: each, with neumes and staff lines on every row (those of benchmarks/bench_paco.py).
CROPS = ((1024, 2048, 2048, 3072), (1024, 3072, 2048, 4096))
#: The selected region, all the training sees: rows 0 .. TRAIN_ROWS of each page.
TRAIN_ROWS = 672
#: The held-out rows the table scores: EVAL_TOP .. the bottom of each page. The gap between (three
#: patches of 32) keeps every training patch, centred on a selected pixel, out of them.
EVAL_TOP = 768
#: The job's settings in the workflow, chosen by measurement (README.md, the demo): with SEED, F1 0.99 /
#: 0.95 / 0.89 on the held-out rows. The training took 3.3-3.7 min on 2 busy cores (load 2.5-6), 48-52 s
#: on quiet ones (benchmarks/README.md: bench_paco.py's quiet 10-epoch runs of these settings). 6 epochs
#: left the staff lines at F1 0.52 (trainer before 040ffeb); 8 epochs of 320 samples did not free the
#: staff-line model of seed 2 (SEED).
SETTINGS = {
    "Batch Size": 16,
    "Maximum number of training epochs": 10,
    "Maximum number of samples per label": 160,
    "Patience": 15,
    "Patch height": 32,
    "Patch width": 32,
    "Maximum time (D-HH:MM)": "0-00:15",
    "Maximum memory (MB)": 3000,
    "CPUs": 2,
    "Slurm Notification Email": "",
}
#: The training's seed (HPC_TRAINING_SEED), so that every run trains the same models: at these settings
#: seed 1 gave the neumes F1 0.69-0.75 and seed 2 a staff-line model that never moved (trainer of 040ffeb;
#: 0.4.0's output start frees it, tests/test_fresh_start.py). With 0.4.0's trainer seed 3 gave F1 1.00 /
#: 0.94 / 0.89 (README.md).
SEED = 3
OUTPUTS = ["Log File", "Background Model", "Model 1", "Model 2", "Multi-Sample Zip"]
MODELS = ["Background Model", "Model 1", "Model 2"]  # Rodan's classifier takes them in this order
#: The layers as the table names them, in MODELS' order, with the page's file of each.
LAYERS = (("Background", "Background"), ("Neumes", "rgba PNG - Layer 0"), ("Staff lines", "rgba PNG - Layer 1"))
#: What the demo calls a result: each layer's F1 on the held-out rows, in both TensorFlow versions, at least this.
TARGET_F1 = (0.7, 0.7, 0.5)
CONSUMERS = (("tf2.5.1-py3.7", "2.5.1"), ("tf2.15.1-py3.11", "2.15.1"))
#: The classifier job's window (height, width): Rodan's default patch; the models take any multiple of 4.
WINDOW = (256, 256)
#: The label images' paint per layer after the background (neumes, staff lines); the background stays the page.
PAINT = ((245, 140, 0), (20, 90, 220))


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
    masks = ("Background", "Neumes", "StaffLines", "SelectedRegions")
    if not all((EINSIEDELN_DIR / f"{name}.png").is_file() for name in masks):
        say(f"the pages are crops of the Einsiedeln masks, which are not in {EINSIEDELN_DIR}: set HPC_EINSIEDELN_DIR")
        return 1

    say("starting the demo's Rodan 3.1.0 with the HPC training job (deploy/dev/rodan.sh up)")
    rodan = rodan_up(broker_url)
    api = Api.login(rodan["RODAN_URL"], rodan["RODAN_EMAIL"], rodan["RODAN_PASSWORD"])
    say(f"Rodan answers at {rodan['RODAN_URL']}/api/ (account {rodan['RODAN_EMAIL']})")

    inputs: dict[str, Upload] = {}
    page_files: list[dict[str, Path]] = []
    for n, crop in enumerate(CROPS, 1):
        page, paths = _page(pages / f"page-{n}", crop, seed=n - 1)  # the images of bench_paco.py
        page_files.append(paths)
        sample = make_sample_zip(run_dir / f"sample-{n}.zip", pages / f"page-{n}", page)
        inputs[f"Sample {n}"] = Upload(f"demo page {n}.zip", sample.read_bytes())
    project = api.create_project(f"hpc-bridge demo {time.strftime('%Y-%m-%d %H:%M:%S')}")
    say(
        f"uploading two Pixel.js sample zips ({len(CROPS)} crops of the real Einsiedeln masks, 1024x1024, three "
        f"layers, rows 0-{TRAIN_ROWS - 1} selected) and running a workflow of the job"
    )
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
                f"HPC_TRAINING_SEED={SEED}",  # the same models every run (SETTINGS says why)
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
    starts = ("layer ", "its first epoch", "WARNING")  # each layer's summary, its fresh starts, a useless model
    within = ("finished: ", "learned nothing")
    shown = [line for line in log_lines if line.lstrip().startswith(starts) or any(w in line for w in within)]
    print("\n".join(f"    {line}" for line in shown))

    say(
        f"classifying rows {TRAIN_ROWS}- of both pages (below the selected region) with the models through "
        "Paco_classifier's process_image_msae, as Rodan does"
    )
    ok = _classify(page_files, [out / f"{m}.hdf5" for m in MODELS], out, pages)

    print()
    print("Where to look:")
    print(f"  Rodan's API (browsable): {run_url}  (RunJob {runjob['url']})")
    print(f"    account {rodan['RODAN_EMAIL']}; its password: HPC_DEV_RODAN_DIR={_rel(WORK / 'rodan')} "
          "bash deploy/dev/rodan.sh env")  # fmt: skip
    print(f"  the outputs and the labels: {_rel(out)}")
    print(f"  the label images (held-out rows, neumes orange, staff lines blue): {_rel(out / 'labels-tf2.15.1.png')}, "
          f"{_rel(out / 'labels-tf2.5.1.png')}")  # fmt: skip
    print(f"  the bridge's log (JSON lines, jq): {_rel(run_dir / 'bridge.log')}")
    print(f"  the Slurm job's logs: {_rel(spool / 'jobs')}")
    print(f"  Rodan's own logs: {_rel(WORK / 'rodan' / 'logs')}")
    print(f"  take this Rodan down: HPC_DEV_RODAN_DIR={_rel(WORK / 'rodan')} bash deploy/dev/rodan.sh down")
    return 0 if ok else 1


def _classify(pages: list[dict[str, Path]], models: list[Path], out: Path, work: Path) -> bool:
    """Paco's classifier in each of Rodan's TensorFlow versions, on the rows of every page below its
    selected region (cut into ``work``); a table of the labels of the held-out rows against the pages'
    own layers, and a label image per version into ``out``. True when both versions classified and
    reached :data:`TARGET_F1`."""
    import numpy as np
    from PIL import Image

    from bridge.logs import configure_logging
    from consumers import by_name, classify

    configure_logging(level="WARNING", component="demo")  # the consumer runs' command lines stay out
    skip = EVAL_TOP - TRAIN_ROWS  # classified, not scored: the gap below the selected region
    strips, images, truths = [], [], []
    for n, page in enumerate(pages, 1):
        with Image.open(page["Image"]) as image:
            rgb = np.asarray(image.convert("RGB"))[TRAIN_ROWS:]
        strips.append(work / f"page-{n}-unselected.png")  # what the classifier gets: no training row
        Image.fromarray(rgb).save(strips[-1])
        images.append(rgb[skip:])
        masks = []
        for _, name in LAYERS:
            with Image.open(page[name]) as layer:  # in the layer where opaque, as the sample zip has it
                masks.append(np.asarray(layer.convert("RGBA"))[EVAL_TOP:, :, 3] == 255)
        truths.append(np.stack(masks))
    truth = np.concatenate(truths, axis=1)  # layer, row (page 1's held-out rows, then page 2's), column
    rows = [("the pages' own layers", *(f"{float(layer.mean()):.1%}" for layer in truth), "")]
    labels: dict[str, Any] = {}
    verdicts: list[str] = []
    for consumer, version in CONSUMERS:
        per_page = []
        try:
            for n, strip in enumerate(strips, 1):
                npy = out / f"labels-tf{version}-page-{n}.npy"
                info = classify(by_name(consumer), strip, models, WINDOW, npy)
                per_page.append(np.load(npy)[skip:])
        except Exception as exc:  # shown in the table: the demo's verdict
            rows.append((f"TensorFlow {version}", f"FAILED: {exc}"[:200], "", "", ""))
            verdicts.append(f"TensorFlow {version} could not classify")
            continue
        predicted = np.concatenate(per_page)
        labels[version] = predicted
        _label_image(out / f"labels-tf{version}.png", images, truths, per_page, f"TensorFlow {version}")
        cells = []
        for index, (name, _) in enumerate(LAYERS):
            share, f1 = float(np.mean(predicted == index)), _f1(predicted == index, truth[index])
            cells.append(f"{share:.1%}, F1 {f1:.2f}")
            if share == 0 or share == 1 or f1 < TARGET_F1[index]:
                verdicts.append(f"TensorFlow {version}: {name} F1 {f1:.2f}, {share:.1%} of the pixels")
        in_a_layer = truth.any(axis=0)
        own = np.take_along_axis(truth, predicted[None].astype(np.intp), axis=0)[0]
        where = f"TensorFlow {info['tensorflow']} (Python {info.get('python', '?')})"
        rows.append((where, *cells, f"{float(own[in_a_layer].mean()):.1%}"))
    print()
    height = truth.shape[1] // len(pages)
    print(
        f"Held-out rows {EVAL_TOP}-{EVAL_TOP + height - 1} of both pages ({len(pages)} x {height} x {truth.shape[2]} "
        "pixels, never trained on): each layer's share of the pixels, and the F1 of the layer in the labels; "
        "last, the pixels (of those in a layer) whose label is a layer they are in"
    )
    print()
    names = " | ".join(f"{name} ({model})" for (name, _), model in zip(LAYERS, MODELS, strict=True))
    print(f"| labels of | {names} | labelled with one of their layers |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    if len(labels) == len(CONSUMERS):
        same = float(np.mean(labels["2.5.1"] == labels["2.15.1"]))
        print(f"\nboth TensorFlow versions give the same label to {same:.1%} of the held-out pixels")
    targets = " / ".join(f"{name} {f1}" for (name, _), f1 in zip(LAYERS, TARGET_F1, strict=True))
    if verdicts:
        print(f"NOT a result: below the F1 the demo expects ({targets}) or never or always chosen:")
        print("\n".join(f"  {line}" for line in verdicts))
    else:
        print(f"every layer learned: F1 at least {targets} on rows the training never saw, in both versions")
    return not verdicts


def _f1(predicted: object, truth: object) -> float:
    """The F1 of ``predicted`` (boolean) against ``truth``: 2 TP / (2 TP + FP + FN); 1 when both are empty."""
    import numpy as np

    p, t = np.asarray(predicted, dtype=bool), np.asarray(truth, dtype=bool)
    tp, wrong = int(np.count_nonzero(p & t)), int(np.count_nonzero(p ^ t))
    return 2 * tp / (2 * tp + wrong) if tp or wrong else 1.0


def _label_image(path: Path, images: Sequence[Any], truths: Sequence[Any], labels: Sequence[Any], who: str) -> None:
    """The held-out rows of every page (side by side): the page as the classifier sees it, then with the
    neumes and the staff lines painted over it, the page's own layers and ``who``'s labels, each panel
    under a caption."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=20)
    caption, gutter = 30, 16
    panels = []
    for image, truth, label in zip(images, truths, labels, strict=True):
        column = []
        for title, layers in (
            ("the page", []),
            ("the page's own layers", [np.asarray(truth)[k] for k in range(1, len(LAYERS))]),
            (f"labels of Paco's classifier, {who}", [np.asarray(label) == k for k in range(1, len(LAYERS))]),
        ):
            painted = np.array(image, dtype=np.uint8)
            for mask, colour in reversed(list(zip(layers, PAINT, strict=False))):  # neumes over staff lines
                painted[mask] = colour
            bar = Image.new("RGB", (painted.shape[1], caption), "white")
            ImageDraw.Draw(bar).text((6, 4), title, fill="black", font=font)
            column += [np.asarray(bar), painted]
        panels.append(np.concatenate(column))
    white = np.full((panels[0].shape[0], gutter, 3), 255, dtype=np.uint8)
    body = np.concatenate([part for panel in panels for part in (panel, white)][:-1], axis=1)
    legend = Image.new("RGB", (body.shape[1], caption), "white")
    draw = ImageDraw.Draw(legend)
    x = 6
    for (name, _), colour in zip(LAYERS[1:], PAINT, strict=True):
        draw.rectangle((x, 6, x + 18, 24), fill=colour)
        draw.text((x + 24, 4), name, fill="black", font=font)
        x += 40 + int(draw.textlength(name, font=font))
    rows = f"rows {EVAL_TOP}-{EVAL_TOP + np.asarray(images[0]).shape[0] - 1}"
    draw.text((x, 4), f"{rows} of page 1 (left) and page 2 (right), never trained on", fill="black", font=font)
    Image.fromarray(np.concatenate([np.asarray(legend), body])).save(path)


def _page(uploads: Path, crop: tuple[int, int, int, int], seed: int) -> tuple[dict[str, str], dict[str, Path]]:
    """A page of the real masks cropped at ``crop`` with a synthesized image, as benchmarks/bench_paco.py
    makes them, whose selected region is the top :data:`TRAIN_ROWS` rows: its inputs, and their files."""
    import numpy as np
    from PIL import Image

    page = synthesize_page_from_masks(EINSIEDELN_DIR, uploads, crop, generation="new", seed=seed)
    files = {name: uploads / path.removeprefix("/uploads/") for name, path in page.items()}
    region = np.zeros((crop[3] - crop[1], crop[2] - crop[0], 4), dtype=np.uint8)
    region[:TRAIN_ROWS] = (120, 116, 114, 255)  # Pixel.js' selection colour; only the alpha counts
    Image.fromarray(region).save(files["Selected Regions"], format="PNG")
    return page, files


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

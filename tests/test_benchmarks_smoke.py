"""Every benchmark script that needs nothing beyond the project's set-up runs in its --quick mode and
prints its table (no timing targets here: those live in benchmarks/README.md). The scripts that need
the original trainer's TensorFlow 1.14 stack are checked in tests/test_benchmarks_stacks.py, and that
every script is one or the other, and has --quick, is checked below."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.bridge import REPO

# script -> the columns its (first) table must have
CASES = {
    "bench_pickup.py": ["mode", "requests", "p50 ms", "p95 ms", "p99 ms", "max ms"],
    "bench_intake.py": ["metric", "value"],
    "bench_download.py": ["server", "client", "best MB/s", "median MB/s", "worst MB/s"],
    "bench_reply.py": ["path", "median ms", "best ms", "peak RSS growth MB (median)"],
    "bench_idle.py": ["phase", "wall s", "CPU s (daemon)", "CPU %", "RSS MiB at end", "peak RSS MiB"],
    "bench_soak.py": ["metric", "value"],
    "bench_paco.py": ["side", "samples/s", "ms / step", "peak RSS MiB"],
    "bench_patch_share.py": ["layer", "page share", "ours: target share", "paco: target share"],
    "bench_sampling.py": ["method", "seconds", "Background", "Neumes", "StaffLines"],
    "bench_input.py": ["batch", "pipeline", "batches/s", "GB/s of float32 x+y"],
    "bench_step.py": ["patch", "case", "step ms", "first epoch s (incl. trace)", "peak RSS MiB"],
    "bench_throughput.py": ["patch", "policy", "samples/s", "step s", "first step s"],
    "bench_checkpoint.py": ["case", "step p50 s", "step p95 s", "step max s", "checkpoints", "wall s"],
    "bench_memory.py": ["approach", "peak RSS (GB)", "original (computed) / this"],
    "bench_precision.py": ["layer", "precision", "best val_accuracy", "s/epoch"],
    "bench_rodan_polling.py": ["version", "poll s", "runs", "polls", "busy %", "CPU s / poll"],
    "bench_gpu_path.py": [
        "patch",
        "batch",
        "precision",
        "train_page ms/step",
        "samples/s",
        "in-memory ms/step",
        "train_page / in-memory",
        "GPU util",
        "1st epoch s",
        "best val_accuracy",
    ],
}
#: Scripts whose real path runs the original trainer's TensorFlow 1.14 stack, which CI cannot build
#: (bench_step.py's --quick leaves that case out, so it is in CASES too).
ORIGINAL_STACK = {"bench_trainer.py"}
#: Modules the scripts import, not scripts themselves: they have no --quick.
HELPERS = {"benchlib.py", "tables.py", "timeline.py", "paco_side.py", "original_sampler.py"}
NEEDS_BROKER = {
    "bench_pickup.py",
    "bench_intake.py",
    "bench_reply.py",
    "bench_idle.py",
    "bench_soak.py",
    "bench_rodan_polling.py",
}
#: A real Rodan 3.1.0 of its own (deploy/dev/rodan.sh, twice: 0.4.0's job package and this tree's).
NEEDS_RODAN = {"bench_rodan_polling.py"}
NEEDS_SLURM = {"bench_pickup.py", "bench_intake.py", "bench_idle.py", "bench_soak.py"}
#: Real TensorFlow (a model fitted, or TensorFlow imported in a fresh process), ours in .venv and for
#: bench_paco.py Paco_classifier's in the TF 2.15.1 consumer environment. Each quick run is 20-45 s on
#: 2 busy cores; bench_paco.py's about a minute on 2 quiet cores, several minutes when other tests share them.
TRAINS = {
    "bench_paco.py",
    "bench_input.py",
    "bench_step.py",
    "bench_throughput.py",
    "bench_checkpoint.py",
    "bench_memory.py",
    "bench_precision.py",
    "bench_gpu_path.py",
}
#: Environments the quick runs need: bench_gpu_path.py is the script a GPU machine without
#: TensorFlow runs, so CI runs it on JAX (its CPU wheels), as it will run there.
ENVIRONMENTS = {"bench_gpu_path.py": {"KERAS_BACKEND": "jax"}}
SLOW = {"bench_paco.py"}
#: bench_soak.py runs a daemon and real Slurm jobs: on a loaded 2-core CI machine its 150 requests
#: took over 120 s once (19 s alone).
TIMEOUT_S = {
    "bench_paco.py": 900,
    "bench_soak.py": 600,
    "bench_rodan_polling.py": 1200,
    **{script: 300 for script in TRAINS - {"bench_paco.py"}},
}


def _marks(script: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.broker] if script in NEEDS_BROKER else []
    marks += [pytest.mark.slurm] if script in NEEDS_SLURM else []
    marks += [pytest.mark.training] if script in TRAINS else []
    marks += [pytest.mark.slow] if script in SLOW else []
    marks += [pytest.mark.rodan, pytest.mark.slow] if script in NEEDS_RODAN else []
    return marks + ([pytest.mark.heavy] if script in {"bench_paco.py", *NEEDS_RODAN} else [])


def _first_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|-"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if len(cells) != len(header):
                break  # the next table
            rows.append(cells)
    return header, rows


@pytest.mark.parametrize("script", [pytest.param(s, marks=_marks(s)) for s in sorted(CASES)])
def test_quick_run_prints_its_table(script: str, request: pytest.FixtureRequest) -> None:
    env = {**os.environ, **ENVIRONMENTS.get(script, {})}
    if script in NEEDS_BROKER:
        env["RABBITMQ_URL"] = request.getfixturevalue("broker_url")
    if script in NEEDS_SLURM:
        request.getfixturevalue("slurm")
    if script in NEEDS_RODAN:
        # A Redis db of its own: at the same time run the heavy phase's Rodan with the job
        # (HPC_TEST_RODAN_REDIS_DB, 12 by default) and, beside that phase, the dev Rodan of
        # tests/test_rodan_real.py (rodan.sh's default, 13).
        env["HPC_TEST_RODAN_REDIS_DB"] = str(int(os.environ.get("HPC_TEST_RODAN_REDIS_DB", "12")) + 2)
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S.get(script, 120),
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    header, rows = _first_table(result.stdout)
    for column in CASES[script]:
        assert column in header, (column, header)
    assert rows
    for row in rows:
        for column in CASES[script]:
            value = row[header.index(column)]
            try:
                number = float(value.split()[0].split("/")[0])
            except ValueError:
                continue  # a label
            assert number >= 0, (column, value)
    numbers = [
        float(row[header.index(c)].split()[0])
        for row in rows
        for c in CASES[script][1:]
        if row[header.index(c)].replace(".", "", 1).isdigit()
    ]
    assert numbers and max(numbers) > 0, rows


def test_every_script_has_quick_and_a_check() -> None:
    """A new script gets --quick and a row in CASES (or ORIGINAL_STACK), and benchmarks/README.md says how
    to run it; a helper module is named in HELPERS."""
    scripts = {path.name for path in (REPO / "benchmarks").glob("*.py")}
    assert scripts - HELPERS == set(CASES) | ORIGINAL_STACK, "a benchmark script is neither run nor checked here"
    assert not (set(CASES) | ORIGINAL_STACK) & HELPERS
    readme = (REPO / "benchmarks" / "README.md").read_text()
    for script in sorted(scripts - HELPERS):
        source = (REPO / "benchmarks" / script).read_text()
        assert re.search(r"add_argument\(\s*\"--quick\"", source), f"{script} has no --quick"
        assert f"benchmarks/{script} --quick" in readme, (
            f"benchmarks/README.md does not say how to run {script} --quick"
        )

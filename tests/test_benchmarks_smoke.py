"""Every benchmark script runs in its --quick mode and prints its table (no timing targets here:
those live in benchmarks/README.md)."""

from __future__ import annotations

import os
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
    "bench_paco.py": ["side", "samples/s", "ms / step", "peak RSS MiB"],
    "bench_patch_share.py": ["layer", "page share", "ours: target share", "paco: target share"],
}
NEEDS_SLURM = {"bench_pickup.py", "bench_intake.py", "bench_idle.py"}
#: Real TensorFlow trainings (ours in .venv, Paco_classifier's in the TF 2.15.1 consumer environment):
#: about a minute on 2 quiet cores, several minutes when other tests share them.
TRAINS = {"bench_paco.py"}
TIMEOUT_S = {"bench_paco.py": 900}


def _marks(script: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.slurm] if script in NEEDS_SLURM else []
    marks += [pytest.mark.training, pytest.mark.slow] if script in TRAINS else []
    return marks + ([pytest.mark.heavy] if script == "bench_paco.py" else [])


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


@pytest.mark.broker
@pytest.mark.parametrize("script", [pytest.param(s, marks=_marks(s)) for s in sorted(CASES)])
def test_quick_run_prints_its_table(script: str, broker_url: str, request: pytest.FixtureRequest) -> None:
    if script in NEEDS_SLURM:
        request.getfixturevalue("slurm")
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S.get(script, 120),
        env={**os.environ, "RABBITMQ_URL": broker_url},
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

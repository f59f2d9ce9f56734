"""Fault suite, secrets (item 6 of docs/reliability.md): after the whole suite, no test secret in what it left.

Marked ``last``, so ``deploy/dev/test.sh`` runs it alone after every other test, when the
other test files' leftovers are all there. It scans every file under the pytest base temporary
directories of this run: ``HPC_TEST_SCAN_DIRS`` (deploy/dev/test.sh gives every phase its base
temp under one directory and names it there), else every ``/tmp/pytest-of-$USER/pytest-N`` left
(pytest keeps the newest three besides the current one): bridge logs, batch scripts (``job.sh``), scheduler output
(``job-*.out``), job logs and run directories (``job.log``, ``settings.json``...), parameter
files left behind, ledgers, outboxes, the crash suite's ``argv.log`` files. A parameter file
whose ledger record says the request is still open (a test that ended before its job did) holds
the token by design: it is only checked to be 0600. One of a finished request must not exist. Zero hits allowed
for: the stand-in's Rodan password (conftest), the Rodan tokens the stand-in hands out
(``token_for_email`` of every user the tests create), and the other passwords the tests use.

Process argument lists: every scheduler command line the bridge ran in tests/test_fault_crash.py
went through a recording wrapper into ``argv.log`` (scanned here, and required to be present when
that test ran); tests/test_e2e.py checks ``ps`` snapshots taken during its passes. Files whose job
is to hold a secret are not "leftovers" and are skipped by name: credentials files
(``credentials.env`` and ``*.env``), where a test wrote the secret on purpose.
"""

from __future__ import annotations

import getpass
import json
import os
import stat
from pathlib import Path

import pytest

from bridge.testing.rodan import token_for_email
from tests.support.bridge import RODAN_EMAIL, RODAN_PASSWORD

# It scans what the tests of the real services left (and requires their files): without them
# there is nothing to scan, so it is no part of a service-free run.
pytestmark = [
    pytest.mark.last,
    pytest.mark.broker,
    pytest.mark.slurm,
    pytest.mark.gridengine,
    pytest.mark.training,
]

MAX_BYTES = 32 * 1024 * 1024
TEST_EMAILS = [RODAN_EMAIL, "ana@example.org", "off@example.org", "a@b.c"]  # users the tests create
PASSWORDS = [
    RODAN_PASSWORD,
    "Rodan-Pw-5d8e1c7a40",  # tests/test_deploy_files.py
    "Broker-Pw-93b1f4e2c6",  # tests/test_deploy_files.py
    "not-the-password-77",  # tests/test_doctor.py
    "wrong-password",  # tests/test_e2e.py, tests/test_deadletter.py
    "pw-for-tests",  # tests/test_rodan_client.py
]
HOLDS_SECRETS_ON_PURPOSE = ("credentials.env", ".env")
OPEN_STATES = ("received", "submitting", "submitted")


def open_request_params(path: Path) -> bool:
    """``SPOOL/params/KEY.json`` of a request still open (its job needs the token): by design."""
    if path.parent.name != "params" or path.suffix != ".json":
        return False
    record = path.parent.parent / "ledger" / path.name
    try:
        return json.loads(record.read_text()).get("state") in OPEN_STATES
    except (OSError, ValueError):
        return False


def secrets() -> dict[str, bytes]:
    found = {f"token of {email}": token_for_email(email).encode() for email in TEST_EMAILS}
    found.update({f"password #{i}": pw.encode() for i, pw in enumerate(PASSWORDS)})
    return found


def base_temps() -> list[Path]:
    given = os.environ.get("HPC_TEST_SCAN_DIRS")  # deploy/dev/test.sh: this run's base temps, and only those
    if given:
        return [Path(d) for d in given.split(os.pathsep) if d]
    root = Path(f"/tmp/pytest-of-{getpass.getuser()}")
    runs = [p for p in root.glob("pytest-*") if p.is_dir() and not p.is_symlink() and p.name[7:].isdigit()]
    return sorted(runs, key=lambda p: int(p.name[7:]))  # pytest keeps only the newest few


def test_no_secret_in_anything_the_suite_left() -> None:
    needles = secrets()
    scanned: list[Path] = []
    hits: list[str] = []
    open_params: list[Path] = []
    for base in base_temps():
        for dirpath, _dirnames, filenames in os.walk(base, followlinks=False):
            for name in filenames:
                path = Path(dirpath, name)
                if name.endswith(HOLDS_SECRETS_ON_PURPOSE) or path.is_symlink() or not path.is_file():
                    continue
                try:
                    if path.stat().st_size > MAX_BYTES:
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue  # vanished (a test beside this one cleaning up) or unreadable
                scanned.append(path)
                if open_request_params(path):
                    # A test that ended before its request did (a job cancelled in teardown): the file
                    # is where the token belongs until the worker reads it, and it must be private.
                    open_params.append(path)
                    if stat.S_IMODE(path.stat().st_mode) != 0o600:
                        hits.append(f"parameter file not 0600: {path}")
                    continue
                hits += [f"{what} in {path}" for what, secret in needles.items() if secret in data]
    names = [p.name for p in scanned]
    kinds = {
        "job.log": names.count("job.log"),
        "job.sh": names.count("job.sh"),
        "scheduler output": sum(n.startswith("job-") and n.endswith(".out") for n in names),
        "bridge logs": sum(n.endswith(".log") for n in names),
        "argv.log": names.count("argv.log"),
        "parameter files of open requests (not scanned)": len(open_params),
    }
    print(f"\nsecrets scan: {len(scanned)} files in {[str(b) for b in base_temps()]}: {kinds}, {len(hits)} hits")
    assert not hits, "\n".join(hits[:50])
    assert len(scanned) > 100, f"only {len(scanned)} files scanned: did the suite run before this test?"
    assert kinds["job.sh"] > 0 and kinds["scheduler output"] > 0 and kinds["bridge logs"] > 0, kinds
    assert kinds["job.log"] > 0, f"no training run directory scanned (run after the suite): {kinds}"
    if any(part.startswith("test_crash_anywhere") for path in scanned for part in path.parts):
        assert kinds["argv.log"] > 0, "the crash suite ran, but left no record of its scheduler command lines"

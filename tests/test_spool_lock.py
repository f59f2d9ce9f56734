"""The spool lock on a filesystem that keeps no locks: a configuration error naming the mount.

Nothing here can make a real filesystem refuse a lock (no NFS without lockd, no Lustre), so
``flock`` is made to fail as such a filesystem makes it fail: in this process by monkeypatching,
and in ``hpc-bridge`` processes by a ``sitecustomize`` module on their PYTHONPATH.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from bridge import spool as spool_module
from bridge.errors import ConfigError
from bridge.ops.doctor import check_spool_lock
from bridge.spool import LOCK_FIX, Spool, mount_of
from tests.support.bridge import bridge_environ, run_bridge
from tests.support.broker import Queues

NO_LOCK_ERRORS = [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP]

#: Makes every flock() of the process fail as on NFS without lockd.
SITECUSTOMIZE = """
import errno, fcntl, os

def flock(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

fcntl.flock = flock
"""


def refusing_flock(number: int) -> Callable[[int, int], None]:
    def flock(fd: int, operation: int) -> None:
        raise OSError(number, os.strerror(number))

    return flock


def findmnt(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) as util-linux sees them."""
    out = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET,FSTYPE", "--target", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], out[1]


def test_mount_of_agrees_with_findmnt(tmp_path: Path) -> None:
    if shutil.which("findmnt") is None:
        pytest.fail("findmnt (util-linux) is missing")
    assert mount_of(tmp_path) == findmnt(tmp_path)
    assert mount_of(tmp_path / "not" / "yet") == findmnt(tmp_path)  # a spool not made yet


@pytest.mark.parametrize("number", NO_LOCK_ERRORS, ids=[errno.errorcode[n] for n in NO_LOCK_ERRORS])
def test_a_filesystem_without_locks_is_a_configuration_error_naming_the_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, number: int
) -> None:
    spool = Spool(tmp_path / "spool")
    monkeypatch.setattr(spool_module.fcntl, "flock", refusing_flock(number))
    with pytest.raises(ConfigError) as caught, spool.lock():
        pytest.fail("the lock was taken")
    point, fstype = findmnt(tmp_path)
    message = str(caught.value)
    assert f"the spool {spool.root} is on {fstype} mounted at {point}" in message
    assert f"does not support file locks ({os.strerror(number)})" in message
    assert LOCK_FIX in message and "HPC_SPOOL_DIR" in message


def test_the_lock_still_works_and_other_errors_stay_what_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path / "spool")
    with spool.lock() as first, spool.lock() as second:
        assert (first, second) == (True, False)
    monkeypatch.setattr(spool_module.fcntl, "flock", refusing_flock(errno.EIO))
    with pytest.raises(OSError) as caught, spool.lock():
        pytest.fail("the lock was taken")
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, ConfigError)


def test_doctor_probes_locking_where_the_spool_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tmp_path / "spool"  # not made yet: the probe runs in the folder it will be made in
    found = check_spool_lock(spool)
    assert (found.status, found.name) == ("ok", "spool-lock"), found
    assert str(tmp_path) in found.found
    monkeypatch.setattr(fcntl, "flock", refusing_flock(errno.ENOLCK))
    found = check_spool_lock(spool)
    point, fstype = findmnt(tmp_path)
    assert found.status == "FAIL", found
    assert f"is on {fstype} at {point}, which does not support file locks" in found.found
    assert found.fix == LOCK_FIX
    assert not list(tmp_path.iterdir()), "the probe file was left behind"


@pytest.fixture
def no_locks(tmp_path: Path) -> dict[str, str]:
    """The environment that makes an ``hpc-bridge`` process's flock() fail with ENOLCK."""
    folder = tmp_path / "nolocks"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": str(folder)}


@pytest.mark.broker
@pytest.mark.parametrize("command", ["check", "run"])
def test_check_and_run_exit_2_with_the_mount_on_a_spool_without_locks(
    tmp_path: Path, broker_url: str, standin, queues: Queues, no_locks: dict[str, str], command: str
) -> None:
    spool = tmp_path / "spool"
    env = bridge_environ(broker_url, standin, queues, spool, HPC_LOG_FILE=str(tmp_path / "bridge.log"))
    result = run_bridge({**env, **no_locks}, command, timeout=60)
    point, fstype = findmnt(tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.startswith(
        f"hpc-bridge: configuration error: the spool {spool} is on {fstype} mounted at {point}, "
        "which does not support file locks (No locks available): put the spool on a filesystem with POSIX locks"
    ), result.stderr
    # The same bridge with working locks: one pass, exit 0.
    if command == "check":
        assert run_bridge(env, command, timeout=120).returncode == 0


@pytest.mark.broker
@pytest.mark.slurm
def test_doctor_fails_the_lock_check_with_the_fix(
    tmp_path: Path, broker_url: str, standin, queues: Queues, no_locks: dict[str, str], slurm: None
) -> None:
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool")
    credentials = tmp_path / "credentials.env"
    credentials.write_text("".join(f"{k}='{v}'\n" for k, v in env.items()))
    credentials.chmod(0o600)
    args = ("--credentials", str(credentials), "doctor", "--json", "--skip-worker")
    result = run_bridge(no_locks, *args, timeout=240)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert result.returncode == 1
    assert checks["spool-lock"]["status"] == "FAIL" and checks["spool-lock"]["fix"] == LOCK_FIX
    assert "does not support file locks (No locks available)" in checks["spool-lock"]["found"]
    healthy = run_bridge({}, *args, timeout=240)
    assert {c["name"]: c for c in json.loads(healthy.stdout)["checks"]}["spool-lock"]["status"] == "ok"

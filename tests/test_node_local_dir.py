"""The node-local checkpoint folder: private to the job, whatever another user of the node made first.

The folder's name (``hpc-checkpoints-<key>`` under ``$SLURM_TMPDIR``, ``$TMPDIR`` or
``HPC_NODE_LOCAL_DIR``) can be guessed, and the base is shared by every user of the node. Each
test plays the other user by making that path first (a directory open to all, another user's
directory, a symbolic link, a file), then trains through the real checkpoint store
(:func:`worker.trainer.sync.open_checkpoints`) and checks what was read and written where. The
folder for "another user's" directory is given away with ``chown``, so that case needs root.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("numpy")  # the worker extra is not installed on login nodes

from structlog.testing import capture_logs

from tests.checkpoint_writer import state_for
from worker.trainer.checkpoint import CheckpointStore, TrainingState, checkpoint_name
from worker.trainer.sync import open_checkpoints

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")


def small_state(k: int) -> TrainingState:
    return state_for(k, 0.01)


def shared_base(tmp_path: Path) -> Path:
    """A base like /tmp: everyone may create in it, the sticky bit keeps each one's entries theirs."""
    base = tmp_path / "node-tmp"
    base.mkdir()
    base.chmod(0o1777)
    return base


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_folder_is_made_private_and_kept_for_the_next_job_on_the_node(tmp_path: Path) -> None:
    persistent, local = tmp_path / "persistent", shared_base(tmp_path) / "hpc-checkpoints-k"
    previous = os.umask(0o002)  # a group-friendly umask, as many clusters set
    try:
        with open_checkpoints(persistent, local, sync_interval_s=3600) as store:
            assert store.directory == local
            assert mode(local) == 0o700 and os.lstat(local).st_uid == os.geteuid()
            store.save(small_state(1))
        # A requeued job on the same node finds its own private folder and resumes from it.
        CheckpointStore(local).save(small_state(2))
        with open_checkpoints(persistent, local, sync_interval_s=3600) as store:
            assert store.directory == local
            assert store.load_latest().seed == 2  # type: ignore[union-attr]
    finally:
        os.umask(previous)


def _open_to_all(path: Path) -> None:
    path.mkdir()
    path.chmod(0o777)


def _another_users(path: Path) -> None:
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)


def _symlink(path: Path) -> None:
    path.symlink_to(path.parent.parent / "victim")


def _dangling_symlink(path: Path) -> None:
    path.symlink_to(path.parent / "not-yet")


def _file(path: Path) -> None:
    path.write_bytes(b"not a directory")


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (_open_to_all, "open to other users (mode 0777)"),
        pytest.param(_another_users, f"owned by uid {NOBODY}", marks=ROOT_ONLY),
        (_symlink, "a symbolic link"),
        (_dangling_symlink, "a symbolic link"),
        (_file, "not a directory"),
    ],
    ids=["open to all", "another user's", "symlink", "dangling symlink", "a file"],
)
def test_a_folder_someone_made_first_is_left_alone_for_a_fresh_private_one(
    tmp_path: Path, plant: Callable[[Path], None], problem: str
) -> None:
    persistent, base = tmp_path / "persistent", shared_base(tmp_path)
    victim = tmp_path / "victim"  # where a symbolic link points: the other user reads it, or swaps it
    victim.mkdir(mode=0o700)
    planted = base / "hpc-checkpoints-k"
    plant(planted)
    forged = planted.is_dir() and not planted.is_symlink()
    if forged:  # a checkpoint the other user planted, newer than anything the job has
        os.chmod(planted, 0o777)
        CheckpointStore(planted).save(small_state(666))
        os.chmod(planted, 0o700 if problem.startswith("owned") else 0o777)
    planted_before = sorted(p.name for p in planted.iterdir()) if forged else []
    with capture_logs() as logs, open_checkpoints(persistent, planted, sync_interval_s=3600) as store:
        used = store.directory
        assert used != planted and used.parent == base and used.name.startswith("hpc-checkpoints-k-")
        assert mode(used) == 0o700 and os.lstat(used).st_uid == os.geteuid() and stat.S_ISDIR(os.lstat(used).st_mode)
        assert store.load_latest() is None  # the planted checkpoint is not read
        store.save(small_state(1))
        store.flush()
        assert CheckpointStore(persistent).load_latest().seed == 1  # type: ignore[union-attr]
    assert not used.exists()  # the fresh folder goes with the block
    assert not list(victim.iterdir())  # nothing written through the link
    if forged:
        assert sorted(p.name for p in planted.iterdir()) == planted_before == [checkpoint_name(1)]
    assert os.path.lexists(planted)  # left alone, not removed
    unsafe = [e for e in logs if e["event"] == "node_local_dir_unsafe"]
    assert len(unsafe) == 1 and unsafe[0]["log_level"] == "warning"
    assert unsafe[0]["path"] == str(planted) and unsafe[0]["problem"] == problem and unsafe[0]["using"] == str(used)


def test_the_fresh_folder_cannot_be_guessed(tmp_path: Path) -> None:
    from worker.trainer.sync import claim_node_local_dir

    planted = shared_base(tmp_path) / "hpc-checkpoints-k"
    _open_to_all(planted)
    first, second = claim_node_local_dir(planted), claim_node_local_dir(planted)
    assert first is not None and second is not None and first != second
    assert {first.parent, second.parent} == {planted.parent} and mode(first) == mode(second) == 0o700
    assert mode(planted) == 0o777  # left alone


def test_without_any_private_folder_checkpoints_go_to_the_run_directory(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "scratch"
    not_a_dir.write_bytes(b"")  # HPC_NODE_LOCAL_DIR pointing at a file: nothing can be made under it
    with capture_logs() as logs, open_checkpoints(tmp_path / "persistent", not_a_dir / "x", 3600) as store:
        assert store.directory == tmp_path / "persistent"
        store.save(small_state(1))
    assert (tmp_path / "persistent" / checkpoint_name(1)).exists()
    unusable = [e for e in logs if e["event"] == "node_local_dir_unusable"]
    assert len(unusable) == 1 and unusable[0]["path"] == str(not_a_dir / "x")


def test_the_worker_uses_the_claimed_folder_not_the_planted_one(tmp_path, monkeypatch):
    """worker.job.node_local_checkpoints hands the trainer (and its clean-up) the folder actually
    claimed: a planted, world-writable one under $TMPDIR is neither used nor emptied."""
    import stat

    import structlog

    from worker.job import node_local_checkpoints

    planted = tmp_path / "hpc-checkpoints-K"
    planted.mkdir()
    planted.chmod(0o777)
    (planted / "someone-elses").write_text("x")
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        chosen = node_local_checkpoints(None, "K")
    assert chosen is not None and chosen != planted and chosen.parent == tmp_path
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o700
    assert (planted / "someone-elses").exists()
    assert [e["event"] for e in logs] == ["node_local_dir_unsafe"]

"""bridge.atomic: the one way files are replaced (content, modes, fsyncs, what a failure leaves)."""

from __future__ import annotations

import ast
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge import atomic, spool
from bridge.atomic import TEMP_SUFFIX, atomic_file, atomic_write, atomic_write_json, fsync_dir


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def temporaries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f".*{TEMP_SUFFIX}"))


def test_the_block_replaces_the_file_with_what_it_wrote(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    with atomic_file(target) as handle:
        handle.write(b"new ")
        handle.write(b"content")
        assert target.read_bytes() == b"old", "the target changes only when the block ends"
    assert target.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir()] == ["data.bin"]


def test_the_temporary_file_is_a_hidden_file_beside_the_target_named_by_the_handle(tmp_path: Path) -> None:
    target = tmp_path / "model.hdf5"
    with atomic_file(target, mode=None) as handle:
        temporary = Path(handle.name)
        assert temporaries(tmp_path) == [temporary]
        assert temporary.parent == tmp_path and temporary.name.startswith(".model.hdf5.")
        # A writer that needs a file name (h5py) writes through its own descriptor.
        with open(temporary, "r+b") as other:
            other.write(b"by name")
    assert target.read_bytes() == b"by name"
    assert temporaries(tmp_path) == []


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o644, 0o700])
def test_the_file_gets_the_mode_asked_for_whatever_the_umask(tmp_path: Path, mode: int) -> None:
    old = os.umask(0o077)  # stricter than every mode asked for here: the mode must still be exact
    try:
        atomic_write(tmp_path / "f", b"x", mode=mode)
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "f") == mode


@pytest.mark.usefixtures("umask_022")
def test_mode_none_gives_the_umasks_mode_like_open(tmp_path: Path) -> None:
    atomic_write(tmp_path / "f", b"x", mode=None)
    (tmp_path / "plain").write_bytes(b"x")
    assert mode_of(tmp_path / "f") == mode_of(tmp_path / "plain") == 0o644


@pytest.mark.usefixtures("umask_022")
def test_the_default_mode_is_private(tmp_path: Path) -> None:
    with atomic_file(tmp_path / "f") as handle:
        assert stat.S_IMODE(os.fstat(handle.fileno()).st_mode) == 0o600, "private while written too"
    assert mode_of(tmp_path / "f") == 0o600


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_midway_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path, error: type) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b'{"old": true}', mode=0o640)
    with pytest.raises(error), atomic_file(target, mode=0o600) as handle:
        handle.write(b'{"new": tr')
        handle.flush()
        assert len(temporaries(tmp_path)) == 1
        raise error("cut short")
    assert target.read_bytes() == b'{"old": true}'
    assert mode_of(target) == 0o640
    assert temporaries(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_an_exception_leaves_no_file_where_there_was_none(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "new") as handle:
        handle.write(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_rename_removes_the_temporary_and_raises(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)  # os.replace cannot put a file over a non-empty directory
    with pytest.raises(OSError), atomic_file(target) as handle:
        handle.write(b"data")
    assert target.is_dir() and temporaries(tmp_path) == []


def test_a_missing_directory_raises_without_making_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), atomic_file(tmp_path / "absent" / "f") as handle:
        handle.write(b"never")
    assert not (tmp_path / "absent").exists()


def fsync_kinds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what every os.fsync call syncs: "file" or "directory"."""
    kinds: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        kinds.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return kinds


def test_the_file_and_then_its_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = fsync_kinds(monkeypatch)
    with atomic_file(tmp_path / "f") as handle:
        handle.write(b"x")
        assert kinds == []
    assert kinds == ["file", "directory"]


def test_durable_false_replaces_atomically_without_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = fsync_kinds(monkeypatch)
    (tmp_path / "f").write_bytes(b"old")
    with atomic_file(tmp_path / "f", durable=False) as handle:
        handle.write(b"new")
    assert kinds == []
    assert (tmp_path / "f").read_bytes() == b"new" and temporaries(tmp_path) == []


def test_no_fsync_of_the_directory_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = fsync_kinds(monkeypatch)
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "f"):
        raise RuntimeError("no")
    assert kinds == []


def test_fsync_dir_syncs_a_directory_and_refuses_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = fsync_kinds(monkeypatch)
    fsync_dir(tmp_path)
    assert kinds == ["directory"]
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "f")


def test_atomic_write_makes_missing_directories_the_files_own_private(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "f"
    atomic_write(target, memoryview(b"bytes"))
    assert target.read_bytes() == b"bytes"
    assert mode_of(tmp_path / "a" / "b") == 0o700


def test_atomic_write_json_writes_sorted_indented_utf8(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    atomic_write_json(target, {"b": 1, "a": ["ü"]})
    assert target.read_bytes() == json.dumps({"a": ["ü"], "b": 1}, indent=1, sort_keys=True).encode()
    assert json.loads(target.read_text("utf-8")) == {"a": ["ü"], "b": 1}
    assert mode_of(target) == 0o600


def test_the_spool_re_exports_the_same_functions() -> None:
    assert spool.atomic_write is atomic_write
    assert spool.atomic_write_json is atomic_write_json
    assert spool.fsync_dir is fsync_dir


def test_the_module_imports_only_the_standard_library() -> None:
    """worker.trainer imports bridge.atomic and nothing else of the project: it must stay stdlib-only."""
    tree = ast.parse(Path(atomic.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add((node.module or "").split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported

"""What keeps the daemon's memory flat over months (benchmarks/README.md, "Months of running"):
passes over the ledger read one record at a time, the counts take one pass, and the daemon pins
glibc's mmap threshold. The soak itself (20,000 requests through the real daemon) is
benchmarks/bench_soak.py; these are the rules under it."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.ledger import Ledger, RequestRecord, RequestState
from bridge.ops.heartbeat import QueueCounts, build_status
from bridge.ops.metrics import count, render
from bridge.runner import pin_mmap_threshold
from bridge.spool import Spool


def _ledger(tmp_path: Path, n: int) -> Ledger:
    ledger = Ledger(Spool(tmp_path / "spool").ensure())
    for i in range(n):
        state = RequestState.REPLIED if i % 2 else RequestState.SUBMITTED
        ledger.save(RequestRecord(f"c{i:03d}", f"k{i:03d}", "hpc-results", state=state, outcome="ok"))
    return ledger


def test_a_pass_over_the_ledger_reads_one_record_at_a_time(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, 5)
    records = ledger.all()
    assert isinstance(records, Iterator)
    first = next(records)
    assert first.correlation_id == "c000"
    # Records are read as the pass gets to them: one deleted meanwhile (a prune) is skipped, not an error.
    (ledger.spool.ledger_dir / "k003.json").unlink()
    assert [r.correlation_id for r in records] == ["c001", "c002", "c004"]
    (ledger.spool.ledger_dir / ".k9.json.tmp").write_text("{}")  # an atomic write under way
    assert ledger.names() == ["k000.json", "k001.json", "k002.json", "k004.json"]
    assert Ledger(Spool(tmp_path / "none")).names() == []


class _Once:
    """An iterable that may be gone through once, as a pass over the ledger."""

    def __init__(self, records: list[RequestRecord]) -> None:
        self.records, self.used = records, False

    def __iter__(self) -> Iterator[RequestRecord]:
        assert not self.used, "went through the ledger twice"
        self.used = True
        return iter(self.records)


def test_the_counts_the_metrics_and_the_status_take_one_pass(tmp_path: Path) -> None:
    records = list(_ledger(tmp_path, 6).all())
    counters = count(_Once(records))
    assert (counters.received, counters.replied_ok, counters.submitted) == (6, 3, 0)
    text = render(_Once(records), outbox=0, now=1.0)
    assert 'hpc_bridge_ledger_requests{state="replied-ok"} 3' in text
    status = build_status(
        _Once(records),
        mode="check",
        scheduler="slurm",
        request_queue="hpc-jobs",
        interval_s=None,
        started_at=0.0,
        last_pass_at=0.0,
        last_pass_ok=True,
        passes=1,
        held=0,
        outbox=0,
        queues=QueueCounts(0, 1, 0),
        broker_connected=True,
        now=1.0,
    )
    assert status["totals"]["received"] == 6 and status["requests_in_flight"] == 3


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_daemon_pins_glibcs_mmap_threshold_unless_the_operator_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ctypes.CDLL(None).mallopt  # glibc has it
    assert pin_mmap_threshold() is True
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert pin_mmap_threshold() is False

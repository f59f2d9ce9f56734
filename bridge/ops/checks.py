"""The lines ``hpc-bridge doctor`` prints: one :class:`Check` each, made by :func:`ok`, :func:`fail`,
:func:`warn` or :func:`skip`.

``doctor`` (bridge/ops/doctor.py) and its probe job (bridge/ops/probe.py) both make them; this module
is below both, so neither imports the other for them (the ``ops-doctor-layers`` import contract).
A node's finding (bridge.handoff.ProbeFinding) becomes a line with :func:`from_finding`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.handoff import CHECK_STATUSES, ProbeFinding

OK, FAIL, WARN, SKIP = CHECK_STATUSES


@dataclass
class Check:
    name: str
    status: str  # one of CHECK_STATUSES: "ok", "FAIL", "warn" or "skip"
    found: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.found}" + (f": {self.fix}" if self.fix else "")


def ok(name: str, found: str) -> Check:
    return Check(name, OK, found)


def fail(name: str, found: str, fix: str) -> Check:
    return Check(name, FAIL, found, fix)


def warn(name: str, found: str, fix: str = "") -> Check:
    return Check(name, WARN, found, fix)


def skip(name: str, why: str) -> Check:
    return Check(name, SKIP, f"skipped: {why}")


def from_finding(name: str, finding: ProbeFinding) -> Check:
    """The line of a check the probe job ran on a node."""
    return Check(name, finding.status, finding.found, finding.fix)

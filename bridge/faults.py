"""Crash injection for the fault tests (tests/test_fault_crash.py). Inert unless asked for.

``fault_point(name)`` marks a place where a crash must be harmless (between two durable
steps). It does nothing at all unless the environment variable ``HPC_FAULT_KILL`` is set;
it is for tests only, never set it in a deployment (it is deliberately not in
credentials.env.example):

* ``HPC_FAULT_KILL=after_submit:3`` SIGKILLs this process the 3rd time ``after_submit`` is
  reached (``NAME`` alone means the 1st time). Several comma-separated entries may be given.
* ``HPC_FAULT_KILL=random:0.05`` SIGKILLs at every point with probability 0.05, drawn from a
  generator seeded by ``HPC_FAULT_SEED`` (an integer; unset: not reproducible).
* ``HPC_FAULT_LOG=PATH``: before killing, append ``NAME`` as one line to PATH, so the test
  knows which point the process died at.

Points (where the one-line calls are): ``after_get`` (runner, a request taken from the queue,
nothing done yet), ``before_submit`` / ``after_submit`` / ``after_record`` (intake: ledger
SUBMITTING written / the scheduler accepted the job / ledger SUBMITTED written), ``before_ack``
(runner), ``before_publish`` / ``after_publish`` / ``after_marker`` (replies: a staged reply about
to be published / confirmed by the broker / its replied marker written).

A name that is not one of these points is an error, never a point that silently does nothing:
``fault_point`` raises :class:`ValueError` for it (at every call, whether or not ``HPC_FAULT_KILL``
is set), and so does an ``HPC_FAULT_KILL`` entry that names it.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from dataclasses import dataclass, field

ENV_KILL = "HPC_FAULT_KILL"
ENV_SEED = "HPC_FAULT_SEED"
ENV_LOG = "HPC_FAULT_LOG"

POINTS = (
    "after_get",
    "before_submit",
    "after_submit",
    "after_record",
    "before_ack",
    "before_publish",
    "after_publish",
    "after_marker",
)
_DECLARED = frozenset(POINTS)


def _check_name(name: str, where: str) -> None:
    if name not in _DECLARED:
        raise ValueError(f"{where}: {name!r} is not a fault point (declared: {', '.join(POINTS)})")


@dataclass
class FaultPlan:
    """What ``HPC_FAULT_KILL`` asked for, and how often each point was reached so far."""

    at: dict[str, int] = field(default_factory=dict)  # point -> kill on its N-th visit
    probability: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    seen: Counter[str] = field(default_factory=Counter)

    @classmethod
    def parse(cls, spec: str, seed: str | None = None) -> FaultPlan:
        plan = cls(rng=random.Random(int(seed)) if seed else random.Random())
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            name, _, count = entry.partition(":")
            if name == "random":
                plan.probability = float(count)
                if not 0.0 <= plan.probability <= 1.0:
                    raise ValueError(f"{ENV_KILL}: probability {count!r} is not within 0..1")
            else:
                _check_name(name, ENV_KILL)
                plan.at[name] = int(count) if count else 1
                if plan.at[name] < 1:
                    raise ValueError(f"{ENV_KILL}: {entry!r} needs a count of at least 1")
        return plan

    def should_kill(self, name: str) -> bool:
        self.seen[name] += 1
        if self.at.get(name) == self.seen[name]:
            return True
        return self.probability > 0.0 and self.rng.random() < self.probability


_plan: FaultPlan | None = None
_plan_spec: str | None = None


def _current() -> FaultPlan | None:
    global _plan, _plan_spec
    spec = os.environ.get(ENV_KILL)
    if not spec:
        return None
    if _plan is None or spec != _plan_spec:
        _plan, _plan_spec = FaultPlan.parse(spec, os.environ.get(ENV_SEED)), spec
    return _plan


def fault_point(name: str) -> None:
    """SIGKILL this process here when ``HPC_FAULT_KILL`` says so; otherwise do nothing.

    Raises ValueError when ``name`` is not one of :data:`POINTS`.
    """
    _check_name(name, "fault_point")
    if ENV_KILL not in os.environ:
        return
    plan = _current()
    if plan is None or not plan.should_kill(name):
        return
    log_path = os.environ.get(ENV_LOG)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)

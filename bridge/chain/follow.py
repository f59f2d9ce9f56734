"""Following a chain from the login node (``hpc-bridge chain --wait``).

:func:`follow` prints one line per event in ``chain.log`` (see :func:`describe`) and the
links' scheduler states until the chain has ended, and returns the exit status that
``FINAL_EVENTS`` gives the final event. Once the chain has ended it cancels links still
waiting that the link itself could not cancel; should every link end without a final event,
it decides how the chain ended and records that in ``chain.log``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bridge.chain.link import _cancel
from bridge.chain.rundir import ChainLog, ChainRunDir
from bridge.chain.settings import EX_TEMPFAIL
from bridge.errors import BridgeError
from bridge.progress import Progress, read_new_events
from bridge.schedulers import JobInfo, JobState, Scheduler

FINAL_EVENTS = {"chain_done": 0, "chain_failed": 1, "chain_incomplete": EX_TEMPFAIL}


def describe(event: Mapping[str, Any]) -> str | None:
    """One line for a person, or None for events not worth a line."""
    name = event.get("event")
    where = f"link {event.get('link')}/{event.get('links')}"
    job = f" (job {event['job_id']})" if event.get("job_id") else ""
    cancelled = event.get("cancelled") or []
    also = f"; cancelled job(s) {' '.join(cancelled)}" if cancelled else ""
    if name == "link_start":
        return f"{where}{job} started on {event.get('host')}, restart {event.get('restart_count')}"
    if name == "warning_forwarded":
        return f"{where}{job} warned the command (SIGUSR1) that its time is nearly up, from the {event.get('source')}"
    if name == "link_terminating":
        return f"{where}{job} is being ended by the scheduler ({event.get('signal')})"
    if name == "command_exit":
        how = f"signal {event['signal']}" if event.get("signal") else f"exit {event.get('code')}"
        return f"{where}{job} command ended with {how} after {event.get('seconds')} s: {event.get('outcome')}"
    if name == "link_skipped":
        return f"{where}{job} skipped: the chain had already {_why(event.get('reason'))}{also}"
    if name == "chain_done":
        return f"chain done: the command finished in {where}{also}"
    if name == "chain_failed":
        why = f"the command exited {event['code']} in {where}" if "code" in event else str(event.get("reason"))
        return f"chain failed: {why}{also}"
    if name == "chain_incomplete":
        return f"chain incomplete: {event.get('reason')} (resume from the checkpoints with a new chain)"
    if name == "cancel_failed":
        return f"{where}: could not cancel job(s) {' '.join(event.get('job_ids') or [])}: {event.get('error')}"
    return None


def _why(reason: Any) -> str:
    return {"done": "finished", "failed": "failed", "submit_failed": "failed to submit"}.get(str(reason), str(reason))


def follow(
    run_path: Path,
    scheduler: Scheduler,
    *,
    out: Callable[[str], None] = print,
    log_poll_s: float = 0.5,
    query_every_s: float = 5.0,
    grace_s: float = 120.0,
    progress: Progress | None = None,
) -> int:
    """Print the chain's events as they come until it has ended; return 0 (done), 1 (failed), 75 (incomplete).

    Raises :class:`~bridge.chain.settings.ChainError` first if the run directory could have been
    changed by someone else (:meth:`ChainRunDir.verify`).

    The chain has ended when a final event is in chain.log and no link is pending or running
    any more (or ``grace_s`` after the final event). Should every link end without a final
    event (a link killed outright, e.g. Grid Engine's SIGKILL at h_rt without a warning), the
    follower decides and records it in chain.log itself.

    With ``progress``, the current link, its scheduler state and the elapsed time are reported
    there too (a status line kept under the printed lines, or JSON lines that also carry every
    chain event); the caller finishes it.
    """
    run = ChainRunDir(run_path)
    run.verify()  # ChainError when someone else could have changed it, as a link would refuse it
    record = run.read()
    job_ids = [str(j) for j in record.get("job_ids") or []]
    links = int(record.get("links", len(job_ids)))
    status = _Status(job_ids, links, progress, out)
    out = status.print_line
    status.report()
    offset = 0
    final: dict[str, Any] | None = None
    final_seen_at = 0.0
    states: dict[str, str] = {}
    next_query = time.monotonic() + query_every_s
    ended_polls = 0
    swept = False
    seen: list[dict[str, Any]] = []
    while True:
        offset, new = read_new_events(run.log_file, offset)
        for event in new:
            seen.append(event)
            line = describe(event)
            status.event(event, line)
            if final is None and event.get("event") in FINAL_EVENTS:
                final, final_seen_at, next_query = event, time.monotonic(), time.monotonic()
        now = time.monotonic()
        if now >= next_query:
            next_query = now + (1.0 if final is not None else query_every_s)
            try:
                current = scheduler.query(job_ids)
            except BridgeError as exc:
                out(f"(the scheduler did not answer: {exc}; still following)")
                current = None
            if current is not None:
                if final is not None and not swept:
                    swept = True
                    _sweep(run, record, scheduler, current, out)
                _print_states(job_ids, links, current, states, out)
                status.set_current(current)
                status.report()
                live = [j for j in job_ids if j in current and not current[j].state.is_terminal]
                ended_polls = ended_polls + 1 if not live else 0
                if final is not None and (ended_polls >= 2 or now - final_seen_at > grace_s):
                    if live:
                        out(f"(job(s) {' '.join(live)} still in the queue; stopped following)")
                    return FINAL_EVENTS[str(final["event"])]
                if final is None and ended_polls >= 3:
                    return _conclude(run, record, seen, current, out)
        status.tick()
        time.sleep(log_poll_s)


def _sweep(
    run: ChainRunDir,
    record: Mapping[str, Any],
    scheduler: Scheduler,
    current: Mapping[str, JobInfo],
    out: Callable[[str], None],
) -> None:
    """The chain has ended but links still wait: the link could not cancel them (on Grid Engine,
    an execution host need not be a submit host). Cancel them from here."""
    job_ids = [str(j) for j in record.get("job_ids") or []]
    waiting = [j for j in job_ids if j in current and current[j].state is JobState.PENDING]
    if not waiting:
        return
    events = ChainLog(run.log_file, chain=record.get("name"), links=record.get("links"))
    try:
        cancelled = _cancel(scheduler, waiting, events)
        if cancelled:
            events.emit("links_cancelled", job_ids=cancelled, by="follower")
            out(f"cancelled waiting job(s) {' '.join(cancelled)}")
    finally:
        events.close()


def _print_states(
    job_ids: Sequence[str],
    links: int,
    current: Mapping[str, JobInfo],
    states: dict[str, str],
    out: Callable[[str], None],
) -> None:
    for index, job_id in enumerate(job_ids, start=1):
        info = current.get(job_id)
        state = info.state.value if info is not None else JobState.MISSING.value
        if states.get(job_id) != state:
            if job_id in states or state != JobState.PENDING.value:
                said = "gone from the scheduler" if state == JobState.MISSING.value else state
                out(f"link {index}/{links} (job {job_id}): {said}")
            states[job_id] = state


def _conclude(
    run: ChainRunDir,
    record: Mapping[str, Any],
    seen: Sequence[Mapping[str, Any]],
    current: Mapping[str, JobInfo],
    out: Callable[[str], None],
) -> int:
    """Every link ended and none said how the chain ended: say it in chain.log."""
    job_ids = [str(j) for j in record.get("job_ids") or []]
    ended = {j: (current[j].state.value if j in current else "gone") for j in job_ids}
    continued = any(e.get("event") == "command_exit" and e.get("outcome") in ("continue", "terminated") for e in seen)
    events = ChainLog(run.log_file, chain=record.get("name"), links=record.get("links"))
    try:
        if continued:
            event = {"event": "chain_incomplete", "reason": "the links ended without finishing the command"}
        else:
            event = {"event": "chain_failed", "reason": "the links ended without the command ever reporting an end"}
        events.emit(str(event["event"]), level="warning", reason=event["reason"], job_states=ended, by="follower")
    finally:
        events.close()
    out(describe(event) or str(event))
    return FINAL_EVENTS[str(event["event"])]


class _Status:
    """The follower's progress: which link is current, its scheduler state, the chain's events."""

    def __init__(
        self, job_ids: Sequence[str], links: int, progress: Progress | None, out: Callable[[str], None]
    ) -> None:
        self.job_ids = list(job_ids)
        self.links = links
        self.progress = progress
        self.out = out
        self.current: Mapping[str, JobInfo] | None = None
        self.started: set[int] = set()  # links that logged link_start
        self.said: tuple[int, str] | None = None  # (link, state) from the last link event in chain.log

    def print_line(self, line: str) -> None:
        """``out(line)``, keeping the status line under it (JSON mode: also a message line)."""
        if self.progress is None:
            self.out(line)
        else:
            self.progress.note(line, out=self.out)

    def event(self, event: Mapping[str, Any], line: str | None) -> None:
        """Print the event's line (JSON mode: the event itself too), and follow the links."""
        link, name = event.get("link"), event.get("event")
        if isinstance(link, int) and name in ("link_start", "command_exit", "link_skipped"):
            # the link's own word is fresher than the scheduler's last answer
            self.said = (link, {"link_start": "running", "command_exit": "ended", "link_skipped": "skipped"}[name])
            if name == "link_start":
                self.started.add(link)
        if self.progress is None:
            if line:
                self.out(line)
            return
        if line is not None or self.progress.mode == "json":
            fields = {k: v for k, v in event.items() if k not in ("event", "level", "out")}
            self.progress.note(line, out=self.out, chain_event=event.get("event"), **fields)
        self.report()

    def link(self) -> tuple[int, str, str]:
        """(link number, its job id, its state): the first link the scheduler still holds, else
        the last one that started, else the first; a later link event in chain.log than the
        scheduler's last answer (which lags) wins."""
        index, job_id, state = self._scheduler_link()
        if self.said is not None:
            link, said = self.said
            if link > index or (link == index and state in ("pending", "submitted", "started")):
                return link, self.job_ids[link - 1] if 0 < link <= len(self.job_ids) else "", said
        return index, job_id, state

    def set_current(self, current: Mapping[str, JobInfo]) -> None:
        self.current = current
        if self.said is not None and self._scheduler_link()[0] > self.said[0]:
            self.said = None  # the scheduler has caught up and moved on

    def _scheduler_link(self) -> tuple[int, str, str]:
        if self.current is not None:
            for index, job_id in enumerate(self.job_ids, start=1):
                info = self.current.get(job_id)
                if info is not None and not info.state.is_terminal:
                    return index, job_id, info.state.value.lower()
        index = max(self.started) if self.started else 1
        job_id = self.job_ids[index - 1] if 0 < index <= len(self.job_ids) else ""
        if self.current is None:
            return index, job_id, "started" if self.started else "submitted"
        info = self.current.get(job_id)
        return index, job_id, (info.state.value.lower() if info is not None else "gone")

    def report(self) -> None:
        if self.progress is None:
            return
        index, job_id, state = self.link()
        job = f" (job {job_id})" if job_id else ""
        self.progress.update(state, f"link {index}/{self.links}{job}", link=index, links=self.links, job_id=job_id)

    def tick(self) -> None:
        if self.progress is not None:
            self.progress.tick()

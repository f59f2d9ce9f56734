"""Progress of a long operation, shown where a person watches it (standard error).

:class:`Progress` reports the state of one thing (a request, a chain) in one of these modes:

``bar``
    one status line redrawn in place (``\\r`` and clear-to-end of line), cut to the terminal's
    width, with a ``[#####.....] 50%`` bar when the fraction done is known and the elapsed time
    refreshed at most once a second. ``finish()`` ends the line with a newline.
``lines``
    one plain line per change (logs, CI).
``json``
    one JSON object per line per change: ``{"event": "progress", "what": ..., "state": ...,
    "elapsed_s": ..., ...}``; messages (:meth:`Progress.note`) are ``{"event": "message", ...}``.
``none``
    nothing.
``auto``
    ``bar`` when the stream is a terminal, else ``json``.

Nothing is printed unless something changed (the elapsed-time refresh of ``bar`` aside). The
reporter never writes to standard output: that stays the command's result. Standard library
only; no TensorFlow, no broker.

:func:`read_new_events` follows a JSON-lines log (``job.log``, ``chain.log``) incrementally.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

MODES = ("auto", "bar", "lines", "json", "none")
CLEAR_LINE = "\r\x1b[K"
BAR_WIDTH = 10


def resolve_mode(mode: str, stream: TextIO) -> str:
    """``auto`` becomes ``bar`` on a terminal, else ``json``; the other modes stay as they are."""
    if mode not in MODES:
        raise ValueError(f"unknown progress mode {mode!r}: one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    try:
        return "bar" if stream.isatty() else "json"
    except (AttributeError, ValueError, OSError):  # a closed or odd stream
        return "json"


def format_elapsed(seconds: float) -> str:
    """``45s``, ``2m14s``, ``1h02m``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """``[###.......] 30%`` (the fraction is clamped to 0..1)."""
    fraction = min(1.0, max(0.0, fraction))
    filled = int(fraction * width + 1e-9)
    return f"[{'#' * filled}{'.' * (width - filled)}] {int(fraction * 100 + 1e-9)}%"


def terminal_width(stream: TextIO, default: int = 80) -> int:
    """The width of the terminal ``stream`` writes to (``$COLUMNS`` first, else ``default``)."""
    if os.environ.get("COLUMNS", "").isdigit() and int(os.environ["COLUMNS"]) > 0:
        return int(os.environ["COLUMNS"])
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size((default, 24)).columns


class Progress:
    """Reports the state of ``what`` to ``stream`` (default: standard error) in ``mode``.

    Call :meth:`update` whenever there is news (or simply often: it prints only on a change),
    :meth:`tick` to refresh the elapsed time of a ``bar`` line, :meth:`note` for a permanent
    message line, and :meth:`finish` at the end.
    """

    def __init__(
        self,
        what: str,
        *,
        mode: str = "auto",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
        refresh_s: float = 1.0,
    ) -> None:
        self.what = what
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(mode, self.stream)
        self._clock = clock
        self._width = width
        self._refresh_s = refresh_s
        self.started = clock()
        self.state = ""
        self._label = ""
        self._detail = ""
        self._fraction: float | None = None
        self._fields: dict[str, Any] = {}
        self._last: tuple[Any, ...] | None = None
        self._drawn = False  # a bar line is on the screen, not yet ended by a newline
        self._drawn_at = 0.0
        self._finished = False

    @property
    def in_place(self) -> bool:
        """The status line is redrawn in place (another writer to the stream would garble it)."""
        return self.mode == "bar"

    @property
    def elapsed(self) -> float:
        return self._clock() - self.started

    def update(
        self,
        state: str,
        detail: str = "",
        /,
        *,
        fraction: float | None = None,
        state_text: str | None = None,
        **fields: Any,
    ) -> bool:
        """Set the state (``state_text`` is how a line shows it, default ``state``); print if it changed.

        ``detail`` is the rest of the human line, ``fraction`` (0..1) draws a bar, ``fields`` go
        into the JSON event. Returns whether anything was printed.
        """
        self.state, self._label, self._detail, self._fraction = state, state_text or state, detail, fraction
        self._fields = dict(fields)
        key = (state, self._label, detail, None if fraction is None else round(fraction, 4), _freeze(fields))
        if key == self._last or self._finished:
            return self.tick()
        shown_before = self._last[:4] if self._last is not None else None
        self._last = key
        if self.mode == "bar":
            self._draw()
        elif self.mode == "lines":
            if key[:4] == shown_before:  # only JSON fields changed: the line would read the same
                return False
            self._write(self.line() + "\n")
        elif self.mode == "json":
            self._json("progress", state=state, **self._json_fields())
        return self.mode != "none"

    def tick(self) -> bool:
        """``bar``: redraw the line when its elapsed time is a second (``refresh_s``) old."""
        if self.mode == "bar" and self._last is not None and not self._finished:
            if self._clock() - self._drawn_at >= self._refresh_s:
                self._draw()
                return True
        return False

    def note(self, text: str | None, /, *, out: Callable[[str], None] | None = None, **fields: Any) -> None:
        """A message that stays: ``out(text)`` (e.g. a line on standard output), else on the stream.

        ``bar``: the status line is cleared first and redrawn under the message. ``json``: the
        message is also a ``{"event": "message", "text": ..., **fields}`` line on the stream.
        """
        if self.mode == "bar" and self._drawn:
            self._write(CLEAR_LINE)
            self._drawn = False
        if text is not None:
            if out is not None:
                out(text)
                _flush(sys.stdout)
            elif self.mode in ("bar", "lines"):
                self._write(text + "\n")
        if self.mode == "json" and (text is not None or fields):
            self._json("message", **({"text": text} if text is not None else {}), **fields)
        if self.mode == "bar" and self._last is not None and not self._finished:
            self._draw()

    def finish(self) -> None:
        """End the in-place line with a newline (after a last redraw). Safe to call twice."""
        if self._finished:
            return
        if self.mode == "bar" and self._last is not None:
            self._draw()
            self._write("\n")
            self._drawn = False
        self._finished = True

    def line(self, width: int | None = None) -> str:
        """The human line: what, state, detail, bar, elapsed (two spaces between).

        With ``width``, the line is cut to ``width - 1`` characters (the last column would wrap on
        some terminals), the detail first, so that the state, bar and elapsed time stay in view.
        """
        head = "  ".join(p for p in (self.what, self._label) if p)
        tail = "  ".join(
            [*([format_bar(self._fraction)] if self._fraction is not None else []), format_elapsed(self.elapsed)]
        )
        detail = self._detail
        text = "  ".join(p for p in (head, detail, tail) if p)
        if width is None or len(text) <= width - 1:
            return text
        room = width - 1 - len(head) - len(tail) - 4  # the two separators around the detail
        if detail and room >= 2:
            return f"{head}  {detail[: room - 1].rstrip()}~  {tail}"
        return text[: max(0, width - 1)]

    def _json_fields(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self._detail:
            extra["detail"] = self._detail
        if self._fraction is not None:
            extra["fraction"] = round(self._fraction, 4)
        return {**extra, **self._fields}

    def _draw(self) -> None:
        width = self._width if self._width is not None else terminal_width(self.stream)
        self._write(CLEAR_LINE + self.line(width))
        self._drawn = True
        self._drawn_at = self._clock()

    def _json(self, event: str, state: str | None = None, **fields: Any) -> None:
        record: dict[str, Any] = {"event": event, "what": self.what}
        if state is not None:
            record["state"] = state
        record["elapsed_s"] = round(self.elapsed, 1)
        for key, value in fields.items():
            record.setdefault(key, value)
        self._write(json.dumps(record, default=str) + "\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal must not end the operation
            pass


def _flush(stream: TextIO) -> None:
    try:
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def read_new_events(path: Path, offset: int) -> tuple[int, list[dict[str, Any]]]:
    """The complete JSON-lines events (objects with an ``event``) written to ``path`` after byte
    ``offset``, and the offset to read on from; a missing file or a half-written line is no error."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return offset, []
    complete = data[: data.rfind(b"\n") + 1]
    events = []
    for line in complete.decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # not ours
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return offset + len(complete), events

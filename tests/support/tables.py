"""A stand-in ``crontab``/``scrontab`` for install tests, and reading what it holds.

Put :data:`FAKE_TABLE` as ``bin/crontab`` (and ``bin/scrontab``) first on PATH with
``FAKE_TABLE_DIR`` set: ``-l`` prints the table (or "no crontab for ..."), ``FILE`` installs
FILE. Every call is recorded in ``NAME.calls``, to tell a rewrite from none.
"""

from __future__ import annotations

FAKE_TABLE = """#!/bin/sh
store="$FAKE_TABLE_DIR/$(basename "$0")"
echo "$*" >>"$store.calls"
case "$1" in
    -l) if [ -f "$store" ]; then cat "$store"; else echo "no crontab for $LOGNAME" >&2; exit 1; fi ;;
    -*) echo "unexpected option $1" >&2; exit 2 ;;
    *) cp "$1" "$store" ;;
esac
"""


def entries(text: str) -> list[str]:
    """The table's schedule lines (no comments, no blank lines)."""
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

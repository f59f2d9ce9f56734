"""docs/log-events.md lists every structured log event the code emits, and nothing else.

The source of ``bridge/`` and ``worker/`` is scanned (ast) for calls of a structlog logger's
``debug``/``info``/``warning``/``error``/``exception``/``critical`` and of the chain's
``ChainLog.emit``; the first argument is the event name. Stdlib ``logging`` loggers (the trainer,
the Rodan stand-in) log human %-format messages, not events, and are left out: only names bound
to ``structlog.get_logger(...)`` in the same module count as structlog loggers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "log-events.md"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "msg"}

# Event names computed at the call site: (file, source of the first argument) -> the names it takes.
# A new computed name must be added here (and to the doc), or the test says so.
DYNAMIC: dict[tuple[str, str], set[str]] = {
    # The follower ends a chain whose links all ended without saying how.
    ("bridge/chain/follow.py", "str(event['event'])"): {"chain_incomplete", "chain_failed"},
}


def _structlog_names(tree: ast.Module) -> set[str]:
    """Names (``log``, ``self._log``) a module binds to ``structlog.get_logger(...)``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Call):
            continue
        if ast.unparse(node.value.func) not in ("structlog.get_logger", "structlog.stdlib.get_logger"):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute):
                names.add(target.attr)
    return names


def _receiver_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def code_events() -> tuple[dict[str, set[str]], list[str]]:
    """Every event name -> the files that emit it; and the computed names the test cannot resolve."""
    found: dict[str, set[str]] = {}
    unresolved: list[str] = []
    for package in ("bridge", "worker"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            loggers = _structlog_names(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                    continue
                is_event = node.func.attr == "emit" or (
                    node.func.attr in LEVELS and _receiver_name(node.func.value) in loggers
                )
                if not is_event:
                    continue
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names = {first.value}
                elif (
                    isinstance(first, ast.IfExp)
                    and isinstance(first.body, ast.Constant)
                    and isinstance(first.orelse, ast.Constant)
                ):
                    names = {str(first.body.value), str(first.orelse.value)}
                elif (rel, ast.unparse(first)) in DYNAMIC:
                    names = DYNAMIC[(rel, ast.unparse(first))]
                else:
                    unresolved.append(f"{rel}:{node.lineno}: {ast.unparse(first)}")
                    continue
                for name in names:
                    found.setdefault(name, set()).add(rel)
    return found, unresolved


def doc_events() -> set[str]:
    """The names in the first column of every table of the doc whose header's first cell is ``event``."""
    names: set[str] = set()
    in_events_table = False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            in_events_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].lower() == "event":
            in_events_table = True
            continue
        if in_events_table and not set(cells[0]) <= set("-: "):
            match = re.fullmatch(r"`([a-z][a-z0-9_]*)`", cells[0])
            assert match, f"docs/log-events.md: an event row must start with `name`: {line}"
            names.add(match.group(1))
    return names


def test_scan_finds_the_events() -> None:
    found, unresolved = code_events()
    assert not unresolved, "event names computed at the call site; add them to DYNAMIC:\n" + "\n".join(unresolved)
    # The scan works: events from each kind of call site, and no stdlib %-format message.
    for name in ("request_received", "job_ended_without_reply", "epoch", "job_start", "job_resume", "gpu_summary"):
        assert name in found, name
    for name in ("link_start", "chain_submitted", "download_retry"):
        assert name in found, name
    assert not [n for n in found if "%" in n or " " in n], "stdlib logging messages counted as events"


def test_every_event_in_the_code_is_documented() -> None:
    found, _ = code_events()
    documented = doc_events()
    missing = sorted(set(found) - documented)
    assert not missing, "events the code emits that docs/log-events.md does not list:\n" + "\n".join(
        f"  `{name}` ({', '.join(sorted(found[name]))})" for name in missing
    )


def test_every_documented_event_exists_in_the_code() -> None:
    found, _ = code_events()
    stale = sorted(doc_events() - set(found))
    assert not stale, "events docs/log-events.md lists that the code no longer emits:\n" + "\n".join(
        f"  `{name}`" for name in stale
    )

"""docs/error-replies.md documents every error reply text the code can produce, and only real ones.

The doc marks the fixed parts of each text on lines starting with ``literal:`` (each fragment in
backticks). Checked here:

* every fragment occurs in ONE string literal (a constant, or the fixed part of an f-string, after
  Python has joined adjacent literals) of ``bridge/`` or ``worker/``: a reworded message fails;
* every place that produces an error reply text is covered by a fragment: each ``error_reply(...)``
  call (its f-string, or the texts its variable is built from, traced below), the exceptions whose
  message becomes a reply (the protocol's, Rodan's, the scheduler's submit path, the trainer's input
  and settings checks, the broker's refusals), the worker's step names and the schedulers' lists of
  permanent submit refusals;
* a few texts built by the real functions (reconciliation, the outbox, request validation) contain
  the documented fragments.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.errors import InvalidRequest
from bridge.ledger import RequestRecord
from bridge.protocol import parse_duration_minutes, parse_request
from bridge.reconcile import explain
from bridge.replies import ReplyBox
from bridge.schedulers import JobInfo, JobState, gridengine, slurm
from bridge.spool import Spool

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "error-replies.md"
PACKAGES = ("bridge", "worker")
# A fragment shorter than this proves nothing about which message a literal belongs to.
MIN_COVERING = 10

# error_reply(...) calls whose argument is a variable: (file, function, source of the argument) ->
# where its texts come from. Each is traced by a check below; a new one must be added here (and to
# the doc), or test_every_error_reply_call_is_known says so.
VARIABLE_REASONS: dict[tuple[str, str, str], str] = {
    # Intake._reject(record, reason): called with str(exc) of a PermanentError (protocol, Rodan, the
    # scheduler's refusal, an unsafe script value) and with the "gave up after" f-string.
    ("bridge/intake.py", "_reject", "reason"): "test_intake_rejections_are_documented",
    # explain() for a job that ended, and the "vanished" f-string.
    ("bridge/reconcile.py", "reconcile", "reason"): "test_reconcile_texts_are_documented",
    ("bridge/reconcile.py", "_missing", "reason"): "test_assigned_reasons_are_documented",
    # A job that waited HPC_MAX_PENDING without starting.
    ("bridge/reconcile.py", "_pending_too_long", "reason"): "test_assigned_reasons_are_documented",
    # A request whose message the broker lost before it was submitted.
    ("bridge/reconcile.py", "judge_lost", "reason"): "test_assigned_reasons_are_documented",
    # The oversized reply.
    ("bridge/replies.py", "stage", "reason"): "test_assigned_reasons_are_documented",
    # stopped(): no continuation, continuations used up, continuing failed.
    ("worker/job.py", "stopped", "reason"): "test_assigned_reasons_are_documented",
}


# --- the doc -----------------------------------------------------------------------------------


def doc_fragments() -> list[str]:
    """Every backticked fragment on a ``literal:`` line."""
    fragments: list[str] = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("literal:"):
            found = re.findall(r"`([^`]+)`", line)
            assert found, f"a literal: line without a `fragment`: {line}"
            fragments += found
    return fragments


def doc_entries() -> dict[str, tuple[list[str], list[str]]]:
    """``### heading`` -> (its ``reply:`` texts, its ``literal:`` fragments)."""
    entries: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            current = entries.setdefault(line[4:].strip(), ([], []))
        elif line.startswith("## "):
            current = None
        elif current is not None and line.startswith("reply:"):
            current[0].extend(re.findall(r"`([^`]+)`", line)[:1])
        elif current is not None and line.startswith("literal:"):
            current[1].extend(re.findall(r"`([^`]+)`", line))
    return entries


def covering(fragments: list[str]) -> list[str]:
    return [f for f in fragments if len(f.strip()) >= MIN_COVERING]


# --- the source --------------------------------------------------------------------------------


def source_files() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)


def literal_parts(node: ast.AST | None) -> list[str]:
    """The fixed text of a string expression: a constant, the constant parts of an f-string, or of
    both sides of ``+`` / a conditional expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return literal_parts(node.left) + literal_parts(node.right)
    if isinstance(node, ast.IfExp):
        return literal_parts(node.body) + literal_parts(node.orelse)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.config.public" and node.args:
        return literal_parts(node.args[0])  # the same text without the installation's paths and accounts
    return []


def source_literals() -> set[str]:
    """Every string literal of bridge/ and worker/ (docstrings too: harmless, they are not fragments)."""
    found: set[str] = set()
    for _, tree in source_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def is_covered(parts: list[str], fragments: list[str]) -> bool:
    """Some fragment of a useful length is in a part, or a short fragment is a whole part."""
    return any(fragment in part for part in parts for fragment in covering(fragments)) or any(
        part in fragments for part in parts if part.strip()
    )


def functions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            yield node


def calls_in(node: ast.AST, name: str) -> Iterator[ast.Call]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called == name:
                yield sub


def raised(tree: ast.AST, classes: set[str]) -> Iterator[tuple[ast.Raise, str, ast.expr | None]]:
    """``raise Cls(message)`` for Cls in ``classes``: (the statement, the class, the message)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in classes:
                yield node, name, node.exc.args[0] if node.exc.args else None


def uncovered_raises(
    rel_prefixes: tuple[str, ...], classes: set[str], *, in_functions: set[str] | None = None
) -> list[str]:
    """The raises of ``classes`` in files under ``rel_prefixes`` whose message no fragment covers."""
    fragments = doc_fragments()
    missing: list[str] = []
    for rel, tree in source_files():
        if not rel.startswith(rel_prefixes):
            continue
        scopes: list[ast.AST] = (
            [f for f in functions(tree) if f.name in in_functions] if in_functions is not None else [tree]
        )
        for scope in scopes:
            for node, name, message in raised(scope, classes):
                parts = literal_parts(message)
                if not parts:
                    continue  # a message passed through (str(exc), the scheduler's output): checked elsewhere
                if not is_covered(parts, fragments):
                    missing.append(f"{rel}:{node.lineno}: {name}({ast.unparse(message) if message else ''})")
    return missing


# --- (a) the doc is true -------------------------------------------------------------------------


def test_doc_is_well_formed() -> None:
    entries = doc_entries()
    assert len(entries) >= 40, sorted(entries)
    for title, (replies, fragments) in entries.items():
        assert replies, f"entry {title!r} has no reply: line"
        assert fragments, f"entry {title!r} has no literal: line"
    assert len(doc_fragments()) == sum(len(f) for _, f in entries.values()), "a literal: line outside an entry"


def test_every_documented_fragment_is_in_the_source() -> None:
    literals = source_literals()
    stale = [f for f in doc_fragments() if not any(f in literal for literal in literals)]
    assert not stale, "docs/error-replies.md quotes text that no string literal of bridge/ or worker/ holds:\n" + (
        "\n".join(f"  `{f}`" for f in stale)
    )


def test_the_fixed_reply_texts_are_quoted_whole() -> None:
    """A reply with no placeholder is the literal itself."""
    for title, (replies, fragments) in doc_entries().items():
        for reply in replies:
            if "<" not in reply and not reply.startswith("..."):
                assert reply in fragments, f"{title}: `{reply}` should also be a literal"


# --- (b) every text the code produces is in the doc ------------------------------------------------


def error_reply_calls() -> list[tuple[str, str, ast.Call]]:
    """(file, enclosing function, call) for every ``error_reply(...)`` call."""
    found: list[tuple[str, str, ast.Call]] = []
    for rel, tree in source_files():
        for function in functions(tree):
            for call in calls_in(function, "error_reply"):
                if call not in [c for _, _, c in found]:
                    found.append((rel, function.name, call))
    return found


def test_scan_finds_the_error_reply_calls() -> None:
    files = {rel for rel, _, _ in error_reply_calls()}
    assert {"bridge/intake.py", "bridge/reconcile.py", "bridge/replies.py", "worker/job.py"} <= files


def test_every_error_reply_call_is_known() -> None:
    fragments = doc_fragments()
    problems: list[str] = []
    for rel, function, call in error_reply_calls():
        if rel == "bridge/protocol.py" and function == "error_reply":
            continue
        argument = call.args[0]
        parts = literal_parts(argument)
        if parts:
            if not is_covered(parts, fragments):
                problems.append(f"{rel}:{call.lineno}: {ast.unparse(argument)} is not in the doc")
        elif (rel, function, ast.unparse(argument)) not in VARIABLE_REASONS:
            problems.append(f"{rel}:{call.lineno}: error_reply({ast.unparse(argument)}) in {function}(): trace it")
    assert not problems, "\n".join(problems)


def test_assigned_reasons_are_documented() -> None:
    """Where the reason is a local variable, every string assigned to it is documented."""
    fragments = doc_fragments()
    trees = dict(source_files())
    problems: list[str] = []
    for (rel, function_name, variable), check in VARIABLE_REASONS.items():
        if check != "test_assigned_reasons_are_documented":
            continue
        (function,) = [f for f in functions(trees[rel]) if f.name == function_name]
        assigned = [
            node.value
            for node in ast.walk(function)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets)
        ]
        assert assigned, f"{rel} {function_name}(): no assignment to {variable}"
        for value in assigned:
            if not is_covered(literal_parts(value), fragments):
                problems.append(f"{rel}:{value.lineno}: {ast.unparse(value)[:120]}")
    assert not problems, "error reply texts not in docs/error-replies.md:\n" + "\n".join(problems)


def test_reconcile_texts_are_documented() -> None:
    """explain(): the common prefix and the text for every state it names."""
    fragments = doc_fragments()
    tree = dict(source_files())["bridge/reconcile.py"]
    (function,) = [f for f in functions(tree) if f.name == "explain"]
    (hints,) = [
        n.value for n in ast.walk(function) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "hints"
    ]
    assert isinstance(hints, ast.Dict)
    problems = [
        ast.unparse(k) if k else "**"
        for k, v in zip(hints.keys, hints.values, strict=True)
        if not is_covered(literal_parts(v), fragments)
    ]
    assert not problems, f"explain() texts not in docs/error-replies.md: {problems}"
    assert {ast.unparse(k) if k else "**" for k in hints.keys} == {
        f"JobState.{s.name}" for s in JobState if s.is_terminal
    }
    (returned,) = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)]
    assert is_covered(literal_parts(returned), fragments)
    # reconcile() stages exactly explain()'s text.
    (reconcile,) = [f for f in functions(tree) if f.name == "reconcile"]
    assigned = [
        ast.unparse(n.value)
        for n in ast.walk(reconcile)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "reason"
    ]
    assert assigned and all(a.startswith("self.config.public(explain(") for a in assigned), assigned


def test_intake_rejections_are_documented() -> None:
    """_reject(reason): its f-string callers, and every PermanentError message that str(exc) passes on."""
    fragments = doc_fragments()
    tree = dict(source_files())["bridge/intake.py"]
    arguments = [call.args[1] for call in calls_in(tree, "_reject")]
    assert len(arguments) >= 2
    for argument in arguments:
        parts = literal_parts(argument)
        assert parts or ast.unparse(argument) == "str(exc)", ast.unparse(argument)
        assert not parts or is_covered(parts, fragments), ast.unparse(argument)
    permanent = {"PermanentError", "InvalidRequest", "RodanAuthError", "SchedulerRejected"}
    missing = uncovered_raises(("bridge/",), permanent)
    # Script rendering: a ValueError becomes PermanentError(str(exc)) in Intake._submit.
    backends = ("bridge/schedulers/base.py", "bridge/schedulers/slurm.py", "bridge/schedulers/gridengine.py")
    missing += uncovered_raises(backends, {"ValueError"})
    # Transient failures of the token and submit paths end in "gave up after ... : <them>", and the
    # scheduler's failures in the worker's "could not continue in a new job: <them>".
    missing += uncovered_raises(("bridge/rodan.py",), {"TransientError"})
    missing += uncovered_raises(
        backends,
        {"SchedulerUnavailable"},
        in_functions={"submit", "_submit_command", "continue_job"},
    )
    assert not missing, "rejection texts not in docs/error-replies.md:\n" + "\n".join(missing)


def test_scheduler_refusals_are_documented() -> None:
    """A permanent refusal is the scheduler's own message; the words that make it permanent are listed."""
    documented = set(doc_fragments())
    for words in (slurm.PERMANENT_SUBMIT_ERRORS, gridengine.PERMANENT_SUBMIT_ERRORS):
        missing = [w for w in words if w not in documented]
        assert not missing, f"permanent submit errors not in docs/error-replies.md: {missing}"


def test_worker_steps_and_trainer_checks_are_documented() -> None:
    """The worker's step names, and the trainer's messages meant for a human (TrainingInputError)."""
    documented = set(doc_fragments())
    tree = dict(source_files())["worker/job.py"]
    steps = set()
    for call in calls_in(tree, "StepFailed"):
        parts = literal_parts(call.args[0])
        assert parts, ast.unparse(call)
        steps.add(parts[0].split(" ")[0])  # "downloading {name!r}" -> "downloading"
    assert {"downloading", "reading", "training", "checkpointing"} <= steps, steps
    missing = sorted(s for s in steps if not any(d == s or d.startswith(s) or d.strip() == s for d in documented))
    assert not missing, f"worker steps not in docs/error-replies.md: {missing}"
    problems = uncovered_raises(("worker/trainer/",), {"TrainingInputError"})
    problems += uncovered_raises(("worker/continuation.py",), {"RuntimeError"})
    problems += uncovered_raises(("bridge/amqp.py",), {"PermanentError"})
    assert not problems, "texts not in docs/error-replies.md:\n" + "\n".join(problems)


def test_the_scan_sees_the_trainer_checks() -> None:
    """The raise scan is not vacuous: it finds the trainer's checks and would flag an undocumented one."""
    tree = dict(source_files())["worker/trainer/settings.py"]
    assert len(list(raised(tree, {"TrainingInputError"}))) >= 9
    assert not is_covered(["the batch size is wrong"], doc_fragments())


# --- behaviour: the real functions produce the documented texts ------------------------------------


def _record() -> RequestRecord:
    return RequestRecord(
        correlation_id="c0ffee", key="c0ffee", reply_to="hpc-results", job_id="61", time_limit="0-06:00", memory_mb=8000
    )


@pytest.mark.parametrize(
    ("state", "native", "expected"),
    [
        (
            JobState.TIMEOUT,
            "TIMEOUT",
            "Slurm job 61 ended without a result: TIMEOUT after 0-06:00: the job hit its time limit ",
        ),
        (
            JobState.OUT_OF_MEMORY,
            "OUT_OF_MEMORY",
            "OUT_OF_MEMORY with 8000 MB: the job ran out of memory; raise 'Maximum memory (MB)'",
        ),
        (
            JobState.CANCELLED,
            "CANCELLED by 0",
            "CANCELLED: the job was cancelled (by an operator or the scheduler); resubmit it",
        ),
        (
            JobState.FAILED,
            "FAILED",
            "FAILED, exit code 1:0: the training job crashed without replying; "
            "see its log in the bridge's spool (jobs/c0ffee/)",
        ),
        (JobState.COMPLETED, "COMPLETED", "COMPLETED: the job finished without sending its models; "),
        (JobState.NODE_FAIL, "NODE_FAIL", "NODE_FAIL: the compute node failed; resubmit the job"),
        (JobState.PREEMPTED, "PREEMPTED", "PREEMPTED: the job was preempted by the scheduler; resubmit the job"),
        (JobState.BOOT_FAIL, "BOOT_FAIL", "BOOT_FAIL: the compute node failed to boot; resubmit the job"),
        (JobState.DEADLINE, "DEADLINE", "DEADLINE: the job missed its scheduling deadline; resubmit the job"),
    ],
)
def test_explain_builds_the_documented_text(state: JobState, native: str, expected: str) -> None:
    exit_code = "1:0" if state is JobState.FAILED else ""
    text = explain(_record(), JobInfo("61", state, native, exit_code), "Slurm")
    assert expected in text
    entry = [title for title in doc_entries() if title.startswith(state.value)]
    assert len(entry) == 1, f"no single doc entry for {state.value}"
    replies, fragments = doc_entries()[entry[0]]
    assert any(f in text for f in covering(fragments)), (text, fragments)


def test_explain_on_grid_engine_names_the_native_state() -> None:
    text = explain(_record(), JobInfo("61", JobState.ERROR, "Eqw: can't chdir"), "Grid Engine")
    assert text.startswith("Grid Engine job 61 ended without a result: ERROR (Eqw: can't chdir): the scheduler put")
    _, fragments = doc_entries()["ERROR: Grid Engine error state (Eqw)"]
    assert all(f in text for f in fragments)


def test_an_oversized_reply_becomes_the_documented_error(tmp_path: Path) -> None:
    box = ReplyBox(Spool(tmp_path), max_bytes=1024)
    entry = box.stage("c0ffee", "hpc-results", b"x" * 2000, origin="worker")
    text = entry.body_path.read_text()
    _, fragments = doc_entries()["Reply too large"]
    assert all(f in text for f in fragments), text


@pytest.mark.parametrize(
    ("body", "title"),
    [
        (b"{", "Request body is not JSON"),
        (b"[1]", "Request body is not an object"),
        (
            b'{"inputs": {"Image": "/a"}, "settings": {"CPUs": "6"}}',
            "Schema: a missing field, a wrong type or a value out of range",
        ),
        (
            b'{"inputs": {"Image": "/a", "Background": "/b", "Selected Regions": "/c"}}',
            "Neither generation's layer inputs",
        ),
        (b'{"inputs": {"Image": "/a"}, "settings": {"Patch width": 130}}', "Patch size not a multiple of 4"),
    ],
)
def test_request_validation_builds_the_documented_text(body: bytes, title: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(body, correlation_id="c", reply_to="r")
    _, fragments = doc_entries()[title]
    assert all(f in str(caught.value) for f in fragments), str(caught.value)


def test_maximum_time_texts() -> None:
    for value, title in (
        ("6h", "Maximum time not in D-HH:MM form"),
        ("0-30:00", "Maximum time with impossible hours or minutes"),
        ("0-00:00", "Maximum time of zero"),
    ):
        with pytest.raises(InvalidRequest) as caught:
            parse_duration_minutes(value)
        _, fragments = doc_entries()[title]
        assert all(f in str(caught.value) for f in fragments), str(caught.value)

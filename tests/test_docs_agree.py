"""The documentation says the same thing everywhere about three facts that used to be contradicted:

1. the spool must survive: project space or home, never a scratch filesystem that purges files
   (a purge deletes the records of the requests and jobs in flight);
2. RabbitMQ's message limit (``max_message_size``) is 128 MiB on RabbitMQ 3.8-3.13 and 16 MiB on
   4.x by default: a sentence that gives either figure for the broker gives both, each with its
   versions (docs/protocol.md §1.5 is the table);
3. ``doctor --skip-worker`` skips the login node's own ``worker`` check only: ``--job``'s
   ``node-worker`` check still runs on the compute node (bridge/ops/doctor.py).

The statements are found by what they say, wherever they are (README, docs/, deploy/, rodan_job/,
credentials.env.example), so that an edit that contradicts one of them fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.bridge import run_bridge

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "credentials.env.example"


def documents() -> list[Path]:
    """Every document an operator or user reads (not the CHANGELOG, which keeps what was said)."""
    found = [REPO / "README.md", EXAMPLE]
    for pattern in ("docs/*.md", "deploy/**/*.md", "rodan_job/**/*.md", "benchmarks/*.md"):
        found += sorted(REPO.glob(pattern))
    return [path for path in found if path.is_file()]


def chunks(path: Path) -> list[tuple[str, str]]:
    """(where, text) for each paragraph, list item and table row of a document, its lines joined;
    code blocks left out. In credentials.env.example, each comment paragraph."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path == EXAMPLE:
        lines = [line[1:].strip() if line.startswith("#") else "" for line in lines]
    out: list[tuple[str, str]] = []
    current: list[str] = []
    start = 0
    fenced = False

    def close() -> None:
        if current:
            out.append((f"{path.relative_to(REPO)}:{start}", " ".join(current)))
            current.clear()

    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if line.startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line:
            close()
            continue
        if re.match(r"^([-*]|\d+\.|\|)\s", line) or (line.startswith("#") and path != EXAMPLE):
            close()  # a list item, a table row or a heading starts a new chunk
        if not current:
            start = number
        current.append(line)
        if line.startswith("|"):
            close()
    close()
    return out


def sentences(text: str) -> list[str]:
    """``text`` cut after each full stop that ends a sentence (not 3.8, e.g. or §1.5)."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", text) if s.strip()]


def all_sentences() -> list[tuple[str, str]]:
    return [(where, sentence) for path in documents() for where, text in chunks(path) for sentence in sentences(text)]


# --- 1. the spool is never on a purged scratch filesystem -----------------------------------------

#: "scratch" meaning node-local scratch (checkpoints), which is another matter.
NODE_LOCAL = re.compile(r"node-local scratch|node-scratch|local scratch|scratch \(`?HPC_NODE_LOCAL_DIR", re.I)
SPOOL = re.compile(r"\bspool\b|HPC_SPOOL_DIR", re.I)


def spool_scratch_statements() -> list[tuple[str, str]]:
    """Every sentence that says something about the spool and a scratch filesystem."""
    found = [(where, sentence) for where, sentence in all_sentences() if _spool_and_scratch(sentence)]
    # A sentence of its own after the spool's may carry the verdict: look at whole chunks too.
    for path in documents():
        found += [(where, text) for where, text in chunks(path) if _spool_and_scratch(text)]
    return found


def _spool_and_scratch(text: str) -> bool:
    """Whether ``text`` names the spool and a scratch filesystem (not node-local scratch, nor a
    check called `scratch`: a word in backticks is a name)."""
    prose = re.sub(r"`[^`]*`", "", NODE_LOCAL.sub("", text))
    return bool(SPOOL.search(text) and re.search(r"\bscratch\b", prose, re.I))


def spool_problem(text: str) -> str:
    """What a statement about the spool and scratch gets wrong ("" when nothing)."""
    if re.search(r"\b(home|project)\b[^.;:]*?,?\s+or\s+(a\s+)?scratch\b", text, re.I) or re.search(
        r"\bscratch\b[^.;]*\b(is|are)\s+(fine|right|ok|good|enough)\b", text, re.I
    ):
        return "names scratch as a place for the spool"
    if not re.search(r"\bpurge", text, re.I):
        return "names scratch without why it is not for the spool (a purge)"
    if not re.search(r"\b(not|never|no)\b", text, re.I):
        return "names scratch without saying that it is not for the spool"
    return ""


def test_the_spool_statements_agree_that_a_purged_scratch_is_not_for_it() -> None:
    statements = spool_scratch_statements()
    places = {where.split(":")[0] for where, _ in statements}
    # The two places that used to disagree both make the statement.
    assert {"credentials.env.example", "docs/operator-guide.md"} <= places, statements
    wrong = [f"{where}: {spool_problem(text)}: {text}" for where, text in statements if spool_problem(text)]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(
    "text",
    [
        "The spool (HPC_SPOOL_DIR) must be shared (home, project or scratch; never /tmp).",
        "The spool can go on scratch: a scratch filesystem is fine for it, whatever it purges.",
        "Put the spool on scratch.",
    ],
)
def test_the_spool_check_catches_a_contradiction(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    document = tmp_path / "contradiction.md"
    document.write_text(f"# A guide\n\n{text}\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    monkeypatch.setattr(f"{__name__}.documents", lambda: [document])
    statements = spool_scratch_statements()
    assert statements and all(spool_problem(statement) for _, statement in statements)


# --- 2. RabbitMQ's message limit: 128 MiB on 3.8-3.13, 16 MiB on 4.x ----------------------------

BROKER = re.compile(r"max_message_size|RabbitMQ|\bbroker|message limit", re.I)
FIGURE = re.compile(r"\b(16|128) MiB\b")


def limit_statements() -> list[tuple[str, str]]:
    """Every sentence that gives the broker's message limit (a 16 or 128 MiB figure with the broker)."""
    return [(where, s) for where, s in all_sentences() if FIGURE.search(s) and BROKER.search(s)]


def limit_problem(sentence: str) -> str:
    """What a sentence giving the broker's limit gets wrong ("" when nothing)."""
    if not ("128 MiB" in sentence and re.search(r"3\.8", sentence)):
        return "does not give 128 MiB for RabbitMQ 3.8-3.13"
    if not ("16 MiB" in sentence and re.search(r"\b4\.x\b", sentence)):
        return "does not give 16 MiB for RabbitMQ 4.x"
    return ""


def test_every_statement_of_the_message_limit_gives_both_versions_figures() -> None:
    statements = limit_statements()
    assert len(statements) >= 5, statements  # the table, the guides, the settings
    wrong = [f"{where}: {limit_problem(s)}: {s}" for where, s in statements if limit_problem(s)]
    assert wrong == [], "\n".join(wrong)
    # The table every other statement agrees with.
    row = "| `max_message_size` | 128 MiB on RabbitMQ 3.8\N{EN DASH}3.13, 16 MiB on 4.x |"
    assert any(where.startswith("docs/protocol.md") and s.startswith(row) for where, s in statements), statements


@pytest.mark.parametrize(
    "sentence",
    [
        "Keep it at or below the broker's max_message_size (RabbitMQ's default: 128 MiB).",
        "RabbitMQ 4.x refuses messages over 16 MiB.",
        "The default is 128 MiB (RabbitMQ 3.8-3.13) and 16 MiB on RabbitMQ 4.",
    ],
)
def test_the_limit_check_catches_a_one_sided_statement(sentence: str) -> None:
    assert FIGURE.search(sentence) and BROKER.search(sentence)
    assert limit_problem(sentence) != ""


# --- 3. doctor --skip-worker ------------------------------------------------------------------------


def skip_worker_statements() -> list[tuple[str, str]]:
    """Every sentence that says what --skip-worker does (not one that only runs it)."""
    describes = re.compile(r"--skip-worker`?\s+(skips|leaves|means|does|is|only|imports|avoids)\b")
    return [(where, s) for where, s in all_sentences() if describes.search(s)]


def option_help(command: str, option: str) -> str:
    """What ``hpc-bridge COMMAND --help`` says of ``option``, its lines joined."""
    result = run_bridge({}, command, "--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first = next(n for n, line in enumerate(lines) if line.strip().startswith(option))
    block = [lines[first].strip().removeprefix(option)]
    for line in lines[first + 1 :]:
        if not line.strip() or re.match(r"^ {1,4}-", line):  # the next option (its help is indented further)
            break
        block.append(line.strip())
    return " ".join(" ".join(block).split())


def says_what_skip_worker_does(text: str) -> str:
    """What a description of --skip-worker gets wrong ("" when nothing)."""
    if not re.search(r"login node", text):
        return "does not say it is the login node's check"
    if not re.search(r"`?worker`? check", text):
        return "does not name the worker check"
    if not re.search(r"node-worker[^.;]*\bstill\b|\bstill\b[^.;]*node-worker", text):
        return "does not say that --job's node-worker check still runs"
    return ""


def test_skip_worker_means_the_same_in_the_help_and_the_guide() -> None:
    described = option_help("doctor", "--skip-worker")
    assert says_what_skip_worker_does(described) == "", described
    statements = skip_worker_statements()
    assert any(where.startswith("docs/operator-guide.md") for where, _ in statements), statements
    for where, sentence in statements:
        assert says_what_skip_worker_does(sentence) == "", f"{where}: {sentence}"
    for where, sentence in all_sentences():  # nowhere does it leave out the node's check
        assert not re.search(r"skip-worker`?\s+(skips|leaves out)\b[^.;]*\bnode-worker", sentence), where


def test_skip_worker_check_catches_a_wrong_description() -> None:
    assert says_what_skip_worker_does("do not import the worker environment (TensorFlow: seconds)") != ""
    assert says_what_skip_worker_does("skips the worker checks on the login node and on the node") != ""

"""The import boundaries are enforced, not just written down.

``lint-imports`` (import-linter, contracts in pyproject.toml; deploy/dev/test.sh runs it next to
ruff and mypy) must pass on the tree, and each contract must fail when a copy of the tree breaks
it. Two rules import-linter cannot state are checked here directly: every module of ``bridge/``
is classified (job-side, login-only or test support) the same way in the contracts and in
``bridge/__init__.py``, and no module but ``bridge/shell.py`` starts a process through ``os``,
``pty``, ``multiprocessing`` or ``asyncio`` (calls, not imports: no import contract sees them).
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.shell import CommandResult, run_command

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def contracts() -> dict[str, dict[str, Any]]:
    """The contracts in pyproject.toml, by id."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def lint_imports(root: Path) -> CommandResult:
    """``lint-imports`` with ``root``'s pyproject.toml, on the packages under ``root``."""
    return run_command(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "HOME": str(root)},
        check=False,
        cwd=root,
    )


def verdicts(output: str) -> dict[str, str]:
    """Contract name -> KEPT or BROKEN, from lint-imports' summary lines."""
    return {m[1]: m[2] for m in re.finditer(r"^(.+?) (KEPT|BROKEN)(?: \(.*\))?$", output, re.MULTILINE)}


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(REPO)
    names = {contract["name"] for contract in contracts().values()}
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdicts(result.stdout) == dict.fromkeys(names, "KEPT")


#: (file, the line appended to it, the id of the one contract that line breaks)
VIOLATIONS = [
    ("bridge/cli.py", "import worker.job", "bridge-no-worker"),
    ("bridge/logs.py", "import tensorflow", "bridge-no-worker"),
    ("worker/trainer/page.py", "import bridge.spool", "trainer-self-contained"),
    ("worker/trainer/page.py", "from worker import memory", "trainer-self-contained"),
    ("bridge/atomic.py", "import bridge.errors", "atomic-stdlib-only"),
    ("bridge/schedulers/base.py", "from bridge import protocol", "schedulers-no-messaging"),
    ("worker/gpumon.py", "import subprocess", "subprocess-only-in-shell"),
    ("bridge/rodan.py", "import bridge.config", "job-side-not-login-only"),
    ("worker/job.py", "from bridge import ledger", "job-side-not-login-only"),
    ("bridge/chain/link.py", "import bridge.ops.status", "job-side-not-login-only"),
    ("bridge/intake.py", "import bridge.testing", "testing-not-in-product"),
    ("bridge/ops/probe.py", "from bridge.ops import doctor", "ops-doctor-layers"),  # the cycle there was
    ("bridge/ops/checks.py", "import bridge.ops.probe", "ops-doctor-layers"),
    ("consumers/verify.py", "from worker.trainer._keras import BACKEND", "consumers-public-worker"),
]


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bridge/, worker/, consumers/ and pyproject.toml, copied once; each test breaks one file and restores it."""
    root = tmp_path_factory.mktemp("tree")
    for package in ("bridge", "worker", "consumers"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(("path", "line", "contract_id"), VIOLATIONS, ids=[f"{v[2]}:{v[0]}" for v in VIOLATIONS])
def test_a_deliberate_violation_breaks_its_contract(tree_copy: Path, path: str, line: str, contract_id: str) -> None:
    target = tree_copy / path
    original = target.read_text()
    target.write_text(f"{original}\n{line}  # a deliberate violation\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        target.write_text(original)
    broken = contracts()[contract_id]["name"]
    assert result.returncode != 0, result.stdout
    assert {name for name, verdict in verdicts(result.stdout).items() if verdict == "BROKEN"} == {broken}
    importer = path.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout  # the report names the offending module


def test_a_cycle_through_a_new_module_breaks_the_ops_layers(tree_copy: Path) -> None:
    """doctor imports its probe job; a module that imports doctor back, imported by the probe job,
    closes a cycle (doctor -> probe -> the new module -> doctor): the layers contract sees it."""
    loop = tree_copy / "bridge" / "ops" / "loop_back.py"
    probe = tree_copy / "bridge" / "ops" / "probe.py"
    original = probe.read_text()
    loop.write_text("from bridge.ops import doctor  # a deliberate cycle\n")
    probe.write_text(f"{original}\nfrom bridge.ops import loop_back  # a deliberate cycle\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        probe.write_text(original)
        loop.unlink()
    broken = {name for name, verdict in verdicts(result.stdout).items() if verdict == "BROKEN"}
    assert result.returncode != 0, result.stdout
    assert broken == {contracts()["ops-doctor-layers"]["name"]}
    assert "bridge.ops.loop_back" in result.stdout  # the report names the chain through it
    assert lint_imports(tree_copy).returncode == 0  # and the copy, restored, keeps every contract again


def test_consumers_may_import_no_private_worker_module() -> None:
    """The contract lists every private module of worker/ (import-linter cannot say ``worker.**._*``)."""
    private = set()
    for path in (REPO / "worker").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        private_at = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
        if private_at:  # the outermost private module or package
            private.add(".".join(parts[: private_at[0] + 1]))
    assert private, "worker/ has no private module: the check found nothing (worker.trainer._keras is one)"
    assert set(contracts()["consumers-public-worker"]["forbidden_modules"]) == private


# --------------------------------------------------------------------------- every module classified


def bridge_modules() -> set[str]:
    """The modules and packages directly under bridge/ (bridge/__init__.py aside)."""
    found = {p.stem for p in (REPO / "bridge").glob("*.py") if p.name != "__init__.py"}
    found |= {p.parent.name for p in (REPO / "bridge").glob("*/__init__.py")}
    return found


def short(names: list[str]) -> set[str]:
    return {name.removeprefix("bridge.") for name in names if name.startswith("bridge.")}


def docstring_kind(kind: str) -> set[str]:
    """The modules bridge/__init__.py lists in the paragraph that starts with ``kind``."""
    doc = ast.get_docstring(ast.parse((REPO / "bridge" / "__init__.py").read_text())) or ""
    paragraphs = [p for p in doc.split("\n\n") if p.startswith(kind)]
    assert len(paragraphs) == 1, f"bridge/__init__.py has no one paragraph starting with {kind!r}"
    return set(re.findall(r"``(\w+)``", paragraphs[0].split(":", 1)[1]))


def test_every_bridge_module_is_job_side_login_only_or_test_support() -> None:
    layers = contracts()["job-side-not-login-only"]
    job_side = short(layers["source_modules"])
    login_only = short(layers["forbidden_modules"])
    test_support = short(contracts()["testing-not-in-product"]["forbidden_modules"])
    assert "worker" in layers["source_modules"]  # the whole worker runs inside jobs
    assert not job_side & login_only and not (job_side | login_only) & test_support
    assert job_side | login_only | test_support == bridge_modules(), "classify the new module in pyproject.toml"
    assert docstring_kind("Job-side") == job_side
    assert docstring_kind("Login-only") == login_only
    assert docstring_kind("Test support") == test_support


# --------------------------------------------------------------------------- starting a process


#: Calls that start a process without the subprocess module.
PROCESS_STARTERS = {
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"},
    "pty": {"spawn", "fork"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}
OS_PREFIXES = ("exec", "spawn")
#: Modules whose import alone means starting processes.
PROCESS_MODULES = {"multiprocessing", "concurrent.futures.process"}


def process_starts(source: str) -> list[str]:
    """Where ``source`` starts a process other than through bridge.shell: ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [(node.value.id, node.attr)]
        else:
            continue
        for module, attr in names:
            top = module.split(".")[0]
            starter = attr is not None and (
                attr in PROCESS_STARTERS.get(top, set()) or (top == "os" and attr.startswith(OS_PREFIXES))
            )
            if starter or module in PROCESS_MODULES or top == "multiprocessing":
                found.append(f"{node.lineno}: {module}{'.' + attr if attr else ''}")
    return found


def test_the_process_check_finds_each_way_to_start_a_process() -> None:
    source = (
        "import os\nimport multiprocessing\nfrom os import execvp\nfrom asyncio import create_subprocess_exec\n"
        "import pty\nos.system('x')\nos.spawnv(0, 'x', [])\npty.spawn('x')\nos.path.join('a')\n"
    )
    assert process_starts(source) == [
        "2: multiprocessing",
        "3: os.execvp",
        "4: asyncio.create_subprocess_exec",
        "6: os.system",
        "7: os.spawnv",
        "8: pty.spawn",
    ]


#: The named exceptions: bridge/logs.py forks the small process that relays what is left of
#: file descriptor 2 after the worker died (capture_native_stderr). It runs no program (no exec),
#: so there is no command, output or timeout for bridge.shell to own. bridge/ops/run_check.py (the
#: crontab entry) replaces itself with bash running the packaged run_check.sh: no child is started,
#: so there is nothing to time out or capture, and cron sees the script's own exit status.
ALLOWED_STARTS = {"bridge/logs.py": ["os.fork"], "bridge/ops/run_check.py": ["os.execve"]}


def test_only_bridge_shell_starts_processes() -> None:
    offenders = {}
    for path in sorted([*(REPO / "bridge").rglob("*.py"), *(REPO / "worker").rglob("*.py")]):
        if path == REPO / "bridge" / "shell.py":
            continue
        allowed = ALLOWED_STARTS.get(str(path.relative_to(REPO)), [])
        found = [f for f in process_starts(path.read_text()) if f.split(": ", 1)[1] not in allowed]
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, "start processes through bridge.shell"

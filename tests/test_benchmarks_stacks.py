"""The benchmark code that runs the original trainer's stack (Python 3.7, TensorFlow 1.14, Keras 2.3.1:
benchmarks/original_stack/) cannot run its real path here: that stack is built from PyPI on first use.
What can rot without it is checked instead: the scripts' options parse, every module and name they
import (at the top or inside functions) exists, and the code the Python 3.7 side runs (the ported
trainer, the shared Timeline, bench_step.py's original case) is Python 3.7 that the Python 3.7 of the
set-up's consumer environment compiles, its Timeline working there."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import consumers
from tests.support.bridge import REPO

BENCHMARKS = REPO / "benchmarks"
ORIGINAL_TRAINER = BENCHMARKS / "original_stack" / "original_trainer.py"
#: The scripts whose real path builds or runs the original trainer's stack.
SCRIPTS = ("bench_trainer.py", "bench_step.py")
#: A Python 3.7 of the project's set-up (deploy/dev/setup.sh builds it; not built: the test fails).
PYTHON_37_CONSUMER = "tf2.5.1-py3.7"
#: Imported only by name here: importing them would start TensorFlow.
HEAVY = {"tensorflow", "keras", "jax"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_options_parse(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--quick" in done.stdout


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """Every ``import m`` (as ``(m, [])``) and ``from m import a, b`` (``(m, [a, b])``) anywhere in ``tree``."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            assert node.module is not None
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _top_level_names(path: Path) -> set[str]:
    """The names a module's source binds at its top level (in ``if``/``try`` blocks too)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.If | ast.Try):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return names


def _missing(module: str, names: list[str]) -> list[str]:
    """What of ``from module import names`` does not exist (the project's modules are read, not run)."""
    if module.split(".")[0] in HEAVY:  # find_spec of a submodule would import the package
        return [] if importlib.util.find_spec(module.split(".")[0]) is not None else [module]
    spec = importlib.util.find_spec(module)
    if spec is None:
        return [module]
    if not names:
        return []
    origin = Path(spec.origin) if spec.origin else None
    if origin is not None and origin.is_relative_to(REPO):
        defined = _top_level_names(origin)
        package = spec.submodule_search_locations is not None
        return [
            f"{module}.{name}"
            for name in names
            if name not in defined and not (package and importlib.util.find_spec(f"{module}.{name}") is not None)
        ]
    imported = importlib.import_module(module)
    return [f"{module}.{name}" for name in names if not hasattr(imported, name)]


def _original_code() -> str:
    """bench_step.py's ``ORIGINAL_CODE``: the program its original case runs in the stack's Python."""
    for node in ast.walk(ast.parse((BENCHMARKS / "bench_step.py").read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ORIGINAL_CODE" for t in node.targets
        ):
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError("bench_step.py has no ORIGINAL_CODE")


@pytest.mark.parametrize("script", [*SCRIPTS, "original_stack/original_trainer.py"])
def test_imports_resolve(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts' own directory: timeline, tables, ...
    monkeypatch.syspath_prepend(str(BENCHMARKS / "original_stack"))  # bench_step.py's original case
    path = BENCHMARKS / script
    tree = ast.parse(path.read_text())
    imports = _imports(tree)
    if script == "bench_step.py":  # the original case's program, a string run by the stack's Python
        imports += _imports(ast.parse(_original_code()))
    if script.startswith("original_stack/"):  # Keras 2.3.1's modules are not this Keras': names only
        imports = [(module, []) if module.startswith("keras") else (module, names) for module, names in imports]
    missing = [gap for module, names in imports for gap in _missing(module, names)]
    assert not missing, f"{script} imports what does not exist: {missing}"


def test_python37_side() -> None:
    """The Python 3.7 side compiles under Python 3.7, and the shared Timeline records there."""
    python = consumers.by_name(PYTHON_37_CONSUMER).python()
    original_code = _original_code()
    program = f"""
import json, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
for path in ({str(ORIGINAL_TRAINER)!r}, {str(BENCHMARKS / "timeline.py")!r}):
    with open(path) as handle:
        compile(handle.read(), path, "exec")
compile({original_code!r}, "ORIGINAL_CODE", "exec")
from timeline import timeline_class
class Callback:
    model = "the model"
events, history, models = [], [], []
timeline = timeline_class(Callback)(events, history, models.append)
timeline.on_train_begin()
timeline.on_epoch_begin(0)
timeline.on_train_batch_begin(0)
timeline.on_train_batch_end(0)
timeline.on_test_begin()
timeline.on_test_end()
timeline.on_epoch_end(0, {{"val_accuracy": 1}})
timeline.on_train_end()
print(json.dumps({{"version": list(sys.version_info[:2]), "events": [e[:2] for e in events],
                  "history": history, "models": models}}))
"""
    done = subprocess.run([str(python), "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == [3, 7]
    assert result["events"] == [
        ["train_begin", None],
        ["epoch_begin", 0],
        ["batch_begin", 0],
        ["batch_end", 0],
        ["test_begin", None],
        ["test_end", None],
        ["epoch_end", 0],
        ["train_end", None],
    ]
    assert result["history"] == [{"val_accuracy": 1.0}]
    assert result["models"] == ["the model"]

"""The worker environment as an Apptainer image (deploy/apptainer/).

Apptainer is not installable on the development machine (Debian 12 has no package, and no release
can be downloaded here), so: the definition is parsed, and its ``%files`` and ``%post`` are run as
Apptainer would run them, with ``/opt`` moved into a temporary directory and the dependencies taken
from the test environment instead of downloaded; its ``%test`` then runs in what was built. The
wrapper runs with a stand-in ``apptainer`` that records its arguments and runs the plain
interpreter, by hand, under ``doctor``, and as ``HPC_WORKER_PYTHON`` of a real request on both
schedulers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib

from bridge.config import load_config
from bridge.ops.doctor import check_worker
from bridge.spool import safe_key
from tests import stub_worker
from tests.support.bridge import FAST_SETTINGS, REPO, bridge_environ, run_bridge
from tests.support.cluster import Cluster, cancel_ledger_jobs
from tests.support.wait import wait_until

APPTAINER_DIR = REPO / "deploy" / "apptainer"
DEFINITION = APPTAINER_DIR / "hpc-worker.def"
WRAPPER = APPTAINER_DIR / "worker-python"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
INSTALLED = version("hpc-bridge")
IN_IMAGE_PYTHON = "/opt/hpc-worker/bin/python"
WORKER_VERSION = ("-m", "worker", "--version")
WORKER_RUN = ("-m", "worker", "run")


@dataclass
class Definition:
    header: dict[str, str]
    sections: dict[str, list[str]]

    @property
    def arguments(self) -> dict[str, str]:
        pairs = [line.strip().partition("=") for line in self.sections["arguments"] if line.strip()]
        return {name: value for name, _, value in pairs}

    def render(self, text: str, **build_args: str) -> str:
        """``text`` with ``{{ NAME }}`` replaced as ``apptainer build --build-arg NAME=...`` does."""
        values = {**self.arguments, **build_args}
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], text)

    def commands(self, section: str) -> list[str]:
        return [line.strip() for line in self.sections[section] if line.strip() and not line.strip().startswith("#")]


def parse_definition(text: str) -> Definition:
    """An Apptainer definition: ``Key: value`` header lines, then ``%section`` blocks."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            assert current not in sections, f"%{current} twice"
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
        elif line.strip() and not line.startswith("#"):
            key, sep, value = line.partition(":")
            assert sep, f"not a header line: {line!r}"
            header[key.strip()] = value.strip()
    return Definition(header, sections)


@pytest.fixture(scope="module")
def definition() -> Definition:
    return parse_definition(DEFINITION.read_text())


def test_the_definition_has_a_header_and_the_sections_apptainer_runs(definition: Definition) -> None:
    assert list(definition.header) == ["Bootstrap", "From"]
    assert definition.header["Bootstrap"] == "docker"
    assert definition.render(definition.header["From"]) == "python:3.11-slim-bookworm"
    for section in ("arguments", "labels", "help", "files", "post", "environment", "runscript", "test"):
        assert definition.commands(section), f"%{section} is empty"
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", DEFINITION.read_text()))
    assert used == set(definition.arguments), "every build argument has a default, and every default is used"


def test_the_defaults_fit_pyproject(definition: Definition) -> None:
    python = definition.arguments["PYTHON"]
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("."))) >= tuple(map(int, minimum.split(".")))
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert definition.arguments["EXTRA"] in extras
    assert "worker" in extras  # the CPU build the README names
    license_label = [ln.split()[1] for ln in definition.commands("labels") if "licenses" in ln.split()[0]]
    assert license_label == [PYPROJECT["project"]["license"]["text"]]


def test_post_installs_nothing_but_this_package_with_a_worker_extra(definition: Definition) -> None:
    """No second list of requirements to drift from pyproject.toml: every pip install in %post is
    pip itself or this package (copied in by %files) with the EXTRA pyproject defines."""
    installs = [shlex.split(c) for c in definition.commands("post") if " pip install " in f" {c} "]
    assert len(installs) == 2, installs
    wanted: list[str] = []
    for words in installs:
        words = words[words.index("install") + 1 :]
        wanted.extend(w for w in words if not w.startswith("-"))
    source_root = os.path.commonpath([dest for _src, dest in files(definition)])
    assert wanted == ["pip", f"{source_root}[{{{{ EXTRA }}}}]"]
    assert not any("requirements" in c for c in definition.commands("post"))


def files(definition: Definition) -> list[tuple[str, str]]:
    pairs = [tuple(line.split()) for line in definition.commands("files")]
    assert all(len(p) == 2 for p in pairs), pairs
    return [(src, dest) for src, dest in pairs]


def test_files_bring_everything_the_package_build_reads(definition: Definition) -> None:
    sources = {src for src, _dest in files(definition)}
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], "LICENSE"}
    needed |= {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert needed <= sources
    assert all((REPO / src).exists() for src in sources)
    assert all(dest == f"/opt/hpc-bridge-src/{src}" for src, dest in files(definition))


def test_the_interpreter_is_the_same_everywhere(definition: Definition) -> None:
    """%runscript, %test, %environment and the wrapper's default name one interpreter."""
    assert definition.commands("runscript") == [f'exec {IN_IMAGE_PYTHON} "$@"']
    assert all(c.startswith(f"{IN_IMAGE_PYTHON} ") for c in definition.commands("test"))
    environment = "\n".join(definition.commands("environment"))
    assert f'PATH="{Path(IN_IMAGE_PYTHON).parent}:$PATH"' in environment
    assert "PYTHONNOUSERSITE=1" in environment
    assert f"HPC_APPTAINER_PYTHON:-{IN_IMAGE_PYTHON}" in WRAPPER.read_text()


@pytest.mark.training  # %test imports TensorFlow in a fresh interpreter
def test_the_definition_builds_and_passes_its_own_test(definition: Definition, tmp_path: Path) -> None:
    """%files, %post and %test as ``apptainer build --build-arg EXTRA=worker`` runs them, with /opt
    moved under a temporary root. Offline: the new environment sees the test environment's packages
    (except hpc-bridge itself) through a .pth file, so pip finds every requirement satisfied."""
    root = tmp_path / "root"

    def inside(text: str) -> str:
        return definition.render(text, EXTRA="worker").replace("/opt/", f"{root}/opt/")

    for src, dest in files(definition):
        target = Path(inside(dest))
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / src, target)
    # The image's `python`: this interpreter's base installation, not the test environment.
    shims = tmp_path / "shims"
    shims.mkdir()
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (shims / "python").symlink_to(base)
    deps = tmp_path / "deps"
    deps.mkdir()
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)))
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("hpc_bridge", "__editable__", "__pycache__")):
            (deps / entry.name).symlink_to(entry)
    venv = Path(inside(IN_IMAGE_PYTHON)).parent.parent
    # Made before %post (which makes it again, with pip) to hold the .pth file.
    subprocess.run([str(shims / "python"), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    version_dir = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version_dir / "site-packages" / "zz-test-deps.pth").write_text(f"{deps}\n")
    env = {
        "PATH": f"{shims}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # build with the setuptools present: nothing to download
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    post = subprocess.run(
        ["sh", "-c", inside("\n".join(definition.sections["post"]))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert post.returncode == 0, post.stdout[-3000:] + post.stderr[-3000:]
    assert not Path(inside("/opt/hpc-bridge-src")).exists(), "%post removes the copied source"
    python = venv / "bin" / "python"
    tests = [
        subprocess.run(["sh", "-c", inside(c)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        for c in definition.commands("test")
    ]
    assert [t.returncode for t in tests] == [0] * len(tests), [t.stderr[-2000:] for t in tests]
    assert tests[0].stdout.strip() == f"hpc-worker {INSTALLED}"
    probe = (
        "import importlib.metadata as m, worker; print(worker.__file__); "
        "print(sorted(r.split(';')[0].replace(' ', '') "
        "for r in m.requires('hpc-bridge') if 'extra == \"worker\"' in r))"
    )
    where, requires = subprocess.run(
        [str(python), "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert where.startswith(str(venv)), "the worker comes from the built environment, not the checkout"
    expected = sorted(r.split(";")[0].replace(" ", "") for r in PYPROJECT["project"]["optional-dependencies"]["worker"])
    assert requires == repr(expected)


# --- the wrapper ---------------------------------------------------------------------------------


def test_the_wrapper_passes_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed: run 'bash deploy/dev/setup.sh', which installs it")
    done = subprocess.run(["shellcheck", str(WRAPPER)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    assert os.access(WRAPPER, os.X_OK)


@dataclass
class Installed:
    """The wrapper installed as docs/upgrade.md lays out an image: ENV/bin/python + its settings."""

    python: Path
    image: Path
    calls: Path  # what the stand-in apptainer was called with: one argument a line, '---' after each

    def arguments(self) -> list[list[str]]:
        text = self.calls.read_text() if self.calls.exists() else ""
        return [call.strip("\n").split("\n") for call in text.split("---\n") if call.strip()]


def install_wrapper(tmp_path: Path, real_python: str, settings: dict[str, str | None] | None = None) -> Installed:
    """The wrapper as ENV/bin/python, and a stand-in ``apptainer`` that records its arguments, checks
    their shape (``exec [OPTIONS] IMAGE PYTHON ARGS``), and runs ``real_python ARGS``."""
    env_dir = tmp_path / "envs" / "worker-image"
    (env_dir / "bin").mkdir(parents=True)
    image = env_dir / "hpc-worker.sif"
    image.write_bytes(b"not really an image")
    calls = tmp_path / "apptainer-calls"
    fake = tmp_path / "fake-apptainer"
    fake.write_text(
        "#!/bin/sh\n"
        f"{{ printf '%s\\n' \"$@\"; echo ---; }} >> {shlex.quote(str(calls))}\n"
        '[ "$1" = exec ] || exit 99\n'
        "shift\n"
        f'while [ "$#" -gt 0 ] && [ "$1" != {shlex.quote(str(image))} ]; do shift; done\n'
        f'[ "$2" = {IN_IMAGE_PYTHON} ] || exit 98\n'
        "shift 2\n"
        f'exec {shlex.quote(real_python)} "$@"\n'
    )
    fake.chmod(0o755)
    python = env_dir / "bin" / "python"
    shutil.copy2(WRAPPER, python)
    lines = {"HPC_APPTAINER_IMAGE": str(image), "HPC_APPTAINER": str(fake), **(settings or {})}
    text = "# written by the test\n" + "".join(f"{k}={v}\n" for k, v in lines.items() if v is not None)
    (python.parent / "worker-python.env").write_text(text)
    return Installed(python, image, calls)


def run_wrapper(installed: Installed, *args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_APPTAINER")}
    env.update(environ)
    return subprocess.run(
        [str(installed.python), *args], capture_output=True, text=True, timeout=120, env=env, cwd=installed.image.parent
    )


def test_the_wrapper_runs_the_interpreter_in_the_image(tmp_path: Path) -> None:
    installed = install_wrapper(tmp_path, sys.executable, {"HPC_APPTAINER_BIND": "/project/lab,/scratch"})
    done = run_wrapper(installed, *WORKER_VERSION)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hpc-worker {INSTALLED}"
    assert installed.arguments() == [
        ["exec", "--nv", "--bind", "/project/lab,/scratch", str(installed.image), IN_IMAGE_PYTHON, *WORKER_VERSION]
    ]


def test_the_wrapper_keeps_every_argument_as_it_came(tmp_path: Path) -> None:
    installed = install_wrapper(tmp_path, sys.executable)
    done = run_wrapper(installed, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", "a b", "*", "$HOME", "")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["a b", "*", "$HOME", ""]


def test_the_environment_wins_over_the_settings_file(tmp_path: Path) -> None:
    installed = install_wrapper(tmp_path, sys.executable, {"HPC_APPTAINER_BIND": "/from/file"})
    done = run_wrapper(
        installed,
        "-c",
        "pass",
        HPC_APPTAINER_NV="no",
        HPC_APPTAINER_BIND="/from/environment",
        HPC_APPTAINER_ARGS="--cleanenv  --rocm",
    )
    assert done.returncode == 0, done.stderr
    assert installed.arguments() == [
        [
            "exec",
            "--bind",
            "/from/environment",
            "--cleanenv",
            "--rocm",
            str(installed.image),
            IN_IMAGE_PYTHON,
            "-c",
            "pass",
        ]
    ]


@pytest.mark.parametrize(
    "settings,environ,status,message",
    [
        ({"HPC_APPTAINER_IMAGE": None}, {}, 2, "HPC_APPTAINER_IMAGE is not set"),
        ({"HPC_APPTAINER_IMAGE": "relative.sif"}, {}, 2, "HPC_APPTAINER_IMAGE must be an absolute path"),
        ({"HPC_APPTAINER_IMAGE": "/nonexistent/hpc-worker.sif"}, {}, 2, "/nonexistent/hpc-worker.sif does not exist"),
        ({"HPC_APPTAINER_IMAGE_TYPO": "x"}, {}, 2, "not a setting of this wrapper: HPC_APPTAINER_IMAGE_TYPO"),
        ({}, {"HPC_APPTAINER_NV": "maybe"}, 2, "HPC_APPTAINER_NV must be yes or no"),
        ({"HPC_APPTAINER": None}, {"PATH": "/usr/bin:/bin"}, 127, "neither apptainer nor singularity is on PATH"),
    ],
    ids=["no-image", "relative-image", "missing-image", "unknown-setting", "bad-nv", "no-apptainer"],
)
def test_a_wrong_setting_stops_at_once_saying_which(
    settings: dict[str, str | None], environ: dict[str, str], status: int, message: str, tmp_path: Path
) -> None:
    installed = install_wrapper(tmp_path, sys.executable, settings)
    if shutil.which("apptainer", path=environ.get("PATH")) or shutil.which("singularity", path=environ.get("PATH")):
        environ = {**environ, "PATH": str(tmp_path)}  # a machine that has them: none on this PATH
    done = run_wrapper(installed, "-c", "pass", **environ)
    assert done.returncode == status, done.stderr
    assert message in done.stderr
    assert installed.arguments() == [], "apptainer is never run"


@pytest.mark.training  # the probe imports TensorFlow in the worker environment
def test_doctor_checks_the_worker_through_the_wrapper(tmp_path: Path) -> None:
    """doctor's probe, through the wrapper, in the real worker environment (TensorFlow imported)."""
    installed = install_wrapper(tmp_path, sys.executable)
    config = load_config(
        environ={
            "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
            "RODAN_HOST": "rodan.example.org",
            "RODAN_USER": "hpc@example.org",
            "RODAN_PASSWORD": "a-password-for-the-apptainer-tests",
            "HPC_SPOOL_DIR": str(tmp_path / "spool"),
        }
    )
    check = check_worker(replace(config, worker_python=str(installed.python)))
    assert check.status == "ok", check
    assert f"hpc-bridge {INSTALLED}, worker.trainer imports" in check.found
    [call] = installed.arguments()
    assert call[:4] == ["exec", "--nv", str(installed.image), IN_IMAGE_PYTHON] and call[4] == "-c"


def test_a_request_runs_through_the_wrapper_on_the_cluster(
    cluster: Cluster, broker_url, standin, queues, rodan, sample_inputs, tmp_path
) -> None:
    """HPC_WORKER_PYTHON is the installed wrapper; its stand-in apptainer runs tests/stub_worker.py
    (real parameter file, real reply path, no TensorFlow): the reply comes back, and the job ran
    ``apptainer exec --nv --bind SPOOL IMAGE /opt/hpc-worker/bin/python -m worker run PARAMS``."""
    spool = tmp_path / "spool"
    stub = stub_worker.install(tmp_path / "stub")
    installed = install_wrapper(tmp_path, str(stub), {"HPC_APPTAINER_BIND": str(spool)})
    env = bridge_environ(
        broker_url, standin, queues, spool, HPC_SCHEDULER=cluster.name, HPC_WORKER_PYTHON=str(installed.python)
    )
    corr = "f" + str(uuid.uuid4())[1:]  # tests/stub_worker.py publishes a reply itself for this one
    rodan.publish_request(sample_inputs("new", n_layers=1), FAST_SETTINGS, correlation_id=corr)
    try:
        done = run_bridge(env, "check")
        assert done.returncode == 0, done.stderr[-2000:]
        replies = wait_until(rodan.drain, 180, 1, "the job's reply")
        assert [c for c, _b, _h in replies] == [corr]
        assert "error" not in json.loads(replies[0][1])  # models, not an error reply
        params = spool / "params" / f"{safe_key(corr)}.json"
        assert installed.arguments() == [
            ["exec", "--nv", "--bind", str(spool), str(installed.image), IN_IMAGE_PYTHON, *WORKER_RUN, str(params)]
        ]
        assert str(installed.python) in (spool / "jobs" / safe_key(corr) / "job.sh").read_text()
    finally:
        cancel_ledger_jobs(spool, cluster)

"""``hpc-bridge upgrade``: the bridge and a new worker environment of one version, ``current`` switched
under the spool's lock (bridge/ops/upgrade.py, docs/upgrade.md).

The end-to-end test installs this repository's wheel into a fresh virtual environment outside the
checkout, then upgrades it to a wheel of the same code with a test version from a local wheelhouse,
as an operator would. Its worker environments are built with ``--extra none`` (the package alone):
the ``worker`` extra (TensorFlow) took 110 s to install here with pip's cache warm, and is checked by
the worker's own tests. It reaches no service: the commands run with nothing but the test
environment's ``bin`` on PATH (doctor finds no scheduler command) and settings that name closed ports.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bridge.config import load_config
from bridge.ops.node_build import BUILT_ON_FILE, NodeBuildFailed, build_on_node, build_script
from bridge.ops.upgrade import MARKER, UpgradeFailed, extra_for, spool_locked, with_extra, worker_layout
from bridge.spool import Spool
from tests.support.cluster import Cluster
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
#: What a wheel is built from (pyproject.toml's packages and readme).
SHIPPED = {"pyproject.toml", "README.md", "LICENSE", "bridge", "worker"}
NEW_VERSION = "99.0.0+upgradetest"  # above any real version: pip takes it as an upgrade


# --- the parts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("packages", "extra"),
    [
        (["tensorflow-cpu", "numpy"], "worker"),
        (["tensorflow", "nvidia-cudnn-cu12", "nvidia-cublas-cu12"], "worker-gpu"),
        (["tensorflow"], "worker"),
        (["keras", "jax", "jaxlib", "jax-cuda12-plugin", "nvidia_cudnn_cu12"], "worker-jax"),
        (["tensorflow_cpu", "jax"], "worker"),  # the dev set-up: JAX's CPU wheels beside TensorFlow
        (["hpc-bridge", "pika"], "worker"),
    ],
)
def test_the_extra_follows_the_installed_packages(packages: list[str], extra: str) -> None:
    chosen, why = extra_for(packages)
    assert chosen == extra
    assert why


@pytest.mark.parametrize(
    ("source", "extra", "requirement"),
    [
        ("hpc-bridge==0.3.0", "worker-gpu", "hpc-bridge[worker-gpu]==0.3.0"),
        ("hpc-bridge", "worker", "hpc-bridge[worker]"),
        ("hpc-bridge[dev] >=0.3", "worker", "hpc-bridge[dev,worker]>=0.3"),
        ("hpc-bridge @ git+https://example.org/b.git@v0.2.0", "worker", "hpc-bridge[worker] @ git+https://example.org/b.git@v0.2.0"),
        ("git+https://example.org/b.git@v0.2.0", "worker-jax", "hpc-bridge[worker-jax] @ git+https://example.org/b.git@v0.2.0"),
        ("/w/hpc_bridge-0.3.0-py3-none-any.whl", "worker", "/w/hpc_bridge-0.3.0-py3-none-any.whl[worker]"),
        ("./hpc-bridge", "worker-gpu", "./hpc-bridge[worker-gpu]"),
        ("hpc-bridge==0.3.0", "none", "hpc-bridge==0.3.0"),
    ],
)  # fmt: skip
def test_the_worker_gets_the_source_with_its_extra(source: str, extra: str, requirement: str) -> None:
    assert with_extra(source, extra) == requirement


def test_a_worker_python_outside_the_envs_layout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "worker-venv" / "bin").mkdir(parents=True)
    with pytest.raises(UpgradeFailed, match="The first upgrade from a worker-venv"):
        worker_layout(str(tmp_path / "worker-venv" / "bin" / "python"))
    (tmp_path / "envs" / "current" / "bin").mkdir(parents=True)  # a directory, not the link
    with pytest.raises(UpgradeFailed, match="current symlink"):
        worker_layout(str(tmp_path / "envs" / "current" / "bin" / "python"))


def test_an_apptainer_wrapper_is_left_to_its_own_procedure(tmp_path: Path) -> None:
    (tmp_path / "envs" / "worker-1" / "bin").mkdir(parents=True)
    (tmp_path / "envs" / "worker-1" / "bin" / "worker-python.env").write_text("HPC_APPTAINER_IMAGE=/x.sif\n")
    (tmp_path / "envs" / "current").symlink_to("worker-1")
    with pytest.raises(UpgradeFailed, match="--skip-worker"):
        worker_layout(str(tmp_path / "envs" / "current" / "bin" / "python"))


def test_the_layout_is_found_through_current(tmp_path: Path) -> None:
    (tmp_path / "envs" / "worker-1" / "bin").mkdir(parents=True)
    (tmp_path / "envs" / "current").symlink_to("worker-1")
    layout = worker_layout(str(tmp_path / "envs" / "current" / "bin" / "python"))
    assert layout.link == tmp_path / "envs" / "current"
    assert layout.current() == (tmp_path / "envs" / "worker-1").resolve()
    assert layout.interpreter == Path("bin/python")


def test_the_daemon_holding_the_lock_is_named_instead_of_waited_for(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    # A process whose command line is the daemon's (`hpc-bridge run`), named in the lock file as a pass does.
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "hpc-bridge", "run"])
    try:
        with (spool.root / "bridge.lock").open("a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            held.write(f"{daemon.pid}\n")
            held.flush()
            with pytest.raises(UpgradeFailed, match=r"systemctl --user stop hpc-bridge@second\.service"):
                with spool_locked(spool, 5, "second"):
                    pytest.fail("the lock was taken while the daemon held it")
    finally:
        daemon.kill()
        daemon.wait()


# --- end to end -------------------------------------------------------------------------------------


@dataclass
class Site:
    root: Path
    venv: Path  # the bridge's environment
    wheel: Path  # the new version's wheel, in `wheelhouse`
    wheelhouse: Path
    envs: Path
    spool: Path
    credentials: Path
    environ: dict[str, str]

    def upgrade(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [self.venv / "bin" / "hpc-bridge", "--credentials", self.credentials, "upgrade", self.wheel]
        offline = ["--pip-arg=--no-index", f"--pip-arg=--find-links={self.wheelhouse}"]  # a site's wheelhouse
        return self.run(*argv, *offline, *args, timeout=900)

    def run(self, *argv: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(a) for a in argv], env=self.environ, cwd=self.root, capture_output=True, text=True, timeout=timeout
        )
        print(f"$ {' '.join(str(a) for a in argv)}\n{result.stdout}{result.stderr}")
        return result

    def bridge_version(self) -> str:
        return self.run(self.venv / "bin" / "hpc-bridge", "--version").stdout.strip()


def build_wheel(version: str, source: Path, out: Path) -> Path:
    """A wheel of this checkout with ``version``, built from a copy (a build writes into its tree)."""
    shutil.copytree(
        REPO,
        source,
        ignore=lambda d, names: [n for n in names if n == "__pycache__" or (Path(d) == REPO and n not in SHIPPED)],
    )
    pyproject = source / "pyproject.toml"
    text, changed = re.subn(r'(?m)^version = ".*"$', f'version = "{version}"', pyproject.read_text(), count=1)
    assert changed == 1
    pyproject.write_text(text)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("hpc_bridge-*.whl"))


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once it is closed


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    """This checkout's wheel installed in a fresh environment; one old worker environment behind `current`."""
    root = tmp_path / "site"
    root.mkdir()
    old_wheel = build_wheel(re.search(r'(?m)^version = "(.*)"$', (REPO / "pyproject.toml").read_text())[1],  # type: ignore[index]
                            root / "src-old", root / "dist-old")  # fmt: skip
    wheelhouse = root / "wheelhouse"  # the new version and every dependency: the pip runs use no index
    wheel = build_wheel(NEW_VERSION, root / "src-new", wheelhouse)
    # Its dependencies from set-up's wheelhouse (deploy/dev/setup.sh, var/wheelhouse): no index, no download.
    setup_wheels = ["--no-index", f"--find-links={REPO / 'var' / 'wheelhouse'}"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", *setup_wheels, "-d", wheelhouse, wheel], check=True, timeout=900
    )
    venv = root / "bridge-venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    offline = ["--no-index", f"--find-links={wheelhouse}"]
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", *offline, old_wheel], check=True, timeout=900
    )
    envs = root / "envs"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", envs / "worker-old"], check=True, timeout=300)
    (envs / "worker-old" / MARKER).write_text("none\n")
    (envs / "current").symlink_to("worker-old")
    spool = root / "spool"
    port = closed_port()
    credentials = root / "credentials.env"
    credentials.write_text(
        f"RABBITMQ_URL=amqp://guest:guest@127.0.0.1:{port}/%2F\nRODAN_HOST=127.0.0.1:{port}\nRODAN_SCHEME=http\n"
        "RODAN_USER=hpc@example.org\nRODAN_PASSWORD=upgrade-test-password\nHPC_RODAN_RETRIES=0\n"
        f"HPC_SPOOL_DIR={spool}\nHPC_WORKER_PYTHON={envs / 'current' / 'bin' / 'python'}\n"
    )
    credentials.chmod(0o600)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))}
    environ["PATH"] = str(venv / "bin")  # no scheduler command: doctor reaches no cluster
    try:
        yield Site(root, venv, wheel, wheelhouse, envs, spool, credentials, environ)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_upgrade_builds_the_worker_switches_current_under_the_lock_and_runs_doctor(site: Site) -> None:
    old_version = site.bridge_version()
    assert old_version != f"hpc-bridge {NEW_VERSION}"
    old_files = files_of(site.envs / "worker-old")

    # --dry-run: says what it would do, changes nothing.
    dry = site.upgrade("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"new version: {NEW_VERSION}" in dry.stdout
    assert "worker extra: none (recorded in" in dry.stdout
    assert "would build" in dry.stdout and "would hold" in dry.stdout
    assert sorted(p.name for p in site.envs.iterdir()) == ["current", "worker-old"]
    assert site.bridge_version() == old_version

    # A pass holds the spool's lock for longer than --lock-timeout: nothing switched, nothing left.
    site.spool.mkdir(mode=0o700)
    with (site.spool / "bridge.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        blocked = site.upgrade("--lock-timeout", "2")
    assert blocked.returncode == 1
    assert "waiting for it" in blocked.stdout
    assert "still held after 2 s" in blocked.stderr
    assert "nothing switched" in blocked.stdout
    assert os.readlink(site.envs / "current") == "worker-old"
    assert sorted(p.name for p in site.envs.iterdir()) == ["current", "worker-old"]
    assert site.bridge_version() == old_version  # the bridge is installed under the lock only

    # The upgrade itself.
    done = site.upgrade()
    built = [p for p in site.envs.iterdir() if p.name.startswith(f"worker-{NEW_VERSION}-")]
    assert len(built) == 1, done.stdout + done.stderr
    new = built[0]
    assert site.bridge_version() == f"hpc-bridge {NEW_VERSION}"
    assert os.readlink(site.envs / "current") == new.name
    assert (new / MARKER).read_text().strip() == "none"
    assert site.run(new / "bin" / "hpc-worker", "--version").stdout.strip() == f"hpc-worker {NEW_VERSION}"
    assert files_of(site.envs / "worker-old") == old_files
    # doctor ran, the new one, on the same settings: its worker line, its summary, its status.
    assert "running the new hpc-bridge doctor" in done.stdout
    assert re.search(r"(?m)^(ok|FAIL|warn|skip)\s+worker: .*" + re.escape(str(site.envs / "current")), done.stdout)
    assert re.search(r"(?m)^\d+ failed, \d+ warnings$", done.stdout)
    assert f"upgraded to {NEW_VERSION}; doctor exited {done.returncode}" in done.stdout

    # --skip-worker (a site whose worker is an Apptainer image): the bridge is reinstalled, no
    # worker environment is built, `current` stays where it was.
    envs_before = sorted(p.name for p in site.envs.iterdir())
    bridge_only = site.upgrade("--skip-worker")
    assert bridge_only.returncode == done.returncode, bridge_only.stdout + bridge_only.stderr
    assert "worker extra" not in bridge_only.stdout and f"creating {site.envs}" not in bridge_only.stdout
    assert f"upgraded to {NEW_VERSION}; doctor exited" in bridge_only.stdout
    assert sorted(p.name for p in site.envs.iterdir()) == envs_before
    assert os.readlink(site.envs / "current") == new.name

    # --python: the next worker environment is made by the interpreter named, not by current's.
    calls = site.root / "python-calls"
    chosen = site.root / "chosen-python" / "python3"
    chosen.parent.mkdir()
    chosen.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys._base_executable} "$@"\n')
    chosen.chmod(0o755)
    time.sleep(1.1)  # the environments' names carry the second they were built in
    rebuilt = site.upgrade("--python", str(chosen))
    assert rebuilt.returncode == done.returncode, rebuilt.stdout + rebuilt.stderr
    assert f"(from {chosen})" in rebuilt.stdout
    assert calls.read_text().split("\n")[0].endswith(f"-m venv {site.envs}/{os.readlink(site.envs / 'current')}")
    newest = site.envs / os.readlink(site.envs / "current")
    assert newest != new and newest.name.startswith(f"worker-{NEW_VERSION}-")
    assert site.run(newest / "bin" / "hpc-worker", "--version").stdout.strip() == f"hpc-worker {NEW_VERSION}"


def test_the_build_job_script_quotes_every_value(tmp_path: Path) -> None:
    odd = tmp_path / "it's a $HOME"
    odd.mkdir()
    calls = tmp_path / "calls"
    interpreter = odd / "python 3"  # records how the script called it, then fails: the script stops there
    interpreter.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {shlex.quote(str(calls))}\nexit 1\n')
    interpreter.chmod(0o755)
    new = odd / "worker-1"
    target = "hpc-bridge[worker] @ file:///wheels/it's here.whl"
    script = build_script(new, target, "worker", interpreter, ["--find-links=/a b", "--no-index"], odd)
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and "building worker-1 on " in ran.stdout
    assert calls.read_text().splitlines() == ["-I", "-m", "venv", str(new)]
    (pip,) = [line for line in script.splitlines() if " -m pip install " in line]
    assert shlex.split(pip) == [
        f"{new}/bin/python",
        "-I",
        "-m",
        "pip",
        "install",
        "--find-links=/a b",
        "--no-index",
        target,
    ]


def test_the_build_job_tunes_onednn_and_a_failed_tune_does_not_fail_the_build(tmp_path: Path) -> None:
    """The build job runs ``hpc-worker tune`` in the new environment (the oneDNN record its jobs read,
    so that they never measure); when tune fails the build still ends well, saying so. Catches a script
    without the tune step, or one that stops (set -e) at a failed tune."""
    new, out, calls = tmp_path / "worker-2", tmp_path / "out", tmp_path / "calls"
    out.mkdir()
    stub = (  # the new environment's hpc-worker: tune fails, --version answers
        f'#!/bin/sh\necho "hpc-worker $*" >> {shlex.quote(str(calls))}\n'
        '[ "$1" = tune ] && exit 1\necho "hpc-worker 9.9.9"\n'
    )
    interpreter = tmp_path / "python"  # "-I -m venv NEW" makes NEW/bin with a python and the stub
    interpreter.write_text(
        '#!/bin/sh\nmkdir -p "$4/bin" && printf "#!/bin/sh\\nexit 0\\n" > "$4/bin/python" && '
        f'printf %s {shlex.quote(stub)} > "$4/bin/hpc-worker" && chmod +x "$4/bin/python" "$4/bin/hpc-worker"\n'
    )
    interpreter.chmod(0o755)
    script = build_script(new, "hpc-bridge[worker]", "worker", interpreter, [], out)
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert calls.read_text().splitlines() == ["hpc-worker tune", "hpc-worker --version"]
    assert "hpc-worker tune failed: jobs keep TensorFlow's default oneDNN setting" in ran.stdout
    assert (out / "built-version").read_text().strip() == "hpc-worker 9.9.9"


def test_a_build_job_never_carries_a_password(tmp_path: Path) -> None:
    config = load_config(
        environ={
            "RABBITMQ_URL": "amqp://hpc:broker-pw@127.0.0.1:5672/%2F",
            "RODAN_HOST": "127.0.0.1:8000",
            "RODAN_SCHEME": "http",
            "RODAN_USER": "hpc@example.org",
            "RODAN_PASSWORD": "rodan-pw",
            "HPC_SPOOL_DIR": str(tmp_path / "spool"),
            "HPC_WORKER_PYTHON": sys.executable,
        }
    )
    submitted: list[Any] = []
    never = SimpleNamespace(render=lambda spec: "", submit=lambda *a: submitted.append(a), display_name="Slurm")
    index = "--index-url=https://hpc:broker-pw@pypi.example.org/simple"  # an operator's own index, same password
    with pytest.raises(NodeBuildFailed, match="would carry a password"):
        build_on_node(config, tmp_path / "w", "hpc-bridge", "none", sys.executable, [index], print, scheduler=never)  # type: ignore[arg-type]
    assert submitted == [] and list((tmp_path / "spool" / "jobs").iterdir()) == []


@pytest.mark.slow
def test_upgrade_builds_the_worker_in_a_job_on_a_compute_node(site: Site, cluster: Cluster) -> None:
    """--build-on-node: the scheduler's job, not the login node, makes the new environment, then the
    upgrade switches to it; a build that fails in the job leaves everything as it was."""
    with site.credentials.open("a") as f:
        f.write(f"HPC_SCHEDULER={cluster.name}\nHPC_GPU_RULES=none\n")
    site.environ["PATH"] = f"{site.venv / 'bin'}:{os.environ['PATH']}"  # the scheduler's commands too
    python = ["--python", sys._base_executable]  # a path the node runs (this machine is the node)

    # The job's pip has no wheelhouse: it fails on the node, and the upgrade stops before the switch.
    failed = site.run(
        site.venv / "bin" / "hpc-bridge", "--credentials", site.credentials, "upgrade", site.wheel,
        "--build-on-node", *python, "--pip-arg=--no-index", timeout=900,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stdout + failed.stderr
    kept = Path(folder_of(failed.stdout))
    assert kept.is_dir() and str(kept) in failed.stderr  # kept, and named in the error
    assert re.search(r"job \d+ ended FAILED", failed.stderr) and "No matching distribution" in failed.stderr
    assert os.readlink(site.envs / "current") == "worker-old"
    assert sorted(p.name for p in site.envs.iterdir()) == ["current", "worker-old"]  # the half-built one removed
    assert site.bridge_version() != f"hpc-bridge {NEW_VERSION}"

    done = site.upgrade("--build-on-node", *python)
    assert f"upgraded to {NEW_VERSION}; doctor exited" in done.stdout, done.stdout + done.stderr
    job_id = re.search(r"job (\d+) builds worker-", done.stdout)[1]  # type: ignore[index]
    new = site.envs / os.readlink(site.envs / "current")
    assert new.name.startswith(f"worker-{NEW_VERSION}-") and (new / MARKER).read_text().strip() == "none"
    assert (new / BUILT_ON_FILE).read_text().split()[-1] == f"job={job_id}"  # written inside that job
    built_by = Path(folder_of(done.stdout))
    wait_until(lambda: cluster.jobs_started(f"rodan-{built_by.name}") == [job_id], 30, what="accounting")
    assert not built_by.exists() and kept.is_dir()  # a build that worked leaves no folder behind
    assert site.run(new / "bin" / "hpc-worker", "--version").stdout.strip() == f"hpc-worker {NEW_VERSION}"
    assert site.bridge_version() == f"hpc-bridge {NEW_VERSION}"


def folder_of(output: str) -> str:
    """The build job's folder, as upgrade printed it."""
    return re.search(r"\(its folder: (\S+)\)", output)[1]  # type: ignore[index]

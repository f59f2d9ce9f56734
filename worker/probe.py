"""``python -m worker.probe PROBE_FILE``: what ``hpc-bridge doctor --job`` runs on a compute node.

It runs inside a batch job rendered from the bridge's own template (the same directives,
prologue and ``HPC_WORKER_PYTHON`` as a Rodan request's job) and checks, from the node, what a
training job needs there:

- spool: the file the login node wrote is readable here, and the folders the worker writes in
  (the outbox, the job folders, the parameter files, the run directories) take a file;
- lock: ``flock`` and ``fcntl`` locks work in the spool, and a lock the login node holds is seen;
- worker: the worker environment imports ``worker.trainer`` and TensorFlow, and TensorFlow sees
  the GPUs the job was given; on a CPU node with TensorFlow, the oneDNN choice is measured for this
  kind of node unless a record of it exists (``hpc-worker tune``, worker/onednn.py), so that the
  jobs never measure;
- scratch: node-local scratch for checkpoints exists, takes a file and has room;
- rodan: Rodan answers an unauthenticated GET over HTTP(S) (the worker downloads the inputs,
  unless HPC_INPUTS_FETCH=login has the bridge fetch them on the login node: then a node without a
  route is fine, and said so);
- broker: the broker's port accepts a TCP connection (else the outbox carries the replies);
- continue: the job may continue itself as a training job does (Slurm requeue, or a successor
  job submitted from the node; the successor is cancelled at once).

The probe file holds no secret (Rodan's address, the broker's host and port; no password, no
token). Every finding is written to ``result.json`` beside it as soon as it is known, so the
login side gets what was found even when a later check kills the job (a Slurm requeue does).
Both files are typed records of bridge/handoff.py, which the login side (bridge/ops/probe.py)
uses too: :class:`~bridge.handoff.ProbeParameters` in, :class:`~bridge.handoff.ProbeResult` out.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import requests
import structlog

from bridge.handoff import (
    PROBE_HELD_LOCK_FILE,
    PROBE_RESULT_FILE,
    PROBE_RESULT_MARKER,
    PROBE_TOKEN_FILE,
    ProbeContinueState,
    ProbeFinding,
    ProbeParameters,
    ProbeRerun,
    ProbeResult,
)
from bridge.logs import configure_logging
from bridge.schedulers import get_scheduler, restart_variables, scratch_variables
from bridge.shell import CommandError, CommandNotFound, CommandTimeout, run_command
from bridge.spool import LOCK_FIX, NO_LOCKS, atomic_write_json, mount_of, read_json
from worker import onednn

log = structlog.get_logger("worker")

#: The exit status when the probe file cannot be read (as the worker's for a parameter file).
EXIT_UNREADABLE = 3
#: What the backend check prints before its JSON line.
BACKEND_MARKER = "HPC-PROBE-BACKEND "
#: Run by the worker's Python on the node: the Keras backend it chose (worker.trainer.backend),
#: its version, and the devices and GPUs it sees.
BACKEND_CODE = (
    "import importlib.util, json, os\n"
    "os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')\n"
    "from worker.trainer._keras import BACKEND\n"
    "if BACKEND == 'jax':\n"
    "    import jax\n"
    "    devices = jax.devices()\n"
    "    found = {'version': jax.__version__, 'gpus': sum(d.platform == 'gpu' for d in devices),\n"
    "             'cuda': any(importlib.util.find_spec(m) for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin')),\n"
    "             'devices': [str(d) for d in devices]}\n"
    "else:\n"
    "    import tensorflow as tf\n"
    "    devices = tf.config.list_physical_devices()\n"
    "    found = {'version': tf.__version__, 'gpus': sum(d.device_type == 'GPU' for d in devices),\n"
    "             'cuda': bool(tf.test.is_built_with_cuda()), 'devices': [d.name for d in devices]}\n"
    f"print({BACKEND_MARKER!r} + json.dumps({{'backend': BACKEND, **found}}))\n"
)
#: What each backend is called in findings, and what to install for its GPUs.
BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX"}
GPU_BUILDS = {
    "tensorflow": "a TensorFlow built for the nodes' CUDA driver (pip install 'hpc-bridge[worker-gpu]')",
    "jax": "JAX with its CUDA wheels (pip install 'hpc-bridge[worker-jax]')",
}
#: Seconds each of the two oneDNN measuring processes may take in the probe job (its time limit is
#: bridge/ops/probe.py's PROBE_MINUTES for every check together).
TUNE_TIMEOUT_S = 75.0
#: How much the scratch check writes (and removes).
SCRATCH_WRITE_BYTES = 1 << 20

Finding = ProbeFinding


def ok(found: str) -> Finding:
    return Finding(status="ok", found=found)


def fail(found: str, fix: str) -> Finding:
    return Finding(status="FAIL", found=found, fix=fix)


def warn(found: str, fix: str = "") -> Finding:
    return Finding(status="warn", found=found, fix=fix)


def skip(why: str) -> Finding:
    return Finding(status="skip", found=f"skipped: {why}")


def _error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


# --- spool -------------------------------------------------------------------------------------


def _write_probe_file(directory: Path) -> None:
    """Write, fsync, rename, read back and remove a small file in ``directory``."""
    name = f".probe-{socket.gethostname()}-{os.getpid()}"
    first, second = directory / f"{name}.tmp", directory / name
    data = f"hpc-bridge probe from {socket.gethostname()}\n".encode()
    try:
        fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(first, second)
        if second.read_bytes() != data:
            raise OSError(errno.EIO, "the file read back differs from what was written")
    finally:
        for path in (first, second):
            with contextlib.suppress(OSError):
                path.unlink()


def check_spool(params: ProbeParameters, result: ProbeResult) -> Finding:
    probe_dir = params.dir
    try:
        result.token = params.path(PROBE_TOKEN_FILE).read_text().strip()
    except OSError as exc:
        return fail(
            f"cannot read {params.path(PROBE_TOKEN_FILE)}, which the login node wrote ({_error(exc)})",
            "HPC_SPOOL_DIR must be the same directory on the login node and the compute nodes (shared storage "
            "mounted at the same path)",
        )
    problems, written = [], []
    for label, directory in params.write_dirs.items():
        try:
            if label == "runs":
                directory.mkdir(parents=True, exist_ok=True)  # as the worker's RunDirectory.create does
            _write_probe_file(directory)
            written.append(f"{label} ({directory})")
        except OSError as exc:
            problems.append(f"{label} ({directory}): {_error(exc)}")
    if problems:
        return fail(
            "cannot write in " + "; ".join(problems),
            "the worker writes its replies (outbox), continuation records (jobs), parameter files (params) and "
            "run directories (runs: HPC_RUNS_DIR) from the node: make them writable there by the user the jobs "
            "run as, at the same path as on the login node",
        )
    point, fstype = mount_of(probe_dir)
    where = f" on {fstype} ({point})" if fstype else ""
    return ok(
        f"read the login node's file, and wrote, fsynced, renamed and removed a file in {', '.join(written)}{where}"
    )


# --- locks -------------------------------------------------------------------------------------


def check_lock(params: ProbeParameters, result: ProbeResult) -> Finding:
    probe_dir = params.dir
    point, fstype = mount_of(probe_dir)
    mount = f"{point or probe_dir} ({fstype or 'unknown filesystem'})"
    for kind, path in (("flock", probe_dir / "node-flock.lock"), ("fcntl", probe_dir / "node-fcntl.lock")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            return fail(f"cannot create {path} ({_error(exc)})", "see node-spool")
        try:
            if kind == "flock":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno in NO_LOCKS:
                return fail(f"{kind} locks are not supported on {mount} ({_error(exc)})", LOCK_FIX)
            return fail(f"{kind} lock on {path} failed ({_error(exc)})", "see node-spool")
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
    held = params.path(PROBE_HELD_LOCK_FILE)
    try:
        fd = os.open(held, os.O_RDWR)
    except OSError as exc:
        return warn(f"flock and fcntl locks work on {mount}; cannot open {held} ({_error(exc)})")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return ok(f"flock and fcntl locks work on {mount}, and the lock the login node holds is seen from the node")
    except OSError as exc:
        return warn(f"flock and fcntl locks work on {mount}; testing the login node's lock failed ({_error(exc)})")
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return warn(
            f"flock and fcntl locks work on {mount}, but the lock the login node holds is not seen from the node "
            "(locks are local to each machine, e.g. NFS mounted with local_lock)",
            "harmless while one machine runs the bridge; never run hpc-bridge on two machines over this spool",
        )
    finally:
        os.close(fd)


# --- worker environment and GPUs ---------------------------------------------------------------


def judge_gpus(
    asked: int, seen: int, *, gres: str = "", cuda: bool = True, visible: str = "", backend: str = "tensorflow"
) -> Finding:
    """Whether the worker's backend sees the GPUs the job was given (``asked``: the count in its GPU request)."""
    request = f" ({gres})" if gres else ""
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""
    name = BACKEND_NAMES.get(backend, backend)
    if seen < asked:
        build = "" if cuda else f" (this {name} is built without CUDA)"
        return fail(
            f"the job asked for {asked} GPU(s){request} and was given them{shown}, but {name} sees {seen}{build}",
            f"give the worker environment {GPU_BUILDS.get(backend, 'a GPU build of its backend')}, or load the CUDA "
            "modules in HPC_JOB_PROLOGUE; compare with nvidia-smi in a job",
        )
    if seen > asked:
        return warn(
            f"{name} sees {seen} GPU(s) but the job asked for {asked}{request}: jobs are not confined to "
            "the GPUs they were given, so a training may use another job's GPU",
            "ask the administrators to confine jobs to their GPUs (Slurm: ConstrainDevices=yes in cgroup.conf)",
        )
    return ok(f"{seen} of the {asked} GPU(s) asked{request} visible to {name}{shown}")


def check_worker(params: ProbeParameters, result: ProbeResult) -> Finding:
    python = sys.executable
    fix = (
        "install the worker into HPC_WORKER_PYTHON's environment on a path the nodes see (pip install "
        "'hpc-bridge[worker]'), or load what it needs (modules, CUDA) in HPC_JOB_PROLOGUE"
    )
    timeout = params.import_timeout_s
    try:
        answer = run_command([python, "-c", BACKEND_CODE], timeout=timeout, env=dict(os.environ))
    except CommandTimeout:
        return fail(f"{python} took over {timeout:g} s to import worker.trainer and its Keras backend on the node", fix)
    except CommandNotFound:
        return fail(f"{python} cannot be started again on the node", fix)
    except CommandError as exc:
        lines = [line for line in exc.output.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else exc.reason
        return fail(f"{python} cannot import worker.trainer and its Keras backend on the node: {last[:300]}", fix)
    lines = [line for line in answer.stdout.splitlines() if line.startswith(BACKEND_MARKER)]
    if not lines:
        return fail(f"{python} printed no Keras backend on the node: {answer.stdout.strip()[:200]!r}", fix)
    found = json.loads(lines[-1][len(BACKEND_MARKER) :])
    result.backend = found
    gpus = judge_gpus(
        params.gpus_asked,
        int(found["gpus"]),
        gres=params.gres,
        cuda=bool(found.get("cuda", True)),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        backend=found["backend"],
    )
    name = BACKEND_NAMES.get(found["backend"], found["backend"])
    devices = ", ".join(found.get("devices", [])) or "none"
    status, fixes, tuned = gpus.status, [gpus.fix] if gpus.fix else [], ""
    if status != "FAIL":  # measured once the environment is right (jobs never measure: worker/onednn.py)
        tuning = onednn.remember(onednn.tuning_dir(), timeout_s=TUNE_TIMEOUT_S)
        tuned = f"; {tuning.describe()}"
        if tuning.outcome == "failed":
            status = "warn"
            fixes.append(
                "jobs keep TensorFlow's default oneDNN setting (slower on some CPUs): run 'hpc-worker tune' in a job"
            )
    return replace(
        gpus,
        status=status,
        found=f"{python}: worker.trainer imports on Keras' {name} backend ({name} {found['version']}; "
        f"devices: {devices}); {gpus.found}{tuned}",
        fix="; ".join(fixes),
    )


# --- node-local scratch ------------------------------------------------------------------------


def scratch_candidates(configured: str | Path | None, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """Where the worker looks for node-local scratch, in its order (worker/job.py)."""
    found = [("HPC_NODE_LOCAL_DIR", str(configured or ""))]
    found += [(name, environ.get(name, "")) for name in (*scratch_variables(), "TMPDIR")]
    return [(name, value) for name, value in found if value]


def check_scratch(params: ProbeParameters, result: ProbeResult) -> Finding:
    minimum = params.min_scratch_bytes
    notes: list[str] = []
    for name, value in scratch_candidates(params.node_local_dir, os.environ):
        base = Path(value)
        if not base.is_dir():
            if name == "HPC_NODE_LOCAL_DIR":
                notes.append(f"{name} {base} does not exist on this node")
            continue
        try:
            fd, path = tempfile.mkstemp(prefix="hpc-probe-", dir=base)
            try:
                os.write(fd, b"\0" * SCRATCH_WRITE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)
            stats = os.statvfs(base)
        except OSError as exc:
            return warn(
                f"cannot write in {name} {base} ({_error(exc)}): checkpoints go straight to the run directory",
                "make node-local scratch writable for jobs, or set HPC_NODE_LOCAL_DIR to one that is",
            )
        free = stats.f_bavail * stats.f_frsize
        point, fstype = mount_of(base)
        where = f"{name} {base} ({fstype or 'unknown'} at {point or '?'}, {free / 2**30:.1f} GiB free)"
        prefix = "; ".join(notes) + ": using " if notes else ""
        if free < minimum:
            return warn(
                f"{prefix}{where}: under the {minimum / 2**30:.1f} GiB a training's checkpoints may need",
                "point HPC_NODE_LOCAL_DIR at a larger node-local disk, or ask for more scratch",
            )
        if notes:  # the configured directory is missing here: the worker falls back, as this did
            return warn(f"{prefix}{where}: writable", "create HPC_NODE_LOCAL_DIR on the nodes, or unset it")
        return ok(f"{where}: writable")
    where = ", ".join(["HPC_NODE_LOCAL_DIR", *(f"${name}" for name in scratch_variables())])
    what = "; ".join(notes) or f"neither {where} nor $TMPDIR names a directory here"
    return warn(
        f"no node-local scratch ({what}): checkpoints go straight to the run directory on shared storage",
        "set HPC_NODE_LOCAL_DIR to a node-local disk (e.g. /local/scratch) for faster checkpoints",
    )


# --- Rodan and the broker, over the network ----------------------------------------------------


#: What check_rodan's finding says when the node cannot reach Rodan and HPC_INPUTS_FETCH=login.
FETCHED_ON_LOGIN = (
    "HPC_INPUTS_FETCH=login: the bridge fetches every input on the login node, so the jobs need no route to Rodan"
)


def check_rodan(params: ProbeParameters, result: ProbeResult) -> Finding:
    """Whether the node reaches Rodan; with HPC_INPUTS_FETCH=login, not reaching it is fine (the
    login side's doctor adds, from its own check of Rodan, which setting the site needs)."""
    found = _reach_rodan(params)
    if params.inputs_fetch != "login":
        return found
    if found.status == "ok":
        return ok(
            f"{found.found}; HPC_INPUTS_FETCH=login is not needed here (with node, the jobs download their "
            "inputs and the login node keeps none in the spool)"
        )
    return ok(f"{found.found}; {FETCHED_ON_LOGIN}")


def _reach_rodan(params: ProbeParameters) -> Finding:
    url = params.rodan_url.rstrip("/") + "/api/auth/me/"
    timeout = params.rodan_timeout_s
    fix = (
        "the worker downloads the inputs from Rodan inside the job (HPC_INPUTS_FETCH=node): open the route from the "
        "nodes to RODAN_HOST, export the site's proxy (HTTPS_PROXY=...) in HPC_JOB_PROLOGUE, or set "
        "HPC_INPUTS_FETCH=login so that the bridge fetches the inputs on the login node"
    )
    with requests.Session() as session:  # honours HTTPS_PROXY and REQUESTS_CA_BUNDLE as the worker does
        try:
            response = session.get(url, timeout=timeout, allow_redirects=False)
        except requests.exceptions.SSLError as exc:
            return fail(
                f"GET {url} from the node: TLS failed ({_error(exc)})",
                "the node does not trust Rodan's certificate: install its CA on the nodes, or export "
                "REQUESTS_CA_BUNDLE=/path/to/ca.pem in HPC_JOB_PROLOGUE",
            )
        except requests.exceptions.RequestException as exc:
            return fail(f"GET {url} from the node failed ({_error(exc)})", fix)
    code = response.status_code
    if code in (200, 401, 403):
        return ok(f"GET {url} answered {code} from the node (no credentials sent: Rodan answers)")
    if 300 <= code < 400:
        where = response.headers.get("Location", "?")
        return warn(f"GET {url} answered {code}, redirecting to {where}", "check RODAN_SCHEME and RODAN_HOST")
    if code >= 500:
        return warn(f"GET {url} answered {code} from the node: reachable, but Rodan (or a proxy) fails now")
    return warn(f"GET {url} answered {code} from the node", "check RODAN_HOST points at Rodan's API")


def check_broker(params: ProbeParameters, result: ProbeResult) -> Finding:
    host, port = params.broker.host, params.broker.port
    try:
        with socket.create_connection((host, port), timeout=10.0):
            pass
    except OSError as exc:
        return warn(
            f"{host}:{port} is not reachable from the node ({_error(exc)}): replies will be carried by the "
            "outbox: the worker stages each reply in the spool's outbox and hpc-bridge publishes it from the "
            "login node on its next pass",
            "nothing to do; to have replies published from the nodes at once, open the route to the broker",
        )
    return ok(f"{host}:{port} accepts a TCP connection from the node: the worker publishes its replies itself")


# --- continuing a job --------------------------------------------------------------------------


def check_continue(params: ProbeParameters, result: ProbeResult, save: Callable[[], None]) -> Finding:
    """Ask the scheduler to continue this job, as a training job at its time limit does.

    Slurm's requeue ends this process soon after it is accepted: the result is saved before asking.
    """
    cont = params.continuation
    if cont is None:
        return skip(params.continuation_skipped or "jobs do not continue")
    job_id = os.environ.get("HPC_JOB_ID", "")
    if not job_id:
        return fail("HPC_JOB_ID is not set: the batch script is not the bridge's template", "see probe-job")
    state = result.continuation = ProbeContinueState(mode=cont.mode, state="asking", job_id=job_id)
    save()
    access = cont.job
    scheduler = get_scheduler(access.scheduler, timeout_s=access.timeout_s, options=access.options)
    try:
        next_id = scheduler.continue_job(job_id, access.script, access.spec)
    except Exception as exc:  # whatever the scheduler says, it is the finding
        state.state, state.error = "refused", _error(exc)
        return _refused(cont.mode, scheduler.display_name, _error(exc))
    if next_id == job_id:
        state.state = "requeued"
        return ok(f"{scheduler.display_name} accepted the requeue of job {job_id} from the node")
    state.state, state.successor = "submitted", next_id
    save()
    try:
        scheduler.cancel(next_id)
        state.cancelled = True
    except Exception as exc:  # the login side cancels it too
        state.cancel_error = _error(exc)
    return ok(f"job {next_id} submitted from the node, held on job {job_id} (the way a job continues), and cancelled")


def _refused(mode: str, label: str, error: str) -> Finding:
    if mode == "requeue":
        return fail(
            f"{label} refused to requeue the job from the node ({error})",
            "this cluster does not let jobs requeue themselves (or strips --requeue): set "
            "HPC_SLURM_CONTINUE=successor so a job continues by submitting its successor",
        )
    return fail(
        f"submitting the successor job from the node failed ({error})",
        "a job continues by submitting its successor from the node: the nodes must be submit hosts (Grid "
        "Engine: qconf -as HOST) and the submit command must be on PATH in the job (HPC_JOB_PROLOGUE)",
    )


# --- the probe ---------------------------------------------------------------------------------

#: The checks in the order they run (continue last, on its own: it may end the job); doctor prints
#: them in PROBE_CHECKS' order.
CHECKS: tuple[tuple[str, Callable[[ProbeParameters, ProbeResult], Finding]], ...] = (
    ("spool", check_spool),
    ("lock", check_lock),
    ("broker", check_broker),
    ("rodan", check_rodan),
    ("scratch", check_scratch),
    ("worker", check_worker),
)
CONTINUE_CHECK = "continue"


def _save(path: Path, result: ProbeResult) -> None:
    try:
        atomic_write_json(path, result.to_json())
    except OSError:  # the login side then looks for it in the job's output
        print(PROBE_RESULT_MARKER + json.dumps(result.to_json(), sort_keys=True), flush=True)


def run_probe(probe_file: Path) -> int:
    try:
        params = ProbeParameters.from_json(read_json(probe_file))
    except (OSError, ValueError) as exc:  # another version's probe file, or none: nothing to check with
        log.error("probe_unreadable", path=str(probe_file), error=_error(exc))
        return EXIT_UNREADABLE
    result_path = params.path(PROBE_RESULT_FILE)
    job_id = os.environ.get("HPC_JOB_ID", "")
    restart = next((os.environ[v] for v in restart_variables() if os.environ.get(v)), "0")
    if result_path.exists():  # run again: requeued, or a successor that was not cancelled in time
        with contextlib.suppress(OSError, ValueError):
            earlier = ProbeResult.from_json(read_json(result_path))
            earlier.reran = ProbeRerun(job_id=job_id, restart=restart, at=time.time())
            _save(result_path, earlier)
        log.info("probe_reran", job_id=job_id, restart=restart)
        return 0
    result = ProbeResult(
        host=socket.gethostname(), job_id=job_id, restart=restart, python=sys.executable, started_at=time.time()
    )
    for name, check in CHECKS:
        try:
            finding = check(params, result)
        except Exception as exc:  # a defect of the probe: say so, and go on with the next check
            finding = fail(f"the check itself failed ({_error(exc)})", "report this as a bug of hpc-bridge")
        result.checks[name] = finding
        log.info("probe_check", check=name, status=finding.status, found=finding.found)
        _save(result_path, result)
    try:
        finding = check_continue(params, result, lambda: _save(result_path, result))
    except Exception as exc:
        finding = fail(f"the check itself failed ({_error(exc)})", "report this as a bug of hpc-bridge")
    result.checks[CONTINUE_CHECK] = finding
    result.finished = True
    result.finished_at = time.time()
    _save(result_path, result)
    log.info("probe_finished", checks={name: f.status for name, f in result.checks.items()})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.probe",
        description="Check a compute node for hpc-bridge (what 'hpc-bridge doctor --job' submits).",
    )
    parser.add_argument("probe_file", type=Path, help="the probe file hpc-bridge doctor --job wrote in the spool")
    args = parser.parse_args(argv)
    configure_logging(level="INFO", stream=sys.stdout, component="worker")
    return run_probe(args.probe_file)


if __name__ == "__main__":
    raise SystemExit(main())

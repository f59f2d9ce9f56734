"""The parameter file: what the bridge hands a batch job, as one typed, versioned record.

``Intake`` builds a :class:`JobParameters` for each request it submits and writes
``to_json()`` to ``SPOOL/params/KEY.json`` (0600: it holds the Rodan token). The worker
reads it back with :meth:`JobParameters.from_json`, removes the token from disk, and a
job that continues itself rewrites it for the next job (one more ``continuation.count``,
its ``run_dir``). Nothing else reads or writes the file.

``from_json`` is strict: a field missing or unknown at any level, or a value of the wrong
type, is a ``ValueError`` naming the field (``rodan.timeout_s``); it never fills in a
default. The defaults below are the only copy of each: the bridge's configuration
(``bridge/config.py``) starts from them, and so do the classes that take the values.

``version`` is :data:`PARAMETERS_VERSION` in every file written. It changes whenever a
field is added, removed, renamed or changes meaning, and a worker reads only its own
version: a file of a newer version means the worker environment is older than the bridge
that submitted the job, one of an older version (or without ``version``, written before
the field existed) the other way round. Either is refused with a message saying so; the
worker logs ``params_unreadable`` and exits 3, and the bridge answers the request when the
job ends (docs/upgrade.md: the bridge and the worker environment are one version).

The probe job of ``hpc-bridge doctor --job`` has a hand-off of its own, in both directions,
typed and versioned the same way (:data:`PROBE_VERSION`): the login side (bridge/ops/probe.py)
writes a :class:`ProbeParameters` to the probe file, the node (worker/probe.py) reads it and
writes its findings as a :class:`ProbeResult`, which the login side reads back. The probe
folder's file names, the node's check names and the defaults are defined here, once.

This module runs on both sides: it imports nothing of the bridge but the protocol, the
spool's key and the job spec.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from bridge.protocol import Generation, InputRole, RequestSettings
from bridge.schedulers.base import CONTINUE_BY, JobSpec
from bridge.spool import safe_key

#: The layout of the parameter file this code writes and reads (see the module's docstring).
PARAMETERS_VERSION = 3  # 2: generation 3 ("rodan3"), the inputs' "roles", "reply_part_bytes"; 3: "inputs_dir"
#: What messages about a parameter file call it.
PARAMETER_FILE = "parameter file"

#: HPC_MAX_REPLY_BYTES: the largest reply published (RabbitMQ 3.8-3.13 refuse a larger message).
DEFAULT_MAX_REPLY_BYTES = 128 * 1024 * 1024
#: HPC_REPLY_PART_BYTES: the largest part of a reply sent in parts (generation 3; RabbitMQ 4.x: 16 MiB).
DEFAULT_REPLY_PART_BYTES = 8 * 1024 * 1024
#: HPC_RODAN_TIMEOUT (seconds per request to Rodan) and HPC_RODAN_RETRIES (after the first try).
DEFAULT_RODAN_TIMEOUT_S = 30.0
DEFAULT_RODAN_RETRIES = 4
#: HPC_MAX_INPUT_BYTES: the largest input file downloaded (raw bytes on the wire).
DEFAULT_MAX_INPUT_BYTES = 1 << 30
#: HPC_MAX_INPUT_PIXELS: the largest input image opened (width x height).
DEFAULT_MAX_INPUT_PIXELS = 400_000_000
#: HPC_INPUTS_FETCH: who downloads the inputs from Rodan: the job on its compute node ("node"), or the
#: bridge on the login node at intake, into the spool ("login": nodes without a route to Rodan).
INPUTS_FETCH_CHOICES = ("node", "login")
DEFAULT_INPUTS_FETCH = "node"
#: HPC_SCHEDULER_TIMEOUT: how long one scheduler command may take (the job's own too, when it continues).
DEFAULT_SCHEDULER_TIMEOUT_S = 60.0
#: HPC_MAX_CONTINUATIONS: continuation jobs one request may use before it gets an error reply.
DEFAULT_MAX_CONTINUATIONS = 5
#: The run directory's folders that only a continuation needs: removed once the request is answered
#: (the worker) or cancelled in Rodan (the bridge). The log, the models and the TensorBoard events stay.
TRANSIENT_RUN_FOLDERS = ("inputs", "checkpoints")
#: HPC_CHECKPOINT_SYNC: how often node-local checkpoints are copied to the run directory (seconds).
DEFAULT_CHECKPOINT_SYNC_S = 60.0


@dataclass(frozen=True, kw_only=True)
class RodanAccess:
    """Where the worker downloads the inputs (``rodan``)."""

    base_url: str
    token: str  # "" once the worker has read it: the token never stays on disk
    timeout_s: float = DEFAULT_RODAN_TIMEOUT_S
    retries: int = DEFAULT_RODAN_RETRIES

    @classmethod
    def from_json(cls, data: object) -> RodanAccess:
        r = _Reader(data, cls, "rodan.")
        return cls(
            base_url=r.text("base_url"),
            token=r.text("token"),
            timeout_s=r.number("timeout_s"),
            retries=r.integer("retries"),
        )


@dataclass(frozen=True, kw_only=True)
class BrokerAccess:
    """Where the worker publishes the reply (``broker``); the outbox takes it when that fails."""

    url: str
    ca_file: str | None = None

    @classmethod
    def from_json(cls, data: object) -> BrokerAccess:
        r = _Reader(data, cls, "broker.")
        return cls(url=r.text("url"), ca_file=r.optional_text("ca_file"))


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """What the worker may download (one file, raw bytes) and open (one image, pixels): ``limits``."""

    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS

    @classmethod
    def from_json(cls, data: object) -> InputLimits:
        r = _Reader(data, cls, "limits.")
        return cls(max_input_bytes=r.integer("max_input_bytes"), max_input_pixels=r.integer("max_input_pixels"))


@dataclass(frozen=True, kw_only=True)
class SchedulerAccess:
    """How the job asks its scheduler to run it again (``job``): the backend, its site options,
    the batch script and the spec it was rendered from. The probe job continues itself the same
    way (``continuation.job`` of the probe file)."""

    scheduler: str
    options: Mapping[str, str]
    timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S
    script: Path
    spec: JobSpec

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "options": dict(self.options),
            "timeout_s": self.timeout_s,
            "script": str(self.script),
            "spec": self.spec.to_json(),
        }

    @classmethod
    def from_json(cls, data: object, *, where: str = "job.", file: str = PARAMETER_FILE) -> SchedulerAccess:
        r = _Reader(data, cls, where, file)
        spec = _Reader(r.value("spec"), JobSpec, f"{where}spec.", file).data
        try:
            job_spec = JobSpec.from_json(spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file}: field '{where}spec' is not a job spec ({type(exc).__name__})") from None
        return cls(
            scheduler=r.text("scheduler"),
            options=r.texts("options"),
            timeout_s=r.number("timeout_s"),
            script=r.path("script"),
            spec=job_spec,
        )


@dataclass(frozen=True, kw_only=True)
class ContinuationState:
    """How far the request's chain of jobs has come (``continuation``): ``count`` continuations
    before this job, at most ``max``; checkpoints on node-local scratch, copied every ``sync_s``."""

    count: int = 0
    max: int = DEFAULT_MAX_CONTINUATIONS
    node_local_dir: Path | None = None
    sync_s: float = DEFAULT_CHECKPOINT_SYNC_S

    @property
    def exhausted(self) -> bool:
        """No continuation left: this job is the last one the request may use."""
        return self.count >= self.max

    def to_json(self) -> dict[str, Any]:
        node_local = str(self.node_local_dir) if self.node_local_dir is not None else None
        return {"count": self.count, "max": self.max, "node_local_dir": node_local, "sync_s": self.sync_s}

    @classmethod
    def from_json(cls, data: object) -> ContinuationState:
        r = _Reader(data, cls, "continuation.")
        return cls(
            count=r.integer("count"),
            max=r.integer("max"),
            node_local_dir=r.optional_path("node_local_dir"),
            sync_s=r.number("sync_s"),
        )


@dataclass(frozen=True, kw_only=True)
class JobParameters:
    """One request's parameter file. The bridge's settings it carries are named after them
    (``save_optimizer``: HPC_SAVE_OPTIMIZER, ``runs_shared``: HPC_RUNS_SHARED=group, ``seed``:
    HPC_TRAINING_SEED, None for one drawn per request)."""

    version: int = PARAMETERS_VERSION
    correlation_id: str
    reply_to: str
    generation: Generation
    inputs: Mapping[str, str]  # Rodan's input name -> its resource
    layers: tuple[tuple[str, str], ...]  # (input name, reply key), in training order; () for generation 3
    # Every input's role (protocol.InputRole), in the order the worker takes them: generation 3's
    # samples and starting models, whose layers are only known once the zips are opened.
    roles: Mapping[str, InputRole] = field(default_factory=dict)
    settings: RequestSettings
    rodan: RodanAccess
    broker: BrokerAccess
    spool: Path
    runs_dir: Path
    runs_shared: bool = False
    save_optimizer: bool = False
    mixed_precision: str = "off"  # HPC_MIXED_PRECISION: the trainer's TrainSettings.mixed_precision
    seed: int | None = None
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    reply_part_bytes: int | None = None  # HPC_REPLY_PART_BYTES for a reply in parts (generation 3), else None
    limits: InputLimits = field(default_factory=InputLimits)
    job: SchedulerAccess
    continuation: ContinuationState = field(default_factory=ContinuationState)
    run_dir: Path | None = None  # set once a first job created it: a continuation resumes there
    # HPC_INPUTS_FETCH=login: the folder where the bridge put every input (input_files' names); the job
    # reads them there and never connects to Rodan (the token is ""). None: the job downloads them.
    inputs_dir: Path | None = None
    created_at: float
    bridge_pid: int
    bridge_version: str  # the worker warns when its own differs (worker_version_mismatch)

    @property
    def key(self) -> str:
        return safe_key(self.correlation_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "correlation_id": self.correlation_id,
            "reply_to": self.reply_to,
            "generation": self.generation.value,
            "inputs": dict(self.inputs),
            "layers": [[name, key] for name, key in self.layers],
            "roles": {name: role.value for name, role in self.roles.items()},
            "settings": asdict(self.settings),
            "rodan": asdict(self.rodan),
            "broker": asdict(self.broker),
            "spool": str(self.spool),
            "runs_dir": str(self.runs_dir),
            "runs_shared": self.runs_shared,
            "save_optimizer": self.save_optimizer,
            "mixed_precision": self.mixed_precision,
            "seed": self.seed,
            "max_reply_bytes": self.max_reply_bytes,
            "reply_part_bytes": self.reply_part_bytes,
            "limits": asdict(self.limits),
            "job": self.job.to_json(),
            "continuation": self.continuation.to_json(),
            "run_dir": str(self.run_dir) if self.run_dir is not None else None,
            "inputs_dir": str(self.inputs_dir) if self.inputs_dir is not None else None,
            "created_at": self.created_at,
            "bridge_pid": self.bridge_pid,
            "bridge_version": self.bridge_version,
        }

    @classmethod
    def from_json(cls, data: object) -> JobParameters:
        """The parameter file ``data`` (parsed JSON). Raises ValueError naming what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"parameter file: must be a JSON object, not {_kind(data)}")
        check_version(data)
        r = _Reader(data, cls, "")
        return cls(
            version=r.integer("version"),
            correlation_id=r.text("correlation_id"),
            reply_to=r.text("reply_to"),
            generation=_generation(r.text("generation")),
            inputs=r.texts("inputs"),
            layers=_layers(r.value("layers")),
            roles=_roles(r.value("roles")),
            settings=_request_settings(r.value("settings")),
            rodan=RodanAccess.from_json(r.value("rodan")),
            broker=BrokerAccess.from_json(r.value("broker")),
            spool=r.path("spool"),
            runs_dir=r.path("runs_dir"),
            runs_shared=r.flag("runs_shared"),
            save_optimizer=r.flag("save_optimizer"),
            mixed_precision=r.text("mixed_precision"),
            seed=r.optional_integer("seed"),
            max_reply_bytes=r.integer("max_reply_bytes"),
            reply_part_bytes=r.optional_integer("reply_part_bytes"),
            limits=InputLimits.from_json(r.value("limits")),
            job=SchedulerAccess.from_json(r.value("job")),
            continuation=ContinuationState.from_json(r.value("continuation")),
            run_dir=r.optional_path("run_dir"),
            inputs_dir=r.optional_path("inputs_dir"),
            created_at=r.number("created_at"),
            bridge_pid=r.integer("bridge_pid"),
            bridge_version=r.text("bridge_version"),
        )


def input_files(inputs: Iterable[str], folder: Path) -> dict[str, Path]:
    """Input name -> its file in ``folder`` (``input-0``, ``input-1``, ... in the order of the names):
    the same names whoever downloads them, the job (into its run directory's ``inputs/``) or the
    bridge (HPC_INPUTS_FETCH=login, into ``JobParameters.inputs_dir``)."""
    return {name: folder / f"input-{index}" for index, name in enumerate(sorted(inputs))}


def check_version(data: Mapping[str, Any]) -> None:
    """Refuse a parameter file of another layout than this code's (``PARAMETERS_VERSION``)."""
    version = data.get("version")
    if version == PARAMETERS_VERSION:
        return
    fix = "install the same hpc-bridge version for the bridge and the worker environment (docs/upgrade.md)"
    written_by = data.get("bridge_version")
    by = f" by hpc-bridge {written_by}" if isinstance(written_by, str) and len(written_by) <= 64 else ""
    if version is None:
        raise ValueError(
            f"parameter file: it has no 'version' (written{by} before parameter files had one); this worker "
            f"reads version {PARAMETERS_VERSION}: {fix}"
        )
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"parameter file: field 'version' must be an integer, not {_kind(version)}")
    newer = "a newer" if version > PARAMETERS_VERSION else "an older"
    raise ValueError(
        f"parameter file: version {version} (written{by}, {newer} hpc-bridge than this worker, which reads "
        f"version {PARAMETERS_VERSION}): {fix}"
    )


# --- the probe job (hpc-bridge doctor --job) ----------------------------------------------------

#: The layout of the probe file and of the node's findings (changes as PARAMETERS_VERSION does).
PROBE_VERSION = 2  # 2: "inputs_fetch"
#: What the probe job runs, with the worker's Python: ``python -m worker.probe PROBE_FILE``.
PROBE_MODULE = "worker.probe"
#: The probe folder's files (``SPOOL/jobs/doctor-probe-ID/``), named here for both sides.
PROBE_FILE = "probe.json"  # the login side's ProbeParameters
PROBE_RESULT_FILE = "result.json"  # the node's ProbeResult, rewritten after every check
PROBE_TOKEN_FILE = "from-login"  # a random token the login side writes; the node reports what it read
PROBE_HELD_LOCK_FILE = "held.lock"  # the login side holds a flock on it while it waits
PROBE_SCRIPT_FILE = "job.sh"  # the batch script (the node continues the job with it)
#: When the node cannot write its result file, it prints the result after this marker in the job's output.
PROBE_RESULT_MARKER = "HPC-PROBE-RESULT "
#: The node's checks, in the order doctor prints them (``node-NAME``); the node runs each once.
PROBE_CHECKS = ("spool", "lock", "worker", "scratch", "rodan", "broker", "continue")
#: What a check of doctor's (and of the node's) can say.
CHECK_STATUSES = ("ok", "FAIL", "warn", "skip")
#: How long the node may take to import the worker and its Keras backend before node-worker fails.
DEFAULT_PROBE_IMPORT_TIMEOUT_S = 180.0
#: Less free node-local scratch than this warns (doctor --min-scratch).
DEFAULT_PROBE_MIN_SCRATCH_BYTES = 2 * 2**30
#: The longest the node (and doctor's own Rodan check) waits for Rodan's answer.
PROBE_RODAN_TIMEOUT_S = 15.0
#: What messages about the probe's files call them.
_PROBE_FILE = "probe file"
_RESULT_FILE = "probe result"


@dataclass(frozen=True, kw_only=True)
class BrokerAddress:
    """Where the broker listens (``broker``): no user, no password."""

    host: str
    port: int

    @classmethod
    def from_json(cls, data: object) -> BrokerAddress:
        r = _Reader(data, cls, "broker.", _PROBE_FILE)
        return cls(host=r.text("host"), port=r.integer("port"))


@dataclass(frozen=True, kw_only=True)
class ProbeContinuation:
    """How the node continues the probe job, as a training job at its limit does (``continuation``):
    ``mode`` is the scheduler's way (CONTINUE_BY: ``requeue`` or ``successor``)."""

    mode: str
    job: SchedulerAccess

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "job": self.job.to_json()}

    @classmethod
    def from_json(cls, data: object) -> ProbeContinuation:
        r = _Reader(data, cls, "continuation.", _PROBE_FILE)
        return cls(
            mode=r.choice("mode", CONTINUE_BY),
            job=SchedulerAccess.from_json(r.value("job"), where="continuation.job.", file=_PROBE_FILE),
        )


@dataclass(frozen=True, kw_only=True)
class ProbeParameters:
    """The probe file: what the node checks, and nothing secret (Rodan's address, the broker's host
    and port). ``write_dirs``: label -> a folder the worker writes in from the node."""

    version: int = PROBE_VERSION
    dir: Path  # the probe folder, beside the probe file
    write_dirs: Mapping[str, Path]
    gpus_asked: int
    gres: str
    node_local_dir: Path | None  # HPC_NODE_LOCAL_DIR
    min_scratch_bytes: int = DEFAULT_PROBE_MIN_SCRATCH_BYTES
    rodan_url: str
    rodan_timeout_s: float = PROBE_RODAN_TIMEOUT_S
    inputs_fetch: str = DEFAULT_INPUTS_FETCH  # HPC_INPUTS_FETCH: whether the jobs need Rodan at all
    broker: BrokerAddress
    import_timeout_s: float = DEFAULT_PROBE_IMPORT_TIMEOUT_S
    continuation: ProbeContinuation | None  # None: jobs never continue (continuation_skipped says why)
    continuation_skipped: str = ""

    def path(self, name: str) -> Path:
        """A file of the probe folder (``PROBE_RESULT_FILE``, ...)."""
        return self.dir / name

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "dir": str(self.dir),
            "write_dirs": {label: str(path) for label, path in self.write_dirs.items()},
            "gpus_asked": self.gpus_asked,
            "gres": self.gres,
            "node_local_dir": str(self.node_local_dir) if self.node_local_dir is not None else None,
            "min_scratch_bytes": self.min_scratch_bytes,
            "rodan_url": self.rodan_url,
            "rodan_timeout_s": self.rodan_timeout_s,
            "inputs_fetch": self.inputs_fetch,
            "broker": asdict(self.broker),
            "import_timeout_s": self.import_timeout_s,
            "continuation": self.continuation.to_json() if self.continuation is not None else None,
            "continuation_skipped": self.continuation_skipped,
        }

    @classmethod
    def from_json(cls, data: object) -> ProbeParameters:
        """The probe file ``data`` (parsed JSON). Raises ValueError naming what is wrong."""
        r = _Reader(_probe_version(data, _PROBE_FILE), cls, "", _PROBE_FILE)
        continuation = r.value("continuation")
        return cls(
            version=r.integer("version"),
            dir=r.path("dir"),
            write_dirs={label: Path(path) for label, path in r.texts("write_dirs").items()},
            gpus_asked=r.integer("gpus_asked"),
            gres=r.text("gres"),
            node_local_dir=r.optional_path("node_local_dir"),
            min_scratch_bytes=r.integer("min_scratch_bytes"),
            rodan_url=r.text("rodan_url"),
            rodan_timeout_s=r.number("rodan_timeout_s"),
            inputs_fetch=r.choice("inputs_fetch", INPUTS_FETCH_CHOICES),
            broker=BrokerAddress.from_json(r.value("broker")),
            import_timeout_s=r.number("import_timeout_s"),
            continuation=ProbeContinuation.from_json(continuation) if continuation is not None else None,
            continuation_skipped=r.text("continuation_skipped"),
        )


@dataclass(frozen=True, kw_only=True)
class ProbeFinding:
    """What one of the node's checks found: its status (CHECK_STATUSES), what it found, what to fix."""

    status: str
    found: str
    fix: str = ""

    @classmethod
    def from_json(cls, data: object, where: str = "") -> ProbeFinding:
        r = _Reader(data, cls, where, _RESULT_FILE)
        return cls(status=r.choice("status", CHECK_STATUSES), found=r.text("found"), fix=r.text("fix"))


#: How far the node's request to continue the probe job came (``ProbeContinueState.state``).
CONTINUE_STATES = ("asking", "refused", "requeued", "submitted")


@dataclass(kw_only=True)
class ProbeContinueState:
    """The node's request to continue its job (``continuation`` of the result): saved as ``asking``
    before it asks (a Slurm requeue ends the node's process), then how it ended."""

    mode: str
    state: str  # one of CONTINUE_STATES
    job_id: str
    successor: str = ""  # the job the node submitted (successor mode), which it cancels
    error: str = ""  # what the scheduler said when it refused
    cancelled: bool = False
    cancel_error: str = ""

    @classmethod
    def from_json(cls, data: object) -> ProbeContinueState:
        r = _Reader(data, cls, "continuation.", _RESULT_FILE)
        return cls(
            mode=r.text("mode"),
            state=r.choice("state", CONTINUE_STATES),
            job_id=r.text("job_id"),
            successor=r.text("successor"),
            error=r.text("error"),
            cancelled=r.flag("cancelled"),
            cancel_error=r.text("cancel_error"),
        )


@dataclass(frozen=True, kw_only=True)
class ProbeRerun:
    """The probe job ran again (requeued, or a successor not cancelled in time): ``reran``."""

    job_id: str
    restart: str
    at: float

    @classmethod
    def from_json(cls, data: object) -> ProbeRerun:
        r = _Reader(data, cls, "reran.", _RESULT_FILE)
        return cls(job_id=r.text("job_id"), restart=r.text("restart"), at=r.number("at"))


@dataclass(kw_only=True)
class ProbeResult:
    """The node's findings (``result.json``), rewritten after every check so that the login side
    gets what was found even when a later check ends the job. ``checks``: name (PROBE_CHECKS) ->
    finding, in the order they ran; ``backend``: what the worker check saw of the Keras backend."""

    version: int = PROBE_VERSION
    host: str
    job_id: str
    restart: str
    python: str
    started_at: float
    token: str | None = None  # what the node read in PROBE_TOKEN_FILE (None: it could not)
    checks: dict[str, ProbeFinding] = field(default_factory=dict)
    backend: dict[str, Any] | None = None
    continuation: ProbeContinueState | None = None
    reran: ProbeRerun | None = None
    finished: bool = False
    finished_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "host": self.host,
            "job_id": self.job_id,
            "restart": self.restart,
            "python": self.python,
            "started_at": self.started_at,
            "token": self.token,
            "checks": {name: asdict(finding) for name, finding in self.checks.items()},
            "backend": self.backend,
            "continuation": asdict(self.continuation) if self.continuation is not None else None,
            "reran": asdict(self.reran) if self.reran is not None else None,
            "finished": self.finished,
            "finished_at": self.finished_at,
        }

    @classmethod
    def from_json(cls, data: object) -> ProbeResult:
        """The node's findings ``data`` (parsed JSON). Raises ValueError naming what is wrong."""
        r = _Reader(_probe_version(data, _RESULT_FILE), cls, "", _RESULT_FILE)
        checks = r.value("checks")
        if not isinstance(checks, Mapping) or not set(checks) <= set(PROBE_CHECKS):
            raise ValueError(f"{_RESULT_FILE}: field 'checks' must be an object of {_quoted(PROBE_CHECKS)}")
        continuation, reran, finished_at = r.value("continuation"), r.value("reran"), r.value("finished_at")
        return cls(
            version=r.integer("version"),
            host=r.text("host"),
            job_id=r.text("job_id"),
            restart=r.text("restart"),
            python=r.text("python"),
            started_at=r.number("started_at"),
            token=r.optional_text("token"),
            checks={str(name): ProbeFinding.from_json(f, f"checks.{name}.") for name, f in checks.items()},
            backend=r.optional_object("backend"),
            continuation=ProbeContinueState.from_json(continuation) if continuation is not None else None,
            reran=ProbeRerun.from_json(reran) if reran is not None else None,
            finished=r.flag("finished"),
            finished_at=r.number("finished_at") if finished_at is not None else None,
        )


def _probe_version(data: object, file: str) -> Mapping[str, Any]:
    """``data`` as an object of this code's PROBE_VERSION; else a ValueError saying which side is older."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{file}: must be a JSON object, not {_kind(data)}")
    version = data.get("version")
    if version == PROBE_VERSION:
        return data
    fix = "install the same hpc-bridge version for the bridge and HPC_WORKER_PYTHON's environment (docs/upgrade.md)"
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"{file}: field 'version' must be an integer, not {_kind(version)}: {fix}")
    side = "a newer" if version > PROBE_VERSION else "an older"
    raise ValueError(
        f"{file}: version {version}, written by {side} hpc-bridge than this one (version {PROBE_VERSION}): {fix}"
    )


# --- reading, strictly -------------------------------------------------------------------------


def _kind(value: object) -> str:
    """A JSON value's kind, for messages (never the value: the file holds a token)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), "an object" if isinstance(value, Mapping) else type(value).__name__
    )


class _Reader:
    """One JSON object of the file, checked against a dataclass: no field missing, none unknown."""

    def __init__(self, data: object, cls: type, where: str, file: str = PARAMETER_FILE) -> None:
        self.file = file
        if not isinstance(data, Mapping):
            raise ValueError(f"{file}: field {where.rstrip('.')!r} must be an object, not {_kind(data)}")
        names = [f.name for f in fields(cls)]
        problems = []
        missing = [where + name for name in names if name not in data]
        if missing:
            problems.append(f"missing field{'s' if len(missing) > 1 else ''} {_quoted(missing)}")
        unknown = [where + str(name) for name in data if name not in names]
        if unknown:
            problems.append(f"unknown field{'s' if len(unknown) > 1 else ''} {_quoted(unknown)}")
        if problems:
            raise ValueError(f"{file}: " + "; ".join(problems))
        self.data: Mapping[str, Any] = data
        self.where = where

    def _wrong(self, name: str, wanted: str) -> NoReturn:
        raise ValueError(f"{self.file}: field {self.where + name!r} must be {wanted}, not {_kind(self.data[name])}")

    def value(self, name: str) -> Any:
        return self.data[name]

    def text(self, name: str) -> str:
        value = self.data[name]
        if not isinstance(value, str):
            self._wrong(name, "a string")
        return value

    def optional_text(self, name: str) -> str | None:
        return None if self.data[name] is None else self.text(name)

    def integer(self, name: str) -> int:
        value = self.data[name]
        if not isinstance(value, int) or isinstance(value, bool):
            self._wrong(name, "an integer")
        return value

    def optional_integer(self, name: str) -> int | None:
        return None if self.data[name] is None else self.integer(name)

    def number(self, name: str) -> float:
        value = self.data[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self._wrong(name, "a number")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.data[name]
        if not isinstance(value, bool):
            self._wrong(name, "a boolean")
        return value

    def path(self, name: str) -> Path:
        return Path(self.text(name))

    def optional_path(self, name: str) -> Path | None:
        return None if self.data[name] is None else self.path(name)

    def texts(self, name: str) -> dict[str, str]:
        value = self.data[name]
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            self._wrong(name, "an object of strings")
        return {str(k): v for k, v in value.items()}

    def choice(self, name: str, choices: Iterable[str]) -> str:
        value = self.text(name)
        if value not in choices:
            raise ValueError(f"{self.file}: field {self.where + name!r} must be one of {_quoted(choices)}")
        return value

    def optional_object(self, name: str) -> dict[str, Any] | None:
        value = self.data[name]
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self._wrong(name, "an object")
        return {str(k): v for k, v in value.items()}


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in names)


def _generation(value: str) -> Generation:
    try:
        return Generation(value)
    except ValueError:
        raise ValueError(
            f"parameter file: field 'generation' must be one of {_quoted(g.value for g in Generation)}"
        ) from None


def _layers(value: object) -> tuple[tuple[str, str], ...]:
    pairs = value if isinstance(value, list) else None
    if pairs is None or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in pairs
    ):
        raise ValueError("parameter file: field 'layers' must be a list of [input name, reply key] pairs")
    return tuple((name, key) for name, key in pairs)


def _roles(value: object) -> dict[str, InputRole]:
    known = {role.value: role for role in InputRole}
    if not isinstance(value, Mapping) or not all(isinstance(v, str) and v in known for v in value.values()):
        raise ValueError(f"parameter file: field 'roles' must be an object of input name -> one of {_quoted(known)}")
    return {str(name): known[role] for name, role in value.items()}


def _request_settings(data: object) -> RequestSettings:
    r = _Reader(data, RequestSettings, "settings.")
    readers = {"int": r.integer, "str": r.text}
    values: dict[str, Any] = {}
    for f in fields(RequestSettings):
        read = readers.get(str(f.type))
        if read is None:  # a new kind of setting: teach this function to read it
            raise TypeError(f"RequestSettings.{f.name} has type {f.type}, which the parameter file cannot carry")
        values[f.name] = read(f.name)
    return RequestSettings(**values)

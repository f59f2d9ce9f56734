"""Configuration: ``credentials.env`` (python-dotenv) overlaid by the environment.

Every setting is documented in ``credentials.env.example``. A missing or
malformed setting raises :class:`ConfigError` naming it, at start-up.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from dotenv import dotenv_values

from bridge.errors import ConfigError
from bridge.protocol import without_private
from bridge.rodan import DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_PIXELS

DEFAULT_CREDENTIALS = Path("credentials.env")
#: HPC_MIXED_PRECISION's values: the trainer's TrainSettings.mixed_precision (worker/trainer/settings.py).
MIXED_PRECISION_CHOICES = ("off", "float16", "bfloat16")
#: Accepted spellings of HPC_SCHEDULER -> the backend's name.
SCHEDULER_ALIASES = {"slurm": "slurm", "gridengine": "gridengine", "sge": "gridengine", "grid engine": "gridengine"}


@dataclass(frozen=True)
class GpuRule:
    """Jobs asking for at least ``min_memory_mb`` get ``gres`` (e.g. ``gpu:v100l:1``)."""

    min_memory_mb: int
    gres: str


@dataclass(frozen=True)
class BridgeConfig:
    broker_url: str = field(repr=False)
    rodan_scheme: str
    rodan_host: str
    rodan_user: str
    rodan_email: str
    rodan_password: str = field(repr=False)
    request_queue: str = "hpc-jobs"
    reply_queue: str = "hpc-results"
    dead_letter_queue: str = "hpc-bridge.dead-letter"
    spool_dir: Path = Path.home() / "hpc-bridge-spool"
    scheduler: str = "slurm"  # "slurm" or "gridengine"
    slurm_account: str = ""
    slurm_partition: str = ""
    sge_project: str = ""
    sge_queue: str = ""
    sge_pe: str = "smp"  # parallel environment for multi-CPU jobs
    sge_gpu_resource: str = "gpu"  # consumable complex counting GPUs
    sge_memory_resource: str = "mem_free"  # complex that requests memory (h_vmem where sites enforce it)
    gpu_rules: tuple[GpuRule, ...] = (GpuRule(0, "gpu:1"),)
    scheduler_args: tuple[str, ...] = ()
    worker_python: str = sys.executable
    reply_queue_patterns: tuple[str, ...] = ("hpc-results",)  # reply_to must match one (fnmatch)
    reply_wait_s: float = 86400.0  # a staged reply whose queue does not exist expires after this long
    defer_limit_s: float = 1800.0  # how long a request may be deferred (Rodan or the scheduler down)
    max_pending_s: float = 3 * 86400.0  # a job PENDING longer is cancelled and answered with the reason
    drain_batch: int = 100  # messages taken per pass before reconciling
    retention_days: float = 30.0  # settled records, job folders and run directories kept this long
    poison_limit: int = 3  # deliveries that crashed a process before a message is quarantined
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES  # one input file, raw bytes on the wire
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS  # one input image, width x height
    max_reply_bytes: int = 128 * 1024 * 1024
    rodan_timeout_s: float = 30.0
    rodan_retries: int = 4
    scheduler_timeout_s: float = 60.0
    reconcile_interval_s: float = 30.0
    poll_interval_s: float = 0.25
    broker_heartbeat_s: int = 30
    broker_ca_file: str | None = None
    missing_timeout_s: float = 3600.0
    runs_dir: Path | None = None  # default SPOOL/runs
    save_optimizer: bool = False
    mixed_precision: str = "off"  # the trainer's precision: off (float32, the original trainer's), float16 or bfloat16
    warn_seconds: int = 300  # warn a training job this long before its time limit (it checkpoints and continues)
    max_continuations: int = 5  # continuation jobs one request may use before it gets an error reply
    node_local_dir: Path | None = None  # checkpoint scratch on the compute node (default $SLURM_TMPDIR/$TMPDIR)
    checkpoint_sync_s: float = 60.0  # how often node-local checkpoints are copied to the run directory
    training_seed: int | None = None  # one seed for every training (reproducible runs); default: one per request
    log_file: Path | None = None
    log_level: str = "INFO"
    metrics_file: Path | None = None  # Prometheus text-format metrics, rewritten after every pass
    credentials_file: Path | None = None

    @property
    def account(self) -> str:
        """Slurm's account or Grid Engine's project."""
        return self.sge_project if self.scheduler == "gridengine" else self.slurm_account

    @property
    def partition(self) -> str:
        """Slurm's partition or Grid Engine's queue."""
        return self.sge_queue if self.scheduler == "gridengine" else self.slurm_partition

    @property
    def scheduler_options(self) -> dict[str, str]:
        """The site settings the chosen backend takes (see ``bridge.schedulers.get_scheduler``)."""
        if self.scheduler == "gridengine":
            return {
                "pe": self.sge_pe,
                "gpu_resource": self.sge_gpu_resource,
                "memory_resource": self.sge_memory_resource,
            }
        return {}

    def warn_seconds_for(self, time_minutes: int) -> int:
        """The warning before a job's limit: ``warn_seconds``, but at most half the limit."""
        return min(self.warn_seconds, time_minutes * 60 // 2)

    def accepts_reply_to(self, queue: str) -> bool:
        """Whether a request's ``reply_to`` names Rodan's reply queue (``HPC_REPLY_QUEUE``)."""
        return any(fnmatch.fnmatchcase(queue, pattern) for pattern in self.reply_queue_patterns)

    def public(self, text: str) -> str:
        """``text`` (an error reason) without this installation's paths or account names."""
        paths = {str(self.spool_dir): "<spool>", str(Path.home()): "<home>"}
        if self.runs_dir is not None:
            paths[str(self.runs_dir)] = "<runs>"
        venv = Path(self.worker_python).parent.parent
        if len(venv.parts) > 2:
            paths[str(venv)] = "<worker environment>"
        names = {self.slurm_account: "<account>", self.sge_project: "<project>"}
        names.update({self.slurm_partition: "<partition>", self.sge_queue: "<queue>"})
        return without_private(text, paths, names)

    @property
    def rodan_base_url(self) -> str:
        return f"{self.rodan_scheme}://{self.rodan_host}"

    def gres_for(self, memory_mb: int) -> str | None:
        """The GPU request for a job of ``memory_mb`` (largest matching threshold wins)."""
        chosen: str | None = None
        best = -1
        for rule in self.gpu_rules:
            if rule.min_memory_mb <= memory_mb and rule.min_memory_mb > best:
                chosen, best = rule.gres, rule.min_memory_mb
        return chosen

    @property
    def secrets(self) -> list[str]:
        """Every value that must never be logged (the URL password both quoted and plain)."""
        password = urlsplit(self.broker_url).password or ""
        return [s for s in {self.rodan_password, password, unquote(password)} if s]


def read_settings(credentials: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The raw settings: the credentials file, then the environment on top."""
    env = dict(os.environ if environ is None else environ)
    path = credentials or (Path(env["HPC_BRIDGE_CREDENTIALS"]) if env.get("HPC_BRIDGE_CREDENTIALS") else None)
    values: dict[str, str] = {}
    if path is None and DEFAULT_CREDENTIALS.exists():
        path = DEFAULT_CREDENTIALS
    if path is not None:
        if not path.exists():
            raise ConfigError(f"credentials file {path} does not exist")
        check_private(path)
        # No ${VAR} expansion: a password may contain any character.
        values.update({k: v for k, v in dotenv_values(path, interpolate=False).items() if v is not None})
        values["HPC_BRIDGE_CREDENTIALS"] = str(path.resolve())
    values.update({k: v for k, v in env.items() if k.startswith(("RABBITMQ_", "RODAN_", "HPC_"))})
    return values


def check_private(path: Path) -> None:
    """Refuse a credentials file that group or others can read or write."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"credentials file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"it holds passwords: run 'chmod 600 {path}'"
        )


def load_config(credentials: Path | None = None, environ: Mapping[str, str] | None = None) -> BridgeConfig:
    raw = read_settings(credentials, environ)
    get = _Getter(raw)
    rodan_user = get.text("RODAN_USER", "")
    rodan_email = get.text("RODAN_EMAIL", rodan_user if "@" in rodan_user else "")
    if not rodan_user and not rodan_email:
        raise ConfigError("RODAN_USER (or RODAN_EMAIL) is not set")
    scheme = get.text("RODAN_SCHEME", "https")
    if scheme not in {"http", "https"}:
        raise ConfigError(f"RODAN_SCHEME must be http or https, got {scheme!r}")
    rodan_host = get.required("RODAN_HOST")
    if "/" in rodan_host or not rodan_host.strip():
        raise ConfigError(f"RODAN_HOST must be host or host:port without a scheme or path, got {rodan_host!r}")
    scheduler = SCHEDULER_ALIASES.get(get.text("HPC_SCHEDULER", "slurm").lower(), "")
    if not scheduler:
        raise ConfigError(f"HPC_SCHEDULER must be 'slurm' or 'gridengine', got {raw.get('HPC_SCHEDULER')!r}")
    node_local = get.text("HPC_NODE_LOCAL_DIR", "")
    worker_python = get.text("HPC_WORKER_PYTHON", sys.executable)
    if not Path(worker_python).is_absolute():
        raise ConfigError(
            f"HPC_WORKER_PYTHON must be an absolute path, got {worker_python!r}: batch jobs start with the "
            "cluster's login PATH (Grid Engine resets it), not yours"
        )
    reply_patterns = parse_reply_queues(get.text("HPC_REPLY_QUEUE", "hpc-results"))
    log_file = get.text("HPC_LOG_FILE", "")
    metrics_file = get.text("HPC_METRICS_FILE", "")
    return BridgeConfig(
        broker_url=broker_url_from(raw),
        rodan_scheme=scheme,
        rodan_host=rodan_host,
        rodan_user=rodan_user or rodan_email,
        rodan_email=rodan_email,
        rodan_password=get.required("RODAN_PASSWORD"),
        request_queue=get.text("HPC_REQUEST_QUEUE", "hpc-jobs"),
        reply_queue=reply_patterns[0],
        dead_letter_queue=get.text("HPC_DEAD_LETTER_QUEUE", "hpc-bridge.dead-letter"),
        spool_dir=Path(get.text("HPC_SPOOL_DIR", str(Path.home() / "hpc-bridge-spool"))).expanduser(),
        scheduler=scheduler,
        slurm_account=get.text("HPC_SLURM_ACCOUNT", ""),
        slurm_partition=get.text("HPC_SLURM_PARTITION", ""),
        sge_project=get.text("HPC_SGE_PROJECT", ""),
        sge_queue=get.text("HPC_SGE_QUEUE", ""),
        sge_pe=get.text("HPC_SGE_PE", "smp"),
        sge_gpu_resource=get.text("HPC_SGE_GPU_RESOURCE", "gpu"),
        sge_memory_resource=get.text("HPC_SGE_MEMORY_RESOURCE", "mem_free"),
        gpu_rules=parse_gpu_rules(get.text("HPC_GPU_RULES", "gpu:1")),
        scheduler_args=tuple(_split("HPC_SCHEDULER_ARGS", get.text("HPC_SCHEDULER_ARGS", ""))),
        worker_python=worker_python,
        reply_queue_patterns=reply_patterns,
        reply_wait_s=get.number("HPC_REPLY_WAIT", 86400.0),
        defer_limit_s=get.number("HPC_DEFER_LIMIT", 1800.0),
        max_pending_s=get.number("HPC_MAX_PENDING", 3 * 86400.0),
        drain_batch=get.integer("HPC_DRAIN_BATCH", 100, minimum=1),
        retention_days=get.number("HPC_RETENTION_DAYS", 30.0),
        poison_limit=get.integer("HPC_POISON_LIMIT", 3, minimum=1),
        max_input_bytes=get.integer("HPC_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES, minimum=1024),
        max_input_pixels=get.integer("HPC_MAX_INPUT_PIXELS", DEFAULT_MAX_INPUT_PIXELS, minimum=1024),
        max_reply_bytes=get.integer("HPC_MAX_REPLY_BYTES", 128 * 1024 * 1024, minimum=1024),
        rodan_timeout_s=get.number("HPC_RODAN_TIMEOUT", 30.0),
        rodan_retries=get.integer("HPC_RODAN_RETRIES", 4, minimum=0),
        scheduler_timeout_s=get.number("HPC_SCHEDULER_TIMEOUT", 60.0),
        reconcile_interval_s=get.number("HPC_RECONCILE_INTERVAL", 30.0),
        poll_interval_s=get.number("HPC_POLL_INTERVAL", 0.25),
        broker_heartbeat_s=get.integer("HPC_BROKER_HEARTBEAT", 30, minimum=1),
        broker_ca_file=get.text("RABBITMQ_CA_FILE", "") or None,
        missing_timeout_s=get.number("HPC_MISSING_TIMEOUT", 3600.0),
        runs_dir=Path(get.text("HPC_RUNS_DIR", "")).expanduser() if get.text("HPC_RUNS_DIR", "") else None,
        save_optimizer=get.boolean("HPC_SAVE_OPTIMIZER", False),
        mixed_precision=get.choice("HPC_MIXED_PRECISION", "off", MIXED_PRECISION_CHOICES),
        warn_seconds=get.integer("HPC_WARN_SECONDS", 300, minimum=0),
        max_continuations=get.integer("HPC_MAX_CONTINUATIONS", 5, minimum=0),
        node_local_dir=Path(node_local).expanduser() if node_local else None,
        checkpoint_sync_s=get.number("HPC_CHECKPOINT_SYNC", 60.0),
        training_seed=get.optional_integer("HPC_TRAINING_SEED", minimum=0),
        log_file=Path(log_file).expanduser() if log_file else None,
        log_level=get.text("HPC_LOG_LEVEL", "INFO"),
        metrics_file=Path(metrics_file).expanduser() if metrics_file else None,
        credentials_file=Path(raw["HPC_BRIDGE_CREDENTIALS"]) if raw.get("HPC_BRIDGE_CREDENTIALS") else None,
    )


def broker_url_from(raw: Mapping[str, str]) -> str:
    """``RABBITMQ_URL``, or one built from the seed's RABBITMQ_HOST/USER/PASSWORD names."""
    url = raw.get("RABBITMQ_URL", "").strip()
    if url:
        parts = urlsplit(url)
        if parts.scheme not in {"amqp", "amqps"} or not parts.hostname:
            raise ConfigError("RABBITMQ_URL must look like amqp://user:password@host:5672/%2F (or amqps://)")
        return url
    host = raw.get("RABBITMQ_HOST", "").strip()
    if not host:
        raise ConfigError("RABBITMQ_URL (or RABBITMQ_HOST, RABBITMQ_USER, RABBITMQ_PASSWORD) is not set")
    tls = raw.get("RABBITMQ_TLS", "false").strip().lower() in {"1", "true", "yes"}
    port = raw.get("RABBITMQ_PORT", "5671" if tls else "5672").strip()
    if not port.isdigit():
        raise ConfigError(f"RABBITMQ_PORT must be a number, got {port!r}")
    user = quote(raw.get("RABBITMQ_USER", "guest"), safe="")
    password = quote(raw.get("RABBITMQ_PASSWORD", "guest"), safe="")
    vhost = quote(raw.get("RABBITMQ_VHOST", "/"), safe="")
    return f"{'amqps' if tls else 'amqp'}://{user}:{password}@{host}:{port}/{vhost}"


def parse_reply_queues(text: str) -> tuple[str, ...]:
    """``"hpc-results"`` or ``"hpc-results, rodan-*-results"``: names or fnmatch patterns. The first
    is the queue ``enqueue`` and the docs use; a request whose ``reply_to`` matches none is refused."""
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise ConfigError("HPC_REPLY_QUEUE is empty")
    for pattern in patterns:
        if len(pattern.encode("utf-8")) > 255 or any(c.isspace() or ord(c) < 32 for c in pattern):
            raise ConfigError(f"HPC_REPLY_QUEUE entry {pattern!r} is not a queue name or pattern")
    return patterns


def parse_gpu_rules(text: str) -> tuple[GpuRule, ...]:
    """``"gpu:1; 128000=gpu:v100l:1"``: the default gres, then memory thresholds. ``none`` = no GPU."""
    rules: list[GpuRule] = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry or entry.lower() == "none":
            continue
        threshold, _, gres = entry.rpartition("=")
        if threshold and not threshold.strip().isdigit():
            raise ConfigError(f"HPC_GPU_RULES entry {entry!r}: expected GRES or MIN_MEMORY_MB=GRES")
        gres = gres.strip()
        if not gres or any(c.isspace() for c in gres) or not all(c.isalnum() or c in ":_-." for c in gres):
            raise ConfigError(f"HPC_GPU_RULES entry {entry!r}: {gres!r} is not a gres like gpu:1")
        rules.append(GpuRule(int(threshold) if threshold else 0, gres))
    return tuple(rules)


def _split(name: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


class _Getter:
    def __init__(self, raw: Mapping[str, str]) -> None:
        self.raw = raw

    def text(self, name: str, default: str) -> str:
        return self.raw.get(name, default).strip() or default

    def required(self, name: str) -> str:
        value = self.raw.get(name, "")
        if not value.strip():
            raise ConfigError(f"{name} is not set")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, "").strip().lower()
        if not value:
            return default
        if value in {"1", "true", "yes", "on"}:
            return True
        if value in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{name} must be true or false, got {value!r}")

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.text(name, default).lower()
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        value = self.raw.get(name, "").strip()
        if not value:
            return default
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{name} must be a whole number, got {value!r}") from None
        if number < minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {number}")
        return number

    def optional_integer(self, name: str, *, minimum: int = 0) -> int | None:
        return self.integer(name, 0, minimum=minimum) if self.raw.get(name, "").strip() else None

    def number(self, name: str, default: float) -> float:
        value = self.raw.get(name, "").strip()
        if not value:
            return default
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
        if number <= 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")
        return number

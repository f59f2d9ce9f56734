"""Configuration: ``credentials.env`` (python-dotenv) overlaid by the environment.

Every setting is documented in ``credentials.env.example``. A missing or
malformed setting raises :class:`ConfigError` naming it, at start-up.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote, urlsplit

from dotenv import dotenv_values

from bridge.errors import ConfigError
from bridge.handoff import (
    DEFAULT_CHECKPOINT_SYNC_S,
    DEFAULT_INPUTS_FETCH,
    DEFAULT_MAX_CONTINUATIONS,
    DEFAULT_MAX_INPUT_BYTES,
    DEFAULT_MAX_INPUT_PIXELS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_REPLY_PART_BYTES,
    DEFAULT_RODAN_RETRIES,
    DEFAULT_RODAN_TIMEOUT_S,
    DEFAULT_SCHEDULER_TIMEOUT_S,
    INPUTS_FETCH_CHOICES,
)
from bridge.instance import DEFAULT_INSTANCE, INSTANCE_ENV, Instance, instance_name
from bridge.protocol import without_private
from bridge.schedulers import (
    DEFAULT_SCHEDULER,
    Scheduler,
    all_site_options,
    backend_name,
    choices_text,
    option_problems,
    refused_site_options,
    scheduler_class,
)
from bridge.schedulers.base import CONTINUE_BY

DEFAULT_CREDENTIALS = Path("credentials.env")
T = TypeVar("T")
#: HPC_MIXED_PRECISION's values: the trainer's TrainSettings.mixed_precision (worker/trainer/settings.py).
MIXED_PRECISION_CHOICES = ("off", "auto", "float16", "bfloat16")


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
    scheduler: str = DEFAULT_SCHEDULER  # a backend's name (bridge.schedulers.BACKENDS)
    # Every backend's site settings (HPC_SLURM_ACCOUNT, HPC_SGE_PE, ...: Scheduler.site_options),
    # setting name -> value; the chosen backend's are used (account, partition, scheduler_options).
    site_options: Mapping[str, str] = field(default_factory=dict)
    gpu_rules: tuple[GpuRule, ...] = (GpuRule(0, "gpu:1"),)
    scheduler_args: tuple[str, ...] = ()
    worker_python: str = sys.executable
    # reply_to must match one (fnmatch); hpc-results.*: generation 3's per-run queues (never declared here)
    reply_queue_patterns: tuple[str, ...] = ("hpc-results", "hpc-results.*")
    reply_wait_s: float = 86400.0  # a staged reply whose queue does not exist expires after this long
    defer_limit_s: float = 1800.0  # how long a request may be deferred (Rodan or the scheduler down)
    max_pending_s: float = 3 * 86400.0  # a job PENDING longer is cancelled and answered with the reason
    drain_batch: int = 100  # messages taken per pass before reconciling
    retention_days: float = 30.0  # settled records, job folders and run directories kept this long
    poison_limit: int = 3  # deliveries that crashed a process before a message is quarantined
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES  # one input file, raw bytes on the wire
    max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS  # one input image, width x height
    # Who downloads the inputs from Rodan: the job on its compute node ("node"), or the bridge on the
    # login node at intake, into the spool ("login": for compute nodes without a route to Rodan).
    inputs_fetch: str = DEFAULT_INPUTS_FETCH
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    reply_part_bytes: int = DEFAULT_REPLY_PART_BYTES  # one part of a reply sent in parts (generation 3)
    rodan_timeout_s: float = DEFAULT_RODAN_TIMEOUT_S
    rodan_retries: int = DEFAULT_RODAN_RETRIES
    scheduler_timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S
    reconcile_interval_s: float = 30.0
    rodan_check_interval_s: float = 60.0  # Rodan 3: ask Rodan about each waiting run this often (0: never)
    poll_interval_s: float = 0.25
    broker_heartbeat_s: int = 30
    broker_ca_file: str | None = None
    missing_timeout_s: float = 3600.0
    runs_dir: Path | None = None  # default SPOOL/runs
    save_optimizer: bool = False
    mixed_precision: str = "auto"  # the trainer's: auto (bfloat16 on GPUs >= 8.0), off (float32), float16, bfloat16
    warn_seconds: int = 300  # warn a training job this long before its time limit (it checkpoints and continues)
    max_continuations: int = DEFAULT_MAX_CONTINUATIONS  # continuation jobs one request may use (then an error reply)
    node_local_dir: Path | None = None  # checkpoint scratch on the compute node (default $SLURM_TMPDIR/$TMPDIR)
    checkpoint_sync_s: float = DEFAULT_CHECKPOINT_SYNC_S  # how often node-local checkpoints go to the run directory
    training_seed: int | None = None  # one seed for every training (reproducible runs); default: one per request
    log_file: Path | None = None
    log_level: str = "INFO"
    metrics_file: Path | None = None  # Prometheus text-format metrics, rewritten after every pass
    job_prologue: str = ""  # shell lines run in every batch job before the worker (module load, proxies)
    job_directives: tuple[str, ...] = ()  # extra '#SBATCH'/'#$' lines, each entry one directive's text
    max_active_jobs: int = 0  # jobs the bridge keeps in the scheduler at once (0: no cap)
    runs_shared: str = "private"  # run directories: private (0700) or group (0750/0640)
    status_queue: str = "hpc-bridge.status"  # where the heartbeat/status message goes ("": none)
    status_interval_s: float = 60.0  # how often the daemon publishes it
    credentials_file: Path | None = None
    instance: str = DEFAULT_INSTANCE  # bridge/instance.py: what this bridge's files, units and own queues are keyed by
    # What load_config found worth saying but harmless (an unknown name in the file); the CLI logs each.
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def backend(self) -> type[Scheduler]:
        """The chosen backend's class."""
        return scheduler_class(self.scheduler)

    def site_option(self, setting: str) -> str:
        """The value of the site setting ``setting`` (``HPC_SLURM_ACCOUNT``), whichever backend's it is."""
        return self.site_options.get(setting, "")

    @property
    def account(self) -> str:
        """The chosen backend's account (Slurm's account, Grid Engine's project; "" when it has none)."""
        return self.site_option(self.backend.account_setting)

    @property
    def partition(self) -> str:
        """The chosen backend's partition (Slurm's partition, Grid Engine's queue; "" when it has none)."""
        return self.site_option(self.backend.partition_setting)

    @property
    def continue_by(self) -> str:
        """How a job continues past its limit (``JobSpec.continue_by``): the backend's setting, if it
        has one (HPC_SLURM_CONTINUE), else ``requeue`` (a backend without requeue runs a successor)."""
        return self.site_option(self.backend.continue_setting) or CONTINUE_BY[0]

    @property
    def scheduler_options(self) -> dict[str, str]:
        """The site settings the chosen backend takes (see ``bridge.schedulers.get_scheduler``)."""
        return self.backend.constructor_options(self.site_options)

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
        for environment in (venv, Path(os.path.realpath(venv))):  # jobs run the resolved one (upgrade.md)
            if len(environment.parts) > 2:
                paths[str(environment)] = "<worker environment>"
        names = {self.site_option(o.setting): o.private_as for o in all_site_options() if o.private_as}
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


@dataclass(frozen=True)
class Settings:
    """The raw settings and where they came from (for messages that say where to look)."""

    values: dict[str, str]
    path: Path | None  # the credentials file read, if any
    file_keys: frozenset[str]  # the names the file set (judged for typos; the environment is not)
    looked: str  # where a credentials file was looked for, in words
    mode_problem: str = ""  # the file is readable by others (check_private's message); "" when it is not


def read_settings(credentials: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The raw settings: the credentials file, then the environment on top."""
    return read_sources(credentials, environ).values


def read_sources(
    credentials: Path | None = None, environ: Mapping[str, str] | None = None, instance: str | None = None
) -> Settings:
    """The settings of ``instance`` (see bridge/instance.py): the credentials file is ``credentials``,
    else ``$HPC_BRIDGE_CREDENTIALS``, else the instance's (``~/.config/hpc-bridge/NAME/credentials.env``),
    else ``./credentials.env`` (an installation from before instances)."""
    env = dict(os.environ if environ is None else environ)
    chosen = Instance.from_environment(instance, env)
    path = credentials_path(credentials, env, chosen)
    looked = (
        f"--credentials (not given), $HPC_BRIDGE_CREDENTIALS (not set), instance {chosen.name}'s "
        f"{chosen.credentials} (absent) and {DEFAULT_CREDENTIALS} in the current directory {Path.cwd()} (absent)"
    )
    values: dict[str, str] = {}
    file_keys: frozenset[str] = frozenset()
    mode_problem = ""
    if path is not None:
        if not path.exists():
            raise ConfigError(f"credentials file {path} does not exist")
        if not path.is_file():  # python-dotenv would read nothing from it, without a word
            raise ConfigError(f"credentials file {path} is not a file")
        mode_problem = private_problem(path)  # read all the same: every problem is reported at once
        try:  # No ${VAR} expansion: a password may contain any character.
            read = dotenv_values(path, interpolate=False)
        except OSError as exc:  # a directory, a file of another user's
            raise ConfigError(f"credentials file {path} cannot be read: {exc.strerror or exc}") from None
        from_file = {k: v for k, v in read.items() if v is not None}
        values.update(from_file)
        file_keys = frozenset(from_file)
        values["HPC_BRIDGE_CREDENTIALS"] = str(path.resolve())
        looked = str(path)
    values.update({k: v for k, v in env.items() if k.startswith(SETTING_PREFIXES)})
    values[INSTANCE_ENV] = chosen.name  # chosen by --instance or the environment, never by the file
    return Settings(values, path, file_keys, looked, mode_problem)


def credentials_path(credentials: Path | None, environ: Mapping[str, str], instance: Instance) -> Path | None:
    """The credentials file to read: ``credentials`` (--credentials), else ``$HPC_BRIDGE_CREDENTIALS``,
    else the instance's when it exists, else ``./credentials.env`` when it exists; None: no file."""
    if credentials is not None:
        return credentials
    if environ.get("HPC_BRIDGE_CREDENTIALS"):
        return Path(environ["HPC_BRIDGE_CREDENTIALS"])
    return next((p for p in (instance.credentials, DEFAULT_CREDENTIALS) if p.exists()), None)


def check_private(path: Path) -> None:
    """Refuse a credentials file that group or others can read or write."""
    problem = private_problem(path)
    if problem:
        raise ConfigError(problem, setting=CREDENTIALS_SETTING)


def private_problem(path: Path) -> str:
    """What is wrong with the credentials file's mode (it names the file and the fix), or ""."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"credentials file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"it holds passwords: run 'chmod 600 {path}'"
        )
    return ""


def load_config(
    credentials: Path | None = None, environ: Mapping[str, str] | None = None, instance: str | None = None
) -> BridgeConfig:
    """The configuration, or one :class:`ConfigError` listing every problem found (not just the first).

    What is worth saying but harmless (a setting of a newer version in the file) is in the
    configuration's ``warnings``: the caller says them (the CLI logs ``config_warning``)."""
    report = examine_config(credentials, environ, instance)
    if report.problems:
        raise report.error()
    return report.config


@dataclass(frozen=True)
class ConfigProblem:
    """One problem of the configuration, and the setting it is about (``""``: no one setting)."""

    setting: str
    message: str


@dataclass(frozen=True)
class ConfigReport:
    """Everything ``load_config`` found, for a caller that goes on despite problems (``doctor``)."""

    config: BridgeConfig  # each setting with a problem holds its default here
    problems: tuple[ConfigProblem, ...]  # in the order they were found
    source: Settings

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.config.warnings

    def by_setting(self, *, without: Iterable[str] = ()) -> dict[str, list[str]]:
        """Setting -> its problems (``without``: settings left out, e.g. what another check reports)."""
        left_out = set(without)
        found: dict[str, list[str]] = {}
        for problem in self.problems:
            if problem.setting not in left_out:
                found.setdefault(problem.setting, []).append(problem.message)
        return found

    def error(self, *, without: Iterable[str] = ()) -> ConfigError:
        """The problems as one :class:`ConfigError` (``without``: as in :meth:`by_setting`)."""
        left_out = set(without)
        messages = [p.message for p in self.problems if p.setting not in left_out]
        if self.source.path is None:
            messages.append(f"no credentials file was read: looked for {self.source.looked}")
        return ConfigError.listing(messages, self.by_setting(without=left_out))


def examine_config(
    credentials: Path | None = None, environ: Mapping[str, str] | None = None, instance: str | None = None
) -> ConfigReport:
    """The configuration, every problem (by setting) and every warning, without raising for a problem:
    a setting with a problem holds its default. Raises :class:`ConfigError` only when no settings can
    be read at all (a credentials file named but absent)."""
    source = read_sources(credentials, environ, instance)
    config, get = _build(source.values)
    typos, warnings = unknown_keys(source, get.asked)
    problems = [ConfigProblem(CREDENTIALS_SETTING, source.mode_problem)] if source.mode_problem else []
    problems += get.problems + placeholders(source.values) + typos
    return ConfigReport(replace(config, warnings=tuple(warnings)), tuple(problems), source)


def _build(raw: Mapping[str, str]) -> tuple[BridgeConfig, _Getter]:
    """The configuration from ``raw``, and the getter holding the problems found on the way."""
    get = _Getter(raw)
    rodan_user = get.text("RODAN_USER", "")
    rodan_email = get.text("RODAN_EMAIL", rodan_user if "@" in rodan_user else "")
    if not rodan_user and not rodan_email:
        get.problem("RODAN_USER (or RODAN_EMAIL) is not set")
    scheme = get.text("RODAN_SCHEME", "https")
    if scheme not in {"http", "https"}:
        get.problem(f"RODAN_SCHEME must be http or https, got {scheme!r}")
    rodan_host = get.required("RODAN_HOST")
    if rodan_host and ("/" in rodan_host or not rodan_host.strip()):
        get.problem(f"RODAN_HOST must be host or host:port without a scheme or path, got {rodan_host!r}")
    try:
        instance = Instance(instance_name(get.text(INSTANCE_ENV, DEFAULT_INSTANCE)))
    except ConfigError as exc:
        get.problem(str(exc), setting=INSTANCE_ENV)
        instance = Instance()
    scheduler = backend_name(get.text("HPC_SCHEDULER", DEFAULT_SCHEDULER))
    if not scheduler:
        get.problem(f"HPC_SCHEDULER must be {choices_text(quote=True)}, got {raw.get('HPC_SCHEDULER')!r}")
    site_options = {}
    for option in all_site_options():
        if option.choices:
            site_options[option.setting] = get.choice(option.setting, option.default, option.choices)
        else:
            site_options[option.setting] = get.text(option.setting, option.default)
    if scheduler:  # a value the chosen backend refuses (HPC_SGE_PE with a space, HPC_SLURM_OMIT=--time)
        for setting, problem in refused_site_options(scheduler, site_options).items():
            get.problem(problem, setting=setting)
            site_options[setting] = next(o.default for o in all_site_options() if o.setting == setting)
    node_local = get.text("HPC_NODE_LOCAL_DIR", "")
    worker_python = get.text("HPC_WORKER_PYTHON", sys.executable)
    if not Path(worker_python).is_absolute():
        get.problem(
            f"HPC_WORKER_PYTHON must be an absolute path, got {worker_python!r}: batch jobs start with the "
            "cluster's login PATH (Grid Engine resets it), not yours"
        )
    default_reply: tuple[str, ...] = ("hpc-results", "hpc-results.*")
    reply_patterns = get.parsed("HPC_REPLY_QUEUE", parse_reply_queues, default_reply, ", ".join(default_reply))
    status_queue = get.text("HPC_STATUS_QUEUE", instance.default_status_queue)
    status_queue = "" if status_queue.lower() in {"none", "off"} else status_queue
    if len(status_queue.encode("utf-8")) > 255 or any(c.isspace() or c in "*?[" for c in status_queue):
        get.problem(f"HPC_STATUS_QUEUE must be one queue name (or none), got {status_queue!r}")
    log_file = get.text("HPC_LOG_FILE", "")
    metrics_file = get.text("HPC_METRICS_FILE", "")
    runs_dir = get.text("HPC_RUNS_DIR", "")
    no_directives: tuple[str, ...] = ()
    config = BridgeConfig(
        broker_url=get.parsed("RABBITMQ_URL", lambda _text: broker_url_from(raw), "amqp://invalid/", "-"),
        rodan_scheme=scheme,
        rodan_host=rodan_host,
        rodan_user=rodan_user or rodan_email,
        rodan_email=rodan_email,
        rodan_password=get.required("RODAN_PASSWORD"),
        request_queue=get.text("HPC_REQUEST_QUEUE", "hpc-jobs"),
        reply_queue=reply_patterns[0],
        dead_letter_queue=get.text("HPC_DEAD_LETTER_QUEUE", instance.default_dead_letter_queue),
        spool_dir=Path(get.text("HPC_SPOOL_DIR", str(instance.default_spool))).expanduser(),
        scheduler=scheduler or DEFAULT_SCHEDULER,
        site_options=site_options,
        gpu_rules=get.parsed("HPC_GPU_RULES", parse_gpu_rules, (GpuRule(0, "gpu:1"),), "gpu:1"),
        scheduler_args=get.parsed("HPC_SCHEDULER_ARGS", _split, (), ""),
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
        inputs_fetch=get.choice("HPC_INPUTS_FETCH", DEFAULT_INPUTS_FETCH, INPUTS_FETCH_CHOICES),
        max_reply_bytes=get.integer("HPC_MAX_REPLY_BYTES", DEFAULT_MAX_REPLY_BYTES, minimum=1024),
        reply_part_bytes=get.integer("HPC_REPLY_PART_BYTES", DEFAULT_REPLY_PART_BYTES, minimum=1024),
        rodan_timeout_s=get.number("HPC_RODAN_TIMEOUT", DEFAULT_RODAN_TIMEOUT_S),
        rodan_retries=get.integer("HPC_RODAN_RETRIES", DEFAULT_RODAN_RETRIES, minimum=0),
        scheduler_timeout_s=get.number("HPC_SCHEDULER_TIMEOUT", DEFAULT_SCHEDULER_TIMEOUT_S),
        reconcile_interval_s=get.number("HPC_RECONCILE_INTERVAL", 30.0),
        rodan_check_interval_s=get.number("HPC_RODAN_CHECK_INTERVAL", 60.0),
        poll_interval_s=get.number("HPC_POLL_INTERVAL", 0.25),
        broker_heartbeat_s=get.integer("HPC_BROKER_HEARTBEAT", 30, minimum=1),
        broker_ca_file=get.text("RABBITMQ_CA_FILE", "") or None,
        missing_timeout_s=get.number("HPC_MISSING_TIMEOUT", 3600.0),
        runs_dir=Path(runs_dir).expanduser() if runs_dir else None,
        save_optimizer=get.boolean("HPC_SAVE_OPTIMIZER", False),
        mixed_precision=get.choice("HPC_MIXED_PRECISION", "auto", MIXED_PRECISION_CHOICES),
        warn_seconds=get.integer("HPC_WARN_SECONDS", 300, minimum=0),
        max_continuations=get.integer("HPC_MAX_CONTINUATIONS", DEFAULT_MAX_CONTINUATIONS, minimum=0),
        node_local_dir=Path(node_local).expanduser() if node_local else None,
        checkpoint_sync_s=get.number("HPC_CHECKPOINT_SYNC", DEFAULT_CHECKPOINT_SYNC_S),
        training_seed=get.optional_integer("HPC_TRAINING_SEED", minimum=0),
        log_file=Path(log_file).expanduser() if log_file else None,
        log_level=get.choice("HPC_LOG_LEVEL", "INFO", LOG_LEVELS, lower=False),
        metrics_file=Path(metrics_file).expanduser() if metrics_file else None,
        job_prologue=get.parsed("HPC_JOB_PROLOGUE", parse_prologue, "", "", strip=False),
        job_directives=get.parsed("HPC_JOB_DIRECTIVES", parse_directives, no_directives, ""),
        max_active_jobs=get.integer("HPC_MAX_ACTIVE_JOBS", 0, minimum=0),
        runs_shared=get.choice("HPC_RUNS_SHARED", "private", RUNS_SHARED_CHOICES),
        status_queue=status_queue,
        status_interval_s=get.number("HPC_STATUS_INTERVAL", 60.0),
        credentials_file=Path(raw["HPC_BRIDGE_CREDENTIALS"]) if raw.get("HPC_BRIDGE_CREDENTIALS") else None,
        instance=instance.name,
    )
    site_lines = {"HPC_JOB_PROLOGUE": config.job_prologue, "HPC_JOB_DIRECTIVES": "\n".join(config.job_directives)}
    for name, text in site_lines.items():
        if contains_secret(text, config.secrets):
            get.problem(f"{name} contains a password from the credentials: batch scripts must never hold secrets")
    if contains_secret("\n".join(config.scheduler_args), config.secrets):
        get.problem(
            "HPC_SCHEDULER_ARGS contains a password from the credentials: the submit command is seen by every "
            "user of the login node (ps) and printed by `hpc-bridge script`"
        )
    if scheduler:  # an option the bridge sets itself (or cannot leave out) is refused now, not per job
        for problem in option_problems(
            config.scheduler,
            options=config.scheduler_options,
            scheduler_args=config.scheduler_args,
            directives=config.job_directives,
        ):
            get.problem(problem)
    return config, get


#: Every prefix of a setting (only these are taken from the environment).
SETTING_PREFIXES = ("RABBITMQ_", "RODAN_", "HPC_")
#: A setting's name at the start of a problem's message (the setting the problem is about).
_SETTING_NAME = re.compile(r"(?:RABBITMQ|RODAN|HPC)_[A-Z0-9_]*[A-Z0-9]")
#: The setting a problem of the credentials file itself is filed under (its mode).
CREDENTIALS_SETTING = "HPC_BRIDGE_CREDENTIALS"
#: Settings read outside ``load_config``'s getters (the broker's alternative names, the file's own path).
OTHER_KEYS = frozenset(
    {
        "RABBITMQ_URL",
        "RABBITMQ_HOST",
        "RABBITMQ_PORT",
        "RABBITMQ_USER",
        "RABBITMQ_PASSWORD",
        "RABBITMQ_VHOST",
        "RABBITMQ_TLS",
        "HPC_BRIDGE_CREDENTIALS",
        INSTANCE_ENV,
    }
)
#: Settings an older version read, and what replaced them.
RETIRED_KEYS = {"HPC_MAX_ATTEMPTS": "replaced by HPC_DEFER_LIMIT (seconds a request may be deferred)"}
PLACEHOLDER = "CHANGE_ME"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
RUNS_SHARED_CHOICES = ("private", "group")
# What a directive may not hold: it is written verbatim after '#SBATCH ' / '#$ ' in a bash script.
_DIRECTIVE_FORBIDDEN = set("\0#'\"\\$`;&|<>()\r")


def known_keys() -> frozenset[str]:
    """Every setting name ``load_config`` reads."""
    _config, get = _build({})
    return frozenset(get.asked) | OTHER_KEYS


def placeholders(raw: Mapping[str, str]) -> list[ConfigProblem]:
    """Values still holding credentials.env.example's CHANGE_ME placeholders."""
    return [
        ConfigProblem(
            name, f"{name} still holds the placeholder {PLACEHOLDER} from credentials.env.example: set the real value"
        )
        for name, value in sorted(raw.items())
        if PLACEHOLDER in value
    ]


def unknown_keys(source: Settings, asked: set[str]) -> tuple[list[ConfigProblem], list[str]]:
    """Names in the credentials file that no setting has: ``(problems, warnings)``.

    A name within :data:`TYPO_DISTANCE` edits of a setting is a typo (HPC_SCHEDULAR): a problem,
    filed under the setting it was meant for (which then holds its default) and saying "did you
    mean". Any other unknown name only warns: a setting of a newer version (the file outlives a
    rollback), or a retired one (RETIRED_KEYS, which says what replaced it). Neither is read."""
    known = asked | OTHER_KEYS
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    for name in sorted(source.file_keys):
        if not name.startswith(SETTING_PREFIXES) or name in known:
            continue
        if name in RETIRED_KEYS:
            warnings.append(f"{name} in {source.looked} is no longer read (ignored): {RETIRED_KEYS[name]}")
            continue
        meant = closest_setting(name, known)
        if meant:
            hint = f"is not a setting (did you mean {meant}?): see credentials.env.example"
            problems.append(ConfigProblem(meant, f"{name} in {source.looked} {hint}"))
        else:
            warnings.append(
                f"{name} in {source.looked} is not a setting of this version (ignored): a newer version's, or "
                "a mistake; see credentials.env.example"
            )
    return problems, warnings


#: At most this many slips (a letter missed, added, wrong, or two swapped) turn a setting's name
#: into a typo of it. Setting names are long (8-30 letters) and share their prefixes, so a name
#: that differs by more is another name, e.g. a newer version's (HPC_MAX_INPUT_PAGES).
TYPO_DISTANCE = 2


def closest_setting(name: str, known: Iterable[str]) -> str:
    """The known setting ``name`` is a typo of (the nearest within TYPO_DISTANCE), or ""."""
    distances = sorted((edit_distance(name, other), other) for other in known)
    return next((other for distance, other in distances if distance <= TYPO_DISTANCE), "")


def edit_distance(a: str, b: str) -> int:
    """The optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    neighbouring letters, one each (a Levenshtein distance that counts a swap as one slip)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


#: A secret at least this long is a leak wherever it appears; a shorter one only as a whole value.
LONG_SECRET = 12
# A whole value: after the start, white space, '=', ':' or a quote; before the end, white space, ';', a
# quote or '@' (the password of a URL's user:password@host).
_VALUE_BEFORE = r"(?:^|(?<=[\s=:'\"]))"
_VALUE_AFTER = r"(?=$|[\s;'\"@])"


def contains_secret(text: str, secrets: Iterable[str]) -> bool:
    """Whether ``text`` holds one of ``secrets``. A short password may well be part of unrelated text
    (``gpu`` in ``--gres=gpu:1``), so it counts only as a whole value (``--password=gpu``,
    ``user:gpu``); a long one counts anywhere."""
    for secret in (s for s in secrets if s):
        if len(secret) >= LONG_SECRET and secret in text:
            return True
        if re.search(_VALUE_BEFORE + re.escape(secret) + _VALUE_AFTER, text, re.M):
            return True
    return False


def parse_prologue(text: str) -> str:
    """HPC_JOB_PROLOGUE: shell lines for the batch job. Any line is allowed but NUL."""
    if "\0" in text:
        raise ConfigError("HPC_JOB_PROLOGUE holds a NUL character")
    return text.strip("\n")


def parse_directives(text: str) -> tuple[str, ...]:
    """HPC_JOB_DIRECTIVES: ``--constraint=v100; --nice=10`` or ``-l h_vmem=4G``, one directive per
    entry (entries separated by ``;`` or new lines). Each is written after ``#SBATCH ``/``#$ ``."""
    entries = []
    for entry in (" ".join(e.split()) for e in text.replace("\n", ";").split(";")):
        if not entry:
            continue
        bad = sorted(_DIRECTIVE_FORBIDDEN & set(entry))
        if bad or not entry.startswith("-"):
            why = f"holds {''.join(bad)!r}" if bad else "does not start with '-'"
            raise ConfigError(f"HPC_JOB_DIRECTIVES entry {entry!r} {why}: each entry is one scheduler option")
        entries.append(entry)
    return tuple(entries)


def broker_url_from(raw: Mapping[str, str]) -> str:
    """``RABBITMQ_URL``, or one built from RABBITMQ_HOST/USER/PASSWORD (the original cron checker's names)."""
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


def _split(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(f"HPC_SCHEDULER_ARGS: {exc}") from None


class _Getter:
    """Reads settings by name, remembering every name asked and every problem (never raising), so
    that one run reports all of them."""

    def __init__(self, raw: Mapping[str, str]) -> None:
        self.raw = raw
        self.asked: set[str] = set()
        self.problems: list[ConfigProblem] = []

    def problem(self, message: str, *, setting: str = "") -> None:
        """Note a problem about ``setting``; by default the setting the message starts with (every
        message names its setting first: "HPC_SCHEDULER must be ..."), else none in particular."""
        if not setting:
            named = _SETTING_NAME.match(message)
            setting = named.group(0) if named else ""
        self.problems.append(ConfigProblem(setting, message))

    def _value(self, name: str) -> str:
        self.asked.add(name)
        return self.raw.get(name, "").strip()

    def text(self, name: str, default: str) -> str:
        return self._value(name) or default

    def required(self, name: str) -> str:
        if not self._value(name):
            self.problem(f"{name} is not set", setting=name)
            return ""
        return self.raw[name]

    def parsed(self, name: str, parse: Callable[[str], T], default: T, fallback_text: str, *, strip: bool = True) -> T:
        """``parse(value)`` (``fallback_text`` when unset); a :class:`ConfigError` becomes a problem.
        ``strip=False`` hands over the value as written (leading white space of shell lines kept)."""
        text = self._value(name) if strip else self.raw.get(name, "")
        self.asked.add(name)
        try:
            return parse(text or fallback_text)
        except ConfigError as exc:
            self.problem(str(exc), setting=exc.setting or name)
            return default

    def boolean(self, name: str, default: bool) -> bool:
        value = self._value(name).lower()
        if not value:
            return default
        if value in {"1", "true", "yes", "on"}:
            return True
        if value in {"0", "false", "no", "off"}:
            return False
        self.problem(f"{name} must be true or false, got {value!r}")
        return default

    def choice(self, name: str, default: str, choices: tuple[str, ...], *, lower: bool = True) -> str:
        value = self.text(name, default)
        value = value.lower() if lower else value.upper()
        if value not in choices:
            self.problem(f"{name} must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        value = self._value(name)
        if not value:
            return default
        try:
            number = int(value)
        except ValueError:
            self.problem(f"{name} must be a whole number, got {value!r}")
            return default
        if number < minimum:
            self.problem(f"{name} must be at least {minimum}, got {number}")
            return default
        return number

    def optional_integer(self, name: str, *, minimum: int = 0) -> int | None:
        return self.integer(name, 0, minimum=minimum) if self._value(name) else None

    def number(self, name: str, default: float) -> float:
        value = self._value(name)
        if not value:
            return default
        try:
            number = float(value)
        except ValueError:
            self.problem(f"{name} must be a number, got {value!r}")
            return default
        if not number > 0 or number == float("inf"):
            self.problem(f"{name} must be positive, got {value!r}")
            return default
        return number

"""Instances: several bridges under one account, each with its own settings, files and queues.

An *instance* is one bridge: one Rodan server's requests, one cluster. ``--instance NAME`` (or
``HPC_BRIDGE_INSTANCE``; default ``default``) keys everything that two bridges under one account
must not share, so that a second one (another Rodan, or a Grid Engine cluster beside a Slurm one)
never overwrites or reads the first one's:

=====================  ==============================================================
settings               ``~/.config/hpc-bridge/NAME/credentials.env`` (unless ``--credentials``)
site environment       ``~/.config/hpc-bridge/NAME/site-env.sh`` (sourced by run_check)
run_check's log        ``~/.local/state/hpc-bridge/NAME/run_check.log``
systemd units          ``hpc-bridge@NAME.service``, ``hpc-bridge-check@NAME.{service,timer}``
crontab blocks         ``# BEGIN hpc-bridge/NAME cron`` (and ``logrotate``, ``scrontab``)
logrotate              ``~/.config/hpc-bridge/NAME/logrotate.conf`` (``/etc/logrotate.d/hpc-bridge-NAME``)
spool                  ``~/hpc-bridge-spool`` for ``default``, ``~/hpc-bridge-spool-NAME`` otherwise
metrics                every sample labelled ``instance="NAME"``
the queues it owns     ``hpc-bridge.dead-letter`` / ``hpc-bridge.status`` for ``default``,
                       ``hpc-bridge.NAME.dead-letter`` / ``hpc-bridge.NAME.status`` otherwise
=====================  ==============================================================

The ``default`` instance keeps the names an installation had before instances existed (spool,
queues), so an upgrade moves nothing. What Rodan names (the request and reply queues) cannot be
keyed here: two instances on one broker need their own vhost or their own queue names, which
``doctor`` checks (``instances``). The spool remembers its instance (``SPOOL/instance``) and a
bridge of another instance refuses it.

``~/.config`` and ``~/.local/state`` follow ``XDG_CONFIG_HOME`` and ``XDG_STATE_HOME``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bridge.errors import ConfigError

DEFAULT_INSTANCE = "default"
#: The environment variable that names the instance when ``--instance`` is not given.
INSTANCE_ENV = "HPC_BRIDGE_INSTANCE"
#: An instance name: it becomes part of a systemd unit name, a path, a queue name and a crontab marker.
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
#: The folder under the XDG config and state homes.
APP = "hpc-bridge"


def instance_name(name: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``name``, else ``$HPC_BRIDGE_INSTANCE``, else ``default``; a name that cannot key a unit,
    path and queue is a :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    chosen = name if name is not None else (env.get(INSTANCE_ENV, "") or DEFAULT_INSTANCE)
    if not NAME.fullmatch(chosen):
        raise ConfigError(
            f"instance name {chosen!r} is not usable: 1 to 32 of a-z, 0-9, '-' and '_', starting with a letter "
            "or digit (it names a systemd unit, a folder and the bridge's own queues)"
        )
    return chosen


@dataclass(frozen=True)
class Instance:
    """Where one instance's files are, and the names of what it owns."""

    name: str = DEFAULT_INSTANCE
    config_home: Path = field(default_factory=lambda: Path.home() / ".config")
    state_home: Path = field(default_factory=lambda: Path.home() / ".local" / "state")
    home: Path = field(default_factory=Path.home)

    @classmethod
    def from_environment(cls, name: str | None = None, environ: Mapping[str, str] | None = None) -> Instance:
        """The instance ``name`` (see :func:`instance_name`) with the XDG homes of ``environ``."""
        env = os.environ if environ is None else environ
        home = Path(env.get("HOME") or Path.home())
        config_home = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else home / ".config"
        state_home = Path(env["XDG_STATE_HOME"]) if env.get("XDG_STATE_HOME") else home / ".local" / "state"
        return cls(instance_name(name, env), config_home.absolute(), state_home.absolute(), home)

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_INSTANCE

    # --- files -------------------------------------------------------------------------------

    @property
    def settings_dir(self) -> Path:
        """``~/.config/hpc-bridge/NAME``: credentials.env, site-env.sh, logrotate's files."""
        return self.config_home / APP / self.name

    @property
    def credentials(self) -> Path:
        return self.settings_dir / "credentials.env"

    @property
    def site_env(self) -> Path:
        return self.settings_dir / "site-env.sh"

    @property
    def state_dir(self) -> Path:
        """``~/.local/state/hpc-bridge/NAME``: run_check's log and state."""
        return self.state_home / APP / self.name

    @property
    def run_check_log(self) -> Path:
        return self.state_dir / "run_check.log"

    @property
    def logrotate_conf(self) -> Path:
        return self.settings_dir / "logrotate.conf"

    @property
    def logrotate_state(self) -> Path:
        return self.settings_dir / "logrotate.state"

    @property
    def system_logrotate(self) -> Path:
        return Path("/etc/logrotate.d") / f"{APP}-{self.name}"

    @property
    def default_spool(self) -> Path:
        return self.home / ("hpc-bridge-spool" if self.is_default else f"hpc-bridge-spool-{self.name}")

    # --- names ------------------------------------------------------------------------------------

    @property
    def daemon_unit(self) -> str:
        return f"{APP}@{self.name}.service"

    @property
    def check_service(self) -> str:
        return f"{APP}-check@{self.name}.service"

    @property
    def check_timer(self) -> str:
        return f"{APP}-check@{self.name}.timer"

    @property
    def units(self) -> tuple[str, ...]:
        """Every systemd unit ``install systemd`` may write for this instance."""
        return (self.daemon_unit, self.check_service, self.check_timer)

    @property
    def mark(self) -> str:
        """The crontab marker's owner: ``# BEGIN hpc-bridge/NAME cron``."""
        return f"{APP}/{self.name}"

    def owned_queue(self, role: str) -> str:
        """A queue the bridge itself declares (``dead-letter``, ``status``)."""
        return f"{APP}.{role}" if self.is_default else f"{APP}.{self.name}.{role}"

    @property
    def default_dead_letter_queue(self) -> str:
        return self.owned_queue("dead-letter")

    @property
    def default_status_queue(self) -> str:
        return self.owned_queue("status")


def installed_instances(config_home: Path) -> list[str]:
    """The instances with a settings folder (``~/.config/hpc-bridge/*/credentials.env``)."""
    base = config_home / APP
    if not base.is_dir():
        return []
    return sorted(p.parent.name for p in base.glob("*/credentials.env") if NAME.fullmatch(p.parent.name))
